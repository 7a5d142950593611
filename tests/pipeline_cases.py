"""Models for the pipelines whose stages are cut from the model's own modules
(tests/test_native_pipeline.py): a Hugging Face Llama of four blocks called with keywords, its
labels partly ignored (``-100``, unevenly spread over the batch), so each microbatch's mean loss
weighs by its share of the counted targets."""

from __future__ import annotations

import torch


def llama4() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (8, 16))
    labels = ids.clone()
    labels[1, 3:] = -100  # the first microbatch's targets fewer than the second's
    labels[2, :5] = -100
    return model, {"input_ids": ids, "labels": labels}, None
