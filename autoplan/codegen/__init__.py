"""Code generation: turn a :class:`~autoplan.plan_schema.Plan` into a runnable program.

``build_program(graph, plan, mesh, params)`` runs the traced graph on DTensors with the plan's
placements (:mod:`autoplan.codegen.dtensor_program`, with :mod:`redistribution`); plans that
are DDP or Megatron patterns run natively (:mod:`native`); pipelines run on
``torch.distributed.pipelining`` (:mod:`pipeline_program`); :mod:`runtime` builds the right
one for a Plan in a torchrun job."""

from autoplan.codegen.dtensor_program import ShardedProgram, build_program, executed_collectives, planned_collectives
from autoplan.codegen.redistribution import shard_batch, to_dtensor_placements

__all__ = ["ShardedProgram", "build_program", "executed_collectives", "planned_collectives", "shard_batch",
           "to_dtensor_placements"]
