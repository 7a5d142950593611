"""autoplan: automatic parallelization planner and compiler for PyTorch.

``autoplan.plan(model, example_inputs, devices=8, cluster="h100", **options) -> Plan``
``autoplan.parallelize(model, example_inputs, devices=N) -> ParallelModule`` (in a torchrun job)
"""

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan
from autoplan.planner.options import PlanOptions


def __getattr__(name: str):  # parallelize pulls in torch.distributed: import it on first use
    if name == "parallelize":
        from autoplan.parallelize import parallelize

        return parallelize
    if name in ("ParallelModule", "PipelinedModule"):
        from autoplan.codegen import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")


__all__ = ["AutoplanError", "MemoryInfeasibleError", "ParallelModule", "PipelinedModule", "Plan", "PlanOptions", "parallelize", "plan"]
