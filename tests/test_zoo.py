"""Public architectures nobody here wrote (tests/zoo.py: tiny configurations of transformers'
and PyTorch's own classes, random weights) plan on 4 devices with and without the pipeline
search, and their programs pass ``--check`` against one device: the 4-device plan found with
the pipeline search on 4 gloo processes, the 2-device intra-op plan on 2, and, for one model of
each family (:data:`SHARDED_OF_FAMILY`), a plan forced by a memory budget to shard weights on 4. Two launches
(tests/check_worker.py) run every check; a model that fails to plan fails its own tests."""

from __future__ import annotations

import json
import sys
import warnings

import pytest

from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from launcher import ROOT, assert_program_as_planned, launch_worker

sys.path.insert(0, str(ROOT / "tests"))
from zoo import ALL_CASES  # noqa: E402

ZOO_FILE = ROOT / "tests" / "zoo.py"
SHARDING_BUDGETS = (0.3, 0.45, 0.6, 0.75, 0.9)  # of the replicated plan's memory, tried in turn
SOLVE_LIMIT_S = 20.0  # seconds per ILP solve under those budgets
# models with ops DTensor has no rule for (hardswish_backward, as_strided_, mkldnn_rnn_layer):
# their replicated two-device plans run natively (the model itself on each device), and also on
# the interpreter, which runs those ops on local tensors
LOCAL_OPS = ("mobilenet_v3", "convnext", "torch_lstm")
# the model of each family planned under those budgets: the family's first, but Whisper for the
# encoder-decoders (it has a frozen parameter, its positional table; and T5's budgeted ILPs
# reach the solve limit: 47 s of planning against Whisper's 25 s)
SHARDED_OF_FAMILY = ("llama", "mixtral", "bert", "whisper", "vit", "mamba", "torch_transformer")


def _spec(name: str):
    case = ALL_CASES[name]()
    return make_model_spec(case.model, case.example_inputs, case.loss_fn, name=name)


