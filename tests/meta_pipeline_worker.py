"""One rank of the meta-device pipelines' check (tests/test_native_pipeline.py launches it).

    python -m torch.distributed.run --nproc-per-node 4 tests/meta_pipeline_worker.py OUT_DIR

For each plan in OUT_DIR/cases.json (``{"name", "plan"}``), builds the program of
:func:`pipeline_cases.llama4_wide_meta` (the wide Llama on the meta device), loads the weights
OUT_DIR/hf holds (what ``save_pretrained`` wrote from the allocated model), runs one training
step on the example batch, and writes OUT_DIR/rank{r}.json: ``{name: {"loss", "description"}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pipeline_cases  # noqa: E402

from autoplan.codegen.pretrained import load_pretrained  # noqa: E402
from autoplan.codegen.runtime import build_parallel_module, init_distributed  # noqa: E402
from autoplan.load import make_model_spec  # noqa: E402
from autoplan.plan_schema import Plan  # noqa: E402


def main(out_dir: Path) -> None:
    ctx = init_distributed()
    results = {}
    for case in json.loads((out_dir / "cases.json").read_text()):
        torch.manual_seed(0)
        spec = make_model_spec(*pipeline_cases.llama4_wide_meta(), name=case["name"])
        pm = build_parallel_module(spec, Plan.load(case["plan"]))
        load_pretrained(pm, out_dir / "hf")
        results[case["name"]] = {"loss": float(pm.forward_backward(*spec.example_inputs)),
                                 "description": pm.description}
        dist.barrier()
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    dist.barrier()
    dist.destroy_process_group()
