#!/usr/bin/env bash
# Generate Python gRPC stubs (and .pyi type stubs) from protos/ into services/pb/, then the
# wire types (services/wire.py, checked in; tests/foundation/test_wire_types.py).
set -euo pipefail
PY=${1:-.venv/bin/python}
PATH="$(dirname "$PY"):$PATH" "$PY" -m scripts.gen_pb --mypy
"$PY" -m scripts.gen_wire_types
