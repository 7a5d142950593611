"""Hugging Face Llama (LlamaForCausalLM) with a small configuration and random weights.

``model`` is the transformers model itself, called with keywords
(``model(input_ids=ids, labels=ids)``); the loss is ``output.loss``, Hugging Face's next-token
cross-entropy, so no ``loss_fn`` is needed. ``build(**LLAMA_1B)`` gives Llama 3.2 1B's shape
(hidden 2048, 16 layers, grouped-query attention with 8 key/value heads, vocabulary 128,256,
tied embeddings)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: Llama 3.2 1B's shape (1.24B parameters).
LLAMA_1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192, "vocab": 128256,
            "tied": True}
#: Llama 3.2 3B's shape (3.21B parameters).
LLAMA_3B = {"hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "intermediate": 8192, "vocab": 128256,
            "tied": True}


def build(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
          vocab: int = 256, tied: bool = False, batch: int = 8, seq: int = 32,
          device: str | torch.device = "cpu") -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    """A LlamaForCausalLM and its keyword inputs ``{"input_ids", "labels"}`` of ``(batch, seq)``
    token ids (the labels are the inputs: Hugging Face shifts them)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=seq, tie_word_embeddings=tied, rope_theta=500000.0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, vocab, (batch, seq), dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


model, example_inputs = build()
