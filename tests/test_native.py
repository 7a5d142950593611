"""Plans that reduce to a native PyTorch pattern run through it (the model itself on one
device, DDP, FSDP2's fully_shard, each with checkpointed layers and bf16 autocast;
parallelize_module with ColwiseParallel/RowwiseParallel) and match the single device; other
plans are not recognised.

One launch of 2 gloo processes runs the multi-device cases of tests/native_worker.py, one of
4 the HSDP cases (2x2), one of 1 process the one-device cases, each planned here beforehand;
the tests read their results. A
planning-only test (no process group) checks that a 2-D plan other than HSDP is refused.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launcher import launch_worker, on_every_rank
from native_worker import (CASES, FOUND_FORM_CASES, HSDP_CASES, MANUAL_CASES, META_CASES, NODES_FOUND_FORM_CASES,
    NODES_INTERPRETED_CASES, PINNED_CASES, RESUMED_CASES, SINGLE_CASES, plan_case, planned_here)

WORKER = Path(__file__).resolve().parent / "native_worker.py"
ROOT = WORKER.parents[1]
WORLD = 2


def _launch(out: Path, world: int, names: list[str], timeout: int) -> dict[int, dict]:
    """The cases ``names`` run on ``world`` processes, each planned here once (but the ones
    that plan on every rank)."""
    for name in names:
        if not planned_here(name):
            (out / f"{name}.json").write_text(plan_case(name, world).to_json())
    return launch_worker(WORKER, world, out, *names, timeout=timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    two = [*CASES, *MANUAL_CASES, *PINNED_CASES, *FOUND_FORM_CASES, "blocks_fsdp_mixed_meta", "llama_table_hidden_meta",
           "llama_table_hidden_resumed"]
    per_rank = _launch(tmp_path_factory.mktemp("native"), WORLD, two, timeout=300)
    single = _launch(tmp_path_factory.mktemp("native_single"), 1, list(SINGLE_CASES), timeout=120)
    four = [*HSDP_CASES, *NODES_FOUND_FORM_CASES, *NODES_INTERPRETED_CASES, "blocks_hsdp_meta",
            "llama_nodes_table_resumed"]
    hsdp = _launch(tmp_path_factory.mktemp("native_hsdp"), 4, four, timeout=300)
    return {**{name: [per_rank[r][name] for r in range(WORLD)] for name in two},
            **{name: [single[0][name]] for name in SINGLE_CASES},
            **{name: [hsdp[r][name] for r in range(4)] for name in four}}


def _case(results, name: str) -> list[dict]:
    return on_every_rank(results[name], name)


@pytest.mark.parametrize("name", [*CASES, *MANUAL_CASES, *PINNED_CASES, *FOUND_FORM_CASES, *HSDP_CASES,
                                  *NODES_FOUND_FORM_CASES, *NODES_INTERPRETED_CASES, *SINGLE_CASES])
def test_runs_the_expected_program_and_matches_single_device(results, name):
    for res in _case(results, name):
        assert res["recognised"] == res["expected"], res["reason"]
        assert res["program"] == res["expected"]
        assert res["values_ok"], f"mismatch: {res['bad']}\n{res['report']}"
        # loss, output, every parameter's gradient, the loss after 2 SGD steps
        assert res["num_compared"] >= res["num_model_parameters"] + 3
        assert res["module_untouched"], "parallelizing changed the user's module"


@pytest.mark.parametrize("name", ["mlp_megatron_allreduce", "mlp_megatron_rs_seq"])
def test_megatron_uses_colwise_then_rowwise_with_the_plans_output_layout(results, name):
    res = _case(results, name)[0]
    assert res["params"]["up.weight"] == ["S(0)"] and res["params"]["down.weight"] == ["S(1)"]
    assert res["styles"]["up"][0] == "colwise" and res["styles"]["down"][0] == "rowwise"
    # the row output all-reduced, or reduce-scattered over batch or sequence (an equal-cost tie
    # between S(0) and S(1): either is right, the solver's canonical tie-break picks one)
    expected_layouts = {"mlp_megatron_allreduce": {"R"}, "mlp_megatron_rs_seq": {"S(0)", "S(1)"}}
    assert res["styles"]["down"][1] in expected_layouts[name]
    # the native program executes exactly the plan's collectives, forward and backward
    assert res["executed"] == res["planned"], res["report"]


def test_data_parallel_runs_ddp_with_bucketed_gradient_reduction(results):
    res = _case(results, "mlp_dp")[0]
    assert all(p == ["R"] for p in res["params"].values()) and res["inputs"]["x"] == ["S(0)"]
    # forward: the loss's all-reduce, as planned; backward: DDP's buckets (1 here) instead of
    # one all-reduce per parameter (4 planned) — what observable_collectives() expects
    assert res["executed"]["forward"] == res["planned"]["forward"]
    assert res["planned_by_plan"]["backward"] == {"all_reduce": 4}
    assert res["executed"] == res["observable"] == res["planned"]  # check.py compares against the buckets
    assert any(not observable for _, _, observable in res["collective_map"])


def test_ddp_reduces_a_position_tables_gradient_in_its_buckets(results):
    """GPT-2's learned position rows are the same on every rank and added to batch-sharded
    tokens: the plan all-reduces their gradient on that edge, DDP in the table's gradient (the
    same sum); the run matches one device, and its collectives are DDP's buckets."""
    res = _case(results, "gpt2_positions_ddp")[0]
    assert res["program"] == "ddp" and res["inputs"]["input_ids"] == ["S(0)"]
    assert all(p == ["R"] for p in res["params"].values())
    assert res["executed"] == res["observable"] == res["planned"], res["report"]


