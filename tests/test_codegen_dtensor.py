"""A plan executed with DTensor equals the single device: loss, outputs and every gradient.

Two launches (gloo, CPU): 2 processes (mesh (2,)) and 4 processes (meshes (4,) and (2, 2)), each
running every case of its world size in tests/dist_worker.py; the tests read their results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import CASES

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
ROOT = WORKER.parents[1]


def _launch(world: int, out_dir: Path) -> dict[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(29500 + world + (os.getpid() % 500) * 8), str(WORKER), str(out_dir)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{world}-process launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[int, dict]]:
    return {world: _launch(world, tmp_path_factory.mktemp(f"dist{world}")) for world in (2, 4)}


def _case(results, name: str) -> list[dict]:
    """The case's result on every rank."""
    world = CASES[name][0]
    per_rank = [results[world][r][name] for r in range(world)]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"{name} failed on rank {r}: {res['error']}\n{res.get('traceback', '')}"
    return per_rank


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(results, name):
    for res in _case(results, name):
        assert res["hash_equal"], "ranks planned different graphs"
        assert res["loss_ok"], f"loss differs by {res['loss_diff']}"
        assert res["outputs_ok"], f"outputs differ by {res['output_diff']}"
        assert not res["grads_missing"], f"no gradient for {res['grads_missing']}"
        assert not res["grads_bad"], f"gradients differ: {res['grads_bad']} (max {res['grad_diff']})"
        assert res["grads_checked"] >= res["num_model_parameters"] > 0
        assert res["loss_diff"] < 1e-5 and res["grad_diff"] < 1e-5
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
    assert two_d["up.weight"] == ["S(0)", "S(1)"]
    assert any(p != ["R"] for p in _case(results, "gpt_2")[0]["params"].values())
    assert any(p != ["R", "R"] for p in _case(results, "gpt_2x2")[0]["params"].values())


def test_tied_weight_stays_one_parameter(results):
    for name in ("gpt_2", "gpt_4", "gpt_2x2"):
        for res in _case(results, name):
            # lm_head.weight is wte.weight: one parameter, a gradient checked under both names
            assert res["num_parameters"] == res["num_model_parameters"]
            assert res["grads_checked"] == res["num_model_parameters"] + 1


@pytest.mark.parametrize("name", ["mlp_megatron_2", "mlp_megatron_4", "mlp_megatron_rs_2", "mlp_megatron_rs_4"])
def test_megatron_forward_collectives_as_planned(results, name):
    res = _case(results, name)[0]
    executed, planned = res["executed_forward"], res["planned_forward"]
    for kind in ("all_reduce", "reduce_scatter"):
        assert executed.get(kind, 0) == planned.get(kind, 0), (kind, executed, planned, res["redistributions"])
    assert planned.get("all_reduce", 0) + planned.get("reduce_scatter", 0) >= 1


@pytest.mark.parametrize("name", list(CASES))
def test_forward_collectives_as_planned(results, name):
    """Every case executes exactly the forward collectives its plan lists. gloo has no
    all_to_all on CPU: DTensor runs each as an all_gather (+ chunk), so those two are summed."""
    res = _case(results, name)[0]
    executed, planned = dict(res["executed_forward"]), dict(res["planned_forward"])
    for counts in (executed, planned):
        counts["all_gather"] = counts.get("all_gather", 0) + counts.pop("all_to_all", 0)
        for k in [k for k, v in counts.items() if v == 0]:
            del counts[k]
    assert executed == planned, (res["redistributions"], res["planned_where"])
