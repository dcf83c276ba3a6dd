#!/usr/bin/env bash
# Regenerates the gRPC stubs of router/grpc/generation.proto (needs grpcio-tools in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
  tandem/router/grpc/generation.proto
