"""The backward's transients (autoplan/cost_models/transient_memory.py): an op's gradients, a
recomputed layer's values and the returned outputs, in the dtype autocast gives them, are
predicted beside the kept values, and the memory budget bounds the peak with them."""

from __future__ import annotations

import sys

import pytest

from autoplan.errors import MemoryInfeasibleError
from autoplan.cost_models.transient_memory import working_itemsize
from autoplan.load import make_model_spec
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.reports.summary import summary_text
from autoplan.trace.tracer import trace
from launcher import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import llama  # noqa: E402


def _spec(batch: int = 8):
    model, inputs = llama.build(batch=batch, seq=32, vocab=512, device="meta")
    return make_model_spec(model, inputs, None, name="llama")


def _plan(batch: int = 8, recompute: str = "none", precision: str = "fp32", memory: float | None = None):
    return plan_model(_spec(batch), PlanOptions(1, "h100", pipeline=False, recompute=recompute, precision=precision,
                                                plan_only=True, memory_per_device=memory))


def test_autocast_keeps_losses_norms_and_fp32_casts_in_fp32() -> None:
    nodes = trace(_spec()).nodes
    by_target = {info.target: info for info in nodes.values() if info.kind == "op"}
    assert working_itemsize(by_target["aten.cross_entropy_loss.default"], True) == 4
    assert working_itemsize(by_target["aten.to.dtype"], True) == 4  # the loss's logits.float()
    assert working_itemsize(by_target["aten.linear.default"], True) == 2
    assert working_itemsize(by_target["aten.linear.default"], False) == 4


def test_a_recomputed_layer_holds_its_values_again_in_the_backward() -> None:
    kept, recomputed = _plan(recompute="none"), _plan(recompute="all")
    assert recomputed.predicted.memory_bytes.activations < kept.predicted.memory_bytes.activations
    assert recomputed.predicted.memory_bytes.transient > kept.predicted.memory_bytes.transient > 0


def test_the_transients_grow_with_the_batch() -> None:
    small, large = (_plan(batch=b, recompute="all", precision="bf16").predicted.memory_bytes.transient for b in (4, 8))
    assert large == pytest.approx(2 * small, rel=0.05)


def test_the_budget_bounds_the_peak_with_transients() -> None:
    """The solvers keep the kept values and the backward's largest moment together under the
    budget: one device cannot meet a budget between its kept peak and its peak with transients;
    two devices meet it with a plan that shards what the moment holds."""
    free = _plan().predicted.memory_bytes
    assert free.transient > 0
    between = free.peak + free.transient / 2
    with pytest.raises(MemoryInfeasibleError, match="no plan fits"):
        _plan(memory=between)
    spec = _spec()
    fast = plan_model(spec, PlanOptions(2, "h100", pipeline=False, plan_only=True, precision="fp32")).predicted
    budget = fast.memory_bytes.peak + fast.memory_bytes.transient / 2
    tight = plan_model(spec, PlanOptions(2, "h100", pipeline=False, plan_only=True, precision="fp32",
                                         memory_per_device=budget))
    m = tight.predicted.memory_bytes
    assert m.peak <= fast.memory_bytes.peak + fast.memory_bytes.transient / 2
    assert m.peak_with_transient <= budget < fast.memory_bytes.peak_with_transient
    assert tight.predicted.step_time_s >= fast.step_time_s
    assert not [w for w in tight.warnings if "backward's transients" in w]
    assert "(within the budget)" in summary_text(tight)


def test_a_pipelined_plan_reports_the_largest_peak_with_transients_of_any_rank() -> None:
    from autoplan.plan_schema import MemoryEstimate
    from autoplan.planner.pipeline.assemble import per_rank, worst_rank

    # four stages on two ranks (interleaved): rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    stages = [MemoryEstimate(1, 1, 1, 1, 4, transient=1), MemoryEstimate(1, 1, 1, 1, 4, transient=9),
              MemoryEstimate(2, 2, 2, 2, 8, transient=3), MemoryEstimate(1, 1, 1, 1, 4, transient=2)]
    ranks = per_rank(stages, 2)
    assert [r.peak for r in ranks] == [12, 8]
    assert [r.transient for r in ranks] == [3, 9]  # one backward at a time: the largest stage's
    worst = worst_rank(ranks)
    assert worst.peak == 12 and worst.params == 3  # the rank the budget binds
    assert worst.peak_with_transient == 17  # rank 1's 8 + 9, above rank 0's 12 + 3


def test_a_gathered_parameter_adds_its_copy_and_its_gradient_where_read_unlike_its_storage() -> None:
    from autoplan.cost_models import LinkSpec, OptimizerSpec
    from autoplan.cost_models.presets import load_cluster
    from autoplan.cost_models.step_costs import CostContext
    from autoplan.cost_models.transient_memory import gathered_bytes
    from autoplan.sharding import R, S
    from autoplan.trace.graph import NodeInfo

    weight = NodeInfo("w", "parameter", "", (64, 32), "torch.float32", 4, 0.0, 0.0, "", "", (), fqn="w")
    for mixed, copy in ((False, 4), (True, 2)):  # bf16 gathers move (and hold) the bf16 copy
        ctx = CostContext((2,), (LinkSpec(1e9, 0.0),), load_cluster("h100").device,
                          OptimizerSpec("adamw", mixed_precision=mixed))
        assert gathered_bytes(weight, (S(0),), (S(0),), True, ctx) == 0.0  # read as stored
        assert gathered_bytes(weight, (S(0),), (R,), False, ctx) == 64 * 32 * copy
        assert gathered_bytes(weight, (S(0),), (R,), True, ctx) == 64 * 32 * (copy + 4)  # fp32 gradient too


def test_fsdp_holds_a_block_gathered_with_its_gradients_and_the_next_block_prefetched() -> None:
    """``fsdp=2`` on the example Llama: a moment of the backward inside a block holds that
    block's parameters gathered whole with their whole fp32 gradients (8 bytes an element), and
    the block before it gathered (4 bytes an element); data parallelism holds none of them."""
    from autoplan.planner.manual import parse_manual, plan_manual

    spec = _spec()
    options = PlanOptions(2, "h100", pipeline=False, plan_only=True, precision="fp32").planner_options()
    dp, fsdp = (plan_manual(spec, options, parse_manual(text)).predicted.memory_bytes for text in ("dp=2", "fsdp=2"))
    block = sum(p.numel() for name, p in spec.module.named_parameters() if name.startswith("model.layers.1."))
    assert fsdp.params < dp.params
    assert fsdp.transient >= 12 * block
    assert fsdp.transient > dp.transient
