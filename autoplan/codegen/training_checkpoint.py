"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): save every K steps, resume
from the newest complete one, under the same plan or another.

A checkpoint is the folder ``DIR/step-00000006``: DCP's files for the tensors, and
``autoplan.json`` for the rest. The tensors are keyed by the model's own parameter names, so
that any plan's program can read any other's:

- ``model.<fqn>``: every parameter this rank holds, as the program holds it (a DTensor in the
  plan's placements, FSDP2's shard, a plain tensor under DDP; under a pipeline only this
  rank's stages'); tied names are saved under each name;
- ``optim.<fqn>.<key>``: the optimizer's state of that parameter (``exp_avg``, ``step``, ...;
  of its master shard under ZeRO-1/2), in the same kind of placements;
- ``rng.rank<r>.cpu`` (and ``.cuda``): each rank's random generator states.

DCP writes each shard once and, on load, reads into each rank's tensors whatever part of the
saved ones they cover, so a checkpoint written on 2 processes under one plan resumes on 4
under another. ``autoplan.json`` holds the step, the data position (batches consumed), the
optimizer's name and the model's signature (every parameter's name, shape and dtype); a
checkpoint of another model or optimizer is refused in one line.

Completeness: every rank writes into ``step-00000006.partial``; only when DCP's save has
returned on every rank (its metadata written last) does rank 0 write ``autoplan.json`` and
rename the folder to its final name, an atomic step on one file system. An asynchronous save
(``dcp.async_save``) copies the tensors to host memory and writes them in a background thread
while training goes on, synchronising its ranks on a gloo group of its own (not the group the
training's collectives run on); rank 0 completes it (renames it) at the first
:meth:`TrainingCheckpoints.poll` after it is written (rank 0 coordinates DCP's save: its
future is done only once every rank has written and the metadata is out), and at the latest
when the next save starts or :meth:`TrainingCheckpoints.wait` is called at the end of the run. A save interrupted at
any point leaves at most a ``.partial`` folder, which resuming ignores and the next save of
that step replaces; the previous complete checkpoint is untouched. The newest ``keep``
complete checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autoplan.errors import AutoplanError

if TYPE_CHECKING:
    from autoplan.codegen.runtime import PlannedTraining
    from autoplan.data import BatchFeed

INFO_FILE = "autoplan.json"
_COMPLETE = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint records beside its tensors."""

    step: int  # training steps done
    position: int  # global batches the data feed has handed out
    optimizer: str
    model_signature: str
    world_size: int
    mesh: list[int]
    stages: int


@dataclass(frozen=True)
class _PendingSave:
    """A save to complete: DCP's future (an asynchronous save in flight), and what completing
    it renames."""

    future: Future | None  # None: written already (a synchronous save)
    partial: Path
    final: Path
    info: CheckpointInfo


def model_signature(module: torch.nn.Module) -> str:
    """A hash of every parameter's name, shape and dtype: what a checkpoint must match."""
    parts = [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in module.named_parameters(remove_duplicate=False)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def checkpoint_folder(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def newest_complete(root: Path) -> Path | None:
    """The complete checkpoint of the highest step under ``root`` (``.partial`` folders and
    folders without ``autoplan.json`` are not complete), or None."""
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _COMPLETE.match(p.name)) and (p / INFO_FILE).exists()]
    return max(found)[1] if found else None


def read_info(folder: Path) -> CheckpointInfo:
    try:
        return CheckpointInfo(**json.loads((folder / INFO_FILE).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise AutoplanError(f"{folder / INFO_FILE} cannot be read ({type(e).__name__}): remove {folder} to resume "
                            f"from the checkpoint before it") from e


def _initialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (moments, step counts) for every parameter that has none,
    so that a checkpoint can be loaded into it: one step on zero gradients at learning rate 0,
    which leaves every parameter unchanged (weight decay is scaled by the learning rate)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if all(p in optimizer.state for p in params):
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


class TrainingCheckpoints:
    """Saving and resuming the training of ``program`` (a planned program) in ``root``."""

    def __init__(self, root: str | os.PathLike[str], program: PlannedTraining, user_module: torch.nn.Module,
                 keep: int = 2, asynchronous: bool = False) -> None:
        if keep < 1:
            raise AutoplanError(f"checkpoints to keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.program = program
        self.signature = model_signature(user_module)
        self.keep = keep
        self.rank = dist.get_rank()
        self._pending: _PendingSave | None = None
        self._save_group = dist.new_group(backend="gloo") if asynchronous else None  # a collective

    # -- what is saved ---------------------------------------------------------------------

    def _tensors(self) -> dict[str, torch.Tensor]:
        pm = self.program
        out: dict[str, torch.Tensor] = {}
        for fqn, param in pm.named_plan_parameters().items():
            out[f"model.{fqn}"] = param
            stepped = pm.sharded_state.parameters([param])[0]  # its master shard under ZeRO-1/2
            for key, value in pm.optimizer.state.get(stepped, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{fqn}.{key}"] = value
        out[f"rng.rank{self.rank}.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[f"rng.rank{self.rank}.cuda"] = torch.cuda.get_rng_state()
        return out

    def _info(self, step: int, feed: BatchFeed) -> CheckpointInfo:
        plan = self.program.plan
        return CheckpointInfo(step, feed.position, plan.optimizer.name, self.signature, dist.get_world_size(),
                              list(plan.mesh), len(plan.stages))

    # -- save ------------------------------------------------------------------------------

    def save(self, step: int, feed: BatchFeed) -> Path:
        """Save the state after ``step`` steps; returns the folder the checkpoint has once
        complete (at once, or, for an asynchronous save, when the next save starts or
        :meth:`wait` returns). A collective: every rank calls it."""
        self.wait()
        final = checkpoint_folder(self.root, step)
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what an interrupted save of this step left
            partial.mkdir(parents=True)
        dist.barrier()
        info = self._info(step, feed)
        if self._save_group is None:
            dcp.save(self._tensors(), checkpoint_id=partial)
            self._complete(_PendingSave(None, partial, final, info))
            dist.barrier()
        else:  # the tensors are copied to host memory before async_save returns
            future = dcp.async_save(self._tensors(), checkpoint_id=partial, process_group=self._save_group)
            self._pending = _PendingSave(future, partial, final, info)
        return final

    def poll(self) -> None:
        """Complete the asynchronous save in flight if it is written; never waits (call it
        every step)."""
        if self._pending is not None and self._pending.future.done():
            pending, self._pending = self._pending, None
            self._complete(pending)

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any, and complete it. A collective."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.future.result()
            self._complete(pending)
        dist.barrier()

    def _complete(self, save: _PendingSave) -> None:
        if save.future is not None:
            save.future.result()  # raises what the writer raised
        if self.rank == 0:
            (save.partial / INFO_FILE).write_text(json.dumps(asdict(save.info)) + "\n")
            shutil.rmtree(save.final, ignore_errors=True)
            os.replace(save.partial, save.final)
            self._remove_old()

    def _remove_old(self) -> None:
        complete = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _COMPLETE.match(p.name)))
        for _, folder in complete[:-self.keep]:
            shutil.rmtree(folder, ignore_errors=True)

    # -- resume ----------------------------------------------------------------------------

    def resume(self, feed: BatchFeed) -> CheckpointInfo | None:
        """Load the newest complete checkpoint into the program (any plan's: DCP reshards),
        move ``feed`` to where it was and restore this rank's random states; None where there
        is no checkpoint yet. A collective: every rank calls it."""
        found = [str(newest_complete(self.root) or "")]
        dist.broadcast_object_list(found, src=0)  # every rank resumes the same one
        if not found[0]:
            return None
        folder = Path(found[0])
        info = read_info(folder)
        if info.model_signature != self.signature:
            raise AutoplanError(f"{folder} is a checkpoint of another model (its parameters' names, shapes or dtypes "
                                f"differ): give another --checkpoint-dir, or resume the model it was written for")
        if info.optimizer != self.program.plan.optimizer.name:
            raise AutoplanError(f"{folder} was written with the {info.optimizer} optimizer and this plan steps "
                                f"{self.program.plan.optimizer.name}: plan again with --optimizer {info.optimizer}")
        _initialise_optimizer_state(self.program.optimizer)
        tensors = self._tensors()
        saved = set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
        missing = [k for k in tensors if not k.startswith("rng.") and k not in saved]
        if missing:
            raise AutoplanError(f"{folder} has no {missing[0]}: it was written by another program; give another "
                                f"--checkpoint-dir")
        tensors = {k: v for k, v in tensors.items() if k in saved}  # a rank the saving job did not have
        dcp.load(tensors, checkpoint_id=folder)
        self.program.sharded_state.take_from_parameters()  # ZeRO-1/2 master shards from the loaded parameters
        if f"rng.rank{self.rank}.cpu" in tensors:
            torch.set_rng_state(tensors[f"rng.rank{self.rank}.cpu"])
        if f"rng.rank{self.rank}.cuda" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.rank{self.rank}.cuda"])
        feed.skip_to(info.position)
        return info

    def resume_line(self, info: CheckpointInfo) -> str:
        """What train.py prints after resuming."""
        return (f"resumed after step {info.step} from {checkpoint_folder(self.root, info.step)} (written by "
                f"{info.world_size} process(es), mesh {'x'.join(map(str, info.mesh))}, {info.stages} stage(s))")
