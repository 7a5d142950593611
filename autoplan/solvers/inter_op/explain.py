"""A pipeline as text: one line for the whole, one per stage."""

from __future__ import annotations

from autoplan.solvers.inter_op.problem import InterOpSolution
from autoplan.solvers.units import format_bytes, format_seconds


def explain_inter_op(solution: InterOpSolution) -> str:
    """The pipeline as text: one line for the whole, one per stage."""
    lines = [(
        f"pipeline of {len(solution.stages)} stage(s): step {format_seconds(solution.step_time_s)}"
        f" (slowest stage {format_seconds(solution.t_max_s)}; "
        f"{solution.num_candidates_evaluated} stage costs evaluated, "
        f"{solution.num_dp_passes} DP passes, {solution.solve_time_s:.2f} s)"
    )]
    for s, stage in enumerate(solution.stages):
        logical = ("" if not stage.cost.logical_mesh
                   else f" (logical mesh {'x'.join(map(str, stage.cost.logical_mesh))})")
        lines.append(
            f"  stage {s}: layers {stage.start}-{stage.end - 1} on {stage.sub_mesh}{logical}: "
            f"{format_seconds(stage.cost.latency_s)} per microbatch, "
            f"{format_bytes(stage.cost.memory_bytes)} per device"
        )
    return "\n".join(lines)
