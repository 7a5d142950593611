"""Pretrained weights loaded into a planned program, each rank reading only what it holds.

Three kinds of folder are read with ``torch.distributed.checkpoint`` (DCP), by the model's own
parameter names:

- a Hugging Face folder of ``*.safetensors`` files (``save_pretrained``), through DCP's
  ``HuggingFaceStorageReader``;
- an autoplan training checkpoint (``ckpt/step-00000100``: its ``model.<fqn>`` tensors);
- any other DCP checkpoint whose keys are the parameter names (a model state dict).

DCP reads, for each rank, the slices of the saved tensors that the rank's parameters cover
(its shard of a DTensor, FSDP2's shard, the whole tensor of a replicated one), so no rank
holds the full model. Every parameter must be found under one of its names (a tied weight
saved once loads into every name it has); one that is not is named in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp

from autoplan.codegen.training_checkpoint import INFO_FILE
from autoplan.errors import AutoplanError

if TYPE_CHECKING:
    from autoplan.codegen.runtime import PlannedTraining


def _reader(folder: Path) -> tuple[dcp.StorageReader, str, str]:
    """The storage reader of ``folder``, the prefix of the parameters' keys in it, and what
    kind of folder it is."""
    if not folder.is_dir():
        raise AutoplanError(f"--weights {folder}: no such folder (give a Hugging Face folder of .safetensors files "
                            f"or a checkpoint folder)")
    if any(folder.glob("*.safetensors")):
        return dcp.HuggingFaceStorageReader(str(folder)), "", "Hugging Face safetensors"
    if (folder / ".metadata").exists():
        if (folder / INFO_FILE).exists():
            return dcp.FileSystemReader(folder), "model.", "autoplan checkpoint"
        return dcp.FileSystemReader(folder), "", "DCP checkpoint"
    raise AutoplanError(f"--weights {folder} holds neither .safetensors files nor a DCP checkpoint (.metadata): give "
                        f"the folder save_pretrained wrote, or a checkpoint folder")


def load_pretrained(program: PlannedTraining, folder: str | Path) -> str:
    """Load the weights in ``folder`` into ``program``'s parameters (a collective: every
    rank calls it); returns a line saying what was loaded."""
    folder = Path(folder)
    reader, prefix, kind = _reader(folder)
    try:
        saved = set(reader.read_metadata().state_dict_metadata)
    except Exception as e:  # a damaged or foreign folder: the reader's own message, in one line
        raise AutoplanError(f"--weights {folder} cannot be read as {kind} ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else 'no message'})") from e
    wanted: dict[str, torch.Tensor] = {}
    loaded: set[int] = set()
    params = program.named_plan_parameters()
    for fqn, param in params.items():
        if prefix + fqn in saved:
            wanted[prefix + fqn] = param
            loaded.add(id(param))
    missing = [fqn for fqn, param in params.items() if id(param) not in loaded]
    if missing:
        raise AutoplanError(f"--weights {folder} has no {missing[0]!r} ({len(missing)} parameter(s) missing): give "
                            f"the weights of this model")
    dcp.load(wanted, storage_reader=reader)
    program.sharded_state.take_from_parameters()  # ZeRO-1/2 master shards from the loaded parameters
    return f"weights: {len(wanted)} tensor(s) from {folder} ({kind})"
