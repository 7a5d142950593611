"""torchvision's own architectures (random weights, small images) through the command line:
plan on 4 devices, then ``--run --check`` on 2 and 4 gloo processes, a plan forced by a memory
budget to shard weights on 4, and (where CUDA is available) the 1-device program on the GPU.

    python benchmarks/torchvision_zoo.py [--case NAME ...] [--out DIR]

torchvision is not installable beside this project's CPU torch build; this runs where it is
installed (for example the GPU machine). Prints one Markdown row per model.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "resnet18": "torchvision.models.resnet18(num_classes=10)",
    "mobilenet_v3_small": "torchvision.models.mobilenet_v3_small(num_classes=10)",
    "efficientnet_b0": "torchvision.models.efficientnet_b0(num_classes=10)",
    "convnext_tiny": "torchvision.models.convnext_tiny(num_classes=10)",
    "vit": ("torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, "
            "hidden_dim=32, mlp_dim=64, num_classes=10)"),
}

MODEL_FILE = '''import torch, torchvision
import torch.nn.functional as F

class Supervised(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, images, labels):
        return self.net(images)

def model():
    torch.manual_seed(0)
    return Supervised({build})

def example_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)

def loss_fn(logits, images, labels):
    return F.cross_entropy(logits, labels)
'''


def _run(args: list[str], gpu: bool = False, timeout: int = 600) -> tuple[bool, str, float]:
    """The command ``autoplan ARGS``; gloo on the CPU unless ``gpu``."""
    start = time.perf_counter()
    env = dict(os.environ) if gpu else dict(os.environ, CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, "timed out", time.perf_counter() - start
    text = proc.stdout + proc.stderr
    lines = [line for line in text.splitlines() if line.strip()]
    telling = [line for line in lines if re.search(r"Error|error:|MISMATCH|FAILED|PASSED", line)
               and "To enable traceback" not in line]
    verdict = (telling or lines or [""])[-1]
    return proc.returncode == 0, verdict.strip()[:160], time.perf_counter() - start


def _sharding_budget(model_file: Path) -> str:
    """60% of the memory the 4-device intra-op plan needs: small enough that weights must be
    sharded."""
    from autoplan.load import load_model_file
    from autoplan.planner.front_door import plan_model
    from autoplan.planner.options import PlanOptions

    plan = plan_model(load_model_file(str(model_file)), PlanOptions(4, "cpu", pipeline=False))
    return f"{0.6 * plan.predicted.memory_bytes.peak / 1e6:.2f}MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(MODELS))
    parser.add_argument("--out", default=None, help="folder for model files and plans (default: a temp folder)")
    args = parser.parse_args()
    import torch

    root = Path(args.out or tempfile.mkdtemp(prefix="tv_zoo_"))
    root.mkdir(parents=True, exist_ok=True)
    print("| model | plan, 4 devices | check 2 procs | check 4 procs | forced-sharded check, 4 procs | 1 GPU |")
    print("|---|---|---|---|---|---|")
    for name, build in MODELS.items():
        if args.case and name not in args.case:
            continue
        model_file = root / f"tv_{name}.py"
        model_file.write_text(MODEL_FILE.format(build=build))
        cells = []
        ok, verdict, seconds = _run([str(model_file), "--devices", "4", "--cluster", "cpu", "--out", str(root / name)])
        cells.append(f"{'ok' if ok else 'FAIL'} ({seconds:.0f} s) {'' if ok else verdict}")
        budget = ["--no-pipeline", "--memory-per-device", _sharding_budget(model_file)]
        for devices, extra in ((2, []), (4, []), (4, budget)):
            ok, verdict, seconds = _run([str(model_file), "--devices", str(devices), "--cluster", "cpu", "--run",
                                         "--check", "--steps", "2", "--out", str(root / f"{name}_{devices}"),
                                         *extra])
            cells.append(f"{'pass' if ok else 'FAIL'} ({seconds:.0f} s){'' if ok else ': ' + verdict}")
        if torch.cuda.is_available():
            ok, verdict, seconds = _run([str(model_file), "--devices", "1", "--cluster", "h100", "--run", "--check",
                                         "--steps", "2", "--out", str(root / f"{name}_gpu")], gpu=True)
            cells.append(f"{'pass' if ok else 'FAIL'} ({seconds:.0f} s){'' if ok else ': ' + verdict}")
        else:
            cells.append("no GPU")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
