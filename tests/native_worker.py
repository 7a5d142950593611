"""One rank of the native-API checks (tests/test_native.py launches it).

    python -m torch.distributed.run --nproc-per-node 2 tests/native_worker.py OUT_DIR CASE [CASE ...]

For every case: read its plan, ``OUT_DIR/NAME.json`` (the test planned it once with
:func:`plan_case`; the meta-device and resumed cases plan on every rank), build the ParallelModule with
``build_parallel_module`` (native preferred), record which program ran it (DDP, parallelize_module or
the DTensor interpreter) and compare it with the single device through
``check_against_single_device`` (loss, outputs, every gradient, loss after 2 SGD steps; fp32,
rtol 1e-4). Each rank writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))

from autoplan.codegen.dtensor_program import planned_collectives
from dataclasses import replace

from autoplan.codegen.check import check_against_single_device, reduced_on_edge
from autoplan.codegen.precision import check_tolerances
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.trace.microbatch import microbatch_inputs
from autoplan.trace.tracer import trace
from autoplan.codegen.native import NativeProgram, recognise
from autoplan.codegen.native_accumulation import AccumulatedProgram
from autoplan.codegen.runtime import init_distributed, build_parallel_module
from autoplan.planner.api import make_options, plan_spec
from autoplan.load import make_model_spec


def _sum_loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((output - x) ** 2).sum()


# name -> (example module, build kwargs, memory_per_device, loss override, expected kind)
CASES: dict[str, tuple[str, dict, float | None, object, str]] = {
    # Megatron, the row output all-reduced (Replicate)
    "mlp_megatron_allreduce": ("mlp", {"hidden": 1024, "batch": 8, "seq": 16}, None, None, "tensor_parallel"),
    # Megatron, the row output reduce-scattered on the sequence dim
    "mlp_megatron_rs_seq": ("mlp", {"hidden": 512, "batch": 4, "seq": 512}, None, None, "tensor_parallel"),
    # pure data parallelism -> DDP
    "mlp_dp": ("mlp", {"hidden": 64, "batch": 64, "seq": 128}, None, None, "ddp"),
    # data parallel, but the loss is a sum: DDP's average would be wrong -> the interpreter
    "mlp_dp_sum_loss": ("mlp", {"hidden": 64, "batch": 64, "seq": 128}, None, _sum_loss, "none"),
    # GPT with a sharded tied embedding and attention: not a native pattern -> the interpreter
    "gpt_sharded": ("gpt", {"hidden": 64, "layers": 2, "heads": 4, "seq": 32, "vocab": 256, "batch": 8}, 2.76e6, None,
                    "none"),
}

def _residual_blocks():
    import residual_blocks

    return (*residual_blocks.build(), residual_blocks.loss_fn)


def _residual_blocks_wide():
    import residual_blocks

    return (*residual_blocks.build(hidden=256, batch=16, seq=64), residual_blocks.loss_fn)


def _llama_ignored_tokens():
    """A Hugging Face Llama whose labels ignore (-100) most tokens of the first two sequences:
    the two ranks' halves of the batch hold different numbers of counted tokens."""
    import llama

    model, inputs = llama.build(batch=4, seq=64, vocab=1024)  # logits worth sharding the loss over
    labels = inputs["input_ids"].clone()
    labels[:2, :40] = -100
    return model, {"input_ids": inputs["input_ids"], "labels": labels}, None


def _nanogpt():
    import fsdp_cases

    return fsdp_cases.nanogpt()


def _llama():
    import llama

    return (*llama.build(batch=4, seq=64, vocab=1024), None)  # logits worth sharding the loss over


def _gpt2_positions():
    """A Hugging Face GPT-2 called by keyword, its loss from the labels: its learned position
    table's rows are the same on every rank, added to the batch-sharded tokens."""
    import gpt2

    model, (ids,) = gpt2.build(batch=4, seq=64, vocab_size=1024)  # logits worth sharding the loss over
    return model, {"input_ids": ids, "labels": ids}, None


