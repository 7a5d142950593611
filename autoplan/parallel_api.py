"""``autoplan.parallelize``: plan (through the front door) where no plan is given, then build
the planned program in this rank of a ``torchrun`` job::

    pm = autoplan.parallelize(model, example_inputs, devices=world_size, loss_fn=loss_fn)
    for batch in data:                      # each rank passes the same GLOBAL batch
        loss = pm.train_step(*batch)        # forward, backward and the plan's optimizer step

Every rank plans for itself (planning is deterministic) and the program checks that all
ranks reached the same decisions before it builds anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.codegen.runtime import ParallelModule, PipelinedModule, build_parallel_module, init_distributed
from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions


def parallelize(model: torch.nn.Module, example_inputs: Any, devices: int | None = None,
                mesh: DeviceMesh | None = None, plan: Plan | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None, cluster: Any = "h100",
                **options: Any) -> ParallelModule | PipelinedModule:
    """Parallelize ``model`` for the running torchrun job.

    ``example_inputs`` is one global batch (shapes are planned for it). ``plan`` reuses a saved
    plan (it must be for this model and this number of processes); otherwise every rank plans
    with :func:`autoplan.plan`'s search for ``devices`` (default: the world size), the given
    ``mesh``'s shape, ``cluster`` and any other :class:`PlanOptions` field in ``options``.
    A pipelined plan gives a :class:`PipelinedModule`.
    """
    spec = make_model_spec(model, example_inputs, loss_fn)
    if plan is None:
        world = init_distributed().world_size
        devices = mesh.size() if mesh is not None else (devices or world)
        pinned = tuple(mesh.shape) if mesh is not None else options.pop("mesh", None)
        plan = plan_model(spec, PlanOptions(devices, cluster, mesh=pinned, **options))
    return build_parallel_module(spec, plan, mesh)
