"""Sharded initialisation: a model built on the meta device runs without any rank ever holding
a full copy of a sharded parameter.

The program is built from the meta model as usual, except that each parameter and buffer is
created empty in its planned placements (``torch.distributed.tensor.empty``: this rank's
shard only; FSDP2 and ``parallelize_module`` shard the meta module, then ``to_empty``
allocates the shards). Then the model's own initialisation runs on those tensors, through a
meta copy of the user's module whose parameters and buffers are replaced by the program's:

1. ``init_weights(module)`` where the model file defines it (a user hook);
2. else ``module.init_weights()`` where the model has one (Hugging Face models: their
   ``_init_weights``, rotary buffers included);
3. else ``reset_parameters()`` of every submodule that has one.

Initialisers write DTensors shard by shard (random ones through DTensor's offset-based
generator where it runs, so the shards of one parameter are drawn as one tensor would be);
then every replica of a DTensor is made equal to the first along each axis it is replicated
over (:func:`synchronise_replicas`: on CPU meshes each rank draws from its own generator);
plain tensors they copy in count as replicated. A buffer no
initialiser sets (one computed in ``__init__``) would be left uninitialised: a model with such
buffers needs the ``init_weights`` hook. Under a pipeline, the tensors of other ranks' stages
stay on the meta device (initialisers do nothing there). Data parallelism (DDP, one device)
holds a whole copy by design: there the module is allocated whole with ``to_empty`` and
initialised the same way. Pipeline stages cut from a meta-device model are traced as fake
tensors on the device (:func:`on_device`), then made meta again (:func:`tensors_on_meta`) and
sharded, allocated and initialised like the rest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import Placement

from autoplan.errors import AutoplanError

Initialiser = Callable[[torch.nn.Module], Any]


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def default_initialiser(module: torch.nn.Module) -> None:
    """The model's own initialisation: ``init_weights()`` (Hugging Face models), else every
    submodule's ``reset_parameters()``."""
    if callable(getattr(module, "init_weights", None)):
        module.init_weights()
        return
    for sub in module.modules():
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()


def planned_tensor(tensor: torch.Tensor, mesh: DeviceMesh, placements: list[Placement]) -> DTensor:
    """``tensor`` as a DTensor in ``placements`` on ``mesh``, cut locally from the whole tensor
    every rank holds (no communication); for a meta tensor, this rank's shard allocated
    empty, to be initialised by :func:`initialise`."""
    if tensor.is_meta:
        return dtensor_empty(tuple(tensor.shape), dtype=tensor.dtype, device_mesh=mesh, placements=placements)
    return distribute_tensor(tensor.clone(), mesh, placements, src_data_rank=None)


def _replace(module: torch.nn.Module, fqn: str, tensor: torch.Tensor) -> None:
    owner_name, _, name = fqn.rpartition(".")
    owner = module.get_submodule(owner_name)
    if name in owner._parameters:
        owner._parameters[name] = tensor if isinstance(tensor, torch.nn.Parameter) else torch.nn.Parameter(tensor)
    elif name in owner._buffers:
        owner._buffers[name] = tensor
    else:
        raise AutoplanError(f"{fqn} is neither a parameter nor a buffer of the model: plan this model again")


def initialise(user_module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], init: Initialiser | None) -> None:
    """Run the model's initialisation (``init``, else :func:`default_initialiser`) on the
    program's ``tensors`` (by FQN, tied names included), through a meta copy of
    ``user_module`` that holds them."""
    shell = copy.deepcopy(user_module)  # a meta module: copying it allocates nothing
    for fqn, tensor in tensors.items():
        _replace(shell, fqn, tensor)
    try:
        with torch.no_grad(), implicit_replication():
            (init or default_initialiser)(shell)
    except AutoplanError:
        raise
    except Exception as e:  # the model's initialiser cannot run on the sharded tensors
        raise AutoplanError(f"initialising the meta-device model shard by shard failed ({type(e).__name__}: "
                            f"{str(e).strip()[:160]}): define init_weights(module) in the model file") from e
    synchronise_replicas(tensors[fqn] for fqn in sorted(tensors))


def materialise_whole(module: torch.nn.Module, device: torch.device | str, init: Initialiser | None) -> None:
    """Allocate every meta tensor of ``module`` on ``device`` (whole, or the shards of the
    parameters FSDP2 or ``parallelize_module`` made DTensors) and initialise them."""
    module.to_empty(device=device)  # under FSDP2 or parallelize_module: this rank's shards only
    try:
        with torch.no_grad(), implicit_replication():
            (init or default_initialiser)(module)
    except Exception as e:
        raise AutoplanError(f"initialising the meta-device model failed ({type(e).__name__}: "
                            f"{str(e).strip()[:160]}): define init_weights(module) in the model file") from e
    synchronise_replicas([*module.parameters(), *module.buffers()])


def synchronise_replicas(tensors: Iterable[torch.Tensor]) -> None:
    """Make every replica of each DTensor among ``tensors`` equal: over each mesh axis where it
    is replicated, the first coordinate's values broadcast to the others. Random initialisers
    draw a replicated DTensor from each rank's own generator where DTensor's offset-based
    generator does not run (on CPU meshes), so the replicas of a bias, of an HSDP shard over
    its replicate axis, would start apart and stay apart (their gradients are reduced alike).
    The ranks of each axis's group visit the same tensors in the same order."""
    seen: set[int] = set()
    for tensor in tensors:
        if not isinstance(tensor, DTensor) or tensor.is_meta or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local()
        for axis, placement in enumerate(tensor.placements):
            if placement.is_replicate() and tensor.device_mesh.size(axis) > 1:
                with torch.no_grad():
                    dist.broadcast(local, group=tensor.device_mesh.get_group(axis), group_src=0)


def tensors_on_meta(module: torch.nn.Module) -> None:
    """Every parameter and buffer of ``module`` replaced by an empty meta tensor of its shape and
    dtype (one for each tensor, however many names it has): a pipeline stage traced as fake
    tensors from a meta-device model, to be sharded and allocated as the model's own meta
    tensors are."""
    made: dict[int, torch.Tensor] = {}

    def on_meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
            made[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
        return made[id(t)]

    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = on_meta(t)  # type: ignore[assignment]


def on_device(value: Any, device: torch.device, fake: FakeTensorMode | None) -> Any:
    """An example input on ``device``: a fake tensor there for a meta-device model's trace."""
    if not isinstance(value, torch.Tensor):
        return value
    if fake is None:
        return value.to(device)
    with fake:
        return torch.empty(value.shape, dtype=value.dtype, device=device)