def _llama_wide(batch: int = 4):
    import llama

    return (*llama.build(hidden=256, intermediate=512, batch=batch, seq=64, vocab=4096), None)


BUILDERS = {"residual_blocks": _residual_blocks, "llama_ignored_tokens": _llama_ignored_tokens, "nanogpt": _nanogpt,
            "llama": _llama, "llama_wide": _llama_wide, "gpt2_positions": _gpt2_positions, "residual_blocks_wide": _residual_blocks_wide,
            # microbatches of 4 sequences, each split over both axes of a 2x2 mesh
            "llama_wide_batch8": lambda: _llama_wide(batch=8)}

# name -> (builder, --manual plan, expected kind): written plans of the memory dimensions
MANUAL_CASES: dict[str, tuple[str, str, str]] = {
    "blocks_fsdp": ("residual_blocks", "fsdp={world}", "fsdp"),
    "blocks_fsdp_checkpointed": ("residual_blocks", "fsdp={world},ac=full", "fsdp"),
    "blocks_fsdp_selective": ("residual_blocks", "fsdp={world},ac=selective", "fsdp"),
    "blocks_fsdp_bf16": ("residual_blocks", "fsdp={world},ac=full,precision=bf16", "fsdp"),
    "blocks_ddp_checkpointed": ("residual_blocks", "dp={world},ac=full", "ddp"),
    # gradient accumulation: each microbatch through the native program, DDP and FSDP2 told the last
    "blocks_fsdp_accumulated": ("residual_blocks", "fsdp={world},microbatches=2", "fsdp"),
    "llama_ddp_accumulated": ("llama", "dp={world},microbatches=2", "ddp"),
    "llama_ddp_ignored_tokens_accumulated": ("llama_ignored_tokens", "dp={world},microbatches=2", "ddp"),
    "llama_zero2_accumulated": ("llama", "dp={world},zero=2,microbatches=2", "fsdp"),
    "llama_fsdp_accumulated_checkpointed_bf16": ("llama", "fsdp={world},microbatches=2,ac=full,precision=bf16",
                                                 "fsdp"),
    # ZeRO-1 accumulates whole gradients and reduce-scatters them at the step: the interpreter
    "llama_zero1_accumulated": ("llama", "dp={world},zero=1,microbatches=2", "none"),
    # cross-entropy averaged over the global batch's counted tokens
    "llama_fsdp_ignored_tokens": ("llama_ignored_tokens", "fsdp={world},ac=full", "fsdp"),
    "llama_ddp_ignored_tokens": ("llama_ignored_tokens", "dp={world}", "ddp"),
    # the gradient of the position table's rows all-reduced on its edge in the plan, in the
    # table's gradient by DDP's buckets (the same sum)
    "gpt2_positions_ddp": ("gpt2_positions", "dp={world}", "ddp"),
    # ... and by FSDP2's reduce-scatter of the table's gradient; the rows looked up whole in the
    # gathered table, as FSDP2 runs the model
    "gpt2_positions_fsdp": ("gpt2_positions", "fsdp={world}", "fsdp"),
    # a Hugging Face Llama's blocks checkpointed three ways (its key-value cache turned off)
    "llama_fsdp": ("llama", "fsdp={world}", "fsdp"),
    "llama_fsdp_checkpointed": ("llama", "fsdp={world},ac=full", "fsdp"),
    "llama_fsdp_selective": ("llama", "fsdp={world},ac=selective", "fsdp"),
    "llama_fsdp_per_op": ("llama", "fsdp={world},ac=op", "fsdp"),
    "llama_fsdp_per_op_bf16": ("llama", "fsdp={world},ac=op,precision=bf16", "fsdp"),  # torchtitan's 8B recipe
    "llama_ddp_per_op": ("llama", "dp={world},ac=op", "ddp"),
    # ZeRO-2: FSDP2 holding a group's gathered parameters from its forward through its backward
    "llama_zero2": ("llama", "dp={world},zero=2", "fsdp"),
    "llama_zero2_per_op_bf16": ("llama", "dp={world},zero=2,ac=op,precision=bf16", "fsdp"),
    "blocks_zero2_checkpointed": ("residual_blocks", "dp={world},zero=2,ac=full", "fsdp"),
    # ZeRO-1 (a whole gradient reduce-scattered once per step): the interpreter
    "llama_zero1": ("llama", "dp={world},zero=1", "none"),
    # nanoGPT's loss (a token mean: ignore_index=-1) on each rank's own samples, its head tied
    # to its token table
    "nanogpt_fsdp": ("nanogpt", "fsdp={world}", "fsdp"),
}
# name -> (builder, pins, expected kind): the search's plans on H100s under pins: the blocks'
# weights stored sharded and gathered at use, the rest (biases, norms, embedding, head) left
# replicated by the planner, every op on the batch's shards
_MIXED = ("x=[S(0)]", "blocks.*.up.weight=fsdp", "blocks.*.down.weight=fsdp", "linear*=[S(0)]", "sub=[S(0)]")
PINNED_CASES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "blocks_fsdp_mixed": ("residual_blocks_wide", _MIXED, "fsdp"),
    "blocks_fsdp_mixed_checkpointed_bf16": ("residual_blocks_wide", (*_MIXED, "blocks.*=checkpoint"), "fsdp"),
    "blocks_fsdp_mixed_accumulated": ("residual_blocks_wide", (*_MIXED, "stages=1", "microbatches=2"), "fsdp"),
    # the down projections stored sharded on dim 1 (FSDP2's shard_placement_fn), gathered at use
    "blocks_fsdp_mixed_dim1": ("residual_blocks_wide", (*_MIXED[:2], "blocks.*.down.weight=[S(1)]", *_MIXED[3:]),
                               "fsdp"),
}
# the form the search finds for Llama at real size on a node of H100s, pinned on a small one: the
# blocks' weights FSDP, the embedding table read in place (hidden- or vocabulary-parallel, the ids
# whole), the head and the last norm ZeRO-2, the blocks' norms whole
_TABLE_HIDDEN = ("input_ids=[R]", "labels=[S(0)]", "model.embed_tokens.weight=[S(1)]", "embedding=[S(2)]",
                 "to_6=[S(0)]", "model.layers.*.*_proj.weight=fsdp", "linear*=[S(0)]", "cross_entropy_loss=[P]",
                 "lm_head.weight=zero2", "model.norm.weight=zero2")