def test_fsdp_looks_up_position_rows_in_the_gathered_table_and_reduces_their_gradient_in_its_groups(results):
    """``--manual fsdp=2`` of the same GPT-2: the position rows are computed whole on every rank
    (the manual rule: a value no user input flows into is replicated over the data axes, as
    FSDP2 runs the model, not looked up in a column-sharded table and gathered), and the plan's
    edge all-reduce of their gradient is FSDP2's reduce-scatter of the table's: the run matches
    one device with the collectives as planned."""
    res = _case(results, "gpt2_positions_fsdp")[0]
    assert res["program"] == "fsdp" and res["inputs"]["input_ids"] == ["S(0)"]
    assert res["params"]["transformer.wpe.weight"] == ["S(0)"]
    assert res["executed"] == res["observable"] == res["planned"], res["report"]
    plan = plan_case("gpt2_positions_fsdp", WORLD)
    assert [c.where for c in plan.collectives if c.tensor == "activation" and c.phase == "forward"
            and not c.where.endswith("-> output")] == []  # nothing gathered: the rows computed whole


def test_a_position_tables_edge_reduction_is_recognised_as_ddp_and_a_batched_one_is_not():
    from autoplan.codegen.native import recognise
    from autoplan.codegen.native_patterns import reduced_in_parameters
    from autoplan.trace.tracer import trace
    from native_worker import _case_spec

    spec = _case_spec("gpt2_positions_ddp")[2]
    plan, graph = plan_case("gpt2_positions_ddp", WORLD), trace(spec)
    same = graph.input_free_values
    edges = [c for c in plan.collectives if c.tensor == "activation" and c.phase == "backward"]
    assert [c.where for c in edges] == ["to -> add_1"]  # the position rows, added to the tokens
    assert reduced_in_parameters(edges[0], same) and recognise(spec, graph, plan).kind == "ddp"
    # a value a user input flows into is never taken for one: its reduction is not DDP's
    assert not set(graph.input_names) & same and "add_1" not in same
    assert not reduced_in_parameters(replace(edges[0], where="add_1 -> dropout"), same)


@pytest.mark.parametrize("name, needle", [("mlp_dp_sum_loss", "not a mean"),
                                          ("gpt_sharded", "tied parameter is sharded")])
def test_non_matching_plans_run_on_the_interpreter(results, name, needle):
    res = _case(results, name)[0]
    assert res["recognised"] == "none" and res["program"] == "none"
    assert needle in res["reason"]


def test_two_dimensional_plan_other_than_hsdp_is_not_recognised():
    sys.path.insert(0, str(ROOT / "examples"))
    import mlp

    from autoplan.codegen.native import recognise
    from autoplan.planner.api import make_options, plan_spec
    from autoplan.load import make_model_spec

    model, inputs = mlp.build(hidden=64, batch=64, seq=128)
    spec = make_model_spec(model, inputs, mlp.loss_fn)
    plan, graph = plan_spec(spec, make_options(4, "h100", (2, 2)))
    found = recognise(spec, graph, plan)
    assert found.kind == "none" and "is 2-D and the plan is neither HSDP" in found.reason


