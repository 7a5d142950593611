"""autoplan: automatic parallelization planner and compiler for PyTorch.

``autoplan.plan(model, example_inputs, devices=8, cluster="h100") -> Plan``
"""

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.planner.api import plan
from autoplan.planner.plan import Plan

__all__ = ["AutoplanError", "MemoryInfeasibleError", "Plan", "plan"]
