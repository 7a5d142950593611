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
    if plan.precision.name != "fp32":
        raise AutoplanError(f"the plan asks for {plan.precision.name} precision and the program trains in fp32 "
                            f"only: plan with --precision fp32")
    for name, storage in plan.storage.items():
        if storage.grad != storage.param or storage.optimizer_state != storage.param:
            raise AutoplanError(f"the plan stores {name}'s gradient or optimizer state unlike the parameter "
                                f"(ZeRO), which the program does not do yet: plan again")
