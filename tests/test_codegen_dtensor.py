"""A plan executed with DTensor equals the single device: loss, outputs and every gradient.

Two launches (gloo, CPU): 2 processes (mesh (2,)) and 4 processes (meshes (4,) and (2, 2)), each
running every case of its world size in tests/dist_worker.py, planned here beforehand; the tests
read their results.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import CASES, gloo_normalised, plan_case
from launcher import launch_worker, on_every_rank

WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def _launch(world: int, out: Path) -> dict[int, dict]:
    for name, case in CASES.items():
        if case[0] == world:
            (out / f"{name}.json").write_text(plan_case(name).to_json())
    return launch_worker(WORKER, world, out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[int, dict]]:
    return {world: _launch(world, tmp_path_factory.mktemp(f"dist{world}")) for world in (2, 4)}


def _case(results, name: str) -> list[dict]:
    """The case's result on every rank."""
    world = CASES[name][0]
    return on_every_rank([results[world][r][name] for r in range(world)], name)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(results, name):
    for res in _case(results, name):
        assert res["hash_equal"], "a rank traced another graph than the plan's"
        assert res["loss_ok"], f"loss differs by {res['loss_diff']}"
        assert res["outputs_ok"], f"outputs differ by {res['output_diff']}"
        assert not res["grads_missing"], f"no gradient for {res['grads_missing']}"
        assert not res["grads_bad"], f"gradients differ: {res['grads_bad']} (max {res['grad_diff']})"
        assert res["grads_checked"] >= res["num_model_parameters"] > 0
        assert res["loss_diff"] < 1e-5 and res["grad_diff"] < 1e-5
        assert not res["indivisible"], f"sharded dims the mesh does not divide: {res['indivisible']}"
        assert res["ok"]


def test_shard_batch(results):
    for world in (2, 4):
        for r in range(world):
            assert results[world][r]["_shard_batch"]["ok"]


def test_strategies_are_exercised(results):
    """The cases cover column/row (Megatron) sharding, data parallelism and both on a 2-D mesh."""
    megatron = _case(results, "mlp_megatron_2")[0]
    assert megatron["params"]["up.weight"] == ["S(0)"] and megatron["params"]["down.weight"] == ["S(1)"]
    assert _case(results, "mlp_megatron_4")[0]["params"]["down.weight"] == ["S(1)"]
    assert _case(results, "mlp_dp_2")[0]["inputs"]["x"] == ["S(0)"]
    assert _case(results, "mlp_dp_4")[0]["inputs"]["x"] == ["S(0)"]
    assert all(v == ["R"] for v in _case(results, "mlp_dp_2")[0]["params"].values())
    two_d = _case(results, "mlp_2x2_megatron")[0]["params"]
    assert sorted(two_d["up.weight"]) == ["S(0)", "S(1)"]  # sharded over both mesh axes
    assert any(p != ["R"] for p in _case(results, "gpt_2")[0]["params"].values())
    assert any(p != ["R", "R"] for p in _case(results, "gpt_2x2")[0]["params"].values())


def test_tied_weight_stays_one_parameter(results):
    for name in ("gpt_2", "gpt_4", "gpt_2x2"):
        for res in _case(results, name):
            # lm_head.weight is wte.weight: one parameter, a gradient checked under both names
            assert res["num_parameters"] == res["num_model_parameters"]
            assert res["grads_checked"] == res["num_model_parameters"] + 1


@pytest.mark.parametrize("name", ["mlp_megatron_2", "mlp_megatron_4", "mlp_megatron_tight_2", "mlp_megatron_tight_4"])
def test_megatron_forward_collectives_as_planned(results, name):
    res = _case(results, name)[0]
    executed, planned = res["executed_forward"], res["planned_forward"]
    for kind in ("all_reduce", "reduce_scatter"):
        assert executed.get(kind, 0) == planned.get(kind, 0), (kind, executed, planned, res["redistributions"])
    assert planned.get("all_reduce", 0) + planned.get("reduce_scatter", 0) >= 1


