"""Hugging Face GPT-2 (GPT2LMHeadModel) with a small configuration and random weights.

``model`` is the transformers model itself, so parameter names are the HF ones
(``transformer.h.0.attn.c_attn.weight``). The loss is GPT-2's causal LM loss with
``labels=input_ids`` (the next-token cross-entropy), computed by ``loss_fn`` from the logits —
the same number as ``model(input_ids, labels=input_ids).loss``. autoplan sets
``use_cache=False`` itself while tracing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def build(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_positions: int = 64, vocab_size: int = 256,
          batch: int = 8, seq: int = 32,
          device: str | torch.device = "cpu") -> tuple[GPT2LMHeadModel, tuple[torch.Tensor]]:
    """A GPT2LMHeadModel (all dropouts 0) and its example input_ids ``(batch, seq)`` int64."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.device(device):
        model = GPT2LMHeadModel(config)
        input_ids = torch.randint(0, vocab_size, (batch, seq), dtype=torch.long)
    return model, (input_ids,)


def loss_fn(output, input_ids: torch.Tensor) -> torch.Tensor:
    """GPT-2's LM loss with labels=input_ids: predict token t+1 from tokens ≤ t."""
    logits = output.logits[:, :-1, :]
    labels = input_ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


model, example_inputs = build()
