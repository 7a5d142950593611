"""The search never loses to a plan it can express: hand-written plans drawn at random
(``--manual`` data, sharded data, tensor and pipeline degrees, microbatches, checkpointing:
none, full, selective or per-op) for small models on two clusters and two device counts, each
costed under the same model as the plan found, are never predicted faster than it (the plan the
search found: where it runs on the DTensor interpreter, a native plan may replace it, by the step
expected with the interpreter's dispatch: :mod:`autoplan.planner.native_rivals`)."""

from __future__ import annotations

import random
import sys

import pytest

from autoplan.load import make_model_spec
from autoplan.planner.front_door import plan_model
from autoplan.planner.manual import ManualPlan, cost_manual, parse_manual
from autoplan.planner.native_rivals import searched_prediction
from autoplan.planner.options import PlanOptions
from launcher import ROOT

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_cases  # noqa: E402
from zoo import ALL_CASES  # noqa: E402

DRAWS = 4
LAYERS = 2  # both models have two blocks: at most two stages


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _draw(rng: random.Random, devices: int) -> ManualPlan:
    pp = rng.choice([d for d in _divisors(devices) if d <= LAYERS])
    tp = rng.choice(_divisors(devices // pp))
    data = devices // pp // tp
    fsdp = data if rng.random() < 0.5 else 1
    microbatches = rng.choice([1, 2]) if pp == 1 else rng.choice([pp, 2 * pp])
    return ManualPlan(dp=data // fsdp, fsdp=fsdp, tp=tp, pp=pp, microbatches=microbatches,
                      ac=rng.choice(["none", "full", "selective", "op"]))


def _spec(name: str):
    if name == "nanogpt":
        return make_model_spec(*fsdp_cases.nanogpt(), name=name)
    case = ALL_CASES[name]()
    return make_model_spec(case.model, case.example_inputs, case.loss_fn, name=name)


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_no_drawn_manual_plan_is_predicted_faster_than_the_found_one(name: str) -> None:
    spec = _spec(name)
    rng = random.Random(name)
    costed = 0
    for cluster in ("cpu", "h100"):
        for devices in (2, 4):
            options = PlanOptions(devices, cluster)
            found = searched_prediction(plan_model(spec, options)).step_time_s
            for _ in range(DRAWS):
                manual = _draw(rng, devices)
                alternative = cost_manual(spec, options.planner_options(), manual)
                if alternative.predicted is None:
                    continue
                costed += 1
                assert found <= alternative.predicted.step_time_s * (1 + 1e-6), \
                    f"{cluster}, {devices} devices: {manual.label} predicted {alternative.predicted.step_time_s} s, " \
                    f"the found plan {found} s"
    assert costed >= 12  # most draws are feasible plans


def test_no_drawn_manual_plan_is_predicted_faster_under_a_memory_budget() -> None:
    spec = _spec("llama")
    peak = plan_model(spec, PlanOptions(4, "cpu")).predicted.memory_bytes.peak_with_transient
    options = PlanOptions(4, "cpu", memory_per_device=0.6 * peak)  # the fastest plan does not fit
    found = searched_prediction(plan_model(spec, options)).step_time_s
    rng = random.Random("budget")
    feasible = [alt for alt in (cost_manual(spec, options.planner_options(), _draw(rng, 4)) for _ in range(2 * DRAWS))
                if alt.predicted is not None]
    assert feasible
    for alternative in feasible:
        assert found <= alternative.predicted.step_time_s * (1 + 1e-6), (alternative.name, found)


def test_hsdp_across_two_nodes_beats_fsdp_over_both_and_never_the_found_plan() -> None:
    """Two nodes of two H100s: HSDP (``dp=2,fsdp=2``: gathers and reduce-scatters inside a
    node, the reduced shard all-reduced across) is predicted faster than FSDP over all four
    (every gather crossing the nodes' link), and the plan found is never slower than either,
    with and without a memory budget that replication cannot meet."""
    spec = _spec("nanogpt")
    peak = plan_model(spec, PlanOptions(4, "h100", devices_per_node=2)).predicted.memory_bytes.peak_with_transient
    for budget in (None, 0.6 * peak):
        options = PlanOptions(4, "h100", devices_per_node=2, memory_per_device=budget)
        found = plan_model(spec, options).predicted.step_time_s
        hsdp, fsdp = (cost_manual(spec, options.planner_options(), parse_manual(text)).predicted
                      for text in ("dp=2,fsdp=2", "fsdp=4"))
        assert hsdp is not None and fsdp is not None
        assert hsdp.comm_s < fsdp.comm_s
        assert found <= hsdp.step_time_s * (1 + 1e-6)


def test_hsdp_is_searched_across_nodes_where_replication_fits() -> None:
    """Four nodes of eight H100s, a Llama shape in bf16 with every layer recomputed: plain data
    parallelism fits in memory, so sharded storage is not needed for memory's sake, but HSDP
    (``dp=4,fsdp=8``: each gradient reduce-scattered inside a node and only its shard reduced
    across nodes) is faster than replicating the parameters. The plan found on that mesh is
    never slower than it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                         intermediate_size=7168, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (64, 2048))
    spec = make_model_spec(model, {"input_ids": ids, "labels": ids}, name="llama")
    options = PlanOptions(32, "h100", precision="bf16", stages=1, microbatches=1, mesh=(4, 8), recompute="all")
    replicated = cost_manual(spec, options.planner_options(), parse_manual("dp=32,ac=full")).predicted
    hsdp = cost_manual(spec, options.planner_options(), parse_manual("dp=4,fsdp=8,ac=full")).predicted
    assert replicated is not None and hsdp is not None  # both fit
    assert hsdp.step_time_s < replicated.step_time_s
    found = plan_model(spec, options).predicted.step_time_s
    assert found <= hsdp.step_time_s * (1 + 1e-6)


def _llama_8b_blocks():
    """Four of Llama 3.1 8B's blocks (Hugging Face's class, meta device), 16 x 8,192 tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=1024, max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 1024, (16, 8192))
    return make_model_spec(model, {"input_ids": ids, "labels": ids}, None, name="llama-8b-blocks")