_TABLE_VOCABULARY = (*_TABLE_HIDDEN[:2], "model.embed_tokens.weight=[S(0)]", "embedding=[P]", *_TABLE_HIDDEN[4:])
FOUND_FORM_CASES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "llama_table_hidden_zero2_head": ("llama_wide", _TABLE_HIDDEN, "fsdp"),
    "llama_table_vocabulary_checkpointed_bf16": ("llama_wide", (*_TABLE_VOCABULARY, "model.layers.*=checkpoint"),
                                                 "fsdp"),
    "llama_table_hidden_accumulated": ("llama_wide", (*_TABLE_HIDDEN, "stages=1", "microbatches=2"), "fsdp"),
}
# the same form on 2 nodes (2 devices each here), as the search finds it for Llama-7B's shape on 2
# nodes of 8 H100s: HSDP blocks, the head and last norm ZeRO-2 under HSDP, the table stored over
# both axes (gathered over the nodes, read in place within one), the ids whole within a node
_NODES_TABLE = ("input_ids=[S(0), R]", "labels=[S(0), S(0)]", "model.embed_tokens.weight=[S(0), S(1)]",
                "embedding=[S(0), S(2)]", "to_6=[S(0), S(0)]", "model.layers.*.*_proj.weight=[R, S(0)]",
                "linear*=[S(0), S(0)]", "cross_entropy_loss=[P, P]", "lm_head.weight=zero2", "model.norm.weight=zero2")