@pytest.mark.parametrize("name", ["blocks_fsdp", "blocks_fsdp_checkpointed", "blocks_fsdp_selective",
                                  "blocks_fsdp_bf16"])
def test_fsdp_plans_run_fully_shard_per_block_with_the_plans_collectives(results, name):
    res = _case(results, name)[0]
    assert res["program"] == "fsdp" and res["fsdp_groups"] == 4  # three blocks and the root
    # the plan's per-parameter gathers and reduce-scatters, one per fully_shard group
    assert res["planned_by_plan"]["forward"]["all_gather"] > res["fsdp_groups"]
    assert res["executed"]["forward"] == {"all_gather": 4, "all_reduce": 1}
    assert res["executed"]["backward"] == {"all_gather": 4, "reduce_scatter": 4}
    assert res["executed"] == res["observable"] == res["planned"]


@pytest.mark.parametrize("name, checkpointed", [("llama_zero2", False), ("llama_zero2_per_op_bf16", True),
                                                ("blocks_zero2_checkpointed", True)])
def test_zero2_plans_run_fully_shard_holding_the_gathered_parameters_through_the_backward(results, name,
                                                                                         checkpointed):
    res = _case(results, name)[0]
    groups = res["fsdp_groups"]
    assert res["program"] == "fsdp" and "ZeRO-2" in res["description"]
    assert bool(res["recomputed_layers"]) == checkpointed
    # the plan: every parameter whole, its gradient reduce-scattered in the backward and its
    # updated shards gathered after the optimizer step
    assert all(p == ["R"] for p in res["params"].values())
    planned = res["planned_by_plan"]
    assert planned["backward"]["reduce_scatter"] == planned["optimizer"]["all_gather"] > groups
    assert "all_gather" not in planned["backward"]
    # FSDP2 gathers each group once, before its forward (the step's gathers moved there), holds
    # it through the backward, recomputation included (no second gather), and reduce-scatters
    assert res["executed"]["forward"]["all_gather"] == groups
    assert res["executed"]["backward"] == {"reduce_scatter": groups}
    assert res["executed"] == res["observable"] == res["planned"]
    assert res["whole_after_forward"] == res["num_model_parameters"]
    assert _case(results, "llama_fsdp")[0]["whole_after_forward"] == 0  # FSDP frees them after the forward


@pytest.mark.parametrize("name", [*PINNED_CASES])
def test_plans_keeping_small_parameters_whole_beside_sharded_ones_run_fsdp2_and_replicate(results, name):
    """The search's plan on H100s shards the blocks' weights and keeps their biases and norms,
    the embedding and the head whole (their gathers would cost a latency each): FSDP2 shards
    only the former (one group per block), and torch's FSDP2-based ``replicate`` all-reduces the
    latter's gradients, one all-reduce per module holding them, once per step (accumulated
    microbatches skip it but for the last)."""
    res = _case(results, name)[0]
    storage = res["storage"]
    whole = [fqn for fqn, placement in storage.items() if placement == ["R"]]
    down = ["S(1)"] if name.endswith("dim1") else ["S(0)"]
    assert {fqn: placement for fqn, placement in storage.items() if placement != ["R"]} == \
        {f"blocks.{i}.{m}.weight": down if m == "down" else ["S(0)"] for i in range(3) for m in ("up", "down")}
    # FSDP2 stores each on the plan's dim (the others: replicate's whole DTensors)
    assert res["program_placements"]["blocks.0.down.weight"] == down
    assert res["program_placements"]["blocks.0.norm.weight"] == ["R"]
    assert "blocks.0.norm.weight" in whole and "embed.weight" in whole and "blocks.0.up.bias" in whole
    assert res["program"] == "fsdp" and res["fsdp_groups"] == 3 and res["replicate_groups"] >= 5
    assert f"replicate on {res['replicate_groups']} modules" in res["description"]
    assert bool(res["recomputed_layers"]) == ("checkpointed" in name)
    assert res["executed"] == res["planned"], res["report"]
    step = res["executed"].get("step, rank 0") or \
        {k: res["executed"]["forward"].get(k, 0) + res["executed"]["backward"].get(k, 0)
         for k in ("all_gather", "all_reduce", "reduce_scatter")}
    m = res["microbatches"]
    assert step["all_gather"] == 2 * m * 3 and step["reduce_scatter"] == m * 3
    assert step["all_reduce"] == res["replicate_groups"] + m  # and the loss's, every microbatch
    # the plan lists one bucketed all-reduce per whole parameter's gradient; replicate runs one per module
    assert res["planned_by_plan"]["backward"]["all_reduce"] >= len(whole) > res["replicate_groups"]


