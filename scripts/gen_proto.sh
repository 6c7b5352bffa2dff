#!/usr/bin/env bash
# Regenerate src/meshnet/proto/meshnet_pb2*.py from meshnet.proto (needs grpcio-tools: the test setup
# installs it into .venv; PYTHON=... picks another interpreter).
set -euo pipefail
cd "$(dirname "$0")/../src"
"${PYTHON:-../.venv/bin/python}" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. meshnet/proto/meshnet.proto