@pytest.mark.parametrize("name", list(CASES))
def test_forward_collectives_as_planned(results, name):
    """Every case executes exactly the forward collectives its plan lists, and exactly those
    its own redistributions ask for (DTensor's propagation adds none). gloo has no all_to_all
    on CPU: DTensor runs each as an all_gather (+ chunk), so the two are summed."""
    res = _case(results, name)[0]
    executed, planned = gloo_normalised(res["executed_forward"]), gloo_normalised(res["planned_forward"])
    assert executed == planned, (res["redistributions"], res["planned_where"])
    assert gloo_normalised(res["redistributed_forward"]) == executed, res["redistributions"]


@pytest.mark.parametrize("name", list(CASES))
def test_backward_collectives_as_planned(results, name):
    """Every case, on 1-D and 2-D meshes, executes exactly the backward collectives its plan
    lists, kind by kind: each partial gradient is reduced on the edge that creates it, into the
    producer's placement, and a mean loss over a sharded batch all-reduces its target count;
    data-parallel parameter gradients are all-reduced in buckets, one collective per bucket
    (gloo runs an all_to_all as an all_gather: the two are summed)."""
    res = _case(results, name)[0]
    executed, planned = gloo_normalised(res["executed_backward"]), gloo_normalised(res["expected_backward"])
    assert executed == planned, (res["executed_backward"], res["expected_backward"], res["planned_where_backward"])


def test_data_parallel_gradients_are_reduced_in_buckets(results):
    """The interpreter reduces data-parallel gradients in buckets, as DDP does: where the plan
    lists one all-reduce per parameter, one per bucket runs."""
    for name in ("mlp_dp_2", "mlp_dp_4"):
        res = _case(results, name)[0]
        assert res["planned_backward"]["all_reduce"] >= 4
        assert res["executed_backward"].get("all_reduce", 0) == 1, res["executed_backward"]


def test_hf_models_and_conv_net_are_sharded(results):
    """HF GPT-2 and BERT (integer token ids, attention masks) and the conv net (BatchNorm
    buffers) run plans that shard parameters, on 1-D and 2x2 meshes."""
    for name in ("gpt2_hf_2", "bert_hf_2", "gpt2_hf_4", "gpt2_hf_2x2", "bert_hf_4", "bert_hf_2x2",
                 "resnet_sharded_2", "resnet_sharded_2x2"):
        res = _case(results, name)[0]
        assert res["sharded_params"] > 0, name
    for name in ("resnet_2", "resnet_sharded_2", "resnet_sharded_2x2"):
        res = _case(results, name)[0]
        assert res["buffers_checked"] >= 10 and res["buffer_diff"] < 1e-5  # running mean/var, counters
        # convolutions run batch-sharded only (strategies/rules/contractions.convolution): their weights stay replicated
        conv = [k for k in res["params"] if "conv" in k or "shortcut.0" in k]
        assert conv and all(all(p == "R" for p in res["params"][k]) for k in conv)


def test_widths_no_device_count_divides(results):
    """hidden 30 on 4 devices: no strategy shards a dim the mesh does not divide, the plan still
    shards what divides (4h = 120), and the run matches the single device."""
    res = _case(results, "mlp_odd_4")[0]
    assert res["params"]["up.weight"] == ["S(0)"] and res["params"]["down.weight"] == ["S(1)"]
    assert res["params"]["down.bias"] == ["R"]  # 30 rows: not divisible by 4
    for name in ("mlp_odd_4", "mlp_odd_2x2"):
        assert not _case(results, name)[0]["indivisible"]


@pytest.mark.parametrize("device_type, fused", [("cpu", False), ("cuda", True)])
def test_attention_backends_by_device(device_type: str, fused: bool) -> None:
    """CPU programs run the math attention (the CPU flash backward has no DTensor rule); GPU
    programs the fused kernels, whose DTensor rules shard batch and heads, with math behind."""
    import torch

    from autoplan.codegen.dtensor_program import dispatch_settings

    with dispatch_settings(device_type):
        assert torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() == fused
        assert torch.backends.cuda.mem_efficient_sdp_enabled() == fused
        assert not torch.backends.cuda.cudnn_sdp_enabled()
