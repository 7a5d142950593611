"""End-to-end planning: the intra-op ILP on traced models picks the sharding a person would."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import mlp
import pytest
import torch

import autoplan
from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.planner.api import make_options, plan_traced
from autoplan.trace.repeated import find_classes
from autoplan.load import make_model_spec
from autoplan.planner.meshes import candidate_meshes, parse_mesh
from autoplan.planner.mesh_plan import StorageRule
from autoplan.plan_schema import Plan
from autoplan.trace.tracer import trace


def _mlp_graph(hidden: int, rows: int):
    model, x = mlp.build(hidden=hidden, batch=rows // 128, seq=128, device="meta")
    return trace(make_model_spec(model, x, mlp.loss_fn))


def _activation_forward(plan: Plan) -> list:
    """Forward collectives on activations, without the reduction of the scalar loss."""
    return [c for c in plan.collectives_in("forward") if c.tensor == "activation" and c.bytes > 8]


@pytest.fixture(scope="module")
def megatron_plan() -> Plan:
    return plan_traced(_mlp_graph(4096, 8 * 128), make_options(8, "h100", mesh=(8,)))


@pytest.fixture(scope="module")
def small_mlp_graph():
    return _mlp_graph(256, 16384)


def test_megatron_mlp_is_column_then_row_sharded(megatron_plan: Plan) -> None:
    assert megatron_plan.params["up.weight"] == ["S(0)"]
    assert megatron_plan.params["down.weight"] == ["S(1)"]
    forward = _activation_forward(megatron_plan)
    assert len(forward) == 1 and forward[0].count == 1
    assert forward[0].kind in ("all_reduce", "reduce_scatter")
    # the only other forward collective is the reduction of the scalar loss
    rest = [c for c in megatron_plan.collectives_in("forward") if c not in forward]
    assert all(c.kind == "all_reduce" and c.bytes <= 8 for c in rest)


def test_wide_batch_small_mlp_is_data_parallel(small_mlp_graph) -> None:
    plan = plan_traced(small_mlp_graph, make_options(8, "h100", mesh=(8,)))
    assert all(p == ["R"] for p in plan.params.values()), plan.params
    assert _activation_forward(plan) == []
    grads = [c for c in plan.collectives_in("backward") if c.tensor == "gradient"]
    assert {c.kind for c in grads} == {"all_reduce"}
    assert sum(c.bytes * c.count for c in grads) == pytest.approx(sum(
        torch.Size(s).numel() * 4 for s in [(1024, 256), (1024,), (256, 1024), (256,)]))
    # in buckets: every byte at the link's bandwidth, and the latency of one all-reduce in all
    from autoplan.cost_models import collective_time, load_cluster

    link = load_cluster("h100").intra_node
    bandwidth = sum(c.count * collective_time("all_reduce", c.bytes, 8, link.without_latency()) for c in grads)
    loss = [c for c in plan.collectives if c.tensor != "gradient"]
    others = sum(c.count * collective_time(c.kind, c.bytes, 8, link) for c in loss)
    assert plan.predicted.comm_s == pytest.approx(bandwidth + collective_time("all_reduce", 0.0, 8, link) + others)


def _least_memory_with_replicated_weights(graph, sharded_state: bool) -> Plan:
    """The plan with replicated weights that needs the least memory (equally fast plans may
    hold more activations: tighten the budget until none fits); with or without the weights'
    optimizer state and gradients sharded (ZeRO-1/2)."""
    def replicated_weights(info, spec) -> bool:
        return info.kind != "parameter" or all(p.is_replicate for p in spec)

    # a rule naming no sharded state (accepting none) allows plain storage only
    rule = StorageRule(replicated_weights, None if sharded_state else (lambda strategy: False))

    def replicated(budget: float | None) -> Plan:
        options = make_options(8, "h100", mesh=(8,), memory_per_device=budget)
        return plan_traced(graph, dataclasses.replace(options, allow_storage=rule))

    plan = replicated(None)
    while True:
        try:
            plan = replicated(plan.predicted.memory_bytes.peak_with_transient * 0.99)
        except MemoryInfeasibleError:
            return plan


def test_memory_budget_forces_sharded_state_then_sharded_weights(small_mlp_graph) -> None:
    """Below the least memory of replicated weights with plain (DDP) storage the plan shards
    the weights' optimizer state or the weights; below the least with the state sharded too
    (ZeRO-1/2) it shards the weights themselves."""
    free = plan_traced(small_mlp_graph, make_options(8, "h100", mesh=(8,)))
    plain = _least_memory_with_replicated_weights(small_mlp_graph, sharded_state=False)
    assert all(p == ["R"] for p in plain.params.values())
    assert all(s.optimizer_state == s.param for s in plain.storage.values())
    replicated_state = plain.predicted.memory_bytes.params * 4  # params + grads + 2 Adam moments
    budget = plain.predicted.memory_bytes.peak_with_transient - replicated_state / 2
    tight = plan_traced(small_mlp_graph, make_options(8, "h100", mesh=(8,), memory_per_device=budget))
    assert tight.predicted.memory_bytes.peak_with_transient <= budget
    assert any(p != ["R"] for p in tight.params.values()) or \
        any(s.optimizer_state != s.param for s in tight.storage.values())
    assert tight.predicted.step_time_s >= free.predicted.step_time_s

    zero = _least_memory_with_replicated_weights(small_mlp_graph, sharded_state=True)
    assert all(p == ["R"] for p in zero.params.values())
    assert zero.predicted.memory_bytes.peak_with_transient < plain.predicted.memory_bytes.peak_with_transient
    below = zero.predicted.memory_bytes.peak_with_transient * 0.99
    sharded = plan_traced(small_mlp_graph, make_options(8, "h100", mesh=(8,), memory_per_device=below))
    assert sharded.predicted.memory_bytes.peak_with_transient <= below
    assert any(p != ["R"] for p in sharded.params.values())


def test_memory_below_the_least_gives_one_line_error(small_mlp_graph) -> None:
    with pytest.raises(MemoryInfeasibleError) as info:
        plan_traced(small_mlp_graph, make_options(8, "h100", memory_per_device=1e6))
    message = str(info.value)
    assert "\n" not in message and "the least any plan needs is" in message
    assert info.value.least_memory_bytes > 1e6
    # it crosses processes whole (an exact plan planned beside the others returns it)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is MemoryInfeasibleError and str(again) == message
    assert again.least_memory_bytes == info.value.least_memory_bytes


def test_python_api_plans_a_module_and_round_trips() -> None:
    model, x = mlp.build(hidden=64, batch=2, seq=16)
    plan = autoplan.plan(model, x, devices=4, cluster="a100-80g", loss_fn=mlp.loss_fn, pipeline=False)
    assert plan.devices == 4 and plan.mesh in ([4], [2, 2])
    assert set(plan.params) == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert Plan.from_json(plan.to_json()) == plan
    data = plan.to_dict()
    for key in ("format", "graph_hash", "devices", "cluster", "mesh", "stages", "microbatches", "schedule",
                "params", "nodes", "collectives", "predicted", "alternatives"):
        assert key in data
    assert {a["name"] for a in data["alternatives"]} == {"mesh 2x2", "mesh 4"} - {f"mesh {'x'.join(map(str, plan.mesh))}"}


def test_plan_rejects_another_format() -> None:
    model, x = mlp.build(hidden=32, batch=1, seq=8)
    data = autoplan.plan(model, x, devices=2).to_dict()
    data["format"] = "autoplan.plan/99"
    with pytest.raises(AutoplanError, match="is of format 'autoplan.plan/99' and this autoplan reads"):
        Plan.from_dict(data)


def test_unknown_op_is_replicated_with_a_warning() -> None:
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.logcumsumexp(self.lin(x), dim=0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoplan.plan(Odd(), torch.randn(8, 16), devices=2)
    messages = [str(w.message) for w in caught if "sharding rule" in str(w.message)]
    assert messages == ["no sharding rule for aten.logcumsumexp.default: planned replicated"]
    node = next(n for n in plan.nodes if "logcumsumexp" in n.op)
    assert node.strategy == "R = R"


def test_mesh_enumeration_and_parsing() -> None:
    assert candidate_meshes(8) == [(8,), (2, 4), (4, 2)]
    assert candidate_meshes(7) == [(7,)]
    assert parse_mesh("2x4", 8) == (2, 4)
    assert parse_mesh("8", 8) == (8,)
    with pytest.raises(AutoplanError, match="holds 6 devices"):
        parse_mesh("2x3", 8)
    with pytest.raises(AutoplanError, match="cannot read mesh"):
        parse_mesh("two", 8)


def test_repeated_layers_share_one_strategy() -> None:
    import gpt

    model, inputs = gpt.build(hidden=64, layers=4, heads=4, seq=32, vocab=256, batch=8, device="meta")
    graph = trace(make_model_spec(model, inputs, gpt.loss_fn))
    classes = find_classes(graph)
    assert len(classes.blocks) == 4
    assert classes.num_classes < len(graph.nodes) / 2
    plan = plan_traced(graph, make_options(4, "h100", mesh=(2, 2)))
    by_layer = {}
    for name, spec in plan.params.items():
        if name.startswith("h."):
            layer, rest = name.split(".", 2)[1:]
            by_layer.setdefault(rest, set()).add(tuple(spec))
    assert by_layer and all(len(specs) == 1 for specs in by_layer.values())
    assert plan.solver.num_groups < classes.num_classes


def test_mesh_choice_keeps_the_cheapest() -> None:
    plan = plan_traced(_mlp_graph(1024, 4096), make_options(8, "h100"))
    costs = [a.predicted.step_time_s for a in plan.alternatives if a.predicted]
    assert len(plan.alternatives) == 2
    assert all(plan.predicted.step_time_s <= c + 1e-12 for c in costs)


def test_two_v100_nodes_are_crossed_by_data_parallelism_only() -> None:
    """With 25 Gbit/s between nodes only data parallelism crosses them: the batch is split
    across the nodes, no parameter is sharded over that axis, and no large activation crosses
    it. Inside a node the plan is no slower than Megatron sharding on the NVLink axis (the
    ``--manual dp=2,tp=8`` plan); with the gradients reduce-scattered inside a node before
    they cross it (ZeRO-2 over both axes), data parallelism over all 16 GPUs beats it."""
    import gpt

    from autoplan.planner.manual import cost_manual, parse_manual

    model, inputs = gpt.build(hidden=1024, layers=4, heads=16, seq=1024, vocab=8192, batch=16, device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn)
    graph = trace(spec)
    options = make_options(16, "v100-16g")
    plan = plan_traced(graph, options)
    assert plan.mesh == [2, 8]
    assert plan.inputs["idx"][0] == "S(0)"  # the batch is split across the nodes
    assert all(placement[0] == "R" for placement in plan.params.values())
    hidden_activation = 16 * 1024 * 1024 * 4  # one [batch, seq, hidden] fp32 tensor
    cross_node = [c for c in plan.collectives_in("forward") if c.mesh_axis == 0]
    assert sum(c.bytes * c.count for c in cross_node) < hidden_activation / 32  # no big activation crosses nodes
    megatron = cost_manual(spec, options, parse_manual("dp=2,tp=8")).predicted
    assert megatron is not None
    assert plan.predicted.step_time_s <= megatron.step_time_s * (1 + 1e-6)


@pytest.mark.parametrize("example, mesh", [("gpt2", (2, 2)), ("gpt", (4,)), ("resnet", (2, 2)), ("bert", (4,))])
def test_predicted_step_time_is_the_ilp_objective(example: str, mesh: tuple[int, ...]) -> None:
    """The plan's prediction (from its listed collectives) and the ILP's objective are the
    same number: what the solver minimised is what the plan reports."""
    from pathlib import Path

    from autoplan.load import load_model_file

    spec = load_model_file(str(Path(__file__).resolve().parent.parent / "examples" / f"{example}.py"))
    plan = plan_traced(trace(spec), make_options(4, "cpu", mesh=mesh))
    objective = plan.explanation.split("objective ")[1].split(",")[0]
    assert plan.solver.status == "optimal"
    from autoplan.solvers import format_seconds

    assert format_seconds(plan.predicted.step_time_s) == objective


def test_a_budget_only_the_backwards_transients_exceed_blames_them() -> None:
    """A tiny Mixtral (transformers' own class) on 4 devices: just above the lower bound of its
    memory (the sum of each op's least, which the budget's first check compares) no plan fits
    once the backward's transients are counted. The one-line error says so, and does not claim
    that the least a plan needs is a figure below the budget."""
    from zoo import ALL_CASES

    case = ALL_CASES["mixtral"]()
    spec = make_model_spec(case.model, case.example_inputs, case.loss_fn, name="mixtral")
    graph = trace(spec)
    with pytest.raises(MemoryInfeasibleError) as below:
        plan_traced(graph, make_options(4, "cpu", memory_per_device=1e3))
    least = below.value.least_memory_bytes
    with pytest.raises(MemoryInfeasibleError) as info:
        plan_traced(graph, make_options(4, "cpu", memory_per_device=least * 1.01))
    message = str(info.value)
    assert "\n" not in message and "backward's transients" in message
    assert "the least any plan needs is" not in message
