"""Models with their own fp32 regions under a bf16 plan: rotary angles computed by a matrix
product inside ``torch.autocast(enabled=False)``, written directly and through Hugging Face's
``maybe_autocast`` helper (Llama's rotary embedding in transformers 5.17 does the latter).
Computed in bf16, the angle of position 301 is 300 or 302: the rotated values, and so the
outputs, are wrong by whole units."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.utils.generic import maybe_autocast

SEQ, HIDDEN, BATCH = 320, 32, 4


class RotaryBlock(nn.Module):
    """``out(rotate(inp(x), angles))`` with ``angles = positions @ frequencies`` in fp32."""

    def __init__(self, helper: bool) -> None:
        super().__init__()
        self.helper = helper
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("frequencies", torch.linspace(0.5, 1.0, HIDDEN // 2)[None, :], persistent=False)

    def _fp32(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.helper:
            return maybe_autocast(device_type, enabled=False)
        return torch.autocast(device_type=device_type, enabled=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)[:, None]
        with self._fp32(x.device.type):
            angles = positions.float() @ self.frequencies.float()  # (seq, hidden / 2)
            cos, sin = angles.cos(), angles.sin()
        first, second = h.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return self.out(rotated)


class RotaryModel(nn.Module):
    """Two :class:`RotaryBlock` s in a row (two layers a pipeline can split)."""

    def __init__(self, helper: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([RotaryBlock(helper) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _case(helper: bool):
    torch.manual_seed(0)
    model = RotaryModel(helper)
    return model, (torch.randn(BATCH, SEQ, HIDDEN),), _loss


def _loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (out - x).pow(2).mean()


def rotary_autocast_off():
    return _case(helper=False)


def rotary_hf_helper():
    return _case(helper=True)


def gpt2_upcast_attention():
    """transformers' GPT-2 with ``reorder_and_upcast_attn``: its attention scores computed in
    fp32 inside ``maybe_autocast(enabled=False)`` (eager attention)."""
    import transformers as tf
    import zoo  # noqa: F401 (imports zoo_hf in its order)
    from zoo_hf import HEADS, HIDDEN, LAYERS, VOCAB, _lm_case

    return _lm_case("gpt2", "decoder", tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=HIDDEN,
                    n_layer=LAYERS, n_head=HEADS, n_positions=64, bos_token_id=1, eos_token_id=2,
                    reorder_and_upcast_attn=True, attn_implementation="eager")
