"""Which program runs the plan the search finds at real size: one of PyTorch's own (DDP, FSDP2,
HSDP, FSDP x TP, Megatron styles) or autoplan's DTensor interpreter, and why.

    .venv/bin/python benchmarks/native_coverage.py [--case NAME ...]
    .venv/bin/python benchmarks/native_coverage.py --zoo   # the test zoo's small models, ~3 min

Each case is built on the meta device (no weights) and planned as ``autoplan model.py --devices
N`` plans it (the pipeline search included, the cluster's precision); the program is the plan's
own (``Plan.program``: read when planned by the recognition the runtime runs,
:mod:`autoplan.codegen.program_choice`): nothing is run. Cases: Hugging Face
``LlamaForCausalLM`` of Llama-7B's shape (seq 4096, global batch 16) on 8, 16 and 32 H100s,
Llama 3.1 8B's (seq 8192, vocab 128256, global batch 8, and 16 as torchtitan's recipe) on 8,
and GPT-2 124M (seq 1024, batch 8) on 8. ``--zoo``: the default plans the test zoo runs
(``tests/zoo.py``: tiny configurations of public architectures, on the ``cpu`` cluster), the
4-device plan with the pipeline search and the 2-device intra-op one, and how many of them
PyTorch's own programs run.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpt2  # noqa: E402
from planning_time import _llama, plan_shape  # noqa: E402

from autoplan.load import make_model_spec  # noqa: E402
from autoplan.planner.front_door import plan_model  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402


def _llama31_8b(batch: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 128256, (batch, 8192))
    return model, {"input_ids": ids, "labels": ids}


def _cases() -> Iterator[tuple[str, str, int, Callable[[], tuple], Callable | None]]:
    for devices in (8, 16, 32):
        yield (f"llama7b-{devices}", "Llama-7B shape (HF)", devices,
               lambda: _llama(4096, 32, 32, 32, 11008, 4096, 16), None)
    for batch in (8, 16):  # 16: torchtitan's recipe (torchtitan_recipes.py)
        yield f"llama31-8b-b{batch}", f"Llama 3.1 8B, batch {batch}", 8, lambda batch=batch: _llama31_8b(batch), None
    yield ("gpt2-8", "GPT-2 124M (HF)", 8,
           lambda: gpt2.build(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257, batch=8,
                              seq=1024, device="meta"), gpt2.loss_fn)


def zoo_programs() -> None:
    """The programs of the zoo's default plans (the ones its tests check on 4 and 2 processes)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import ALL_CASES

    from autoplan.codegen.program_choice import INTERPRETER_PROGRAM

    native = total = 0
    print(f"{'model':20s} {'devices':>7s} {'plan (found)':28s} program")
    for name, build in ALL_CASES.items():
        case = build()
        spec = make_model_spec(case.model, case.example_inputs, case.loss_fn, name=name)
        for devices, pipeline in ((4, True), (2, False)):
            plan = plan_model(spec, PlanOptions(devices, "cpu", pipeline=pipeline))
            native += not plan.program.startswith(INTERPRETER_PROGRAM)
            total += 1
            print(f"{name:20s} {devices:7d} {plan_shape(plan):28s} {plan.program}", flush=True)
    print(f"{native} of {total} plans run on PyTorch's own programs, {total - native} on the DTensor interpreter")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c[0] for c in _cases()],
                        help="run only this case (repeatable; default: all)")
    parser.add_argument("--zoo", action="store_true", help="the test zoo's default plans instead")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.zoo:
        zoo_programs()
        return
    print(f"{'case':14s} {'model':24s} {'devices':>7s} {'plan (found)':38s} program")
    for key, name, devices, build, loss_fn in _cases():
        if args.case and key not in args.case:
            continue
        start = time.perf_counter()
        model, inputs = build()
        spec = make_model_spec(model, inputs, loss_fn, name=name)
        plan = plan_model(spec, PlanOptions(devices, "h100", plan_only=True))
        print(f"{key:14s} {name:24s} {devices:7d} {plan_shape(plan):38s} {plan.program}  "
              f"({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