@pytest.mark.parametrize("name", [*FOUND_FORM_CASES])
def test_the_searchs_real_size_form_runs_fsdp2_zero2_modules_and_an_embedding_read_in_place(results, name):
    """The form the search finds for a Llama on a node of H100s (pinned here on a small one):
    the blocks' weights FSDP, the head and the last norm ZeRO-2, the blocks' norms whole, and
    the embedding table never gathered but read in place, the ids whole, its output moved onto
    the batch shards (hidden slices all-to-all'd, vocabulary partial sums reduce-scattered).
    FSDP2 groups the blocks, each ZeRO-2 module is a group of its own held through the
    backward, ``replicate`` takes the norms, and torch's parallel style the table."""
    res = _case(results, name)[0]
    vocabulary = "vocabulary" in name
    table = ["S(0)"] if vocabulary else ["S(1)"]
    assert res["storage"]["model.embed_tokens.weight"] == table
    assert res["program_placements"]["model.embed_tokens.weight"] == table  # the style's slice, never gathered
    assert res["storage"]["lm_head.weight"] == ["R"]  # whole, its gradient and state sharded (ZeRO-2)
    assert res["program"] == "fsdp" and res["fsdp_groups"] == 2 and res["held_groups"] == 2
    assert res["replicate_groups"] == 4  # the blocks' two norms each
    style = "RowwiseParallel" if vocabulary else "ColwiseParallel"
    assert f"model.embed_tokens {style}" in res["description"] and "2 ZeRO-2 modules" in res["description"]
    assert bool(res["recomputed_layers"]) == ("checkpointed" in name)
    assert res["executed"] == res["planned"], res["report"]
    m = res["microbatches"]
    moved = "reduce_scatter" if vocabulary else "all_to_all"
    assert res["planned_by_plan"]["forward"][moved] == m  # the embedding's output, every microbatch
    step = res["executed"].get("step, rank 0") or \
        {k: res["executed"]["forward"].get(k, 0) + res["executed"]["backward"].get(k, 0)
         for k in ("all_gather", "all_reduce", "reduce_scatter")}
    # gloo has no all-to-all: DTensor gathers and cuts instead, in the forward and the backward
    lookups = {"all_gather": m if vocabulary else 2 * m, "reduce_scatter": m if vocabulary else 0}
    # the blocks gather before the forward and again before the backward, every microbatch; the
    # ZeRO-2 modules once per step; every group reduce-scatters every microbatch
    assert step["all_gather"] == 2 * 2 * m + 2 + lookups["all_gather"]
    assert step["reduce_scatter"] == (2 + 2) * m + lookups["reduce_scatter"]


@pytest.mark.parametrize("name", [*NODES_FOUND_FORM_CASES])
def test_the_same_form_across_nodes_runs_hsdp_with_the_table_gathered_between_nodes(results, name):
    """The search's plan of Llama-7B's shape on 2 nodes of 8 H100s, pinned on 2 nodes of 2: the
    blocks HSDP (replicated between the nodes, sharded within one), the head and the last norm
    ZeRO-2 under HSDP, the blocks' norms whole, and the table stored sharded over both axes:
    gathered between the nodes for the lookup (FSDP2 over axis 0), read in place within one
    (``ColwiseParallel`` over axis 1), the ids split between the nodes only."""
    res = _case(results, name)[0]
    assert res["storage"]["model.embed_tokens.weight"] == ["S(0)", "S(1)"]
    assert res["inputs"]["input_ids"] == ["S(0)", "R"] and res["inputs"]["labels"] == ["S(0)", "S(0)"]
    assert res["program_placements"]["model.embed_tokens.weight"] == ["S(0)", "S(1)"]  # FSDP2 over TP's slice
    assert res["program"] == "hsdp" and res["fsdp_groups"] == 2 and res["held_groups"] == 2
    assert res["table_groups"] == 1 and res["replicate_groups"] == 4
    assert "model.embed_tokens ColwiseParallel" in res["description"] and "1 table sharded over axis 0" in \
        res["description"]
    assert bool(res["recomputed_layers"]) == ("checkpointed" in name)
    assert res["executed"] == res["planned"], res["report"]
    m = res["microbatches"]
    step = res["executed"].get("step, rank 0") or \
        {k: res["executed"]["forward"].get(k, 0) + res["executed"]["backward"].get(k, 0)
         for k in ("all_gather", "all_reduce", "reduce_scatter")}
    # the blocks gather before the forward and the backward every microbatch, the ZeRO-2 modules
    # and the table once per step; gloo has no all-to-all: DTensor gathers and cuts instead
    assert step["all_gather"] == 2 * 2 * m + 2 + 1 + 2 * m
    assert step["reduce_scatter"] == (2 + 2 + 1) * m
    # HSDP's groups all-reduce over axis 0 every microbatch, replicate once per step, and the
    # loss and its token count are all-reduced over each axis every microbatch
    assert step["all_reduce"] == (2 + 2) * m + 4 + 2 * 2 * m


