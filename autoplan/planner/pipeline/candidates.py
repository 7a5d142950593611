"""What the user pins (:class:`PipelineOptions`) and what the stage search finds (:class:`PipelineCandidate`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoplan.errors import AutoplanError
from autoplan.plan_schema import RecomputeMode
from autoplan.planner.meshes import mesh_label
from autoplan.planner.pipeline.range_costs import LayerCosts
from autoplan.planner.pipeline.schedules import INTERLEAVE, INTERLEAVED
from autoplan.planner.recompute import RecomputePolicy, lighter_mode
from autoplan.solvers.inter_op import SubMesh
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer


@dataclass(frozen=True)
class PipelineOptions:
    """What the user pins; ``None`` lets the planner choose."""

    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    layers: int | None = None


@dataclass
class PipelineCandidate:
    """One pipeline found by the DP: its stages' layer ranges and its predicted step time."""

    microbatches: int
    submesh: SubMesh
    meshes: list[tuple[int, ...]]  # the logical mesh of each stage
    cuts: list[tuple[int, int]]
    step_time_s: float
    graph: TracedGraph
    layers: list[Layer]
    schedule: str = "1f1b"
    costs: dict[tuple[int, ...], LayerCosts] | None = None  # the layer ILPs per logical mesh, for a second search
    boundaries: bool = False  # whether the search costed the boundaries inside stages
    recomputed: frozenset[int] = frozenset()  # the layers recomputed in the backward (indices into layers)
    selective: frozenset[int] = frozenset()  # those of them recomputed keeping some outputs (the others fully)
    # the mode of the layers in ``selective``; None: the options' policy's (:func:`lighter_mode`)
    lighter: RecomputeMode | None = None

    @property
    def ranks(self) -> int:
        """Pipeline ranks: one per stage, or one per ``INTERLEAVE`` chunks when interleaved."""
        return len(self.cuts) // INTERLEAVE if self.interleaved else len(self.cuts)

    interleaved: bool = False
    tied_mesh: tuple[int, ...] | None = None  # the logical mesh of the stages holding a tied weight, if pinned


def interleave(candidate: PipelineCandidate) -> PipelineCandidate:
    """The interleaved form of a pipeline: its layers cut evenly into ``INTERLEAVE`` chunks per
    pipeline rank; chunk ``c`` runs on rank ``c % ranks`` (torch's interleaved placement)."""
    ranks, layers = len(candidate.cuts), len(candidate.layers)
    chunks = INTERLEAVE * ranks
    if layers < chunks:
        raise AutoplanError(f"the interleaved schedule needs at least {chunks} layers for {ranks} pipeline ranks; "
                            f"the model has {layers}: use 1f1b or fewer stages")
    bounds = [round(i * layers / chunks) for i in range(chunks + 1)]
    if len(set(candidate.meshes)) > 1:
        raise AutoplanError("an interleaved pipeline needs one logical mesh for all its stages")
    return replace(candidate, cuts=list(zip(bounds, bounds[1:])), meshes=candidate.meshes[:1] * chunks,
                   interleaved=True)


def candidate_lighter(candidate: PipelineCandidate, policy: RecomputePolicy | str) -> RecomputeMode:
    """The mode in which ``candidate`` recomputes the layers in its ``selective`` set."""
    return candidate.lighter if candidate.lighter is not None else lighter_mode(policy)


def candidate_name(c: PipelineCandidate) -> str:
    meshes = ("mesh " + mesh_label(c.meshes[0]) if len(set(c.meshes)) == 1
              else "meshes " + "/".join(mesh_label(m) for m in c.meshes))
    schedule = f", {c.schedule}" if c.schedule in INTERLEAVED else ""
    return f"{len(c.cuts)} stage(s) x {meshes}, {c.microbatches} microbatch(es){schedule}"
