"""The predicted pipeline timeline: when each stage runs each microbatch's forward and
backward, as a Chrome trace (opens in Perfetto) and as a PNG.

Each stage's per-microbatch latency is split one third forward, two thirds backward (the
backward computes gradients for inputs and weights). Per stage, the schedule fixes the order
of its work (GPipe: every forward, then every backward; 1F1B: ``S − s − 1`` warm-up forwards,
then one forward one backward); a step starts when the stage is free and its inputs exist
(the forward of microbatch m on stage s after that on stage s − 1, the backward after that on
stage s + 1). What is left between a stage's work is bubble.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class Slot:
    stage: int
    microbatch: int
    phase: str  # "forward" or "backward"
    start_s: float
    end_s: float


def _order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    if schedule == "gpipe" or stages == 1:
        return [("forward", m) for m in range(microbatches)] + [("backward", m) for m in range(microbatches)]
    warmup = min(stages - stage - 1, microbatches)
    order = [("forward", m) for m in range(warmup)]
    f, b = warmup, 0
    while b < microbatches:
        if f < microbatches:
            order.append(("forward", f))
            f += 1
        order.append(("backward", b))
        b += 1
    return order


def simulate(latencies: list[float], microbatches: int, schedule: str) -> list[Slot]:
    """Every stage's forward and backward slots under ``schedule`` (gpipe or 1f1b ordering;
    interleaved is drawn with 1F1B's order over its stages)."""
    stages = len(latencies)
    orders = [_order(schedule, s, stages, microbatches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * stages
    free = [0.0] * stages
    slots: list[Slot] = []
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] >= len(orders[s]):
                continue
            phase, m = orders[s][position[s]]
            if phase == "forward":
                ready = 0.0 if s == 0 else done.get(("forward", m, s - 1))
            else:
                ready = done.get(("forward", m, s)) if s == stages - 1 else done.get(("backward", m, s + 1))
            if ready is None:
                continue
            share = FORWARD_SHARE if phase == "forward" else 1.0 - FORWARD_SHARE
            start = max(free[s], ready)
            end = start + latencies[s] * share
            slots.append(Slot(s, m, phase, start, end))
            done[(phase, m, s)] = end
            free[s] = end
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # a bug in _order, not user input
    return slots


def chrome_trace(slots: list[Slot]) -> dict:
    """Chrome trace events (microseconds), one track per stage."""
    events = [{"name": f"{'F' if s.phase == 'forward' else 'B'}{s.microbatch}", "cat": s.phase, "ph": "X",
               "ts": s.start_s * 1e6, "dur": (s.end_s - s.start_s) * 1e6, "pid": 0, "tid": s.stage}
              for s in slots]
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": stage, "args": {"name": f"stage {stage}"}}
             for stage in sorted({s.stage for s in slots})]
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def write_timeline(latencies: list[float], microbatches: int, schedule: str, folder: Path) -> list[Path]:
    """Write ``timeline.json`` (Chrome trace) and ``timeline.png`` into ``folder``."""
    from autoplan.reports.figures import (
        pipeline_timeline,  # figures draws this module's simulation
    )

    slots = simulate(latencies, microbatches, schedule)
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "timeline.json"
    json_path.write_text(json.dumps(chrome_trace(slots)))
    png_path = folder / "timeline.png"
    png_path.write_bytes(pipeline_timeline(latencies, microbatches, schedule))
    return [json_path, png_path]
