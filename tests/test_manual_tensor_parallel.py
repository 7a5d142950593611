"""``--manual fsdp=,tp=`` costs tensor parallelism as torchtitan runs it: the tensor-parallel ranks
share their samples, norms hold their weights whole, only weights split by ``tp`` make partial
sums there and nothing is resharded there inside a norm;
torchtitan's Llama-70B recipe, a small Llama's plan and the 70B shape on 64 H100s then run on
PyTorch's own FSDP x TP (Hugging Face Llamas with grouped-query attention, planned on the meta
device, nothing run)."""

from __future__ import annotations

import warnings

import pytest
import torch

from autoplan.codegen.native_patterns import tensor_inputs
from autoplan.codegen.program_choice import ProgramChoice, ProgramKind, program_choice
from autoplan.load import ModelSpec, make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.planner.pipeline.search import trace_microbatch

transformers = pytest.importorskip("transformers")


def _llama_spec(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, seq: int,
                batch: int) -> ModelSpec:
    """A Hugging Face Llama built on the meta device, trained on its own tokens (``labels``)."""
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, intermediate_size=intermediate,
                                      vocab_size=vocab, max_position_embeddings=seq)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, vocab, (batch, seq))
    return make_model_spec(model, {"input_ids": ids, "labels": ids}, None, name="llama")


def _small_llama(kv_heads: int) -> ModelSpec:
    return _llama_spec(hidden=512, layers=2, heads=8, kv_heads=kv_heads, intermediate=1536, vocab=8192, seq=1024,
                       batch=8)


def _plan_pinned(spec: ModelSpec, *pins: str) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model(spec, PlanOptions(8, "h100", pins=pins, pipeline=False))


