"""The plan's optimizer, built over the program's parameters, and the one-line refusal of
what the program cannot carry out yet."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from autoplan.errors import AutoplanError
from autoplan.plan_schema import OptimizerPlan, Plan


def build_optimizer(spec: OptimizerPlan, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``torch.optim`` for ``spec`` (AdamW, Adam, SGD, SGD with momentum) over ``params``
    (plain tensors or DTensors: torch's optimizers step DTensors shard by shard)."""
    unique = list({id(p): p for p in params}.values())
    if spec.name == "adamw":
        return torch.optim.AdamW(unique, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps,
                                 weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(unique, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps,
                                weight_decay=spec.weight_decay)
    momentum = spec.momentum if spec.name == "sgd-momentum" else 0.0
    return torch.optim.SGD(unique, lr=spec.lr, momentum=momentum, weight_decay=spec.weight_decay)


def refuse_unsupported(plan: Plan) -> None:
    """One line for the first decision of ``plan`` this program cannot carry out."""
    for name, storage in plan.storage.items():
        if storage.held and not plan.scheduled:
            raise AutoplanError(f"the plan holds {name} gathered through a step's microbatches, but it has one "
                                "microbatch and no pipeline: plan again")
        for kind, placements in (("gradient", storage.grad), ("optimizer state", storage.optimizer_state)):
            if any(p.startswith("P") for p in placements):
                raise AutoplanError(f"the plan stores {name}'s {kind} as partial sums ({placements}): "
                                    f"a stored tensor must be R or S(d); plan again")