def test_zero2_over_the_nodes_under_hsdp_reduces_every_microbatch_as_planned(results):
    """Accumulated on 2 nodes of 2, the planner keeps gradients sharded within a node and
    replicated between the nodes under whole parameters (ZeRO-2 under HSDP: the head, the last
    norm) and the blocks' sharded over both axes: after every microbatch each is reduced on its
    own edge, the interpreter's all-reduces between the nodes one per parameter and microbatch,
    as many as the plan lists, not in the step's buckets (``--check`` counted them as bucketed
    and failed: 14 all-reduces run, 10 expected)."""
    res = _case(results, "llama_nodes_table_accumulated")[0]
    assert res["program"] == "none" and res["microbatches"] == 2
    assert res["storage"]["model.layers.0.mlp.up_proj.weight"] == ["R", "S(0)"]
    assert res["executed"] == res["planned"], res["report"]
    assert res["zero2_all_reduces"] and all(c["count"] == 2 for c in res["zero2_all_reduces"])


@pytest.mark.parametrize("name", [*RESUMED_CASES])
def test_a_checkpoint_of_the_searchs_form_resumes_on_the_interpreter_and_back(results, name):
    """A DCP checkpoint written by the native program of the search's real-size form (FSDP2
    shards, ZeRO-2 groups, ``replicate``'s norms, the style's table; HSDP across nodes) resumes
    under the same plan on the DTensor interpreter, and the interpreter's resumes natively: each
    resumed step equals the step it continues (loss, every parameter: the Adam moments came
    along)."""
    native = "hsdp" if name.startswith("llama_nodes") else "fsdp"
    for res in _case(results, name):
        assert res["programs"] == [native, "none", native]
        assert res["resumed_steps"] == [1, 2]
        assert res["resumed_losses"] == pytest.approx(res["losses"][1:], rel=1e-5)
        assert res["worst_after_native"] < 1e-5 and res["worst_after_interpreter"] < 1e-5
        assert res["num_parameters"] > 10


@pytest.mark.parametrize("name", [*META_CASES])
def test_a_meta_device_models_replicas_start_equal(results, name):
    """Built on the meta device with each rank's generator apart, a model's parameters the plan
    keeps whole (``replicate``) or replicates over an axis (HSDP's shards over its replicate
    axis) start equal on every rank: the replicas are broadcast after initialisation."""
    res = _case(results, name)[0]
    assert res["program"] == res["expected"] and res["num_parameters"] > 10
    assert res["replicas_differ"] == []


@pytest.mark.parametrize("name", ["llama_zero1", "llama_zero1_accumulated"])
def test_zero1_plans_run_on_the_interpreter(results, name):
    res = _case(results, name)[0]
    assert res["program"] == "none" and "(ZeRO-1)" in res["reason"]
    assert res["executed"] == res["planned"], res["report"]


@pytest.mark.parametrize("name, calls", [("blocks_fsdp", 1), ("blocks_fsdp_checkpointed", 2),
                                         ("blocks_fsdp_selective", 2),
                                         ("blocks_ddp_checkpointed", 2), ("blocks_single_checkpointed", 2)])