NODES_FOUND_FORM_CASES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "llama_nodes_table_hidden": ("llama_wide", _NODES_TABLE, "hsdp"),
    "llama_nodes_table_checkpointed_bf16": ("llama_wide", (*_NODES_TABLE, "model.layers.*=checkpoint"), "hsdp"),
}
# ... with 2 microbatches accumulated: the planner then stores the blocks' gradients sharded over
# both axes (ZeRO-2 over the nodes on top of HSDP: reduce-scattered within a node and all-reduced
# between the nodes after every microbatch), which has no FSDP2 form: the interpreter runs it
NODES_INTERPRETED_CASES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "llama_nodes_table_accumulated": ("llama_wide_batch8", (*_NODES_TABLE, "stages=1", "microbatches=2"), "none"),
}
# cases for 4 processes: HSDP on a 2x2 mesh (FSDP2's fully_shard on a 2-D mesh)
HSDP_CASES: dict[str, tuple[str, str, str]] = {
    "blocks_hsdp": ("residual_blocks", "dp=2,fsdp=2", "hsdp"),
    "blocks_hsdp_checkpointed_bf16": ("residual_blocks", "dp=2,fsdp=2,ac=full,precision=bf16", "hsdp"),
    "llama_hsdp_ignored_tokens": ("llama_ignored_tokens", "dp=2,fsdp=2,ac=full", "hsdp"),
    "llama_hsdp_per_op": ("llama", "dp=2,fsdp=2,ac=op", "hsdp"),
    "blocks_hsdp_accumulated": ("residual_blocks", "dp=2,fsdp=2,microbatches=2", "hsdp"),
    # FSDP x TP on a 2x2 mesh, as torchtitan composes them
    "llama_fsdp_tp": ("llama", "fsdp=2,tp=2", "fsdp_tp"),
    "llama_fsdp_tp_checkpointed": ("llama", "fsdp=2,tp=2,ac=full", "fsdp_tp"),
    "llama_fsdp_tp_per_op_bf16": ("llama", "fsdp=2,tp=2,ac=op,precision=bf16", "fsdp_tp"),
    "llama_fsdp_tp_selective": ("llama", "fsdp=2,tp=2,ac=selective", "fsdp_tp"),
    "llama_fsdp_tp_accumulated": ("llama", "fsdp=2,tp=2,microbatches=2", "fsdp_tp"),
    # ... with the norms and the residual stream sharded on the sequence (Megatron's sequence parallelism)
    "llama_fsdp_tp_sequence": ("llama_wide", "fsdp=2,tp=2", "fsdp_tp"),
}
# cases for one process: the plan of one device runs the model itself
SINGLE_CASES: dict[str, tuple[str, str, str]] = {
    "blocks_single_checkpointed": ("residual_blocks", "dp=1,ac=full", "single"),
    "blocks_single_bf16": ("residual_blocks", "dp=1,ac=full,precision=bf16", "single"),
}


def _manual_plan(spec, text: str, world: int) -> Plan:
    options = PlanOptions(world, "cpu", plan_only=True)
    manual = parse_manual(text)
    if manual.precision:
        options = replace(options, precision=manual.precision)
    return with_decisions(plan_manual(spec, options.planner_options(), manual), options)