def _plan(name: str, devices: int, **options) -> tuple[Plan, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_model(_spec(name), PlanOptions(devices, "cpu", **options))
    return plan, sorted({str(w.message) for w in caught if "planned replicated" in str(w.message)})


def _sharded(name: str, replicated: Plan) -> Plan | None:
    """The 4-device intra-op plan under the smallest budget (a share of the replicated
    plan's memory) that makes it shard a weight."""
    for share in SHARDING_BUDGETS:
        try:
            budget = share * replicated.predicted.memory_bytes.peak_with_transient
            # a budget near the least a model needs can make the ILP slow to prove: its best plan in the limit
            # the search's own sharded plan, on whatever program runs it (not a native rival's FSDP)
            plan, _ = _plan(name, 4, pipeline=False, memory_per_device=budget, time_limit_s=SOLVE_LIMIT_S,
                            native_rivals=False)
        except Exception:  # noqa: BLE001  (too small a budget: try a larger one)
            continue
        if any(p != "R" for placement in plan.params.values() for p in placement):
            return plan
    return None


def _plans(name: str, shard: bool) -> dict:
    pipelined, replicated_ops = _plan(name, 4)
    intra, _ = _plan(name, 4, pipeline=False, native_rivals=False)  # the search's plan: the budgets' reference
    two, _ = _plan(name, 2, pipeline=False)
    return {"pipelined": pipelined, "intra": intra, "two": two, "replicated_ops": replicated_ops,
            "sharded": _sharded(name, intra) if shard else None}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zoo")
    found: dict = {"plans": {}, "errors": {}, "launches": {}}
    by_world: dict[int, list[dict]] = {2: [], 4: []}
    for name in ALL_CASES:
        try:
            plans = found["plans"][name] = _plans(name, shard=name in SHARDED_OF_FAMILY)
        except Exception as e:  # noqa: BLE001  (the model's own tests report it)
            found["errors"][name] = f"{type(e).__name__}: {e}"
            continue
        for label, plan, world in (("default", plans["two"], 2), ("default", plans["pipelined"], 4),
                                   ("sharded", plans["sharded"], 4)):
            if plan is None:
                continue
            path = out / f"{name}-{label}-{world}.json"
            path.write_text(plan.to_json())
            by_world[world].append({"name": f"{name}/{label}", "file": str(ZOO_FILE), "builder": name,
                                    "plan": str(path)})
            if name in LOCAL_OPS and world == 2:
                by_world[2].append({"name": f"{name}/interpreter", "file": str(ZOO_FILE), "builder": name,
                                    "plan": str(path), "interpreter": True})
    for world, listed in by_world.items():
        folder = out / f"procs{world}"
        folder.mkdir()
        (folder / "cases.json").write_text(json.dumps(listed))
        found["launches"][world] = launch_worker(ROOT / "tests" / "check_worker.py", world, folder, timeout=1200)
    return found


def _passed(zoo: dict, world: int, name: str) -> None:
    for rank, results in zoo["launches"][world].items():
        res = results[name]
        assert "error" not in res, f"{name} on {world} processes, rank {rank}: {res.get('traceback')}"
        assert res["ok"], f"{name} on {world} processes, rank {rank}:\n{res['text']}"
        assert_program_as_planned(res, f"{name} on {world} processes, rank {rank}")


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_zoo_model_plans(zoo, name: str) -> None:
    assert name not in zoo["errors"], f"{name} did not plan: {zoo['errors'][name]}"
    plans = zoo["plans"][name]
    assert plans["pipelined"].devices == 4 and plans["intra"].devices == 4 and plans["two"].devices == 2


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_zoo_default_plan_passes_check_on_4(zoo, name: str) -> None:
    _passed(zoo, 4, f"{name}/default")


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_zoo_two_device_plan_passes_check_on_2(zoo, name: str) -> None:
    _passed(zoo, 2, f"{name}/default")


@pytest.mark.parametrize("name", LOCAL_OPS)
def test_zoo_ops_without_a_dtensor_rule_run_on_local_tensors_in_the_interpreter(zoo, name: str) -> None:
    _passed(zoo, 2, f"{name}/interpreter")
    for results in zoo["launches"][2].values():
        assert not results[f"{name}/interpreter"]["description"].startswith("native"), results


def test_zoo_every_family_has_a_model_sharded_by_memory() -> None:
    families = {ALL_CASES[name]().family for name in ALL_CASES}
    assert sorted(ALL_CASES[name]().family for name in SHARDED_OF_FAMILY) == sorted(families)


@pytest.mark.parametrize("name", SHARDED_OF_FAMILY)
def test_zoo_family_sharded_by_memory_passes_check(zoo, name: str) -> None:
    assert name not in zoo["errors"], f"{name} did not plan: {zoo['errors'][name]}"
    sharded = zoo["plans"][name]["sharded"]
    assert sharded is not None, f"{name}: no budget among {SHARDING_BUDGETS} of the replicated memory shards a weight"
    _passed(zoo, 4, f"{name}/sharded")


def test_zoo_moe_sharded_by_memory_is_expert_parallel(zoo) -> None:
    """Under the budget that makes the family's MoE model shard its weights, its experts are sharded
    by expert (each device computing its own experts' contributions, partial sums) on one axis of
    the mesh and its tokens split on the other, as the launch above checks against one device."""
    name = next(n for n in SHARDED_OF_FAMILY if ALL_CASES[n]().family == "moe")
    sharded = zoo["plans"][name]["sharded"]
    experts = [n for n in sharded.nodes if n.op.startswith("autoplan.moe_experts")]
    assert experts, f"{name}: no experts traced as one op"
    for node in experts:
        (out,) = node.outputs
        axis = out.index("P")  # the axis sharding the experts
        assert node.inputs[3][axis] == node.inputs[4][axis] == "S(0)", node  # each device its experts' weights
        assert all(spec[axis] == "R" for spec in node.inputs[:3]), node  # every token on every device of it
