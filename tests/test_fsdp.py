"""Parameters stored sharded over a data-parallel axis and gathered at use (FSDP / ZeRO-3).

Which inputs an op keeps for its backward decides where the program gathers a parameter again
in the backward; the search chooses sharded storage where a memory budget makes replication
infeasible on a data-parallel node; ``--manual fsdp=`` writes FSDP and FSDP × TP plans, and
with ``dp=`` HSDP plans (the batch over both axes); their programs (1-D, 2x2, checkpointed,
pipelined) pass ``--check`` on 2 and 4 gloo processes with every gather, re-gather and
reduce-scatter counted."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from autoplan.errors import AutoplanError
from autoplan.load import make_model_spec
from autoplan.plan_schema import HELD_SUFFIX, Plan
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import cost_manual, parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.reports.summary import summary_text
from autoplan.trace.saved_inputs import keeps_value, saved_inputs
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
import fsdp_cases  # noqa: E402
from zoo import ALL_CASES  # noqa: E402


def _spec(name: str):
    if name == "nanogpt":
        return make_model_spec(*fsdp_cases.nanogpt(), name=name)
    case = ALL_CASES[name]()
    return make_model_spec(case.model, case.example_inputs, case.loss_fn, name=name)


class _Ops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.embedding = nn.Embedding(8, 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.embedding(ids)


def test_an_op_keeps_a_weight_only_where_its_backward_needs_it() -> None:
    gm = torch.export.export(_Ops(), (torch.randn(2, 4), torch.tensor([1, 2]))).graph_module
    linear = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    embedding = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    x, weight, bias = linear.args
    # the weight is needed for the input's gradient: kept only where the input needs one
    assert saved_inputs(linear, [x, weight, bias], [True, True, True]) == {0, 1}
    assert saved_inputs(linear, [x, weight, bias], [False, True, True]) == {0}
    table, ids = embedding.args
    assert not keeps_value(embedding, table, {table.name: True, ids.name: False})


def _megatron_free_node(budget_gb: float, cluster: str = "h100") -> Plan:
    import gpt

    model, inputs = gpt.build(hidden=2048, layers=4, heads=16, seq=1024, vocab=32000, batch=64, device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn, name="gpt")
    # the search's own plan: on the interpreter, DDP (26.7 ms) is expected faster than it (24.2 ms
    # predicted, 52.3 ms with the interpreter's dispatch) and would replace it (native rivals)
    return plan_model(spec, PlanOptions(8, cluster, pipeline=False, mesh=(8,), recompute="none", plan_only=True,
                                        memory_per_device=budget_gb * 1e9, native_rivals=False))


def _h100_without_overlap(tmp_path) -> str:
    """H100s whose collectives never run beside compute (no prefetched gathers hidden)."""
    path = tmp_path / "h100-serial.toml"
    path.write_text('name = "h100-serial"\npreset = "h100"\n[device]\noverlapped_dispatch = false\n')
    return str(path)


def _gathered(plan: Plan) -> set[str]:
    """Parameters gathered at use (ZeRO-3 / FSDP): all-gathered in the forward."""
    return {c.where.split(" -> ")[0] for c in plan.collectives
            if c.tensor == "parameter" and c.kind == "all_gather" and c.phase == "forward"}


def _sharded_state(plan: Plan) -> set[str]:
    """Parameters whose optimizer state is sharded under the parameter (ZeRO-1/2)."""
    return {name for name, s in plan.storage.items() if s.optimizer_state != s.param}


def _tensor_parallel(plan: Plan) -> list:
    return [c for c in plan.collectives if c.tensor == "activation" and c.kind == "all_reduce"
            and c.bytes > 1e6]  # the loss's own scalar all-reduce aside


def test_a_budget_replication_cannot_meet_shards_state_then_parameters_before_tensor_parallelism(tmp_path) -> None:
    """A data-parallel node (64 sequences of 1,024 tokens on 8 devices) whose collectives never
    run beside compute: without a budget the weights are replicated. Under one that replicated
    Adam state exceeds, the plan shards the optimizer state (and gradients) of the large
    weights (ZeRO-1/2: one all-gather per step); under one that the replicated weights
    themselves exceed, it stores weights sharded and gathers them at use (ZeRO-3, gathered
    again in the backward). The batch stays sharded throughout and no activation is
    all-reduced (no tensor parallelism)."""
    cluster = _h100_without_overlap(tmp_path)
    free = _megatron_free_node(80, cluster)
    assert not any(name.startswith("h.") for name in _gathered(free) | _sharded_state(free))
    tight = free.predicted.memory_bytes.peak_with_transient - 0.5 * free.predicted.memory_bytes.optimizer
    zero = _megatron_free_node(tight / 1e9, cluster)
    assert zero.predicted.memory_bytes.peak_with_transient <= tight
    assert any(name.startswith("h.") and name.endswith(".weight") for name in _sharded_state(zero))
    assert not any(name.startswith("h.") for name in _gathered(zero))
    assert any(c.phase == "optimizer" and c.kind == "all_gather" for c in zero.collectives)
    assert zero.predicted.memory_bytes.optimizer < free.predicted.memory_bytes.optimizer
    assert not _tensor_parallel(zero)

    tighter = zero.predicted.memory_bytes.peak_with_transient - 0.5 * zero.predicted.memory_bytes.params
    fsdp = _megatron_free_node(tighter / 1e9, cluster)
    assert fsdp.predicted.memory_bytes.peak_with_transient <= tighter
    assert any(name.startswith("h.") and name.endswith(".weight") for name in _gathered(fsdp)), _gathered(fsdp)
    assert any(c.where.endswith("(re-gathered)") and c.phase == "backward" for c in fsdp.collectives)
    assert fsdp.predicted.memory_bytes.params < zero.predicted.memory_bytes.params
    assert not _tensor_parallel(fsdp)


def test_hidden_gathers_make_fsdp_the_fastest_plan_of_a_gpu_node(tmp_path) -> None:
    """The same node on H100s, whose blocks' forward gathers run beside the block before: the
    plan gathers the blocks' weights at use without any budget (its gathers partly hidden, its
    optimizer steps over shards), and it is faster than the plan found where nothing overlaps,
    costed here."""
    fsdp = _megatron_free_node(80)
    assert any(name.startswith("h.") and name.endswith(".weight") for name in _gathered(fsdp))
    assert fsdp.prefetch and fsdp.predicted.hidden_s > 0
    assert not _tensor_parallel(fsdp)
    serial = _megatron_free_node(80, _h100_without_overlap(tmp_path))
    assert not any(name.startswith("h.") for name in _gathered(serial))
    assert not serial.prefetch and serial.predicted.hidden_s == 0
    assert fsdp.predicted.step_time_s < serial.predicted.step_time_s


def _manual(name: str, text: str, devices: int, cluster: str = "cpu") -> Plan:
    options = PlanOptions(devices, cluster)
    return with_decisions(plan_manual(_spec(name), options.planner_options(), parse_manual(text)), options)


def _sharded_and_gathered(plan: Plan) -> bool:
    return any(c.where.endswith("(re-gathered)") or c.where.endswith("(recomputed)")
               for c in plan.collectives if c.tensor == "parameter") and \
        any(c.kind == "reduce_scatter" and c.tensor == "gradient" for c in plan.collectives)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_programs_pass_check(world: int, tmp_path) -> None:
    cases = {
        2: {"llama fsdp": ("llama", "fsdp=2"), "gpt2 fsdp checkpointed": ("gpt2", "fsdp=2,ac=full"),
            "llama fsdp per-op checkpointed": ("llama", "fsdp=2,ac=op"),
            "nanogpt fsdp 2 microbatches": ("nanogpt", "fsdp=2,microbatches=2"),
            "nanogpt fsdp bf16 2 microbatches": ("nanogpt", "fsdp=2,microbatches=2,precision=bf16")},
        4: {"gpt2 fsdp x tp": ("gpt2", "fsdp=2,tp=2"), "nanogpt fsdp 4": ("nanogpt", "fsdp=4"),
            "llama 2 stages x fsdp checkpointed": ("llama", "fsdp=2,pp=2,microbatches=2,ac=full"),
            "nanogpt hsdp": ("nanogpt", "dp=2,fsdp=2"), "llama hsdp checkpointed": ("llama", "dp=2,fsdp=2,ac=full")},
    }[world]
    plans = {label: (model, _manual(model, text, world)) for label, (model, text) in cases.items()}
    if world == 4:  # planned for GPUs: FSDP inside pipeline stages, gathered per microbatch
        plans["nanogpt4 pipeline fsdp prefetched"] = ("nanogpt4", _stage_prefetching(_pipelined_fsdp("none")))
        plans["nanogpt4 pipeline fsdp checkpointed prefetched"] = ("nanogpt4",
                                                                  _stage_prefetching(_pipelined_fsdp("all")))
    if world == 2:  # bf16 on GPUs: a small batch computed whole, the weights gathered for it (the linears
        # then run on local tensors, whose autocast casts of the gathered weights are re-gathered too)
        for label, pins in (("nanogpt weights gathered for replicated compute bf16", ("*.weight=fsdp",)),
                            ("nanogpt weights gathered for replicated compute bf16 accumulated",
                             ("*.weight=fsdp", "stages=1", "microbatches=2"))):
            plans[label] = ("nanogpt", plan_model(_spec("nanogpt"), PlanOptions(
                2, "h100", mesh=(2,), pipeline="stages=1" in pins, pins=pins, precision="bf16")))
    if world == 2:  # planned for GPUs: each block's gathers issued when the block before starts
        plans["llama fsdp prefetched"] = ("llama", _prefetching(_manual("llama", "fsdp=2", world, "h100")))
        plans["gpt2 fsdp checkpointed prefetched"] = ("gpt2", _prefetching(_manual("gpt2", "fsdp=2,ac=full", world,
                                                                                    "h100")))
    for label, (model_name, plan) in plans.items():
        if "replicated compute" in label:  # each rank computes every gradient whole: sliced, not reduced
            assert _regathered(plan) and plan.inputs["idx"] == ["R"], label
        else:
            assert (_held(plan) if "stages" in label else _sharded_and_gathered(plan)), label
        if "hsdp" in label:
            _assert_hsdp(plan, frozenset(name for name, _ in _spec(model_name).module.named_buffers()))
    assert "gathered at use" in summary_text(next(iter(plans.values()))[1])
    # the interpreter's own prefetching of a block's gathers (FSDP2, which runs Llama's plan natively,
    # prefetches by itself)
    prefetching = frozenset({"llama fsdp prefetched", "gpt2 fsdp checkpointed prefetched"})
    write_check_cases(tmp_path, plans, {"nanogpt": "fsdp_cases.py", "nanogpt4": "fsdp_cases.py"}, prefetching)
    results = launch_worker(ROOT / "tests" / "check_worker.py", world, tmp_path, timeout=600)
    assert_checks_passed(results, plans)
    for label, (_, plan) in plans.items():  # planned for GPUs: a block re-gathered beside the next one's backward
        early = [found[label]["prefetched_regathers"] for found in results.values()]
        regathered = any(c.where.endswith(("(re-gathered)", "(recomputed)")) for c in plan.collectives)
        assert (min(early) > 0) == (plan.prefetch_regathers and regathered), (label, early)


def _regathered(plan: Plan) -> bool:
    """Whether the plan gathers parameters at use and again in the backward."""
    return any(c.where.endswith("(re-gathered)") for c in plan.collectives if c.tensor == "parameter")


def _pipelined_fsdp(recompute: str) -> Plan:
    """Two 1F1B stages of two blocks on two H100s each, FSDP over each stage's two (the blocks'
    weights pinned gathered at use, each microbatch: not held), every layer recomputed or none."""
    spec = make_model_spec(*fsdp_cases.nanogpt4(), name="nanogpt4")
    return plan_model(spec, PlanOptions(4, "h100", precision="fp32", recompute=recompute, schedule="1f1b",
                                        pins=("fsdp=2", "h.*.weight=fsdp", "stages=2", "microbatches=2")))


def _stage_prefetching(plan: Plan) -> Plan:
    """A pipeline whose stages issue each block's forward gathers when the block before it in
    the stage starts: one prefetch per stage, its consumers in the stage, hidden in part."""
    assert len(plan.stages) == 2 and plan.microbatches == 2
    stage_of = {op: i for i, stage in enumerate(plan.stages) for op in stage.nodes}
    assert sorted(stage_of[p.at] for p in plan.prefetch) == [0, 1], plan.prefetch
    for prefetch in plan.prefetch:
        assert prefetch.reads and all(stage_of[op] == stage_of[prefetch.at] for op, _ in prefetch.reads)
    assert plan.predicted.hidden_s > 0
    return plan


def _prefetching(plan: Plan) -> Plan:
    """A plan whose blocks' forward gathers are issued a block ahead and hidden in part."""
    assert plan.prefetch and plan.predicted.hidden_s > 0, (plan.prefetch, plan.predicted)
    nodes = {n.name: n for n in plan.nodes}
    for prefetch in plan.prefetch:
        assert prefetch.at in nodes
        assert all(nodes[consumer].inputs[pos] == ["R"] for consumer, pos in prefetch.reads)  # read whole
    step = plan.predicted.compute_s + plan.predicted.comm_s - plan.predicted.hidden_s
    assert plan.predicted.step_time_s == pytest.approx(step)
    assert "of it beside compute" in summary_text(plan)
    return plan