def test_recomputed_layers_run_again_in_the_backward(results, name, calls):
    res = _case(results, name)[0]
    assert bool(res["recomputed_layers"]) == (calls == 2)
    assert res["block_calls_per_step"] == calls


def test_selective_checkpointing_runs_no_matrix_product_again(results):
    plain, full, selective = (_case(results, name)[0] for name in
                              ("blocks_fsdp", "blocks_fsdp_checkpointed", "blocks_fsdp_selective"))
    assert set(selective["recompute_modes"]) == {"selective"} and set(full["recompute_modes"]) == {"full"}
    assert selective["matmuls_per_step"] == plain["matmuls_per_step"] < full["matmuls_per_step"]


def test_a_llamas_checkpointed_blocks_run_again_what_their_policy_recomputes(results):
    """FSDP2 over a Hugging Face Llama's blocks, checkpointed as modules: selectively, no matrix
    product runs again; by the per-op policy, the three of each block's seven that the plan
    recomputes (k, o and up: :func:`~autoplan.plan_schema.kept_outputs`), its attention kept;
    fully, every one the backward needs. Each passes the check above."""
    plain, full, selective, per_op = (_case(results, f"llama_fsdp{suffix}")[0] for suffix in
                                      ("", "_checkpointed", "_selective", "_per_op"))
    assert all(res["program"] == "fsdp" for res in (plain, full, selective, per_op))
    assert set(per_op["recompute_modes"]) == {"op"} and len(per_op["recomputed_layers"]) == 2
    assert selective["matmuls_per_step"] == plain["matmuls_per_step"]
    assert per_op["matmuls_per_step"] == plain["matmuls_per_step"] + 3 * len(per_op["recomputed_layers"])
    assert per_op["matmuls_per_step"] < full["matmuls_per_step"]
    assert [res["block_calls_per_step"] for res in (plain, full, selective, per_op)] == [1, 2, 2, 2]


@pytest.mark.parametrize("name, kind", [("llama_fsdp_per_op_bf16", "fsdp"), ("llama_ddp_per_op", "ddp"),
                                        ("llama_hsdp_per_op", "hsdp")])
def test_per_op_checkpointing_runs_natively_with_bf16_ddp_and_hsdp(results, name, kind):
    """torchtitan's 8B recipe in small (FSDP2, bf16 under its mixed-precision policy, per-op
    checkpointing), and the per-op policy under DDP and HSDP: native, the same products run
    again as in fp32 FSDP, and each passes the check above with its collectives as planned."""
    res, fp32 = _case(results, name)[0], _case(results, "llama_fsdp_per_op")[0]
    assert res["program"] == kind and set(res["recompute_modes"]) == {"op"}
    assert res["matmuls_per_step"] == fp32["matmuls_per_step"]
    assert res["executed"] == res["observable"] == res["planned"]
    if name.endswith("bf16"):
        assert res["block_output_dtype"] == "torch.bfloat16"
        assert res["moved"]["forward"]["all_gather"] == ["bfloat16"]


@pytest.mark.parametrize("name", ["blocks_fsdp_bf16", "blocks_single_bf16"])
def test_bf16_plans_run_natively_under_autocast(results, name):
    res = _case(results, name)[0]
    assert res["precision"] == "bf16" and res["recognised"] == res["program"]
    assert res["block_output_dtype"] == "torch.bfloat16"  # the linear computed in bf16
    if name == "blocks_fsdp_bf16":  # FSDP2's MixedPrecisionPolicy: gathered in bf16, reduced in fp32
        assert res["moved"]["forward"]["all_gather"] == ["bfloat16"] == res["moved"]["backward"]["all_gather"]
        assert res["moved"]["backward"]["reduce_scatter"] == ["float32"]


