"""The Triton fused-MoE kernel against the torch grouped path, on CPU through the Triton
interpreter. As in test_attention_triton.py, Triton picks compiling or interpreting when the
kernel is decorated, so the cases run in a child pytest started with TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

from tests.worker.interpret import run_under_interpreter
from worker_service.models.moe import fused_moe_torch, select_experts

CHILD_FLAG = "TESSERA_MOE_TRITON_CHILD"
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"
F32, BF16 = torch.float32, torch.bfloat16
# (tokens, experts, top_k, hidden, intermediate, dtype): one token, uneven groups, a block
# of 16 rows spilling over, sizes that are not powers of two, experts nobody picks
CASES = [
    (1, 8, 2, 64, 48, F32),
    (5, 4, 1, 32, 16, F32),
    (37, 8, 2, 64, 40, F32),
    (20, 16, 4, 48, 24, F32),
    (37, 8, 2, 64, 48, BF16),
]
NUM_CHILD_TESTS = len(CASES) + 2


def make_case(
    n: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n * 131 + e)
    x = torch.randn(n, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / 8).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) / 6).to(dtype)
    logits = torch.randn(n, e, generator=gen) * 3
    weights, ids = select_experts(logits.to(dtype), k, True, dtype == F32)
    return x, w13, w2, weights, ids


if IN_CHILD:
    from worker_service.models import moe_triton

    def test_running_interpreted() -> None:
        assert moe_triton.interpreted()

    def test_align_groups_pairs_by_expert_in_whole_blocks() -> None:
        ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
        pairs, block_expert = moe_triton.align_by_expert(ids, 4, 4)
        # bound 6 + 4 * 3 = 18 -> 20 slots, 5 blocks; expert 3 has no pairs, no block; 4 =
        # unused block
        assert block_expert.tolist() == [0, 1, 2, 4, 4]
        want = [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]  # sentinel 6 = n * k
        assert pairs.tolist() == want + [6] * 8

    @pytest.mark.parametrize("n,e,k,h,inter,dtype", CASES)
    def test_triton_matches_torch(
        n: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype
    ) -> None:
        x, w13, w2, weights, ids = make_case(n, e, k, h, inter, dtype)
        got = moe_triton.fused_moe_triton(x, w13, w2, weights, ids)
        expected = fused_moe_torch(x, w13, w2, weights, ids)
        assert got.dtype == dtype and got.shape == x.shape
        tol = 1e-5 if dtype == F32 else 2e-2
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)

else:

    def test_kernel_under_interpreter() -> None:
        """Runs this file's kernel cases in a child pytest with TRITON_INTERPRET=1."""
        pytest.importorskip("triton")
        run_under_interpreter(__file__, CHILD_FLAG, NUM_CHILD_TESTS)
