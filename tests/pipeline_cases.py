"""Models for the pipelines whose stages are cut from the model's own modules
(tests/test_native_pipeline.py): Hugging Face Llamas of four blocks called with keywords, their
labels partly ignored (``-100``, unevenly spread over the batch), so each microbatch's (and each
device's slice's) mean loss weighs by its share of the counted targets."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def _llama(vocab: int, hidden: int, batch: int, seq: int, ignored: list[tuple[int, slice]], tied: bool = False,
           device: str = "cpu") -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(64, seq),
                         tie_word_embeddings=tied)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))  # on meta too
    labels = ids.clone()
    for row, positions in ignored:
        labels[row, positions] = -100
    return model, {"input_ids": ids, "labels": labels}, None


def llama4() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """The first microbatch's targets fewer than the second's."""
    return _llama(128, 32, 8, 16, [(1, slice(3, None)), (2, slice(None, 5))])


def llama4_tied() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """:func:`llama4` with its head tied to its token table (``tie_word_embeddings``, as Gemma's
    and the small Llamas'): the first and the last stage each hold it."""
    return _llama(128, 32, 8, 16, [(1, slice(3, None)), (2, slice(None, 5))], tied=True)


def llama4_wide() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """Wide enough that the values crossing a stage boundary (a microbatch's hidden states:
    256 KiB in fp32, 128 KiB in bf16) are worth sending as shards on the ``cpu`` cluster (more
    than a link's latency of transfer), so that its stages of two devices are data parallel;
    the devices' slices count different numbers of targets."""
    return _llama(512, 128, 16, 64, [(1, slice(3, None)), (5, slice(None, 20)), (12, slice(7, None))])


def llama4_wide_meta() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """:func:`llama4_wide` on the meta device, its inputs the same."""
    return _llama(512, 128, 16, 64, [(1, slice(3, None)), (5, slice(None, 20)), (12, slice(7, None))], device="meta")


def llama4_wide_tied() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """:func:`llama4_wide` with its head tied to its token table."""
    return _llama(512, 128, 16, 64, [(1, slice(3, None)), (5, slice(None, 20)), (12, slice(7, None))], tied=True)


def llama4_long() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """Sequences of 512 tokens and heads of 64 dims: its rotary tables (``[1, 512, 64]``, 128 KiB
    in fp32) are larger than a link's latency of transfer on the ``cpu`` cluster, and the same
    for every sample, so they cross a stage boundary whole where the hidden states cross as
    shards."""
    return _llama(128, 256, 4, 512, [(1, slice(100, None)), (2, slice(None, 300))])


def opt_odd() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """A Hugging Face OPT of hidden size 45, which two devices cannot divide: FSDP over two keeps
    its norms, biases and attention weights whole beside its MLP weights and tables, and its
    16 sequences of 128 tokens cross a stage boundary as shards."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=128, hidden_size=45, num_attention_heads=3, ffn_dim=90, num_hidden_layers=2,
                       max_position_embeddings=128, word_embed_proj_dim=45, dropout=0.0, attention_dropout=0.0)
    model = OPTForCausalLM(config)
    ids = torch.randint(0, 128, (16, 128), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, None


def gpt2_positions() -> tuple[torch.nn.Module, dict[str, torch.Tensor], None]:
    """A Hugging Face GPT-2 whose learned position table's rows, the same for every sample, are
    added to the tokens' (its head tied to its token table); 16 sequences of 64 tokens, wide enough
    that its hidden states cross a stage boundary as shards."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import gpt2

    model, (ids,) = gpt2.build(n_embd=128, batch=16, seq=64, vocab_size=512)
    return model, {"input_ids": ids, "labels": ids}, None
