"""The alpha-beta fit of timed collectives and the op-bandwidth fit of a timed step (pure arithmetic).

A fit can be numerically fine and physically absurd: on a busy machine a quick run once gave an
all-reduce 0.08 us of latency and 17.8 TB/s of bandwidth, with its own points missed by 62-82%.
:func:`implausible` names what rules a fit out: a latency below :data:`MIN_LATENCY_S` (no
collective between processes starts faster), a bandwidth above :data:`MAX_BANDWIDTH` (no link
moves more per device), or an rms relative error above :data:`MAX_RMS_ERROR` (the model does not
describe the timings). Such a fit is not written: its kind falls back to the joint fit, the
joint fit to the preset's link, and the command warns on stderr naming the kind, the figure
and the bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost_models import (BACKWARD_FACTOR, DeviceSpec, LinkSpec, bytes_moved_per_device, latency_steps,
    op_seconds, roofline_time)

# ---------------------------------------------------------------------------------------------
# The alpha-beta fit (pure arithmetic)


#: Bounds of a plausible link fit (see the module docstring).
MIN_LATENCY_S = 0.5e-6
MAX_BANDWIDTH = 2e12
MAX_RMS_ERROR = 0.5


@dataclass(frozen=True)
class Sample:
    """One timed collective: ``kind`` on ``n`` devices with a per-device buffer of ``nbytes``
    (the convention of :mod:`autoplan.cost_models.communication`) took ``seconds``."""

    kind: str
    n: int
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class LinkFit:
    """``alpha`` seconds per ring step and ``bandwidth`` bytes/s fitted to ``points`` samples;
    ``rms_rel_error`` is the root mean square of (model − measured)/measured."""

    kind: str
    alpha: float
    bandwidth: float
    points: int
    rms_rel_error: float

    def link(self) -> LinkSpec:
        return LinkSpec(bandwidth=self.bandwidth, latency=self.alpha)


def fit_alpha_beta(samples: Iterable[Sample], kind: str | None = None) -> LinkFit:
    """Least-squares fit of ``t = latency_steps(kind, n)·α + bytes_moved_per_device(...)·β``
    (β = 1/bandwidth) to ``samples``, which may mix collectives and device counts.

    Residuals are relative, (model − t)/t, so microsecond latencies weigh as much as the
    millisecond transfers of large messages. α is kept ≥ 0 (a negative intercept refits β
    alone). Raises ValueError when the samples cannot determine a positive bandwidth (fewer
    than two distinct message sizes, or times that do not grow with size).
    """
    rows = [(float(latency_steps(s.kind, s.n)), bytes_moved_per_device(s.kind, s.nbytes, s.n), float(s.seconds))
            for s in samples]
    if any(not (t > 0 and math.isfinite(t)) for _, _, t in rows):
        raise ValueError("every timing must be a positive number of seconds")
    rows = [r for r in rows if r[1] > 0]  # n == 1 moves nothing: nothing to learn from it
    if len({m for _, m, _ in rows}) < 2:
        raise ValueError("the fit needs at least two message sizes")
    # Columns scaled to about 1 so the 2x2 normal equations stay well conditioned.
    s_scale = max(s for s, _, _ in rows)
    m_scale = max(m for _, m, _ in rows)
    a = b = c = d = e = 0.0
    for s, m, t in rows:
        x, y, w = s / s_scale, m / m_scale, 1.0 / (t * t)
        a += w * x * x
        b += w * x * y
        c += w * y * y
        d += w * x * t
        e += w * y * t
    det = a * c - b * b
    alpha_s = (c * d - b * e) / det if det > 1e-12 * a * c else -1.0
    beta_s = (a * e - b * d) / det if det > 1e-12 * a * c else 0.0
    if alpha_s < 0:  # no room for a latency: bandwidth term alone
        alpha_s, beta_s = 0.0, e / c
    if not beta_s > 0:  # times do not grow with the size
        raise ValueError("the timings do not grow with message size: bandwidth cannot be fitted")
    alpha, beta = alpha_s / s_scale, beta_s / m_scale
    rel = [((s * alpha + m * beta) - t) / t for s, m, t in rows]
    return LinkFit(kind or "all", alpha, 1.0 / beta, len(rows),
                   math.sqrt(sum(r * r for r in rel) / len(rel)))


def costed_ops(graph: Any) -> list[Any]:
    """The op nodes the cost model charges (a ``getitem`` costs nothing)."""
    return [info for info in graph.nodes.values() if info.kind == "op" and info.target != "getitem"]


def fit_op_bandwidth(nodes: Sequence[Any], seconds: float, peaks: dict[str, float], overhead_s: float,
                     overlapped_dispatch: bool = False, lowest: float = 1e6, highest: float = 1e15) -> float:
    """The op bandwidth (bytes/s) at which the cost model predicts ``seconds`` for a training
    step of ``nodes`` (:class:`~autoplan.trace.graph.NodeInfo` of op nodes, all needing
    gradients): ``Σ (1 + BACKWARD_FACTOR) · op_seconds(roofline(flops, moved bytes))`` (the
    roofline plus ``overhead_s``, or the larger of the two with ``overlapped_dispatch``) with
    the matmul ``peaks`` (FLOP/s by dtype), as :func:`autoplan.cost_models.step_costs.op_cost` charges
    one device. The prediction falls as the bandwidth grows; the root is bisected (in log
    space) between ``lowest`` and ``highest``. 0.0 when even ``highest`` predicts more than
    ``seconds`` (the matmuls and the overhead explain the step: no rate can be told); ``lowest``
    when even it predicts less."""
    from autoplan.cost_models.step_costs import moved_bytes

    def predicted(bandwidth: float) -> float:
        device = DeviceSpec("fit", peaks, bandwidth, 1.0, overhead_s, overlapped_dispatch=overlapped_dispatch)
        return sum((1.0 + BACKWARD_FACTOR) * op_seconds(roofline_time(info.flops, moved_bytes(info), device,
                                                                      info.dtype or "float32"), device)
                   for info in nodes)

    if predicted(highest) >= seconds:
        return 0.0
    if predicted(lowest) <= seconds:
        return lowest
    lo, hi = math.log(lowest), math.log(highest)
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted(math.exp(mid)) > seconds:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def peak_rates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The best matmul rate of each dtype (as :attr:`Calibration.peak_flops`)."""
    peaks: dict[str, float] = {}
    for row in rows:
        peaks[row["dtype"]] = max(peaks.get(row["dtype"], 0.0), row["flops"])
    return peaks


def implausible(fit: LinkFit) -> str | None:
    """Why ``fit`` cannot be a link's rates, in words (None when it can)."""
    if fit.alpha < MIN_LATENCY_S:
        return f"latency {fit.alpha * 1e6:.3g} us is below {MIN_LATENCY_S * 1e6:.3g} us"
    if fit.bandwidth > MAX_BANDWIDTH:
        return f"bandwidth {fit.bandwidth / 1e12:.3g} TB/s is above {MAX_BANDWIDTH / 1e12:.3g} TB/s"
    if fit.rms_rel_error > MAX_RMS_ERROR:
        return f"its rms error {fit.rms_rel_error:.0%} is above {MAX_RMS_ERROR:.0%}"
    return None
