"""A nanoGPT (examples/gpt.py) with a batch of 8 sequences: enough to shard over a 2x2 mesh of
data-parallel axes (HSDP). The same model on every rank when the caller seeds first."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt  # noqa: E402


def nanogpt():
    model, inputs = gpt.build(hidden=64, layers=2, heads=4, seq=16, vocab=128, batch=8)
    return model, inputs, gpt.loss_fn


def nanogpt4():
    """Four blocks: two pipeline ranks of two interleaved stages each."""
    model, inputs = gpt.build(hidden=64, layers=4, heads=4, seq=16, vocab=128, batch=8)
    return model, inputs, gpt.loss_fn
