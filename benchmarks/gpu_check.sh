#!/usr/bin/env bash
# The device call for a GPU machine that reaches no registry, from the repository root, after
# `python -m benchmarks.gpu_carry` here; carry `.gpu` and `services/pb`. Installs the carried
# wheels into that machine's python (torch, triton, transformers are its own), then runs
# benchmarks/gpu_check.py (all sections; GPU_CHECK_ARGS adds flags, e.g. --only-dequant) and
# the CUDA IPC tensor-handle test. Reports land in $OUT: gpu_check.json (written after each
# section), gpu_check.log, cuda_ipc.log, versions.txt.
set -uo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
"$PY" -m pip install --quiet --no-index --no-deps .gpu/wheels/*.whl 2>&1 | tail -3
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  nproc
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
PYTHONUNBUFFERED=1 timeout "${GPU_CHECK_TIMEOUT:-420}" "$PY" -m benchmarks.gpu_check \
  --gguf .gpu/smollm2-2l.Q4_1.gguf --throughput-config .gpu/smollm2-config \
  --out "$OUT/gpu_check.json" ${GPU_CHECK_ARGS:-} > "$OUT/gpu_check.log" 2>&1
check=$?
tail -c 3000 "$OUT/gpu_check.log"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/foundation/test_tensor_handles.py \
  -k cuda_ipc > "$OUT/cuda_ipc.log" 2>&1
ipc=$?
tail -5 "$OUT/cuda_ipc.log"
echo "gpu_check rc=$check cuda_ipc rc=$ipc"
exit $(( check || ipc ))
