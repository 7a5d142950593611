"""ZeRO-1 and ZeRO-2: a parameter's optimizer state (and gradient) stored sharded under a
parameter the forward reads whole, carried out with DTensor placements.

The plan's :class:`~autoplan.plan_schema.ParamStorage` gives, per parameter, three placements:
the parameter, its gradient after the reduction and its optimizer state. Where the optimizer
state's differs from the parameter's (ZeRO-1), the optimizer steps a *master shard*: a DTensor
in the state's placements holding this rank's part of the parameter (taken from the parameter
by a local slice, no communication). The gradient is not all-reduced in the backward: it stays
partial sums (through the microbatches it accumulates), and before the step it is
reduce-scattered into the state's placements, as DeepSpeed's ZeRO-1 does; the optimizer
updates the shard and its moments, and the parameter is rebuilt from the updated shards with
DTensor's all-gather. Both are the plan's optimizer-phase collectives: a reduce-scatter and an
all-gather per parameter, the bytes of the all-reduce plain storage runs. Where the gradient's
placements differ too (ZeRO-2), the backward reduces the gradient's partial sums straight into
them, a reduce-scatter instead of an all-reduce, so no rank holds a whole reduced gradient.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from autoplan.codegen.redistribution import reduce_to, to_dtensor_placements
from autoplan.plan_schema import ParamStorage


def zero_parameters(plan_storage: Mapping[str, ParamStorage], params: Mapping[str, torch.nn.Parameter]
                    ) -> dict[str, ParamStorage]:
    """The parameters of ``params`` (by FQN) whose plan storage shards the gradient or the
    optimizer state unlike the parameter; one FQN per parameter object. A held parameter
    (:mod:`autoplan.codegen.held_parameters`) is stored as its optimizer state's shard: not one."""
    out: dict[str, ParamStorage] = {}
    seen: set[int] = set()
    for fqn, param in params.items():
        storage = plan_storage.get(fqn)
        if storage is None or storage.held or id(param) in seen or not isinstance(param, DTensor) \
                or not param.requires_grad:
            continue
        if storage.grad != storage.param or storage.optimizer_state != storage.param:
            out[fqn] = storage
            seen.add(id(param))
    return out


def gradient_placements(plan_storage: Mapping[str, ParamStorage], params: Mapping[str, torch.nn.Parameter]
                        ) -> dict[int, tuple[Placement, ...]]:
    """``id(parameter)`` → the placements the backward reduces its gradient into, for the
    parameters whose gradient is stored unlike the parameter (ZeRO-2)."""
    return {id(params[fqn]): tuple(to_dtensor_placements(storage.grad))
            for fqn, storage in zero_parameters(plan_storage, params).items() if storage.grad != storage.param}


def reduced_before_step(plan_storage: Mapping[str, ParamStorage], params: Mapping[str, torch.nn.Parameter],
                        deferred: Collection[str]) -> set[int]:
    """``id(parameter)`` of the ZeRO-1 parameters (optimizer state sharded under a whole
    gradient) among ``deferred`` (FQNs whose edges leave the gradient partial sums): their
    gradients stay partial sums through the backward, and
    :meth:`ShardedOptimizerState.before_step` reduce-scatters them into the state's shard."""
    return {id(params[fqn]) for fqn, storage in zero_parameters(plan_storage, params).items()
            if storage.grad == storage.param and fqn in deferred}


class ShardedOptimizerState:
    """The master shards of the ZeRO parameters of ``params`` and the step around them; see
    the module docstring. :meth:`parameters` replaces those parameters by their shards in the
    list the optimizer is built over."""

    def __init__(self, plan_storage: Mapping[str, ParamStorage], params: Mapping[str, torch.nn.Parameter]) -> None:
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (parameter, master shard)
        for fqn, storage in zero_parameters(plan_storage, params).items():
            param = params[fqn]
            placements = to_dtensor_placements(storage.optimizer_state)
            with torch.no_grad():  # its own memory: the step must not write into the parameter
                shard = param.detach().redistribute(param.device_mesh, placements).clone()
            self._pairs.append((param, torch.nn.Parameter(shard)))
        self._masters = {id(p): m for p, m in self._pairs}

    def __len__(self) -> int:
        return len(self._pairs)

    def parameters(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """``params`` with each ZeRO parameter replaced by its master shard."""
        return [self._masters.get(id(p), p) for p in params]

    def before_step(self) -> None:
        """Hand each gradient to its master shard, in the state's placements: a ZeRO-1
        gradient left as partial sums is reduce-scattered there (the plan's optimizer-phase
        reduction), a ZeRO-2 one is already there (or a local slice away)."""
        for param, master in self._pairs:
            grad = param.grad
            param.grad = None
            if grad is not None:
                master.grad = reduce_to(grad, master.device_mesh, master.placements)

    def after_step(self) -> None:
        """Rebuild each parameter from the updated shards (the planned all-gathers)."""
        with torch.no_grad():
            for param, master in self._pairs:
                whole = master.detach().redistribute(param.device_mesh, param.placements)
                param.to_local().copy_(whole.to_local())

    def take_from_parameters(self) -> None:
        """Take each master shard from its parameter again: after the parameters were loaded
        from a checkpoint (a local slice, no communication)."""
        with torch.no_grad():
            for param, master in self._pairs:
                shard = param.detach().redistribute(master.device_mesh, master.placements)
                master.to_local().copy_(shard.to_local())
