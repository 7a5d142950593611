"""Frozen parameters (``requires_grad=False``: Whisper's positional table, the lower blocks of a
model fine-tuned from the top): no gradient, no optimizer state, no gradient reduction in the
plan, and blocks whose weights are frozen are not copies of blocks whose weights are trained.
(Whisper's plan forced to shard weights passes ``--check`` in tests/test_zoo.py: planned as
trained, its frozen table's gradient was a collective the program never ran.)"""

from __future__ import annotations

import pytest
import torch

import autoplan
from autoplan.codegen.program_choice import ProgramKind, program_choice
from autoplan.load import make_model_spec
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.mesh_plan import GraphView
from autoplan.planner.options import PlanOptions
from autoplan.trace.repeated import find_classes
from autoplan.trace.tracer import trace
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 4, frozen: int = 0) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        for block in self.blocks[:frozen]:
            block.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _spec(frozen: int, width: int = 16, batch: int = 16):
    torch.manual_seed(0)
    return make_model_spec(_Stack(width, frozen=frozen), (torch.randn(batch, width),), _loss,
                           name=f"stack, {frozen} frozen")


def half_frozen_stack() -> tuple[torch.nn.Module, tuple[torch.Tensor], object]:
    """The check worker's builder: four blocks, the lower two frozen."""
    spec = _spec(frozen=2, width=16, batch=32)
    return spec.module, spec.example_inputs, _loss


def up_frozen_stack() -> tuple[torch.nn.Module, tuple[torch.Tensor], object]:
    """The check worker's builder: four blocks, each with its up-projection frozen."""
    spec = _spec(frozen=0, width=16, batch=32)
    for block in spec.module.blocks:
        block.up.requires_grad_(False)
    return spec.module, spec.example_inputs, _loss


def test_frozen_parameters_need_no_gradient_and_their_blocks_are_not_copies_of_trained_ones() -> None:
    graph = trace(_spec(frozen=2))
    view = GraphView.of(graph)
    trained = {graph.param_names[n]: view.needs_grad[n] for n, info in graph.nodes.items() if info.kind == "parameter"}
    assert trained == {f"blocks.{b}.{lin}.{p}": b >= 2 for b in range(4) for lin in ("up", "down")
                       for p in ("weight", "bias")}
    classes = find_classes(graph)
    ups = [n for n, info in graph.nodes.items() if info.target == "aten.linear.default"][::2]
    assert classes.class_of[ups[0]] == classes.class_of[ups[1]] != classes.class_of[ups[2]] \
        == classes.class_of[ups[3]]
    assert graph.same_as(graph) and not graph.same_as(trace(_spec(frozen=0)))  # same ops, other training


def test_a_plan_reduces_and_keeps_state_only_for_trained_parameters() -> None:
    """Data parallel on two H100s (a batch large enough for it): with the lower two of four
    blocks frozen, only the upper blocks' gradients are all-reduced, and gradients and
    optimizer state take half the memory."""
    plans = {}
    for frozen in (0, 2):
        spec = _spec(frozen, width=64, batch=4096)
        plans[frozen] = autoplan.plan(spec.module, spec.example_inputs, loss_fn=_loss, devices=2, cluster="h100",
                                      pipeline=False, native_rivals=False, plan_only=True)
    reduced = {frozen: {c.where.split(" -> ")[0] for c in plan.collectives if c.tensor == "gradient"}
               for frozen, plan in plans.items()}
    assert reduced[0] and reduced[2]  # (listed by each class's first block)
    assert all(name.startswith(("blocks.2.", "blocks.3.")) for name in reduced[2]), reduced[2]
    memory = {frozen: plan.predicted.memory_bytes for frozen, plan in plans.items()}
    assert memory[2].optimizer == pytest.approx(memory[0].optimizer / 2)
    assert memory[2].grads == pytest.approx(memory[0].grads / 2)


def test_programs_with_frozen_parameters_pass_check(tmp_path) -> None:
    """On 2 gloo processes: the default plan and FSDP (``--manual fsdp=2``) of the stack whose
    lower blocks are frozen, and FSDP of the one whose up-projections are frozen: outputs,
    loss, every gradient and the collectives as planned. Where a block's parameters are all
    frozen, FSDP2 would reduce no gradient for its group and gather it in the backward only
    where gradients flow through it: that plan runs on the DTensor interpreter, and says why;
    where every group trains some parameter, FSDP2 runs it."""
    options = PlanOptions(2, "cpu")
    specs = {name: make_model_spec(*builder(), name=name)
             for name, builder in (("half_frozen_stack", half_frozen_stack), ("up_frozen_stack", up_frozen_stack))}
    fsdp = {name: with_decisions(plan_manual(spec, options.planner_options(), parse_manual("fsdp=2")), options)
            for name, spec in specs.items()}
    plans = {"half frozen, default": ("half_frozen_stack", plan_model(specs["half_frozen_stack"], options)),
             "half frozen, fsdp": ("half_frozen_stack", fsdp["half_frozen_stack"]),
             "up frozen, fsdp": ("up_frozen_stack", fsdp["up_frozen_stack"])}
    assert not any(c.where.startswith(("blocks.0.", "blocks.1.")) for c in fsdp["half_frozen_stack"].collectives
                   if c.tensor == "gradient")
    programs = {name: program_choice(spec, trace(spec), fsdp[name]) for name, spec in specs.items()}
    assert programs["half_frozen_stack"].kind == ProgramKind.INTERPRETER
    assert "frozen parameters" in programs["half_frozen_stack"].line()
    assert programs["up_frozen_stack"].kind == ProgramKind.NATIVE, programs["up_frozen_stack"].line()
    for name, spec in specs.items():
        fsdp[name].program = programs[name].line()
    write_check_cases(tmp_path, plans, {"half_frozen_stack": "test_frozen_parameters.py",
                                        "up_frozen_stack": "test_frozen_parameters.py"})
    results = launch_worker(ROOT / "tests" / "check_worker.py", 2, tmp_path, timeout=420)
    assert_checks_passed(results, plans)
