"""autoplan: automatic parallelization planner and compiler for PyTorch.

``autoplan.plan(model, example_inputs, devices=8, cluster="h100", **options) -> Plan``
``autoplan.parallelize(model, example_inputs, devices=N) -> ParallelModule`` (in a torchrun job)
"""

import importlib
from typing import Any

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.plan_schema import Plan

# names whose modules import torch, imported on first use (``autoplan --help`` needs none of them)
_ON_FIRST_USE = (
    ("plan", "autoplan.planner.front_door"),
    ("PlanOptions", "autoplan.planner.options"),
    ("parallelize", "autoplan.parallel_api"),  # not autoplan.parallelize: a module of that name would shadow it
    ("ParallelModule", "autoplan.codegen.runtime"),
    ("PipelinedModule", "autoplan.codegen.runtime"),
)


def __getattr__(name: str) -> Any:
    module = next((module for known, module in _ON_FIRST_USE if known == name), None)
    if module is None:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)  # found here from now on
    return value


__all__ = ["AutoplanError", "MemoryInfeasibleError", "ParallelModule", "PipelinedModule", "Plan", "PlanOptions", "parallelize", "plan"]
