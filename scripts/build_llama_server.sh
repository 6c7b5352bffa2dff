#!/usr/bin/env bash
# Find or build llama.cpp's llama-server, llama-bench, ggml-rpc-server and llama-gguf-split once into a cache folder; prints its path.
# The build uses the llama-cpp-python==0.3.36 sdist's vendor/llama.cpp (about 10 minutes on 2 cores).
# usage: scripts/build_llama_server.sh      (MESHNET_LLAMA_CPP_CACHE=DIR overrides the cache folder)
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m meshnet.bench.llama_server