@pytest.mark.parametrize("name", ["blocks_hsdp", "blocks_hsdp_checkpointed_bf16"])
def test_hsdp_plans_run_fully_shard_on_the_2d_mesh(results, name):
    """HSDP (``dp=2,fsdp=2`` on 4 ranks): FSDP2 on the named 2-D mesh, each group gathered over
    axis 1, its gradient reduce-scattered over axis 1 and the shard all-reduced over axis 0;
    each rank computes its quarter of the batch."""
    res = _case(results, name)[0]
    assert res["program"] == "hsdp" and res["fsdp_groups"] == 4
    assert all(spec == ["R", "S(0)"] for fqn, spec in res["params"].items())
    assert all(spec == ["S(0)", "S(0)"] for spec in res["inputs"].values())
    assert res["executed"]["backward"] == {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 4}
    assert res["executed"]["forward"] == {"all_gather": 4, "all_reduce": 2}  # the loss over each axis
    assert res["executed"] == res["observable"] == res["planned"]
    if name.endswith("bf16"):
        assert res["moved"]["forward"]["all_gather"] == ["bfloat16"]
        assert res["moved"]["backward"]["reduce_scatter"] == ["float32"] == res["moved"]["backward"]["all_reduce"]


_FSDP_TP = ("llama_fsdp_tp", "llama_fsdp_tp_checkpointed", "llama_fsdp_tp_selective", "llama_fsdp_tp_per_op_bf16")


@pytest.mark.parametrize("name", _FSDP_TP)
def test_fsdp_x_tp_plans_run_parallelize_module_then_fully_shard(results, name):
    """``fsdp=2,tp=2`` of a Hugging Face Llama on a 2x2 mesh, as torchtitan composes them:
    ``ColwiseParallel`` on q, k, v, gate and up, ``RowwiseParallel`` on o and down, the
    embedding and the head column-parallel with their outputs gathered; FSDP2 over axis 0 per
    block and the root. Each rank computes its half of the batch; the forward runs each block's
    gather and the two row all-reduces per block, the embedding's and the logits' gathers and
    the loss's two all-reduces; the backward one all-reduce per column linear's input (and the
    row all-reduces again where the blocks are recomputed), as the plan lists them."""
    res = _case(results, name)[0]
    styles = res["styles"]
    assert res["program"] == "fsdp_tp" and res["fsdp_groups"] == 3  # two blocks and the root
    assert {m for m, (kind, layout) in styles.items() if kind == "colwise" and layout == "None"} == \
        {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                           "mlp.gate_proj", "mlp.up_proj")}
    assert {m for m, (kind, _) in styles.items() if kind == "rowwise"} == \
        {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.o_proj", "mlp.down_proj")}
    assert styles["model.embed_tokens"] == styles["lm_head"] == ["colwise", "R"]
    assert all(spec[1] == "R" for spec in res["inputs"].values())  # the batch split over axis 0 only
    recomputed = 2 * 2 if res["recomputed_layers"] else 0  # the row all-reduces again
    assert res["executed"]["forward"] == {"all_gather": 3 + 2, "all_reduce": 2 * 2 + 2}
    assert res["executed"]["backward"] == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 5 * 2 + 1 + recomputed}
    assert res["executed"] == res["observable"] == res["planned"]


def test_fsdp_x_tp_with_sequence_parallelism_runs_natively(results):
    """A wider Llama's plan keeps the residual stream and the norms sharded on the sequence over
    axis 1 (Megatron's sequence parallelism): the embedding's output all-to-all'd onto sequence
    shards, every column linear gathering its input, the row linears reduce-scattering, the norms
    as ``SequenceParallel`` (their weights' gradients all-reduced over axis 1, as planned)."""
    res = _case(results, "llama_fsdp_tp_sequence")[0]
    styles = res["styles"]
    assert res["program"] == "fsdp_tp"
    assert styles["model.embed_tokens"] == ["colwise", "S(1)"] and styles["lm_head"] == ["colwise", "R"]
    assert {m for m, (kind, _) in styles.items() if kind == "sequence"} == \
        {"model.norm", *(f"model.layers.{i}.{m}" for i in (0, 1) for m in ("input_layernorm",
                                                                           "post_attention_layernorm"))}
    assert {layout for kind, layout in styles.values() if kind == "rowwise"} == {"S(1)"}
    assert res["executed"]["forward"]["reduce_scatter"] == 2 * 2  # the row outputs
    assert res["executed"]["backward"]["all_reduce"] == 2 * 2 + 1  # the norms' weight gradients
    assert res["executed"] == res["planned"]  # (gloo runs the planned all-to-all as a gather)


