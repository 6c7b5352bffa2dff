#!/usr/bin/env bash
# Quickstart 1: set up, then complete a prompt with SmolLM2's 30 layers split into 3 layer ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/meshnet generate --stages 3 --temperature 0 --max-tokens 48 "${@:-The capital of France is}"
