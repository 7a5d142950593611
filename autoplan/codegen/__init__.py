"""Code generation: turn a :class:`~autoplan.plan_schema.Plan` into a runnable program.

``build_program(graph, plan, mesh, params)`` runs the traced graph on DTensors with the plan's
placements (see :mod:`autoplan.codegen.dtensor_program`)."""

from autoplan.codegen.dtensor_program import (
    ShardedProgram,
    build_program,
    executed_collectives,
    planned_collectives,
    shard_batch,
    to_dtensor_placements,
)

__all__ = [
    "ShardedProgram",
    "build_program",
    "executed_collectives",
    "planned_collectives",
    "shard_batch",
    "to_dtensor_placements",
]
