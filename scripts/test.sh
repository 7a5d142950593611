#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite in AUTOPLAN_TEST_WORKERS pytest
# processes (default 2, pytest-xdist), each test file in one of them, so that a file's fixtures
# (its plans, its gloo launches) are made once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -n "${AUTOPLAN_TEST_WORKERS:-2}" --dist loadfile "$@"
