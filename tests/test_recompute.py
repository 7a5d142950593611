"""Activation checkpointing: layers recomputed in the backward, costed, chosen under memory and
run. A checkpointed region keeps fewer tensors and gives the same gradients; a recomputed plan
costs one forward more and keeps fewer activations; a memory budget that one stage's sharding
cannot meet makes the search recompute layers; the programs (1-D, 2x2, pipelined) pass
``--check`` on 2 and 4 gloo processes, the recomputed forward's collectives counted."""

from __future__ import annotations

import collections
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.codegen.checkpointing import CheckpointedRegions
from autoplan.errors import MemoryInfeasibleError
from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan, RecomputedLayer
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.reports.summary import summary_text
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases

sys.path.insert(0, str(ROOT / "tests"))
from zoo import ALL_CASES  # noqa: E402


def _spec(name: str):
    case = ALL_CASES[name]()
    return make_model_spec(case.model, case.example_inputs, case.loss_fn, name=name)


def _walk(gm: torch.fx.GraphModule, x: torch.Tensor, regions: CheckpointedRegions) -> torch.Tensor:
    """Run ``gm`` node by node as the programs do, recomputed regions through ``regions``."""
    interpreter = torch.fx.Interpreter(gm)

    def run(n: torch.fx.Node, env: dict) -> object:
        interpreter.env = env
        return interpreter.run_node(n)

    env: dict = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = x
        elif n.op == "output":
            return env[n.args[0]]
        else:
            env[n] = regions.value(n, env, run) if n in regions else run(n, env)
    raise AssertionError("no output")


def _three_linears() -> tuple[nn.Module, torch.fx.GraphModule, list[str], torch.Tensor]:
    """A model of three linears with tanh between them, its graph, the op nodes of its middle
    (tanh, linear, tanh) and an input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    gm = torch.fx.symbolic_trace(model)
    ops = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return model, gm, ops[1:4], torch.randn(4, 8)


def test_checkpointed_region_keeps_fewer_tensors_and_gives_the_same_gradients() -> None:
    model, gm, middle, x = _three_linears()
    results = []
    for recomputed in ([], [RecomputedLayer("middle", middle)]):
        saved = []
        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = _walk(gm, x, CheckpointedRegions(recomputed, gm.graph.nodes)).sum()
        loss.backward()
        results.append((len(saved), loss.item(), [p.grad.clone() for p in model.parameters()]))
    (kept_plain, loss_plain, grads_plain), (kept_ckpt, loss_ckpt, grads_ckpt) = results
    assert kept_ckpt < kept_plain
    assert loss_ckpt == loss_plain
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_ckpt))


def test_recomputing_costs_a_forward_and_frees_activations() -> None:
    spec = _spec("gpt2")
    kept = plan_model(spec, PlanOptions(2, "cpu", pipeline=False, mesh=(2,)))
    again = plan_model(spec, PlanOptions(2, "cpu", pipeline=False, mesh=(2,), recompute=True))
    assert not kept.recompute and [r.layer for r in again.recompute] == kept.stages[0].layers
    assert again.predicted.memory_bytes.activations < kept.predicted.memory_bytes.activations
    assert again.predicted.compute_s > kept.predicted.compute_s


def _backward_ops(model: nn.Module, gm: torch.fx.GraphModule, x: torch.Tensor, middle: list[str],
                  modes: tuple[str | None, ...]) -> list[tuple[collections.Counter[str], list[torch.Tensor]]]:
    """For each mode (None: nothing recomputed), the ops the backward runs with ``middle``
    recomputed so, and the parameters' gradients."""
    results = []
    for mode in modes:
        recomputed = [RecomputedLayer("middle", middle, mode)] if mode else []
        model.zero_grad()
        loss = _walk(gm, x, CheckpointedRegions(recomputed, gm.graph.nodes)).sum()
        with _OpCounter() as counter:
            loss.backward()
        results.append((counter.counts, [p.grad.clone() for p in model.parameters()]))
    return results


