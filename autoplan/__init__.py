"""autoplan: automatic parallelization planner and compiler for PyTorch.

``autoplan.plan(model, example_inputs, devices=8, cluster="h100") -> Plan``
``autoplan.parallelize(model, example_inputs, devices=N) -> ParallelModule`` (in a torchrun job)
"""

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.planner.api import plan
from autoplan.plan_schema import Plan


def __getattr__(name: str):  # parallelize pulls in torch.distributed: import it on first use
    if name in ("parallelize", "ParallelModule"):
        from autoplan.codegen import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")


__all__ = ["AutoplanError", "MemoryInfeasibleError", "ParallelModule", "Plan", "parallelize", "plan"]
