"""One rank of the sharded-initialisation check (tests/test_training_run.py launches it).

    python -m torch.distributed.run --nproc-per-node 4 tests/meta_init_worker.py OUT_DIR PLAN_JSON

Builds the planned program of a Llama built on the meta device (``meta_llama`` below, about
1.1 GB of fp32 weights), measures this process's peak resident memory before and after, and
writes OUT_DIR/rank{r}.json: the growth of the peak, the bytes of parameters it holds, the mean
and standard deviation of its shards of the matrices (Hugging Face initialises them from N(0,
0.02)) and of the norms (ones), and the loss of one training step on the example batch.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from autoplan.codegen.runtime import build_parallel_module, init_distributed  # noqa: E402
from autoplan.plan_schema import Plan  # noqa: E402

META_LLAMA = dict(hidden=1024, layers=12, heads=8, kv_heads=8, intermediate=4096, vocab=32000, batch=4, seq=16)


def meta_spec():
    import llama

    from autoplan.load import make_model_spec

    model, inputs = llama.build(**META_LLAMA, device="meta")
    inputs = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in inputs.items()}
    return make_model_spec(model, inputs)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def main(out_dir: Path, plan_file: Path) -> None:
    ctx = init_distributed()
    torch.manual_seed(0)
    spec = meta_spec()
    model_bytes = sum(p.numel() * p.element_size() for p in spec.module.parameters())
    before = _peak_bytes()
    pm = build_parallel_module(spec, Plan.load(plan_file))
    grown = _peak_bytes() - before
    params = {id(p): p for p in pm.named_plan_parameters().values()}.values()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    matrices = torch.cat([t.detach().flatten() for t in local if t.dim() == 2])
    norms = torch.cat([t.detach().flatten() for t in local if t.dim() == 1])
    result = dict(model_bytes=model_bytes, peak_growth=grown, held_bytes=sum(t.numel() * t.element_size()
                                                                            for t in local),
                  matrix_mean=matrices.mean().item(), matrix_std=matrices.std().item(),
                  norm_min=norms.min().item(), norm_max=norms.max().item(), program=pm.description,
                  meta_left=any(t.is_meta for t in local),
                  loss=float(pm.forward_backward(*spec.example_inputs)))  # the program runs a step
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