def test_selective_region_keeps_matrix_products_and_gives_the_same_gradients() -> None:
    model, gm, middle, x = _three_linears()
    (plain, grads), (full, grads_full), (selective, grads_selective) = _backward_ops(
        model, gm, x, middle, (None, "full", "selective"))
    # the layer (tanh, linear, tanh) again; selectively without its product
    assert full["addmm"] == plain["addmm"] + 1 and full["tanh"] == plain["tanh"] + 2
    assert selective["addmm"] == plain["addmm"] and selective["tanh"] == plain["tanh"] + 2
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(grads, grads_full, grads_selective))


class _FiveLinears(nn.Module):
    """Five linears with tanh between them, each product an op call (``F.linear``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linears = nn.ModuleList(nn.Linear(m, n) for m, n in ((8, 32), (32, 32), (32, 32), (32, 32), (32, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, linear in enumerate(self.linears):
            x = nn.functional.linear(x, linear.weight, linear.bias)
            x = torch.tanh(x) if i < len(self.linears) - 1 else x
        return x


def test_per_op_region_keeps_every_other_matrix_product_and_gives_the_same_gradients() -> None:
    model = _FiveLinears()
    gm = torch.fx.symbolic_trace(model)  # the linears as calls of ops, as a traced graph has them
    nodes = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    middle = nodes[nodes.index(ops[1]):nodes.index(ops[7]) + 1]  # tanh, then three (linear, tanh), their weights
    (plain, grads), *others = _backward_ops(model, gm, torch.randn(4, 8), middle, (None, "selective", "op", "full"))
    selective, per_op, full = (counts for counts, _ in others)
    # of the three products, the first and third kept, the second computed again; all four tanh again
    assert (selective["addmm"], per_op["addmm"], full["addmm"]) == (plain["addmm"], plain["addmm"] + 1,
                                                                    plain["addmm"] + 3)
    assert selective["tanh"] == per_op["tanh"] == full["tanh"] == plain["tanh"] + 4
    assert all(torch.equal(a, b) for _, again in others for a, b in zip(grads, again))


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops that run, by overload-packet name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_selective_recomputation_costs_less_and_frees_less() -> None:
    spec = _spec("gpt2")
    by_policy = {policy: plan_model(spec, PlanOptions(2, "cpu", pipeline=False, mesh=(2,), recompute=policy))
                 for policy in ("none", "selective", "op", "all")}
    kept, selective, per_op, full = (by_policy[p].predicted for p in ("none", "selective", "op", "all"))
    assert {r.mode for r in by_policy["selective"].recompute} == {"selective"}
    assert {r.mode for r in by_policy["op"].recompute} == {"op"}
    # the per-op policy (every other matrix product kept) lies between the two
    assert kept.compute_s < selective.compute_s < per_op.compute_s < full.compute_s
    assert full.memory_bytes.activations < per_op.memory_bytes.activations < selective.memory_bytes.activations \
        < kept.memory_bytes.activations
    assert "1 selectively" not in summary_text(by_policy["selective"])
    assert "all selectively" in summary_text(by_policy["selective"])
    assert "all by the per-op policy" in summary_text(by_policy["op"])


def test_search_recomputes_selectively_first_and_fully_where_that_is_not_enough() -> None:
    """On one device, where no sharding can trim a plan (on two, trimming meets these budgets
    first, and the window where selective recomputation is the next step depends on the
    search's estimates of both)."""
    spec = _spec("llama")
    one_stage = {"stages": 1, "microbatches": 1}
    peaks = {policy: plan_model(spec, PlanOptions(1, "cpu", recompute=policy, **one_stage))
             .predicted.memory_bytes.peak_with_transient for policy in ("selective", "all")}
    # budgets in steps below what selective recomputation alone needs, each met within it at the
    # peak (the backward's transients included): the looser ones by recomputing selectively, the
    # tightest by recomputing fully, which frees more
    modes = []
    for share in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55):
        budget = share * peaks["selective"]
        try:
            plan = plan_model(spec, PlanOptions(1, "cpu", memory_per_device=budget, **one_stage))
        except MemoryInfeasibleError:
            break
        assert plan.predicted.memory_bytes.peak_with_transient <= budget
        modes.append({r.mode for r in plan.recompute})
    assert {"selective"} in modes, modes
    assert "full" in modes[-1] and peaks["all"] < peaks["selective"], modes