def _held(plan: Plan) -> bool:
    """FSDP under a pipeline: parameters gathered once per step and held through its
    microbatches, their gradients reduce-scattered once, after the last (where they arrive as
    partial sums: a position table's comes whole, reduced with the activations); none
    re-gathered."""
    held = sum(1 for stage in plan.stages for name in stage.params
               if name in plan.storage and plan.storage[name].held)  # per stage: a tied one on each
    gathers = [c for c in plan.collectives if c.where.endswith(HELD_SUFFIX)]
    names = {c.where.removesuffix(HELD_SUFFIX).strip() for c in gathers}
    reductions = [c for c in plan.collectives if c.tensor == "gradient" and c.where.endswith(" (gradient)")
                  and c.where.removesuffix(" (gradient)") in names]
    regathered = [c for c in plan.collectives if c.tensor == "parameter" and c.phase == "backward"]
    return held > 0 and all(c.kind == "all_gather" and c.phase == "forward" for c in gathers) \
        and sum(c.count for c in gathers) == held >= sum(c.count for c in reductions) > 0 \
        and all(c.kind == "reduce_scatter" and c.phase == "backward" for c in reductions) and not regathered


def _assert_hsdp(plan: Plan, buffers: frozenset[str] = frozenset()) -> None:
    """HSDP on a ``dp × fsdp`` mesh: the batch split over both axes, every parameter the
    ``fsdp`` degree divides stored sharded over axis 1 and replicated over axis 0, its
    gradient all-reduced over axis 0 and reduce-scattered over axis 1."""
    assert plan.mesh == [2, 2]
    assert all(spec == ["S(0)", "S(0)"] for spec in plan.inputs.values()), plan.inputs
    stored = {fqn: spec for fqn, spec in plan.params.items() if fqn not in buffers}
    assert stored and all(spec[0] == "R" and spec[1].startswith("S(") for spec in stored.values()), stored
    gradients = {(c.kind, c.mesh_axis) for c in plan.collectives if c.tensor == "gradient"}
    assert {("all_reduce", 0), ("reduce_scatter", 1)} <= gradients, gradients


def test_hsdp_splits_the_batch_over_both_axes() -> None:
    plan = _manual("nanogpt", "dp=2,fsdp=2", 4)
    _assert_hsdp(plan)
    fsdp = _manual("nanogpt", "fsdp=4", 4)
    # half the parameter shards of FSDP over all four, none of its activation all-gathers per parameter twice
    assert plan.predicted.memory_bytes.params == pytest.approx(2 * fsdp.predicted.memory_bytes.params, rel=0.05)


def test_manual_precision_is_costed_and_checked() -> None:
    options = PlanOptions(2, "h100").planner_options()
    spec = _spec("nanogpt")
    fp32, bf16 = (cost_manual(spec, options, parse_manual(f"fsdp=2,precision={p}")) for p in ("fp32", "bf16"))
    assert bf16.name.endswith("precision=bf16")
    assert bf16.predicted.compute_s < fp32.predicted.compute_s
    with pytest.raises(AutoplanError, match="precision=fp16: use one of fp32, bf16"):
        parse_manual("fsdp=2,precision=fp16")
