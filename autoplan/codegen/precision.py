"""The plan's precision, carried out by the program and by ``--check``'s reference.

``bf16`` runs the forward under ``torch.autocast`` with ``dtype=torch.bfloat16``, torch's own
mixed-precision policy, which composes with DTensor (torchtitan uses it for tensor and data
parallelism without FSDP): matrix products, linear layers and attention compute in bf16 from bf16
casts of their inputs, the ops autocast keeps in fp32 (losses, norms on GPUs) stay in fp32, and
element-wise ops follow their inputs. The parameters stay fp32 (the master weights); each cast's
backward turns its bf16 gradient back into fp32, so gradients are reduced in fp32 and the
optimizer steps fp32 state. A parameter gathered for its consumer moves as bf16, as FSDP2's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` gathers it:
its shard is cast to bf16, gathered, and cast back to fp32 for the consumer, whose autocast
cast of it is then what the single-device model's is (the re-gather in the backward too,
:mod:`autoplan.codegen.parameter_regather`); its gradient goes back in fp32.

``--check`` runs the single-device reference under the same policy, so the two differ by the
rounding of bf16 products summed in another order (a sharded contraction adds partial bf16
results), not by the policy: :func:`check_tolerances` gives the tolerances for that.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoplan.plan_schema import PrecisionPlan

FP32_TOLERANCES = (1e-4, 1e-5)  # rtol, atol
# bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.0039): a value summed from a few
# bf16 products in another order differs by a few such steps
BF16_TOLERANCES = (3e-2, 3e-3)


def compute_dtype(precision: PrecisionPlan) -> torch.dtype:
    """The dtype the plan's matrix products compute in."""
    return getattr(torch, precision.compute_dtype)


def compute_precision(precision: PrecisionPlan, device_type: str) -> AbstractContextManager:
    """What a forward runs under for ``precision`` on ``device_type`` ("cpu", "cuda")."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def gathered_dtype(precision: PrecisionPlan) -> torch.dtype | None:
    """The dtype a parameter's gather moves under ``precision`` (None: its own)."""
    dtype = getattr(torch, precision.param_dtype)
    return None if dtype == torch.float32 else dtype


def check_tolerances(precision: PrecisionPlan) -> tuple[float, float]:
    """(rtol, atol) of ``--check`` for a plan in ``precision``."""
    return FP32_TOLERANCES if compute_dtype(precision) == torch.float32 else BF16_TOLERANCES


def mixed_precision_policy(precision: PrecisionPlan) -> MixedPrecisionPolicy:
    """FSDP2's policy for the plan's precision: parameters gathered in its parameter dtype
    (bf16), gradients reduced in its reduction dtype (fp32); module inputs are left to
    ``torch.autocast``, which the program runs under."""
    return MixedPrecisionPolicy(param_dtype=gathered_dtype(precision),
                                reduce_dtype=getattr(torch, precision.reduce_dtype), cast_forward_inputs=False)
