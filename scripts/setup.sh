#!/usr/bin/env bash
# Creates .venv with autoplan and its dependencies at the versions of constraints.txt. Idempotent.
# Keeps a torch that is already installed for python3 (for example a CUDA build on a GPU machine);
# otherwise installs torch==2.13.0 (on a CPU machine pip takes the CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 13) else 1)' 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv   # reuse the installed torch
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
fi
# every other package at the exact version of constraints.txt (a no-op when they are installed)
.venv/bin/pip install -q -c constraints.txt -e '.[dev,examples]'
