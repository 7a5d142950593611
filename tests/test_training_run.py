"""Real training runs through the emitted train.py: the user's DataLoader, checkpoints with DCP,
a restart under ``torchrun --max-restarts`` after a rank dies, an interrupted save, and a
resume under another plan on more processes.

The model is tests/training_run_model.py (a small nanoGPT, 3 shuffled global batches an epoch,
so 6 steps cross an epoch); the faults are injected by its environment, not by train.py. Each
launch is a real torchrun of the emitted train.py on gloo; losses are compared in fp32 at
rtol 1e-5, step by step, with an uninterrupted run of the same plan.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.codegen.script import render_train_script
from autoplan.codegen.training_checkpoint import INFO_FILE, model_signature, newest_complete
from autoplan.data import BatchFeed
from autoplan.errors import AutoplanError
from autoplan.load import load_model_file
from autoplan.planner.front_door import with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from launcher import backstop

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILE = ROOT / "tests" / "training_run_model.py"
STEPS = 6
# name -> (--manual plan, processes, the program train.py says runs it)
PLANS = {
    "data_parallel": ("dp=2", 2, "native: DistributedDataParallel"),
    "tensor_parallel": ("tp=2", 2, "the DTensor interpreter"),
    "fsdp": ("fsdp=2", 2, "native: FSDP2 fully_shard"),
    "pipeline": ("pp=2,microbatches=2", 2, "native: torch.distributed.pipelining"),
    "fsdp_x_tp": ("fsdp=2,tp=2", 4, "the DTensor interpreter"),
    "tensor_parallel_4": ("tp=4", 4, "the DTensor interpreter"),
    "single": ("dp=1", 1, "native: the model itself"),
}
RESTARTED = ["data_parallel", "tensor_parallel", "fsdp", "pipeline"]


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    """train.py and plan.json of every plan, each in its own folder (lr 1e-2: resumed moments
    that were wrong would show in the losses)."""
    spec = load_model_file(str(MODEL_FILE))
    folders = {}
    for name, (text, processes, _) in PLANS.items():
        options = PlanOptions(processes, "cpu", lr=1e-2)
        plan = with_decisions(plan_manual(spec, options.planner_options(), parse_manual(text)), options)
        folder = tmp_path_factory.mktemp(name)
        (folder / "plan.json").write_text(plan.to_json())
        script = folder / "train.py"
        script.write_text(render_train_script(str(MODEL_FILE), "model", "example_inputs", "loss_fn", processes,
                                              "gpt", text, str(script)))
        folders[name] = folder
    return folders


def train(folder: Path, processes: int, *args: str, restarts: int = 0, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "--max-restarts", str(restarts), str(folder / "train.py"), *args]
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=backstop(400), check=False)


def losses(run: subprocess.CompletedProcess) -> dict[int, float]:
    """Step → loss as logged (a step logged twice, before and after a restart, keeps the last)."""
    assert run.returncode == 0, f"train.py failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)", run.stdout, re.M)}


class UninterruptedRuns(dict):
    """The losses of an uninterrupted run of a plan, run once per plan when first asked for."""

    def __init__(self, programs: dict[str, Path]) -> None:
        super().__init__()
        self.programs = programs

    def __missing__(self, name: str) -> dict[int, float]:
        run = train(self.programs[name], PLANS[name][1], "--steps", str(STEPS))
        assert "data: batches (DataLoader)" in run.stdout and f"program: {PLANS[name][2]}" in run.stdout
        self[name] = found = losses(run)
        assert sorted(found) == list(range(STEPS))
        return found


@pytest.fixture(scope="module")
def uninterrupted(programs) -> UninterruptedRuns:
    return UninterruptedRuns(programs)


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), f"step {step}: {got[step]} != {want[step]}"


@pytest.mark.parametrize("name, asynchronous", [*((name, False) for name in RESTARTED), ("fsdp", True)])
def test_a_rank_killed_during_step_5_is_restarted_and_resumes_the_same_run(programs, uninterrupted, name,
                                                                         asynchronous, tmp_path):
    marker = tmp_path / "fault"
    run = train(programs[name], PLANS[name][1], "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "ckpt"),
                "--checkpoint-every", "2", "--resume", *(["--async-checkpoint"] if asynchronous else []),
                restarts=1, env={"FAULT_MARKER": str(marker), "FAULT_BATCH": "4"})
    got = losses(run)
    assert marker.exists(), "the fault was not injected"
    # an asynchronous save of step 4 may still be writing when the rank dies: then step 2's
    assert re.search(r"resumed after step (4|2)" if asynchronous else "resumed after step 4", run.stdout)
    assert sorted(got) == list(range(STEPS))
    assert_same_losses(got, uninterrupted[name], range(STEPS))
    assert newest_complete(tmp_path / "ckpt").name == "step-00000006"


def test_a_save_interrupted_on_one_rank_leaves_the_previous_checkpoint(programs, uninterrupted, tmp_path):
    folder, checkpoints = programs["data_parallel"], tmp_path / "ckpt"
    args = ("--steps", str(STEPS), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2", "--resume")
    crashed = train(folder, 2, *args, env={"FAULT_MARKER": str(tmp_path / "fault"), "FAULT_SAVE": "2"})
    assert crashed.returncode != 0
    assert (checkpoints / "step-00000004.partial").is_dir()  # what the interrupted writer left
    assert newest_complete(checkpoints).name == "step-00000002"
    resumed = train(folder, 2, *args)
    assert "resumed after step 2" in resumed.stdout
    got = losses(resumed)
    assert sorted(got) == list(range(2, STEPS))
    assert_same_losses(got, uninterrupted["data_parallel"], range(2, STEPS))
    assert not (checkpoints / "step-00000004.partial").exists()


def test_a_checkpoint_of_two_processes_resumes_under_another_plan_on_four(programs, uninterrupted, tmp_path):
    checkpoints = tmp_path / "ckpt"
    first = losses(train(programs["data_parallel"], 2, "--steps", "2", "--checkpoint-dir", str(checkpoints)))
    run = train(programs["fsdp_x_tp"], 4, "--steps", str(STEPS), "--checkpoint-dir", str(checkpoints), "--resume")
    assert "resumed after step 2" in run.stdout and "written by 2 process(es), mesh 2" in run.stdout
    got = losses(run)
    assert sorted(got) == list(range(2, STEPS))
    single = uninterrupted["single"]
    assert_same_losses({**first, **got}, single, range(STEPS))


@pytest.mark.parametrize("other, needle", [("model", "is a checkpoint of another model"),
                                           ("optimizer", "was written with the sgd optimizer")])
def test_a_checkpoint_of_another_model_or_optimizer_is_refused_in_one_line(programs, tmp_path, other, needle):
    sys.path.insert(0, str(MODEL_FILE.parent))
    import training_run_model as user

    folder = tmp_path / "ckpt" / "step-00000002"
    folder.mkdir(parents=True)
    signature = "0" * 16 if other == "model" else model_signature(user.model)
    info = dict(step=2, position=2, optimizer="sgd" if other == "optimizer" else "adamw", model_signature=signature,
                world_size=1, mesh=[1], stages=1)
    (folder / INFO_FILE).write_text(json.dumps(info))
    run = train(programs["single"], 1, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume")
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("autoplan: error:")]
    assert len(errors) == 1 and needle in errors[0], run.stderr[-2000:]
    assert "autoplan/codegen/training_checkpoint.py" not in run.stderr  # no worker traceback


def test_safetensors_saved_by_transformers_load_into_a_tensor_parallel_plan_on_four(programs, uninterrupted,
                                                                                     tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(MODEL_FILE.parent))
    import training_run_model as user

    torch.manual_seed(7)
    pretrained = LlamaForCausalLM(user.model.config)
    with torch.no_grad():  # weights far from the ones the model file builds
        for param in pretrained.parameters():
            if param.dim() > 1:  # matrices and tables; the norms stay 1
                param.normal_(0.0, 0.5)
    pretrained.save_pretrained(tmp_path / "hf")
    assert list((tmp_path / "hf").glob("*.safetensors"))
    run = train(programs["tensor_parallel_4"], 4, "--steps", "1", "--weights", str(tmp_path / "hf"))
    got = losses(run)
    assert "(Hugging Face safetensors)" in run.stdout and f"program: {PLANS['tensor_parallel_4'][2]}" in run.stdout
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    input_ids, labels = BatchFeed(load_model_file(str(MODEL_FILE)), user.batches).next_batch()
    with torch.no_grad():
        expected = reference(input_ids=input_ids, labels=labels).loss.item()
    assert got[0] == pytest.approx(expected, rel=1e-5, abs=0)
    assert got[0] != pytest.approx(uninterrupted["single"][0], rel=1e-2)  # not the model file's own weights


@pytest.mark.parametrize("make, needle", [
    (lambda folder: None, "no such folder"),
    (lambda folder: folder.mkdir(), "holds neither .safetensors files nor a DCP checkpoint"),
])
def test_a_weights_folder_of_nothing_it_can_read_is_named_in_one_line(tmp_path, make, needle):
    from autoplan.codegen.pretrained import load_pretrained

    make(tmp_path / "weights")
    with pytest.raises(AutoplanError, match=needle):
        load_pretrained(None, tmp_path / "weights")


@pytest.mark.parametrize("text, program", [("fsdp=4", "native: FSDP2 fully_shard"),
                                           ("fsdp=2,tp=2", "native: parallelize_module on axis 1"),
                                           ("pp=2,fsdp=2,microbatches=2", "native: torch.distributed.pipelining")])
def test_a_meta_model_three_times_a_ranks_budget_initialises_sharded_within_it(tmp_path, text, program):
    sys.path.insert(0, str(ROOT / "tests"))
    from launcher import launch_worker
    from meta_init_worker import meta_spec

    options = PlanOptions(4, "cpu")
    plan = with_decisions(plan_manual(meta_spec(), options.planner_options(), parse_manual(text)), options)
    (tmp_path / "plan.json").write_text(plan.to_json())
    results = launch_worker(ROOT / "tests" / "meta_init_worker.py", 4, tmp_path, str(tmp_path / "plan.json"))
    for rank, found in results.items():
        budget = found["model_bytes"] / 3
        assert found["program"].startswith(program)
        assert found["held_bytes"] <= found["model_bytes"] / 4 * 1.01, rank  # its shards, nothing whole
        assert found["peak_growth"] < budget, f"rank {rank} grew {found['peak_growth'] / 1e6:.0f} MB"
        assert not found["meta_left"]
        # the model's own initialisation ran on the shards: N(0, 0.02) matrices, norms of ones
        assert found["matrix_std"] == pytest.approx(0.02, rel=0.05) and abs(found["matrix_mean"]) < 1e-3
        assert found["norm_min"] == found["norm_max"] == 1.0
        # and the program runs a step: weights that small predict every token about alike (the
        # target's own logit, the same token at every position, moves the loss by about one)
        assert abs(found["loss"] - math.log(32000)) < 1.5
        assert found["loss"] == results[0]["loss"]