def _beyond_sharding(name: str) -> tuple[Plan, float]:
    """The largest budget (a share of what the fastest plan needs) that no plan of the whole
    batch on one stage meets without recomputation, and the search's one-stage, whole-batch
    plan under it."""
    spec = _spec(name)
    fastest = plan_model(spec, PlanOptions(2, "cpu", stages=1, microbatches=1))
    assert not fastest.recompute
    for share in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3):
        budget = share * fastest.predicted.memory_bytes.peak_with_transient
        try:
            plan_model(spec, PlanOptions(2, "cpu", pipeline=False, memory_per_device=budget))
        except MemoryInfeasibleError:
            return plan_model(spec, PlanOptions(2, "cpu", stages=1, microbatches=1, memory_per_device=budget)), budget
    raise AssertionError(f"{name}: sharding met every budget tried")


@pytest.fixture(scope="module")
def chosen() -> tuple[Plan, float]:
    return _beyond_sharding("llama")


def test_search_recomputes_where_sharding_alone_does_not_fit(chosen: tuple[Plan, float]) -> None:
    plan, budget = chosen
    assert plan.recompute and len(plan.stages) == 1 and plan.microbatches == 1
    assert plan.predicted.memory_bytes.peak_with_transient <= budget
    assert "activation checkpointing: " in summary_text(plan)


def test_recomputing_programs_pass_check_on_2_processes(chosen: tuple[Plan, float], tmp_path) -> None:
    plans = {
        "llama chosen": ("llama", chosen[0]),
        "llama all": ("llama", plan_model(_spec("llama"), PlanOptions(2, "cpu", stages=1, recompute=True))),
        "gpt2 all": ("gpt2", plan_model(_spec("gpt2"), PlanOptions(2, "cpu", stages=1, recompute=True))),
        "llama 2 stages": ("llama", plan_model(_spec("llama"), PlanOptions(2, "cpu", stages=2, recompute=True))),
        "gpt2 selective": ("gpt2", plan_model(_spec("gpt2"), PlanOptions(2, "cpu", stages=1, recompute="selective"))),
        "llama 2 stages selective": ("llama", plan_model(_spec("llama"), PlanOptions(2, "cpu", stages=2,
                                                                                      recompute="selective"))),
        "gpt2 op": ("gpt2", plan_model(_spec("gpt2"), PlanOptions(2, "cpu", stages=1, recompute="op"))),
        "llama 2 stages op": ("llama", plan_model(_spec("llama"), PlanOptions(2, "cpu", stages=2, recompute="op"))),
    }
    assert all(plan.recompute for _, plan in plans.values())
    assert all(r.mode == "selective" for name, (_, plan) in plans.items() if name.endswith("selective")
               for r in plan.recompute)
    assert all(r.mode == "op" for name, (_, plan) in plans.items() if name.endswith(" op") for r in plan.recompute)
    write_check_cases(tmp_path, plans)
    assert_checks_passed(launch_worker(ROOT / "tests" / "check_worker.py", 2, tmp_path, timeout=600), plans)


def test_recomputing_programs_pass_check_on_4_processes(tmp_path) -> None:
    options = PlanOptions(4, "cpu", stages=1, microbatches=1, mesh=(2, 2), recompute=True, memory_per_device="1.4MB")
    mesh_2x2 = plan_model(_spec("gpt2"), options)
    assert any(c.where.endswith("(recomputed)") for c in mesh_2x2.collectives)  # sharded inside a layer
    selective_2x2 = plan_model(_spec("gpt2"), replace(options, recompute="selective", memory_per_device="1.4MB"))
    assert any(c.where.endswith("(recomputed)") for c in selective_2x2.collectives)
    plans = {
        "gpt2 2x2": ("gpt2", mesh_2x2),
        "gpt2 2x2 selective": ("gpt2", selective_2x2),
        "llama 2 stages x 2": ("llama", plan_model(_spec("llama"), PlanOptions(4, "cpu", stages=2, mesh=(2,),
                                                                                recompute=True))),
    }
    write_check_cases(tmp_path, plans)
    assert_checks_passed(launch_worker(ROOT / "tests" / "check_worker.py", 4, tmp_path, timeout=600), plans)
