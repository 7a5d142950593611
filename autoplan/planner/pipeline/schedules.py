"""Pipeline schedules: their names, step time and the activations each keeps in flight (see
the package docstring for the formulas)."""

from __future__ import annotations

from enum import StrEnum

from autoplan.errors import AutoplanError


class Schedule(StrEnum):
    """A plan's schedule, as plan.json names it (``none``: no pipeline)."""

    NONE = "none"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved1f1b"
    INTERLEAVED_ZERO_BUBBLE = "interleavedzerobubble"


SCHEDULES: tuple[Schedule, ...] = tuple(s for s in Schedule if s is not Schedule.NONE)
INTERLEAVED = frozenset({Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZERO_BUBBLE})

INTERLEAVE = 2  # chunks per pipeline rank in the interleaved schedules
ZERO_BUBBLE_LEFT = 1.0 / 3.0  # share of the interleaved bubble zero-bubble scheduling leaves (the forward's)


def normalize_schedule(name: str) -> Schedule:
    """torch's schedule names, any case, with or without torch's ``Schedule`` prefix:
    ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``ScheduleInterleavedZeroBubble``."""
    key = name.replace("_", "").replace("-", "").lower().removeprefix("schedule")
    if key not in SCHEDULES:
        raise AutoplanError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    return Schedule(key)


def activations_in_flight(schedule: str, microbatches: int, stages: int) -> int:
    """Microbatches whose activations one stage keeps at once. GPipe: all of them; 1F1B: at most
    one per stage; the interleaved schedules (``stages`` chunks, ``v = INTERLEAVE`` per rank on
    ``D`` ranks): torch's keeps at most ``(v − 1)·D + 2(D − 1) + 1`` chunk-forwards on a rank
    (its first rank's warm-up, then the forward before the first backward), counted here as an
    equal share per chunk (its chunks have equal layer counts)."""
    if schedule == "gpipe":
        return microbatches
    if schedule in INTERLEAVED and stages >= INTERLEAVE:
        ranks = stages // INTERLEAVE
        per_rank = (INTERLEAVE - 1) * ranks + 2 * (ranks - 1) + 1
        return max(1, min(microbatches, -(-per_rank // INTERLEAVE)))
    return min(microbatches, stages)


def rank_stages(stages: int, schedule: str) -> list[list[int]]:
    """The stages each pipeline rank runs: one each, or, interleaved, stages ``r, r + D, ...``
    on rank ``r`` of ``D`` (torch's loop placement)."""
    if schedule in INTERLEAVED and stages >= INTERLEAVE:
        ranks = stages // INTERLEAVE
        return [list(range(r, stages, ranks)) for r in range(ranks)]
    return [[s] for s in range(stages)]


def busiest_rank(latencies: list[float], schedule: str) -> list[int]:
    """The stages of the pipeline rank that works longest per microbatch: the rank whose
    compute and communication a step's parts report, beside the bubble it waits out."""
    return max(rank_stages(len(latencies), schedule), key=lambda stages: sum(latencies[s] for s in stages))


def pipeline_time(latencies: list[float], microbatches: int, schedule: str) -> float:
    """Step time of a pipeline whose stages take ``latencies`` per microbatch."""
    if schedule in INTERLEAVED and len(latencies) >= INTERLEAVE:
        ranks = len(latencies) // INTERLEAVE
        per_rank = [sum(latencies[s] for s in stages) for stages in rank_stages(len(latencies), schedule)]
        # zero bubble: the weight-gradient half of each backward fills the warm-up and drain
        bubble = (ranks - 1) * max(latencies) * (ZERO_BUBBLE_LEFT if schedule == "interleavedzerobubble" else 1.0)
        return microbatches * max(per_rank) + bubble
    return sum(latencies) + (microbatches - 1) * max(latencies)


def ranks_time(latencies: list[float], microbatches: int, schedule: str) -> float:
    """Step time of a pipeline whose pipeline ranks take ``latencies`` per microbatch (the stage
    search's stages: interleaved chunks are cut after it): under an interleaved schedule each
    rank's work counted as ``INTERLEAVE`` equal chunks, chunk ``c`` on rank ``c % D``
    (:func:`rank_stages`), so that its bubble is a chunk's, not a rank's."""
    if schedule in INTERLEAVED:
        ranks = len(latencies)
        return pipeline_time([latencies[c % ranks] / INTERLEAVE for c in range(INTERLEAVE * ranks)], microbatches,
                             schedule)
    return pipeline_time(latencies, microbatches, schedule)
