"""Emit ``train.py``: a readable, editable program that ``torchrun`` runs.

It loads the user's model file (found relative to train.py, so the folder can move with the
model) and ``plan.json``, builds the planned program, trains ``--steps`` steps with the plan's
optimizer and logs the loss; ``--check`` compares with the model on one device instead (see
:mod:`autoplan.codegen.check`).
"""

from __future__ import annotations

import os
from pathlib import Path

TEMPLATE = '''#!/usr/bin/env python
"""Train {model_name} with the plan autoplan chose ({plan_summary}).

    torchrun --nproc-per-node {devices} {script} --steps 10
    torchrun --nnodes 2 --nproc-per-node {half} --node-rank R --rdzv-backend c10d \\\\
             --rdzv-endpoint HOST:29500 {script}          # the same plan over two nodes

    torchrun --nproc-per-node {devices} --max-restarts 3 {script} --steps 1000 \\\\
             --checkpoint-dir ckpt --checkpoint-every 100 --resume  # restarted after a fault

The data is `batches` in the model file (a DataLoader of global batches shaped like the
example inputs), else the example inputs every step. On GPUs each process uses one GPU (NCCL);
on CPUs gloo. Every rank reads the same global batch; the program keeps its own slice. The
optimizer ({optimizer}) and everything else the program does come from plan.json. With
--checkpoint-dir, the model, optimizer state, step, data position and random states are saved
with torch.distributed.checkpoint; --resume continues from the newest complete checkpoint,
which may have been written under another plan or device count.
"""

import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.arguments import OneLineParser
from autoplan.codegen.pretrained import load_pretrained
from autoplan.codegen.runtime import build_parallel_module, init_distributed
from autoplan.codegen.training_checkpoint import TrainingCheckpoints
from autoplan.data import BatchFeed, find_batches
from autoplan.errors import AutoplanError
from autoplan.load import import_file, spec_from_file_module
from autoplan.plan_schema import Plan

MODEL_FILE = Path(__file__).resolve().parent / {model_file!r}
NAMES = dict(model_name={model_attr!r}, inputs_name={inputs_attr!r}, loss_name={loss_attr!r})
BATCHES = "batches"  # the name of the data in the model file
PLAN_FILE = Path(__file__).resolve().with_name("plan.json")


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])  # a mistyped flag: one line, on rank 0
    parser.add_argument("--steps", type=int, default=10, help="the total number of steps, counted across resumes")
    parser.add_argument("--check", action="store_true", help="compare with the model on one device")
    parser.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (torch.distributed.checkpoint)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (default: at the end)")
    parser.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept (default 2)")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="write checkpoints in the background while training goes on (dcp.async_save)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint, if any")
    parser.add_argument("--weights", default=None,
                        help="start from these weights: a Hugging Face folder of .safetensors or a checkpoint folder")
    args = parser.parse_args()
    if args.resume and not args.checkpoint_dir:
        raise AutoplanError("--resume needs --checkpoint-dir DIR: the folder the checkpoints are in")

    ctx = init_distributed()
    torch.manual_seed(0)  # every rank builds the same weights
    user_file = import_file(str(MODEL_FILE))
    spec = spec_from_file_module(user_file, str(MODEL_FILE), **NAMES)
    device = torch.device("cpu")
    if ctx.device_type == "cuda":  # trace where it runs: tensors the graph creates land there
        device = torch.device("cuda", torch.cuda.current_device())
        spec = spec.to(device)
    plan = Plan.load(PLAN_FILE)
    pm = build_parallel_module(spec, plan)
    if ctx.rank == 0:
        print(f"program: {{pm.description}}", flush=True)
    if args.weights:
        loaded = load_pretrained(pm, args.weights)  # each rank reads its own shards
        if ctx.rank == 0:
            print(loaded, flush=True)

    if args.check:
        from autoplan.codegen.check import check_against_single_device

        report = check_against_single_device(spec, pm, steps=args.steps)
        if ctx.rank == 0:
            print(report.text(), flush=True)
        return 0 if report.ok else 1

    feed = BatchFeed(spec, find_batches(user_file, str(MODEL_FILE), BATCHES), device)
    checkpoints = first = None
    if args.checkpoint_dir:
        checkpoints = TrainingCheckpoints(args.checkpoint_dir, pm, spec.module, keep=args.keep_checkpoints,
                                          asynchronous=args.async_checkpoint)
        resumed = checkpoints.resume(feed) if args.resume else None
        first = resumed.step if resumed else None
        if ctx.rank == 0 and args.resume:
            print(checkpoints.resume_line(resumed) if resumed else f"no checkpoint in {{args.checkpoint_dir}} yet: "
                  f"starting at step 0", flush=True)
    if ctx.rank == 0:
        print(f"data: {{feed.source}}", flush=True)
    for step in range(first or 0, args.steps):
        start = time.perf_counter()
        loss = pm.train_step(*feed.next_batch())  # forward, backward (every microbatch of a pipeline), optimizer
        value = loss.item()  # waits for the step to finish
        seconds = time.perf_counter() - start
        if ctx.rank == 0:
            print(f"step {{step}} loss {{value:.6f}} time {{seconds:.6f}}", flush=True)
        done = step + 1
        if checkpoints:
            checkpoints.poll()  # completes an asynchronous save that has been written
        if checkpoints and (done == args.steps or args.checkpoint_every and done % args.checkpoint_every == 0):
            saved = checkpoints.save(done, feed)
            if ctx.rank == 0:
                print(f"checkpoint: {{saved}}", flush=True)
    if checkpoints:
        checkpoints.wait()  # an asynchronous save still writing
    return 0


def shutdown() -> None:
    """Leave together: no rank tears its connections down while another still uses them. The
    program's objects (a DDP reducer holds the process group) are collected first, while the
    interpreter is whole: gloo's threads freed at its finalisation can abort the process."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        code = main()
    except AutoplanError as e:
        if os.environ.get("RANK", "0") == "0":  # one line, not one per process
            print(f"autoplan: error: {{e}}", file=sys.stderr, flush=True)
        sys.exit(2)
    shutdown()
    sys.exit(code)
'''


def render_train_script(model_file: str, model_attr: str, inputs_attr: str, loss_attr: str, devices: int,
                        model_name: str, plan_summary: str, script: str = "autoplan_out/train.py",
                        optimizer: str = "adamw") -> str:
    """The text of train.py for a model file and its plan; the model file is named relative
    to the folder train.py is written to."""
    relative = os.path.relpath(Path(model_file).resolve(), Path(script).resolve().parent)
    return TEMPLATE.format(model_file=relative, optimizer=optimizer, model_attr=model_attr,
                           inputs_attr=inputs_attr, loss_attr=loss_attr, devices=devices,
                           half=max(devices // 2, 1), model_name=model_name, plan_summary=plan_summary,
                           script=script)
