"""Collectives beside the backward of a block (:mod:`autoplan.cost_models.backward_overlap`): on a
GPU the gradient reductions of the block after it (with one microbatch per step) and the
re-gathers of the block before it are hidden up to its backward; nothing where the device
overlaps nothing."""

from __future__ import annotations

import pytest

from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions


def _plan(manual: str, cluster: str, vocab: int = 32000, seq: int = 512) -> Plan:
    import gpt

    model, inputs = gpt.build(hidden=1024, layers=4, heads=16, seq=seq, vocab=vocab, batch=64, device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn, name="gpt")
    options = PlanOptions(8, cluster, plan_only=True)
    return with_decisions(plan_manual(spec, options.planner_options(), parse_manual(manual)), options)


@pytest.fixture
def serial_h100(tmp_path) -> str:
    """H100s whose collectives never run beside compute."""
    path = tmp_path / "h100-serial.toml"
    path.write_text('name = "h100-serial"\npreset = "h100"\n[device]\noverlapped_dispatch = false\n')
    return str(path)


def _kind_seconds(plan: Plan, kind: str) -> float:
    return plan.predicted.comm_by_kind_s.get(kind, 0.0)


def test_data_parallel_gradient_all_reduces_are_hidden_behind_the_backward(serial_h100: str) -> None:
    overlapped, serial = _plan("dp=8", "h100"), _plan("dp=8", serial_h100)
    assert not overlapped.prefetch  # nothing gathered: all it hides are gradient reductions
    assert serial.predicted.hidden_s == 0
    hidden = overlapped.predicted.hidden_s
    assert 0 < hidden < _kind_seconds(overlapped, "all_reduce")  # the first block's are not hidden
    assert overlapped.predicted.comm_s == pytest.approx(serial.predicted.comm_s)
    assert overlapped.predicted.step_time_s + hidden == pytest.approx(serial.predicted.step_time_s)


def test_fsdp_gradient_reduce_scatters_are_hidden_too(serial_h100: str) -> None:
    overlapped, serial = _plan("fsdp=8", "h100"), _plan("fsdp=8", serial_h100)
    assert _kind_seconds(overlapped, "reduce_scatter") > 0
    assert overlapped.predicted.hidden_s > 0 == serial.predicted.hidden_s
    assert not serial.prefetch_regathers and overlapped.prefetch_regathers
    assert overlapped.predicted.step_time_s + overlapped.predicted.hidden_s == pytest.approx(
        serial.predicted.step_time_s)
    accumulating = _plan("fsdp=8,microbatches=2", "h100")  # reductions not hidden, per microbatch the rest
    assert overlapped.predicted.hidden_s > accumulating.predicted.hidden_s / 2


def test_fsdp_regathers_are_hidden_where_the_backward_gathers_again() -> None:
    """A block whose ops keep their gathered weights for the backward, or recompute them, is
    gathered again there, beside the backward of the block after it. Each block's weights are
    gathered twice a microbatch, as much each time; the forward's prefetch hides at most the
    first gathers of three blocks of four, so more hidden than half the gathers shows the
    backward's hidden too (a small vocabulary: next to the blocks' gathers, the embeddings' are
    negligible; long sequences: a block computes longer than its gathers take)."""
    for ac, where in (("none", "(re-gathered)"), ("full", "(recomputed)")):
        plan = _plan(f"fsdp=8,microbatches=2,ac={ac}", "h100", vocab=128, seq=4096)
        assert any(c.where.endswith(where) and c.kind == "all_gather" for c in plan.collectives), ac
        assert plan.predicted.hidden_s > _kind_seconds(plan, "all_gather") / 2, ac


def test_accumulated_gradients_are_reduced_without_overlap() -> None:
    accumulating = _plan("dp=8,microbatches=2", "h100")
    assert _kind_seconds(accumulating, "all_reduce") > 0
    assert accumulating.predicted.hidden_s == 0
