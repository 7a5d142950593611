"""Hugging Face GPT-2 at its real size (124M parameters, 12 layers, hidden 768, sequence 1024,
global batch 64), built on the meta device: planned without allocating its weights.

    autoplan examples/gpt2_124m.py --devices 8          # what scripts/plan-example.sh runs

A meta model can be planned, not run: ``examples/gpt2.py`` is the same model, small enough to
run here with ``--run --check``."""

from __future__ import annotations

from gpt2 import build, loss_fn  # noqa: F401  (loss_fn: GPT-2's causal LM loss)

model, example_inputs = build(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257,
                              batch=64, seq=1024, device="meta")
