#!/usr/bin/env bash
# Regenerates kvstore/_proto from proto/kvstore.proto. Run after editing the proto.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Ikvstore/_proto=proto --python_out=. --pyi_out=. \
  --grpc_python_out=. kvstore/_proto/kvstore.proto
