"""The report's figures, one small function each, returned as PNG bytes. They take plain
numbers and labels, not plans.

Figures are drawn on :class:`matplotlib.figure.Figure` objects, never through pyplot: PNGs are
rendered by Agg without a display, and the caller's pyplot backend is left as it was."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from autoplan.reports.timeline import simulate

DPI = 100
COMPUTE = "#4c72b0"
BUBBLE = "#c7c7c7"
KIND_COLORS = {"all_reduce": "#dd8452", "all_gather": "#55a868", "reduce_scatter": "#8172b3",
               "all_to_all": "#937860", "send_recv": "#da8bc3", "communication": "#dd8452"}
MEMORY_COLORS = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#8172b3", "activations": "#dd8452"}


def _subplots(figsize: tuple[float, float]):
    """A figure of one axes, detached from pyplot (garbage-collected once dropped)."""
    fig = Figure(figsize=figsize)
    return fig, fig.add_subplot()


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.15)  # keeps outside legends
    return buffer.getvalue()


def time_unit(seconds: float) -> tuple[float, str]:
    """The scale and unit that keep the largest value readable."""
    if seconds >= 1.0:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def byte_unit(n: float) -> tuple[float, str]:
    if n >= 1e9:
        return 1e-9, "GB"
    if n >= 1e6:
        return 1e-6, "MB"
    return 1e-3, "kB"


def placement_color(placement: str) -> str:
    if placement == "R":
        return "#e8e8e8"
    if placement.startswith("P"):
        return "#e07b7b"
    m = re.fullmatch(r"S\((\d+)\)", placement)
    if m:
        return ("#6d9bd1", "#f0a35e", "#7fc48a", "#b39ddb")[min(int(m.group(1)), 3)]
    return "#ffffff"


def placement_map(rows: Sequence[tuple[str, Sequence[str]]], axes: Sequence[str], title: str) -> bytes:
    """A grid: one row per parameter (group), one column per mesh axis, coloured and labelled
    by placement (R grey, S(0) blue, S(1) orange, S(2) green, P red)."""
    n, k = len(rows), max(len(axes), 1)
    label_width = max((len(r[0]) for r in rows), default=10)
    fig_w = min(2.5 + 0.075 * label_width + 1.3 * k, 12.0)
    fig, ax = _subplots(figsize=(fig_w, 1.3 + 0.28 * n))
    for i, (_label, placements) in enumerate(rows):
        for j, p in enumerate(placements):
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=placement_color(p), edgecolor="white", linewidth=1.5))
            ax.text(j + 0.5, i + 0.5, p, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, k)
    ax.set_ylim(n, 0)
    ax.set_xticks([j + 0.5 for j in range(k)], list(axes))
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(n)], [r[0] for r in rows], fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=10, pad=22)
    fig.tight_layout()
    return _png(fig)


def step_breakdown(segments: Sequence[tuple[str, float]], step_time_s: float, title: str) -> bytes:
    """One horizontal bar: compute, each collective kind and bubble, end to end."""
    scale, unit = time_unit(max(step_time_s, sum(v for _, v in segments), 1e-12))
    fig, ax = _subplots(figsize=(10, 2.2))
    left = 0.0
    handles = []
    for name, seconds in segments:
        if seconds <= 0:
            continue
        color = COMPUTE if name == "compute" else BUBBLE if name == "bubble" else KIND_COLORS.get(name, "#999999")
        ax.barh(0, seconds * scale, left=left, color=color, edgecolor="white", height=0.6)
        if seconds * scale > 0.06 * step_time_s * scale:
            ax.text(left + seconds * scale / 2, 0, f"{seconds * scale:.3g}", ha="center", va="center", fontsize=8,
                    color="white" if name != "bubble" else "black")
        handles.append(Patch(color=color, label=name.replace("_", "-")))
        left += seconds * scale
    ax.axvline(step_time_s * scale, color="black", linestyle="--", linewidth=1)
    ax.text(step_time_s * scale, 0.42, f" step {step_time_s * scale:.3g} {unit}", va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-0.5, 0.6)
    ax.set_xlim(0, max(left, step_time_s * scale) * 1.15)
    ax.set_xlabel(f"predicted time per step ({unit})")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=max(len(handles), 1),
              frameon=False, fontsize=8)  # below the axis label; _png's tight bounding box keeps it
    return _png(fig)


def memory_bars(entries: Sequence[tuple[str, dict[str, float], float]], budget: float | None, title: str) -> bytes:
    """Per plan (name, {params, grads, optimizer, activations}, peak): a stacked bar of the bytes
    each device holds, with the device budget as a red line (or a note when it is far off)."""
    largest = max([peak for _, _, peak in entries] + [sum(p.values()) for _, p, _ in entries] + [1.0])
    budget_shown = budget is not None and budget <= 20 * largest
    scale, unit = byte_unit(max(largest, budget if budget_shown and budget else 0))
    fig, ax = _subplots(figsize=(10, 1.4 + 0.55 * len(entries)))
    for i, (_name, parts, peak) in enumerate(entries):
        left = 0.0
        for key, color in MEMORY_COLORS.items():
            value = parts.get(key, 0.0) * scale
            ax.barh(i, value, left=left, color=color, edgecolor="white", height=0.6)
            left += value
        ax.plot([peak * scale], [i], marker="|", color="black", markersize=18)
        ax.text(max(left, peak * scale), i, f"  peak {peak * scale:.3g} {unit}", va="center", fontsize=8)
    ax.set_yticks(range(len(entries)), [e[0] for e in entries], fontsize=8)
    ax.invert_yaxis()
    handles = [Patch(color=c, label=k) for k, c in MEMORY_COLORS.items()]
    right = largest * scale * 1.3
    if budget is not None and budget_shown:
        ax.axvline(budget * scale, color="#c44e52", linewidth=2)
        handles.append(Line2D([], [], color="#c44e52", linewidth=2, label=f"budget {budget * scale:.3g} {unit}"))
        right = max(right, budget * scale * 1.08)
    ax.set_xlim(0, right)
    ax.set_xlabel(f"bytes per device ({unit})")
    if budget is not None and not budget_shown:
        title += (f"\nthe budget ({budget * 1e-9:.3g} GB per device) is off the scale: "
                  f"the largest peak uses {100 * largest / budget:.2g}% of it")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / max(len(entries), 1)),
              ncol=len(handles), frameon=False, fontsize=8)
    fig.tight_layout()
    return _png(fig)


def comparison(entries: Sequence[tuple[str, tuple[float, float, float] | None, str]], title: str) -> bytes:
    """Per plan (name, (compute, communication, bubble) seconds or None, note): its predicted
    step time as a stacked bar; an infeasible one gets its note instead of a bar. The first
    entry (the found plan) is drawn in bold."""
    totals = [sum(p) for _, p, _ in entries if p is not None]
    scale, unit = time_unit(max(totals + [1e-12]))
    fig, ax = _subplots(figsize=(10, 1.4 + 0.6 * len(entries)))
    right = max(totals + [1e-12]) * scale
    for i, (_name, parts, note) in enumerate(entries):
        if parts is None:
            ax.text(0.01 * right, i, note[:90], va="center", fontsize=8, color="#c44e52")
            continue
        left = 0.0
        for value, color in zip(parts, (COMPUTE, KIND_COLORS["communication"], BUBBLE)):
            ax.barh(i, value * scale, left=left, color=color, edgecolor="white", height=0.6)
            left += value * scale
        ax.text(left, i, f"  {left:.3g} {unit}" + (f"  {note}" if note else ""), va="center", fontsize=8)
    ax.set_yticks(range(len(entries)), [e[0] for e in entries], fontsize=8)
    if entries:
        ax.get_yticklabels()[0].set_fontweight("bold")
    ax.set_ylim(len(entries) - 0.5, -0.5)  # top to bottom, rows without a bar included
    ax.set_xlim(0, right * 1.45)
    ax.set_xlabel(f"predicted time per step ({unit})")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=COMPUTE, label="compute"), Patch(color=KIND_COLORS["communication"], label="communication"),
               Patch(color=BUBBLE, label="bubble")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.55 / (1 + 0.6 * len(entries)) - 0.1),
              ncol=3, frameon=False, fontsize=8)
    fig.tight_layout()
    return _png(fig)


def pipeline_timeline(latencies: Sequence[float], microbatches: int, schedule: str) -> bytes:
    """Every stage's forward (blue) and backward (orange) slots, from
    :func:`autoplan.reports.timeline.simulate`; gaps are bubble."""
    slots = simulate(list(latencies), microbatches, schedule)
    stages = len(latencies)
    end = max((s.end_s for s in slots), default=0.0)
    scale, unit = time_unit(end)
    fig, ax = _subplots(figsize=(10, 0.6 * stages + 1.6))
    for s in slots:
        color = COMPUTE if s.phase == "forward" else "#dd8452"
        width = (s.end_s - s.start_s) * scale
        ax.broken_barh([(s.start_s * scale, width)], (s.stage - 0.4, 0.8), facecolors=color, edgecolors="white",
                       linewidth=0.5)
        if width > end * scale / 60:
            ax.text(s.start_s * scale + width / 2, s.stage, f"{'F' if s.phase == 'forward' else 'B'}{s.microbatch}",
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(stages), [f"stage {i}" for i in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(f"predicted pipeline timeline ({schedule}, {microbatches} microbatches): "
                 "forward blue, backward orange, gaps are bubble", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def loss_curve(steps: Sequence[int], losses: Sequence[float]) -> bytes:
    fig, ax = _subplots(figsize=(6, 3.2))
    ax.plot(list(steps), list(losses), marker="o", color=COMPUTE)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("measured loss (rank 0)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def step_times(steps: Sequence[int], times_s: Sequence[float], predicted_s: float) -> bytes:
    """Measured seconds per step against the predicted step time (a dashed line)."""
    scale, unit = time_unit(max(list(times_s) + [predicted_s]))
    fig, ax = _subplots(figsize=(6, 3.2))
    ax.bar(list(steps), [t * scale for t in times_s], color="#55a868", label="measured")
    ax.axhline(predicted_s * scale, color="#c44e52", linestyle="--", label="predicted")
    positive = [t for t in list(times_s) + [predicted_s] if t > 0]
    if positive and max(positive) > 30 * min(positive):
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(f"time per step ({unit})")
    ax.set_title("measured step time vs predicted", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)
