"""autoplan: automatic parallelization planner and compiler for PyTorch.

``autoplan.plan(model, example_inputs, devices=8, cluster="h100", **options) -> Plan``
``autoplan.parallelize(model, example_inputs, devices=N) -> ParallelModule`` (in a torchrun job)
"""

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.plan_schema import Plan


def __getattr__(name: str):  # what imports torch is imported on first use (``autoplan --help`` needs none of it)
    if name == "plan":
        from autoplan.planner.front_door import plan

        return plan
    if name == "PlanOptions":
        from autoplan.planner.options import PlanOptions

        return PlanOptions
    if name == "parallelize":
        from autoplan.parallelize import parallelize

        return parallelize
    if name in ("ParallelModule", "PipelinedModule"):
        from autoplan.codegen import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")


__all__ = ["AutoplanError", "MemoryInfeasibleError", "ParallelModule", "PipelinedModule", "Plan", "PlanOptions", "parallelize", "plan"]
