"""FSDP2 units of a data-parallel plan: ``fully_shard`` per repeated block and on the root,
and ``replicate`` on the modules that hold the parameters the plan keeps whole beside them.

A plan on a GPU node often stores the large weights sharded and gathers them at use while it
keeps the small ones (norm weights, biases) replicated, their gradients all-reduced: their
gathers would cost a latency each in its cost model. FSDP2 carries that out with its own
parts: every block and the root are ``fully_shard``ed with the replicated parameters left out
(``ignored_params``) and each sharded one on the dim the plan shards
(``shard_placement_fn``: a tied table stored on its dim 1), and every module that holds
replicated parameters directly gets torch's FSDP2-based ``replicate``
(``torch.distributed._composable.replicate_with_fsdp``: DDP's semantics in FSDP2's groups)
over the others, whose gradients it all-reduces after the module's backward, one all-reduce
per module. A parameter the plan keeps whole while its gradient and optimizer state are
sharded (ZeRO-2: a head, whose second gather would cost more than holding it) makes its module a
group of its own, ``fully_shard``ed first with ``reshard_after_forward=False``; an embedding
table read in place (:mod:`autoplan.codegen.native_storage`) is left to its parallel style.
Under a bf16 plan every group takes the plan's ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

if TYPE_CHECKING:
    from autoplan.codegen.native_storage import ParameterStorage


@dataclass(frozen=True)
class FsdpUnits:
    """How many FSDP2 groups gather and reduce-scatter (``sharded``: blocks and the root that
    hold sharded parameters; ``held``: modules of ZeRO-2 parameters, gathered once per step) and
    how many ``replicate`` groups all-reduce (``replicated``)."""

    sharded: int
    replicated: int
    held: int = 0


def frozen_group(module: torch.nn.Module, blocks: list[torch.nn.Module]) -> str | None:
    """Why FSDP2's groups (``blocks``, then the root with the rest) would not run the plan's
    collectives, or None: a group whose parameters are all frozen reduces no gradient and is
    gathered in the backward only where gradients flow through it, which the program's count of
    its collectives (one reduce-scatter and one backward gather per group) does not follow. Such
    a plan runs on the DTensor interpreter, which reduces gradients parameter by parameter."""
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    names = {id(m): name for name, m in module.named_modules()}
    for block in blocks:
        if not any(p.requires_grad for p in block.parameters()):
            return f"FSDP2's group {names.get(id(block), '?')} holds only frozen parameters"
    rest = [p for p in module.parameters() if id(p) not in in_blocks]
    if rest and not any(p.requires_grad for p in rest):
        return "FSDP2's root group holds only frozen parameters"
    return None


def root_holds_replicated(module: torch.nn.Module, managed: Collection[str]) -> bool:
    """Whether the root module itself holds a parameter the plan keeps whole beside the
    ``managed`` ones (FQNs: sharded, ZeRO-2, tables read in place): ``replicate`` and
    ``fully_shard`` cannot share the root."""
    return bool(managed) and any(name not in managed for name, _ in module.named_parameters(recurse=False))


def shard_modules(module: torch.nn.Module, blocks: list[torch.nn.Module], mesh: DeviceMesh,
                  policy: MixedPrecisionPolicy, reshard_after_forward: bool,
                  storage: ParameterStorage | None = None) -> FsdpUnits:
    """``fully_shard`` each of ``blocks`` and then ``module`` (the root) on ``mesh``; with
    ``storage`` (a 1-D plan's: :class:`~autoplan.codegen.native_storage.ParameterStorage`), only
    its sharded parameters, each on its dim, its ZeRO-2 parameters' modules first, each a group
    of its own held from the forward through the backward, the tables its embeddings read in
    place left out (their parallel style holds them), and the other parameters ``replicate``d
    on the modules that hold them (see the module docstring). Every parameter is sharded on dim
    0 without it."""
    named = dict(module.named_parameters(remove_duplicate=False))
    options: dict = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    dims = {id(p): 0 for p in named.values()}
    kept_whole: dict[int, torch.nn.Parameter] = {}
    holders: list[torch.nn.Module] = []
    if storage is not None:
        dims = {id(named[fqn]): d for fqn, d in storage.shard_dims.items()}
        elsewhere = {id(named[fqn]) for fqn in (*storage.zero2, *storage.table_names())}
        tables = {named[fqn] for fqn in storage.table_names()}
        kept_whole = {id(p): p for p in named.values() if id(p) not in dims and id(p) not in elsewhere}
        options.update(ignored_params=set(kept_whole.values()) | tables or None,
                       shard_placement_fn=lambda param: Shard(dims[id(param)]))
        holders = list({id(h): h for h in (module.get_submodule(fqn.rpartition(".")[0]) for fqn in storage.zero2)
                        }.values())
    # (counted before sharding: fully_shard replaces a module's parameters)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    sharded = sum(any(id(p) in dims for p in block.parameters()) for block in blocks)
    sharded += any(id(p) in dims and id(p) not in in_blocks for p in module.parameters())
    for holder in holders:  # ZeRO-2: gathered before the forward, held through the backward
        fully_shard(holder, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    for block in blocks:
        fully_shard(block, **options)
    replicated = 0
    # replicate takes a 1-D mesh: on HSDP's 2-D one, every rank (one all-reduce where the plan
    # all-reduces over each axis in turn)
    whole_mesh = mesh if mesh.ndim == 1 else mesh._flatten()
    for holder in module.modules():
        own = {id(p) for p in holder.parameters(recurse=False) if id(p) in kept_whole}
        if holder is module or not own:
            continue
        others = {p for p in holder.parameters() if id(p) not in own}
        replicate(holder, mesh=whole_mesh, mp_policy=policy, ignored_params=others or None)
        for i in own:  # a tied parameter is replicated with its first holder
            kept_whole.pop(i)
        replicated += 1
    fully_shard(module, **options)
    return FsdpUnits(sharded, replicated, len(holders))
