"""A small Hugging Face Llama (random weights) trained on a shuffled DataLoader of keyword batches, for the checkpoint and restart tests
(tests/test_training_run.py). Faults are injected here, by the test's environment, never by a
product flag:

- ``FAULT_MARKER`` and ``FAULT_BATCH=B``: rank ``FAULT_RANK`` (default 1) exits while reading
  global batch B (0-based, counted across epochs and resumes of this process) the first time,
  i.e. during step B; the marker file records that the fault happened;
- ``FAULT_MARKER`` and ``FAULT_SAVE=K``: rank ``FAULT_RANK`` exits while DCP writes its K-th
  checkpoint (1-based), after some of the files are written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama  # noqa: E402

BATCH, SEQ, VOCAB, SEQUENCES = 4, 64, 1024, 12  # 3 global batches an epoch

model, example_inputs = llama.build(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=VOCAB,
                                    batch=BATCH, seq=SEQ)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _fault_here() -> bool:
    marker = os.environ.get("FAULT_MARKER")
    if not marker or Path(marker).exists() or _rank() != int(os.environ.get("FAULT_RANK", "1")):
        return False
    Path(marker).write_text("fault\n")
    return True


class Tokens(Dataset):
    """Random token sequences; item i gives the model's keyword inputs (Hugging Face shifts the
    labels itself)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.data = torch.randint(VOCAB, (SEQUENCES, SEQ), generator=generator)
        self.items_read = 0

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        batch = self.items_read // BATCH
        self.items_read += 1
        if "FAULT_BATCH" in os.environ and batch == int(os.environ["FAULT_BATCH"]) and _fault_here():
            os._exit(1)
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


batches = DataLoader(Tokens(), batch_size=BATCH, shuffle=True, drop_last=True)


def _fail_during_save() -> None:
    """Make the K-th checkpoint write fail on one rank, after the first file is written."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data
    saves = [0]

    def write_then_fail(self, plan, planner):
        saves[0] += 1
        result = write(self, plan, planner)
        if saves[0] == int(os.environ["FAULT_SAVE"]) and _fault_here():
            result.wait()
            os._exit(1)
        return result

    FileSystemWriter.write_data = write_then_fail


if "FAULT_SAVE" in os.environ:
    _fail_during_save()
