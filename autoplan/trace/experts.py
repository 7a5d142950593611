"""A mixture-of-experts layer's experts as one op, so that they can be sharded by expert.

transformers' experts modules (Mixtral, Qwen2-MoE, DeepSeek-V3, ...: the classes decorated by
``use_experts_implementation``) compute ``out[t] = Σ_slot w[t, slot] · expert_{i[t, slot]}(x[t])``
from the tokens ``x[T, H]``, the router's choices ``i[T, k]`` and weights ``w[T, k]``: a sort of
the token-slot pairs by expert, a grouped matrix product per projection, and the pairs put back
in token order. Traced op by op, the expert dim of the weights cannot be sharded: a device
holding experts ``e0:e1`` needs the rows of those experts only, which the sort decides at run
time. Traced as one op (``autoplan::moe_experts``, :func:`experts_as_one_op`), the expert dim
is what it is mathematically, a sum: each device computes the contributions of its own experts
to every token (the others' slots are sentinels that the grouped products skip, as
transformers' own expert parallelism does), and the devices' outputs are partial sums of the
layer's (:func:`~autoplan.strategies.rules.moe.moe_experts`). The tokens are independent of
one another, so they may be sharded too.

What runs is transformers' ``grouped_mm_experts_forward`` on this device's experts
(:func:`local_experts_forward`): the program calls it on local tensors; the single-device
reference runs the model's own implementation, which computes the same sums.

Eligible modules: a gate and up projection concatenated (or no gate), no biases, no norm after
the experts, the default gating with the activation ``config.hidden_act`` names. Others are
traced op by op as before.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["EXPERTS_OP", "experts_as_one_op", "experts_flops", "local_experts_forward", "saved_inside_elements"]


def _transformers_moe() -> Any | None:
    try:
        from transformers.integrations import moe
    except ImportError:  # transformers not installed, or without the experts interface
        return None
    return moe if hasattr(moe, "grouped_mm_experts_forward") else None


def local_experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor, gated: bool, transposed: bool, activation: str,
                          first_expert: int = 0, num_experts: int | None = None) -> torch.Tensor:
    """The experts' output for ``hidden`` computed from experts ``first_expert`` onwards, as many
    as ``gate_up`` holds (all ``num_experts`` when not given): a token's slots routed to other
    experts are sentinels (expert id ``len(gate_up)``), whose rows the grouped products skip and
    whose contributions are zero, so that the outputs of devices holding disjoint experts add up
    to the layer's."""
    from transformers.activations import ACT2FN

    moe = _transformers_moe()
    assert moe is not None, "transformers' experts interface is needed to run autoplan::moe_experts"
    local = gate_up.shape[0]
    total = local if num_experts is None else num_experts
    sharded = local != total
    index = top_k_index
    if sharded:
        mine = (top_k_index >= first_expert) & (top_k_index < first_expert + local)
        index = torch.where(mine, top_k_index - first_expert, torch.full_like(top_k_index, local))
    experts = SimpleNamespace(num_experts=local, has_gate=gated, has_bias=False, is_transposed=transposed,
                              is_concatenated=True, has_post_expert_norm=False, _is_expert_parallel=sharded,
                              act_fn=ACT2FN[activation])
    if gated:
        experts.gate_up_proj = gate_up
        experts._apply_gate = lambda out: moe._default_apply_gate(experts, out)
    else:
        experts.up_proj = gate_up
    experts.down_proj = down
    return moe.grouped_mm_experts_forward(experts, hidden, index, top_k_weights)


@torch.library.custom_op("autoplan::moe_experts", mutates_args=())
def _moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, gated: bool, transposed: bool,
                 activation: str) -> torch.Tensor:
    return local_experts_forward(hidden, top_k_index, top_k_weights, gate_up, down, gated, transposed, activation)


@_moe_experts.register_fake
def _moe_experts_fake(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, gated: bool, transposed: bool,
                      activation: str) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.flags = inputs[5:]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """The experts again, their gradients taken (the op runs eagerly only outside the planned
    program, which calls :func:`local_experts_forward` itself)."""
    hidden, index, weights, gate_up, down = ctx.saved_tensors
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in (hidden, weights, gate_up, down)]
    with torch.enable_grad():
        out = local_experts_forward(inputs[0], index, inputs[1], inputs[2], inputs[3], *ctx.flags)
        grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return grads[0], None, grads[1], grads[2], grads[3], None, None, None


_moe_experts.register_autograd(_backward, setup_context=_setup_context)

EXPERTS_OP = torch.ops.autoplan.moe_experts.default


def _activation_name(module: torch.nn.Module) -> str | None:
    from transformers.activations import ACT2FN

    name = getattr(getattr(module, "config", None), "hidden_act", None)
    if not isinstance(name, str) or name not in ACT2FN:
        return None
    return name if type(ACT2FN[name]) is type(getattr(module, "act_fn", None)) else None


def _eligible(module: torch.nn.Module, moe: Any) -> bool:
    """Whether ``module`` is a transformers experts module :func:`local_experts_forward`
    computes exactly."""
    if not hasattr(module, "_is_expert_parallel") or getattr(module, "has_bias", True) \
            or getattr(module, "has_post_expert_norm", True) or not getattr(module, "is_concatenated", False):
        return False
    gated = bool(getattr(module, "has_gate", False))
    if gated and type(module)._apply_gate is not moe._default_apply_gate:
        return False
    weight = getattr(module, "gate_up_proj" if gated else "up_proj", None)
    return isinstance(weight, torch.nn.Parameter) and isinstance(getattr(module, "down_proj", None),
                                                                 torch.nn.Parameter) \
        and _activation_name(module) is not None


def _one_op_forward(module: torch.nn.Module) -> Any:
    gated, transposed = bool(module.has_gate), bool(module.is_transposed)
    activation = _activation_name(module)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        gate_up = module.gate_up_proj if gated else module.up_proj
        return EXPERTS_OP(hidden_states, top_k_index, top_k_weights, gate_up, module.down_proj, gated, transposed,
                          activation)
    return forward


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module) -> Iterator[int]:
    """While tracing: every eligible experts module of ``model`` calls ``autoplan::moe_experts``
    (yields how many); their own forwards come back afterwards."""
    moe = _transformers_moe()
    swapped = [m for m in model.modules() if moe is not None and _eligible(m, moe)]
    for m in swapped:
        m.forward = _one_op_forward(m)
    try:
        yield len(swapped)
    finally:
        for m in swapped:
            del m.forward


def experts_flops(top_k_index: Any, gate_up: Any, down: Any) -> float:
    """Forward FLOPs of the experts: ``2 · T · k`` routed token-slots, each through one expert's
    two projections."""
    return 2.0 * math.prod(top_k_index.shape) * (math.prod(gate_up.shape[1:]) + math.prod(down.shape[1:]))


def saved_inside_elements(hidden: tuple[int, ...], top_k_index: tuple[int, ...], gate_up: tuple[int, ...],
                          down: tuple[int, ...], tokens: int) -> float:
    """Elements the experts keep inside for the backward on a device holding ``tokens`` of the
    ``hidden[0]`` tokens, per routed token-slot: its copy sorted by expert (``H``), its up
    projection (``math.prod(gate_up[1:]) / H``) and its gated activations
    (``math.prod(down[1:]) / H``). They are as large on a device holding a shard of the
    experts: the sentinel rows are allocated too."""
    width = hidden[-1]
    per_slot = width + (math.prod(gate_up[1:]) + math.prod(down[1:])) / width
    return tokens * top_k_index[-1] * per_slot
