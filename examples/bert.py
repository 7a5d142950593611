"""Hugging Face BERT (BertForMaskedLM) with a small configuration and random weights.

Inputs are ``input_ids`` and ``attention_mask`` (int64). The loss is the masked-LM
cross-entropy with ``labels=input_ids`` (reconstruct every token), computed by ``loss_fn``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM


def build(num_hidden_layers: int = 2, hidden_size: int = 64, num_attention_heads: int = 4,
          intermediate_size: int = 256, vocab_size: int = 256, batch: int = 8, seq: int = 32,
          device: str | torch.device = "cpu") -> tuple[BertForMaskedLM, tuple[torch.Tensor, torch.Tensor]]:
    """A BertForMaskedLM (dropouts 0) and its example ``(input_ids, attention_mask)``."""
    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                        vocab_size=vocab_size, max_position_embeddings=max(64, seq), pad_token_id=0,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.device(device):
        model = BertForMaskedLM(config)
        input_ids = torch.randint(1, vocab_size, (batch, seq), dtype=torch.long)
        attention_mask = torch.ones(batch, seq, dtype=torch.long)
    return model, (input_ids, attention_mask)


def loss_fn(output, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Masked-LM cross-entropy with labels=input_ids."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), input_ids.reshape(-1))


model, example_inputs = build()
