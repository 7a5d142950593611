"""What sharded storage and activation checkpointing save (autoplan/planner/memory_savings.py):
each is the difference between the plan's kept bytes and the same plan's without the lever,
shown in the summary and the report's memory by kind."""

from __future__ import annotations

import sys

import pytest

from autoplan.load import make_model_spec
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.reports.document import Table
from autoplan.reports.report import summary_section
from autoplan.reports.summary import summary_text
from launcher import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import llama  # noqa: E402


@pytest.fixture(scope="module")
def plans():
    model, inputs = llama.build(batch=8, seq=32, vocab=512, device="meta")
    spec = make_model_spec(model, inputs, None, name="llama")
    options = PlanOptions(2, "h100", pipeline=False, plan_only=True, precision="fp32").planner_options()
    texts = ("dp=2", "fsdp=2", "dp=2,zero=1", "dp=2,ac=full", "fsdp=2,ac=selective")
    return {text: plan_manual(spec, options, parse_manual(text)) for text in texts}


def _state(m) -> float:
    return m.params + m.grads + m.optimizer


def test_the_sharded_state_saves_what_replicated_storage_would_keep_more(plans) -> None:
    dp, fsdp, zero1 = (plans[t].predicted.memory_bytes for t in ("dp=2", "fsdp=2", "dp=2,zero=1"))
    assert dp.sharding_saved == 0.0 and dp.recompute_saved == 0.0
    assert fsdp.sharding_saved == pytest.approx(_state(dp) - _state(fsdp))
    assert zero1.sharding_saved == pytest.approx(dp.optimizer - zero1.optimizer)  # the state alone
    assert zero1.sharding_saved > 0
    assert fsdp.recompute_saved == 0.0


def test_checkpointing_saves_the_activations_the_kept_plan_holds_more(plans) -> None:
    dp, full, selective = (plans[t].predicted.memory_bytes for t in ("dp=2", "dp=2,ac=full", "fsdp=2,ac=selective"))
    assert full.recompute_saved == pytest.approx(dp.activations - full.activations)
    assert selective.recompute_saved == pytest.approx(dp.activations - selective.activations)
    assert 0 < selective.recompute_saved < full.recompute_saved  # selective keeps the matrix products' outputs
    assert selective.sharding_saved == pytest.approx(plans["fsdp=2"].predicted.memory_bytes.sharding_saved)


def test_the_summary_and_the_report_show_what_was_saved(plans) -> None:
    plan = plans["fsdp=2,ac=selective"]
    line = next(line for line in summary_text(plan).splitlines() if line.startswith("saved per device"))
    assert "sharded training state (ZeRO / FSDP) 1.12 MB" in line and "activation checkpointing 1.89 MB" in line
    assert "saved per device" not in summary_text(plans["dp=2"])
    table = next(b for b in summary_section(plan).blocks if isinstance(b, Table))
    rows = {row[0]: row[1] for row in table.rows}
    assert "saved per device by the sharded training state" in rows["memory by kind"]
