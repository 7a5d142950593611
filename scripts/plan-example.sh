#!/usr/bin/env bash
# Sets up .venv if needed, then plans GPT-2 124M (built on the meta device) for 8 H100s.
# Extra arguments go to autoplan (e.g. --mesh 2x4 --cluster a100-80g --json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/autoplan examples/gpt2_124m.py --devices 8 "$@"