class _MatmulCounter(TorchDispatchMode):
    """Counts the matrix products that run (those a selective checkpoint returns from its
    cache do not reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _calls_per_step(pm, module_name: str, inputs) -> tuple[int, str, int]:
    """How often ``module_name`` of the program's model runs in one forward and backward
    (twice where its layer is recomputed), the dtype of its output (bf16 under autocast), and
    how many matrix products the step runs."""
    calls: list[str] = []
    handle = pm.program.user_module.get_submodule(module_name).register_forward_hook(
        lambda module, args, output: calls.append(str(output.dtype)))
    with _MatmulCounter() as counter:
        pm.forward_backward(*inputs)
    handle.remove()
    return len(calls), calls[0], counter.count


def _whole_after_forward(pm, inputs) -> int:
    """How many of the program's parameters are whole (gathered, not FSDP's DTensor shards)
    between a forward and its backward: FSDP2 holds only the root's, ZeRO-2 every group's."""
    loss = pm(*inputs).loss
    whole = sum(not isinstance(p, DTensor) for p in pm.program.user_module.parameters())
    loss.backward()
    return whole


# name -> (pins or --manual text, expected kind): a meta-device model's replicas must start equal
META_CASES: dict[str, tuple[tuple[str, ...] | str, str]] = {
    "blocks_fsdp_mixed_meta": (_MIXED, "fsdp"),  # 2 processes: replicate's whole parameters
    "blocks_hsdp_meta": ("dp=2,fsdp=2", "hsdp"),  # 4 processes: HSDP's shards over its replicate axis
    # 2 processes: the search's real-size form, its table read in place a DTensor from the start
    "llama_table_hidden_meta": (_TABLE_HIDDEN, "fsdp"),
}


def run_meta_case(name: str, world: int) -> dict:
    """Plan residual blocks built on the meta device, build the program (its shards allocated and
    initialised by the model's own initialiser), and compare every parameter across the ranks:
    each whole value (``full_tensor``) must be the same everywhere."""
    import residual_blocks

    how, expected = META_CASES[name]
    if name.startswith("llama"):
        import llama

        model, inputs = llama.build(hidden=256, intermediate=512, batch=4, seq=64, vocab=4096, device="meta")
        spec = make_model_spec(model, inputs)
    else:
        _, inputs = residual_blocks.build(hidden=256, batch=16, seq=64)
        with torch.device("meta"):
            model = residual_blocks.ResidualBlocks(16, 256, 3)
        spec = make_model_spec(model, tuple(x.to("meta") for x in inputs), residual_blocks.loss_fn)
    torch.manual_seed(1000 + dist.get_rank())  # each rank's own generator, as a script's ranks may start
    if isinstance(how, str):
        plan = _manual_plan(spec, how, world)
    else:
        plan = plan_model(spec, PlanOptions(world, "h100", mesh=(world,), pipeline=False, plan_only=True, pins=how))
    pm = build_parallel_module(spec, plan, graph=trace(spec))
    differ = []
    for fqn, param in sorted(pm.named_plan_parameters().items()):
        whole = (param.full_tensor() if isinstance(param, DTensor) else param).detach().contiguous()
        first = whole.clone()
        dist.broadcast(first, src=0)
        same = torch.tensor([float(torch.equal(first, whole))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            differ.append(fqn)
    return {"expected": expected, "program": getattr(pm.program, "kind", "none"), "description": pm.description,
            "replicas_differ": differ, "num_parameters": len(pm.named_plan_parameters())}


PINNED_PLANS = {**PINNED_CASES, **FOUND_FORM_CASES, **NODES_FOUND_FORM_CASES, **NODES_INTERPRETED_CASES}


def _pinned_plan(name: str, world: int) -> tuple:
    """The spec and plan of a pinned case."""
    module_name, pins, _ = PINNED_PLANS[name]
    spec = make_model_spec(*BUILDERS[module_name]())
    precision = "bf16" if name.endswith("bf16") else "fp32"
    across = name in NODES_FOUND_FORM_CASES or name in NODES_INTERPRETED_CASES
    nodes = dict(devices_per_node=2, mesh=(2, 2)) if across else dict(mesh=(world,))
    plan = plan_model(spec, PlanOptions(world, "h100", pipeline="stages=1" in pins, plan_only=True, pins=pins,
                                        precision=precision, **nodes))
    return spec, plan


# a checkpoint written by the native program of a found-form case, resumed by the interpreter
# running the same plan (and the other way round): name -> the case
RESUMED_CASES: dict[str, str] = {
    "llama_table_hidden_resumed": "llama_table_hidden_zero2_head",
    "llama_nodes_table_resumed": "llama_nodes_table_hidden",
}


def _step(pm, feed) -> float:
    loss = pm.forward_backward(*feed.next_batch())
    pm.optimizer_step()
    return float(loss)


def _whole_parameters(pm) -> dict[str, torch.Tensor]:
    return {fqn: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for fqn, p in pm.named_plan_parameters().items()}


def run_resumed_case(name: str, world: int) -> dict:
    """Two steps natively, a checkpoint after the first (DCP) resumed by the DTensor interpreter
    under the same plan, then a checkpoint of the interpreter after its second step resumed by a
    fresh native program: each resumed program's next step must equal the one it continues
    (loss, every parameter), so parameters and optimizer states travel between the native form
    (FSDP2 shards, ZeRO-2 groups, ``replicate``, the style's table) and the plan's placements."""
    import shutil
    import tempfile

    from autoplan.codegen.runtime import build_parallel_module
    from autoplan.codegen.training_checkpoint import TrainingCheckpoints
    from autoplan.data import BatchFeed

    spec, plan = _pinned_plan(RESUMED_CASES[name], world)
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches)))
    folders = [tempfile.mkdtemp(prefix="resumed-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(folders, src=0)
    first, second = Path(folders[0]) / "native", Path(folders[0]) / "interpreter"

    def program(native: bool, folder: Path, resume: bool):
        pm = build_parallel_module(spec, plan, graph=graph, prefer_native=native)
        feed = BatchFeed(spec, None)
        checkpoints = TrainingCheckpoints(folder, pm, spec.module)
        info = checkpoints.resume(feed) if resume else None
        return pm, feed, checkpoints, info

    native, feed, checkpoints, _ = program(True, first, False)
    losses = [_step(native, feed)]
    checkpoints.save(1, feed)
    losses.append(_step(native, feed))
    after_native = _whole_parameters(native)
    resumed, resumed_feed, _, info = program(False, first, True)
    resumed_losses = [_step(resumed, resumed_feed)]
    after_resumed = _whole_parameters(resumed)
    TrainingCheckpoints(second, resumed, spec.module).save(2, resumed_feed)
    losses.append(_step(resumed, resumed_feed))
    after_interpreter = _whole_parameters(resumed)
    again, again_feed, _, again_info = program(True, second, True)
    resumed_losses.append(_step(again, again_feed))
    after_again = _whole_parameters(again)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folders[0], ignore_errors=True)

    def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)) for k in a)

    return {"programs": [getattr(p.program, "kind", "none") for p in (native, resumed, again)],
            "resumed_steps": [info.step if info else None, again_info.step if again_info else None],
            "losses": losses, "resumed_losses": resumed_losses,
            "worst_after_native": worst(after_resumed, after_native),
            "worst_after_interpreter": worst(after_again, after_interpreter),
            "num_parameters": len(after_native)}


def _case_spec(name: str) -> tuple[str, str, object]:
    """(example module, expected program kind, spec) of a case planned by :func:`plan_case`."""
    if name in CASES:
        module_name, kwargs, _, loss_override, expected = CASES[name]
        module = __import__(module_name)
        model, inputs = module.build(**kwargs)
        return module_name, expected, make_model_spec(model, inputs, loss_override or module.loss_fn)
    module_name, _, expected = {**PINNED_PLANS, **MANUAL_CASES, **HSDP_CASES, **SINGLE_CASES}[name]
    return module_name, expected, make_model_spec(*BUILDERS[module_name]())


def plan_case(name: str, world: int) -> Plan:
    """The plan of a case that is not a meta-device or resumed one, on ``world`` processes."""
    if name in CASES:
        memory = CASES[name][2]
        return plan_spec(_case_spec(name)[2], make_options(world, "h100", (world,), memory_per_device=memory))[0]
    if name in PINNED_PLANS:
        _, plan = _pinned_plan(name, world)
        return plan
    text = {**MANUAL_CASES, **HSDP_CASES, **SINGLE_CASES}[name][1]
    return _manual_plan(_case_spec(name)[2], text.format(world=world), world)


def planned_here(name: str) -> bool:
    """Whether the case plans on every rank (the meta-device and resumed ones) rather than
    reading the plan :func:`plan_case` made."""
    return name in META_CASES or name in RESUMED_CASES


def run_case(name: str, world: int, out_dir: Path) -> dict:
    if name in META_CASES:
        return run_meta_case(name, world)
    if name in RESUMED_CASES:
        return run_resumed_case(name, world)
    module_name, expected, spec = _case_spec(name)
    model, inputs = spec.module, spec.example_inputs
    plan = Plan.load(out_dir / f"{name}.json")
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches)))
    found = recognise(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches)), graph, plan)
    before = {k: v.detach().clone() for k, v in spec.module.state_dict().items()}
    pm = build_parallel_module(spec, plan, graph=graph)
    untouched = all(torch.equal(before[k], v) for k, v in spec.module.state_dict().items())
    program = pm.program
    kind = program.kind if isinstance(program, (NativeProgram, AccumulatedProgram)) else "none"
    rtol, atol = check_tolerances(plan.precision)
    report = check_against_single_device(spec, pm, steps=2, rtol=rtol, atol=atol)
    native = isinstance(program, NativeProgram)
    block_calls, block_dtype, matmuls = _calls_per_step(pm, "blocks.0.up", inputs) \
        if native and module_name == "residual_blocks" else \
        _calls_per_step(pm, "model.layers.0.mlp.up_proj", inputs) if native and module_name == "llama" else (0, "", 0)
    whole_after_forward = _whole_after_forward(pm, inputs) if native and kind in ("fsdp", "hsdp") else 0
    observable = ({p: program.observable_collectives(p) for p in ("forward", "backward")}
                  if isinstance(program, NativeProgram) else report.planned)
    return {
        "expected": expected,
        "recognised": found.kind,
        "reason": found.reason,
        "program": kind,
        "styles": {k: [v[0], str(v[1])] for k, v in found.styles.items()},
        "params": plan.params,
        "inputs": plan.inputs,
        "values_ok": report.values_ok,
        "worst": [report.worst.name, report.worst.max_abs_diff, report.worst.allowed],
        "num_compared": len(report.comparisons),
        "num_model_parameters": len(list(model.parameters())),
        "bad": [[c.name, c.max_abs_diff, c.allowed] for c in report.comparisons if not c.ok],
        "executed": report.executed,
        "moved": report.moved,
        "planned": report.planned,  # what check.py expects the program to run
        "planned_by_plan": {p: planned_collectives(plan, p) for p in ("forward", "backward", "optimizer")},
        "whole_after_forward": whole_after_forward,
        "description": pm.description,
        "microbatches": plan.microbatches,
        "observable": observable,
        "collective_map": [[m.planned, m.native, m.observable] for m in getattr(program, "collective_map", [])],
        "module_untouched": untouched,
        "recomputed_layers": [r.layer for r in plan.recompute],
        "recompute_modes": [r.mode for r in plan.recompute],
        "matmuls_per_step": matmuls,
        "precision": plan.precision.name,
        "fsdp_groups": getattr(getattr(program, "program", program), "fsdp_groups", 0),
        "replicate_groups": getattr(getattr(program, "program", program), "replicate_groups", 0),
        "held_groups": getattr(getattr(program, "program", program), "held_groups", 0),
        "table_groups": getattr(getattr(program, "program", program), "table_groups", 0),
        "storage": {fqn: s.param for fqn, s in plan.storage.items()},
        "program_placements": {fqn: [str(q) for q in p.placements] for fqn, p in pm.named_plan_parameters().items()
                               if isinstance(p, DTensor)},
        "token_mean": getattr(program, "token_mean", False),
        # the gradient all-reduces of parameters whose gradient is stored sharded unlike them (ZeRO-2)
        "zero2_all_reduces": [{"where": c.where, "count": c.count, "bucketed": c.bucketed} for c in plan.collectives
                              if c.kind == "all_reduce" and reduced_on_edge(c, plan)],
        "block_calls_per_step": block_calls,
        "block_output_dtype": block_dtype,
        "report": report.text(),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    names = sys.argv[2:]
    ctx = init_distributed()
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for name in names:
        try:
            results[name] = run_case(name, ctx.world_size, out_dir)
        except Exception as e:  # noqa: BLE001 -- recorded, so the test names the failing case
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        dist.barrier()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
