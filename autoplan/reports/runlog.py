"""What a run of the emitted train.py measured, read from its standard output.

Rank 0 prints one line per step: ``step K loss X`` with an optional `` time S`` suffix (the
step's wall-clock seconds). Other lines (torchrun's banners, warnings) are ignored."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

_STEP = re.compile(r"^\s*step\s+(\d+)\s+loss\s+(\S+)(?:\s+time\s+(\S+))?\s*$")


@dataclass
class RunLog:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times_s: list[float] | None = None  # None: the log carries no step times

    @property
    def measured_step_s(self) -> float | None:
        """The median step time, leaving out the first step (warm-up) when there are more."""
        if not self.times_s:
            return None
        times = self.times_s[1:] if len(self.times_s) > 1 else self.times_s
        return statistics.median(times)


def parse_train_log(text: str) -> RunLog:
    """Every ``step K loss X [time S]`` line of ``text``; step times only when every step has one."""
    log = RunLog(times_s=[])
    complete = True
    for line in text.splitlines():
        m = _STEP.match(line)
        if not m:
            continue
        try:
            loss = float(m.group(2))
            seconds = float(m.group(3)) if m.group(3) is not None else None
        except ValueError:
            continue
        log.steps.append(int(m.group(1)))
        log.losses.append(loss)
        if seconds is None:
            complete = False
        else:
            assert log.times_s is not None
            log.times_s.append(seconds)
    if not complete or not log.times_s:
        log.times_s = None
    return log