def test_fsdp_x_tp_checkpointing_runs_again_what_its_policy_recomputes(results):
    plain, full, selective, per_op = (_case(results, name)[0] for name in _FSDP_TP)
    assert [set(res["recompute_modes"]) for res in (full, selective, per_op)] == [{"full"}, {"selective"}, {"op"}]
    assert selective["matmuls_per_step"] == plain["matmuls_per_step"]
    assert per_op["matmuls_per_step"] == plain["matmuls_per_step"] + 3 * 2
    assert full["matmuls_per_step"] == plain["matmuls_per_step"] + 7 * 2  # no early stop: the whole block
    assert per_op["block_output_dtype"] == "torch.bfloat16" and plain["block_output_dtype"] == "torch.float32"


@pytest.mark.parametrize("name", ["blocks_fsdp_accumulated", "llama_ddp_accumulated",
                                  "llama_ddp_ignored_tokens_accumulated", "llama_zero2_accumulated",
                                  "llama_fsdp_accumulated_checkpointed_bf16", "blocks_hsdp_accumulated",
                                  "llama_fsdp_tp_accumulated"])
def test_accumulated_microbatches_run_one_after_another_through_the_native_program(results, name):
    """Each microbatch through DDP or FSDP2, which reduce and gather as often per step as the
    plan: DDP's buckets once (``no_sync`` before the last microbatch), FSDP's gathers and
    reduce-scatters every microbatch, ZeRO-2's gathers once (held through the microbatches)
    and its reduce-scatters every microbatch. (The loss, every gradient and the parameters
    after two steps equal one device's: the first test.)"""
    res = _case(results, name)[0]
    m, groups = res["microbatches"], res["fsdp_groups"]
    assert m == 2 and f"{m} microbatches accumulated" in res["description"]
    executed = res["executed"]["step, rank 0"]
    assert res["executed"] == res["planned"], res["report"]
    planned = res["planned_by_plan"]
    if res["program"] == "ddp":  # the per-parameter all-reduces of the step's gradients, in buckets once
        assert planned["backward"]["all_reduce"] > executed["all_reduce"] - planned["forward"]["all_reduce"] >= 1
    elif res["program"] == "fsdp_tp":  # (its tensor axis's gathers and all-reduces every microbatch, as planned)
        assert executed["reduce_scatter"] == m * groups and executed["all_gather"] > 2 * m * groups
    elif "ZeRO-2" in res["description"]:
        assert executed["all_gather"] == groups and executed["reduce_scatter"] == m * groups
        assert planned["optimizer"]["all_gather"] > groups  # the plan's, per parameter once per step
    else:
        assert executed["all_gather"] == 2 * m * groups and executed["reduce_scatter"] == m * groups
        assert executed.get("all_reduce", 0) == planned["forward"]["all_reduce"] + \
            (m * groups if res["program"] == "hsdp" else 0)


@pytest.mark.parametrize("name", ["llama_fsdp_ignored_tokens", "llama_ddp_ignored_tokens",
                                  "llama_hsdp_ignored_tokens"])
def test_a_token_mean_cross_entropy_divides_by_the_global_batchs_count(results, name):
    """The ranks' halves of the batch count different numbers of targets (most of the first
    half's labels are ignored): each rank's cross-entropy divides by the global count, so the
    loss and every gradient equal the single device's (checked above), with the count
    all-reduced in the forward as the plan lists it."""
    res = _case(results, name)[0]
    assert res["token_mean"] and res["program"] == res["expected"]
    axes = 2 if "hsdp" in name else 1  # the count and the loss value, over each mesh axis
    assert res["planned_by_plan"]["forward"]["all_reduce"] == 2 * axes
    assert res["executed"]["forward"]["all_reduce"] == 2 * axes
    assert res["executed"] == res["planned"]


def test_a_manual_fsdp_plan_computes_its_loss_on_each_ranks_own_samples(results):
    """nanoGPT's ``--manual fsdp`` plan: its cross-entropy (a token mean, ``ignore_index=-1``)
    reads each rank's logits and targets where they are, the count all-reduced beside the loss,
    as FSDP2 runs the model (the ILP found gathering the small model's logits cheaper, which no
    data-parallel program does: the manual rule has ops read the batch on the ranks' own
    samples). Its head, tied to its token table, and its position rows (computed whole) run as
    FSDP2 runs them."""
    res = _case(results, "nanogpt_fsdp")[0]
    assert res["program"] == "fsdp" and res["token_mean"]
    assert res["planned_by_plan"]["forward"]["all_reduce"] == 2  # the count and the loss value
    assert res["executed"] == res["planned"]