def test_selectively_recomputed_blocks_that_must_also_be_trimmed_lose_to_full_recomputation() -> None:
    """Four of Llama 3.1 8B's blocks on 8 H100s (meta device, 16 x 8,192 tokens) under a budget
    between what FSDP needs with every block recomputed selectively and fully: the search's
    best estimate recomputes every block selectively, which the exact plans can only fit by
    trimming further (slower than recomputing fully), so the found plan is never slower than
    ``fsdp=8,ac=full``."""
    spec = _llama_8b_blocks()
    whole = {"stages": 1, "microbatches": 1}
    unbounded = PlanOptions(8, "h100", **whole).planner_options()
    selective, full = (cost_manual(spec, unbounded, parse_manual(f"fsdp=8,ac={ac}")).predicted
                       for ac in ("selective", "full"))
    low, high = full.memory_bytes.peak_with_transient, selective.memory_bytes.peak_with_transient
    assert selective.step_time_s < full.step_time_s and low < high
    budget = low + 0.75 * (high - low)
    options = PlanOptions(8, "h100", memory_per_device=budget, **whole)
    plan = plan_model(spec, options)
    recipe = cost_manual(spec, options.planner_options(), parse_manual("fsdp=8,ac=full")).predicted
    assert recipe is not None and plan.predicted.memory_bytes.peak_with_transient <= budget
    assert plan.predicted.step_time_s <= recipe.step_time_s * (1 + 1e-6), (plan.mesh, plan.recompute)


def test_the_per_op_policy_is_searched_where_selective_recomputation_does_not_fit() -> None:
    """The same four blocks under a budget between what FSDP needs with every block recomputed
    by torchtitan's per-op policy and selectively: the per-op policy (``ac=op``, faster than
    recomputing fully) fits, every block selectively does not, and the found plan is never
    slower than ``fsdp=8,ac=op``."""
    spec = _llama_8b_blocks()
    whole = {"stages": 1, "microbatches": 1}
    unbounded = PlanOptions(8, "h100", **whole).planner_options()
    per_op, selective, full = (cost_manual(spec, unbounded, parse_manual(f"fsdp=8,ac={ac}")).predicted
                               for ac in ("op", "selective", "full"))
    low, high = per_op.memory_bytes.peak_with_transient, selective.memory_bytes.peak_with_transient
    assert per_op.step_time_s < full.step_time_s and low < high
    options = PlanOptions(8, "h100", memory_per_device=low + 0.25 * (high - low), **whole)
    plan = plan_model(spec, options)
    recipe = cost_manual(spec, options.planner_options(), parse_manual("fsdp=8,ac=op")).predicted
    assert recipe is not None and plan.predicted.memory_bytes.peak_with_transient <= options.memory_per_device
    assert plan.predicted.step_time_s <= recipe.step_time_s * (1 + 1e-6), (plan.mesh, plan.recompute)
