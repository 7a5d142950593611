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


def llama_accumulated():
    """A Llama (transformers, random weights) whose batch of 16 sequences of 128 tokens is
    worth splitting over the devices: under a memory budget on the ``cpu`` cluster, with
    microbatches accumulated, the search holds its weights gathered through the step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=512, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (16, 128), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, None
