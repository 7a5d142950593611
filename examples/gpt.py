"""A nanoGPT-style decoder: token + position embeddings, pre-LayerNorm blocks of causal
self-attention (one ``c_attn`` Linear for q, k, v, then ``c_proj``) and an MLP
(``c_fc`` → GELU → ``c_proj``), a final LayerNorm and an ``lm_head`` tied to the token embedding.

``model``/``example_inputs``/``loss_fn`` at module level are a small CPU model; ``build(...)``
makes any size, and ``build(**GPT_39B, device="meta")`` makes a model to plan without allocating
its weights."""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
import torch.nn as nn
import torch.nn.functional as F

# Presets for benchmarks, read-only keyword arguments of ``build``:
# ``build(**GPT_39B, device="meta")`` (use the meta device for the big ones).
GPT_124M = MappingProxyType(dict(hidden=768, layers=12, heads=12, seq=1024, vocab=50304, batch=8))
GPT_39B = MappingProxyType(dict(hidden=8192, layers=48, heads=64, seq=1024, vocab=51200, batch=64))


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.gelu(self.c_fc(x))  # the 4x-wide activation
        return self.c_proj(hidden)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, hidden: int, layers: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.seq = seq
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.h = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        if self.wte.weight.device.type != "meta":
            self.apply(self._init_weights)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build(hidden: int = 64, layers: int = 2, heads: int = 4, seq: int = 32, vocab: int = 256, batch: int = 8,
          device: str | torch.device = "cpu") -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """A GPT and its example inputs ``(idx, targets)``, each ``(batch, seq)`` int64; targets are
    the next tokens. On ``device="meta"`` nothing is allocated."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(hidden, layers, heads, seq, vocab)
        data = torch.randint(0, vocab, (batch, seq + 1), dtype=torch.long)
    return model, (data[:, :-1].contiguous(), data[:, 1:].contiguous())


def loss_fn(output, idx, targets):
    """The model computes its loss when given targets: ``(logits, loss)``."""
    return output[1]


model, example_inputs = build()
