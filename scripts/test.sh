#!/usr/bin/env bash
# Quickstart 2: set up with test extras, then run the test suite (extra pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest -q "$@"
