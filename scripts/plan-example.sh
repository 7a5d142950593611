#!/usr/bin/env bash
# Sets up .venv if needed, then plans the bundled GPT-2 example for 8 devices.
# Extra arguments go to autoplan (e.g. --mesh 2x4 --cluster a100-80g --json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/autoplan examples/gpt2.py --devices 8 "$@"
