"""The Triton attention kernel's batch-invariant mode, on CPU through the Triton interpreter
(a child pytest with TRITON_INTERPRET=1, as tests/worker/test_attention_triton.py runs its
cases): a token's output bit-identical alone, in a mixed batch, as a decode and as a later
chunk after a cached prefix, and close to the reference backend. The interpreter's numpy
GEMMs are not a GPU's MMA units: on a GPU this is still to be checked (docs/features.md)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.attention_cases import build_case
from tests.worker.interpret import run_under_interpreter
from tests.worker.test_batch_invariant import L, check_attention_invariance
from worker_service.attention.reference import ReferenceAttentionBackend

CHILD_FLAG = "TESSERA_TRITON_INVARIANT_CHILD"
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"
NUM_CHILD_TESTS = 2
# bf16 with every key, float32 with a sliding window (each interpreted case takes minutes)
CASES = [(torch.bfloat16, 0), (torch.float32, 48)]

if IN_CHILD:
    from worker_service.attention.triton_backend import TritonAttentionBackend

    @pytest.mark.parametrize(("dtype", "window"), CASES)
    def test_triton_attention_is_batch_invariant(dtype: torch.dtype, window: int) -> None:
        backend = TritonAttentionBackend()
        backend.make_batch_invariant()
        alone = check_attention_invariance(backend, dtype, window)
        case = build_case([(0, L)], 6, 2, 64, 16, dtype)
        ref = ReferenceAttentionBackend()
        ref.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
        expected = ref.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale,
                               window)  # fmt: skip
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(alone.float(), expected.float(), rtol=tol, atol=tol)

else:

    @pytest.mark.slow
    def test_triton_batch_invariance_under_interpreter() -> None:
        run_under_interpreter(__file__, CHILD_FLAG, NUM_CHILD_TESTS)
