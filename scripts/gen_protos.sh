#!/usr/bin/env bash
# Generate Python gRPC stubs (and .pyi type stubs) from protos/ into services/pb/.
set -euo pipefail
PY=${1:-.venv/bin/python}
OUT=services/pb
rm -f "$OUT"/*_pb2*.py "$OUT"/*_pb2*.pyi
PATH="$(dirname "$PY"):$PATH" "$PY" -m grpc_tools.protoc -I protos \
    --python_out="$OUT" --grpc_python_out="$OUT" \
    --mypy_out=quiet:"$OUT" --mypy_grpc_out=quiet:"$OUT" \
    protos/*.proto
# protoc writes top-level imports (`import engine_pb2`); make them package-relative.
sed -i -E 's/^import (\w+_pb2) as /from . import \1 as /' "$OUT"/*_pb2*.py "$OUT"/*_pb2*.pyi
# The domain dataclasses and their converters (checked in, tests/foundation/test_wire_types.py).
"$PY" -m scripts.gen_wire_types