def _manual_program(spec: ModelSpec, options: PlanOptions, manual: str) -> ProgramChoice:
    """The program that runs ``--manual manual``'s plan of ``spec``, planned on its trace."""
    graph = trace_microbatch(spec, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_manual(spec, options.planner_options(), parse_manual(manual), graph)
    return program_choice(spec, graph, with_decisions(plan, options))


def _resharded_in_norms(spec: ModelSpec, plan: Plan) -> list[str]:
    """The edges between two ops of one norm on which a value is resharded over ``tp`` (mesh
    axis 1)."""
    graph = trace_microbatch(spec, plan.microbatches)
    plans = {n.name: n for n in plan.nodes}
    found = []
    for node in graph.graph_module.graph.nodes:
        reader = plans.get(node.name)
        for k, value in enumerate(tensor_inputs(node) if reader is not None else []):
            producer = plans.get(value.name)
            if producer is None or not producer.outputs or k >= len(reader.inputs) or reader.inputs[k] is None:
                continue
            given, read = producer.outputs[0][1], reader.inputs[k][1]
            if producer.module == reader.module and reader.module.endswith("norm") and given != read:
                found.append(f"{value.name} ({given}) -> {node.name} ({read})")
    return found


@pytest.fixture(scope="module")
def recipe_plan() -> Plan:
    """``fsdp=2,tp=4,ac=full`` on 8 H100s: 2 layers, 8 heads over 2 key-value heads."""
    return _plan_pinned(_small_llama(kv_heads=2), "fsdp=2", "tp=4", "ac=full")


def test_the_tensor_parallel_ranks_share_their_samples(recipe_plan: Plan) -> None:
    assert recipe_plan.mesh == [2, 4]
    assert {name: spec[1] for name, spec in recipe_plan.inputs.items()} == {"input_ids": "R", "labels": "R"}
    loss = [n for n in recipe_plan.nodes if "cross_entropy" in n.op]
    assert loss and all(spec is None or spec[1] != "S(0)" for n in loss for spec in n.inputs)


def test_what_tp_does_not_split_is_stored_whole_there(recipe_plan: Plan) -> None:
    """Norm weights and buffers (the rotary frequencies) are whole over ``tp``: FSDP shards them
    over ``fsdp`` alone, as ``fully_shard`` on the data axis does."""
    unsplit = {fqn: spec for fqn, spec in recipe_plan.params.items() if "norm" in fqn or "rotary" in fqn}
    assert any("rotary" in fqn for fqn in unsplit) and any("norm" in fqn for fqn in unsplit)
    assert all(spec[1] == "R" for spec in unsplit.values()), unsplit


def test_only_the_split_weights_make_partial_sums_over_tp(recipe_plan: Plan) -> None:
    partial = {n.op for n in recipe_plan.nodes for spec in n.outputs if spec[1] == "P"}
    assert partial == {"aten.linear.default"}  # the row linears: o_proj and down_proj


def test_norm_weights_are_read_whole_and_their_gradients_all_reduced_over_tp(recipe_plan: Plan) -> None:
    """As ``SequenceParallel`` holds a norm: its weight whole over ``tp``, its gradient's partial
    sums all-reduced there (read sliced, the gradient was all-gathered: no style runs that)."""
    over_tp = {(c.kind, c.tensor) for c in recipe_plan.collectives if c.mesh_axis == 1 and c.tensor == "gradient"}
    assert over_tp <= {("all_reduce", "gradient")}
    weighted = {}  # each norm's last product: ``self.weight * hidden_states`` (the weight first)
    for n in recipe_plan.nodes:
        if n.module.endswith("norm") and n.op == "aten.mul.Tensor":
            weighted[n.module] = n
    assert len(weighted) == 5  # two per layer and the last
    assert all(n.inputs[0][1] == "R" for n in weighted.values()), {m: n.inputs for m, n in weighted.items()}


def test_key_and_value_projections_are_columns(recipe_plan: Plan) -> None:
    """Megatron's rows read what a column region made: the narrow key and value projections are
    columns (their outputs split by heads), not rows over the norm's output sliced by features."""
    projections = [n for n in recipe_plan.nodes if n.module.endswith(("k_proj", "v_proj"))]
    assert len(projections) == 4
    assert all(n.outputs[0][1] == "S(2)" for n in projections), [(n.name, n.outputs) for n in projections]


def test_nothing_is_resharded_over_tp_inside_a_norm(recipe_plan: Plan) -> None:
    """A norm runs whole or on its sequence shard throughout, as the styles run it (before the
    rule the ILP gathered a sequence-sharded norm's output before its weight's product)."""
    assert _resharded_in_norms(_small_llama(kv_heads=2), recipe_plan) == []


def test_a_small_llamas_plan_runs_on_fsdp_x_tp() -> None:
    """``fsdp=2,tp=4,ac=full`` of a small Llama whose key-value heads ``tp`` divides: PyTorch's own
    styles and FSDP2 (before the rule: the DTensor interpreter, a norm's output gathered inside
    the norm)."""
    spec = _small_llama(kv_heads=4)
    plan = _plan_pinned(spec, "fsdp=2", "tp=4", "ac=full")
    choice = program_choice(spec, trace_microbatch(spec, plan.microbatches), plan)
    assert choice.kind == ProgramKind.NATIVE and "FSDP x TP" in choice.text, choice.line()


def test_the_llama_70b_shape_on_64_h100s_runs_on_fsdp_x_tp() -> None:
    """``fsdp=8,tp=8,ac=full`` of the Llama-70B shape (seq 4096, batch 16) on 64 H100s: PyTorch's
    own FSDP x TP (before the rule: the DTensor interpreter; the ILP multiplied a slice of the
    last norm's whole output by its weight)."""
    spec = _llama_spec(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=32000, seq=4096,
                       batch=16)
    choice = _manual_program(spec, PlanOptions(64, "h100", plan_only=True), "fsdp=8,tp=8,ac=full")
    assert choice.kind == ProgramKind.NATIVE and "FSDP x TP" in choice.text, choice.line()


def test_torchtitans_llama_70b_recipe_runs_on_fsdp_x_tp() -> None:
    """torchtitan's Llama 3.1 70B recipe on 256 H100s (``fsdp=32,tp=8,ac=full``, local batch 16,
    seq 8192), at its own size: its plan is taken by ``parallelize_module`` on the tensor axis
    and FSDP2 on the data axis (before the rule: the DTensor interpreter, its loss split by
    samples over both axes)."""
    spec = _llama_spec(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256, seq=8192,
                       batch=512)
    choice = _manual_program(spec, PlanOptions(256, "h100", precision="bf16", plan_only=True), "fsdp=32,tp=8,ac=full")
    assert choice.kind == ProgramKind.NATIVE and "FSDP x TP" in choice.text, choice.line()
