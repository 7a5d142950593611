#!/usr/bin/env bash
# The checks only a GPU can show, in one run on a one-GPU machine (CUDA, NCCL), from the
# repository root; every log and result goes to the folder given (default gpu_results).
# CLUSTER names the preset of the GPU it runs on (default h100; h200 on an H200):
#   1. the emitted program's CUDA path: `--run --check` of a small Llama in bf16, recomputed;
#   2. `autoplan calibrate --devices 1` on the GPU (calibrated.toml; CALIBRATED=FILE uses that
#      file instead);
#   3. a bf16, checkpointed plan of Llama 3.2 1B's shape (batch 4 x 2048 tokens): checked against
#      the model on the GPU, then its measured step time beside its prediction under the preset and
#      the calibrated file, and the model run eagerly by hand (gpu_step_time.py);
#   4. GPT-2 124M fp32 the same way;
#   5. the Llama plan on the DTensor interpreter, checked and timed;
#   6. the Llama with torchtitan's per-op policy (`--recompute op`), checked and timed.
# Steps 3 and 6 also profile the program's GPU kernels by kind. STEPS="NAME ..." runs only the
# steps named (check calibrate llama1b gpt2 llama1b-interpreter llama1b-op).
# Each step has its own time limit, so one failure leaves the others' figures.
set -u
out=${1:-gpu_results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
py=${PYTHON:-python3}
run() {  # run NAME SECONDS COMMAND...: log to $out/NAME.log, print its tail and exit status
  local name=$1 limit=$2
  shift 2
  [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $name "* ]] || return 0
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s"
  grep -v -e '^\s*$' -e 'Warning' -e 'warnings.warn' "$out/$name.log" | tail -n 25
}
nvidia-smi -L
$py -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
cluster=${CLUSTER:-h100}
run check 110 $py -m autoplan examples/llama.py --devices 1 --cluster "$cluster" --precision bf16 --recompute all \
  --no-pipeline --run --check --steps 3 --out "${TMPDIR:-/tmp}/autoplan_gpu_check"
calibrated=${CALIBRATED:-$out/calibrated.toml}
[ -n "${CALIBRATED:-}" ] || run calibrate 90 $py -m autoplan calibrate --devices 1 -o "$calibrated"
clusters=(--cluster "$cluster")
[ -f "$calibrated" ] && clusters+=(--cluster "$calibrated")
llama_1b=(--model llama-1b --precision bf16 --batch 4 --seq 2048 "${clusters[@]}")
llama=("${llama_1b[@]}" --recompute all)
step_time=($py -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_step_time.py)
run llama1b 180 "${step_time[@]}" "${llama[@]}" --check --eager --profile --json "$out/llama1b.json"
run gpt2 100 "${step_time[@]}" --model gpt2 "${clusters[@]}" --check --eager --json "$out/gpt2.json"
run llama1b-interpreter 120 "${step_time[@]}" "${llama[@]}" --interpreter --check --json "$out/llama1b-interpreter.json"
run llama1b-op 150 "${step_time[@]}" "${llama_1b[@]}" --recompute op --check --profile --json "$out/llama1b-op.json"
