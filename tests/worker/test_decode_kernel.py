"""The C++ paged decode kernel, each build this CPU runs (portable, AVX2, AVX-512, AVX-512
with bf16 dot products), against dense attention on the unpaged tensors: GQA groups 1-8,
head sizes 64 and 128, contexts from 1 token to 4096 across block boundaries, and batches
few enough that the kernel splits each request's KV over the threads and merges the parts."""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention_cases import PagedCase, build_case, dense_attention, tolerance
from worker_service import native
from worker_service.attention import cpu_kernel

F32, BF16 = torch.float32, torch.bfloat16


def kernel_levels() -> list[str]:
    """The builds this CPU runs: portable and AVX2 everywhere, then up to its own level."""
    levels = ["", "AVX2"]
    own = native.cpu_level()
    if own.startswith("AVX512"):
        levels.append("AVX512")
    if own == "AVX512_BF16":
        levels.append(own)
    return levels


# (cached context, 1 new token) per request: block edges of 16, one token, and one long
# request beside short ones (split while the short ones are not).
CONTEXTS = {
    "edges": [(15, 1), (16, 1), (1, 1), (31, 1), (32, 1), (0, 1)],
    "long_mixed": [(4095, 1), (600, 1), (3, 1)],
    "one_long": [(4095, 1)],
}


def run_kernel(level: str, requests: list[tuple[int, int]], group: int, head_dim: int,
               dtype: torch.dtype, kv_heads: int = 2, window: int = 0, threads: int = 2,
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kernel output, dense ground truth) for one decode step over a shuffled pool."""
    case = build_case(requests, kv_heads * group, kv_heads, head_dim, 16, dtype)
    k_cache, v_cache = case.k_cache.nan_to_num(1e4), case.v_cache.nan_to_num(1e4)
    slots = case.meta.slot_mapping.long()
    k_cache.view(-1, kv_heads, head_dim)[slots] = case.key
    v_cache.view(-1, kv_heads, head_dim)[slots] = case.value
    n = len(requests)
    batch = cpu_kernel.DecodeBatch(
        block_table=case.meta.block_table.contiguous(),
        seq_lens=case.meta.seq_lens.contiguous(),
        reqs=torch.arange(n),
        rows=torch.arange(n),
    )
    out = torch.full_like(case.query, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lib = cpu_kernel.build(level)
        cpu_kernel.paged_decode(lib, case.query, k_cache, v_cache, out, batch, case.scale, window)
    finally:
        torch.set_num_threads(before)
    return out, dense_attention(case) if not window else windowed_dense(case, window)


def windowed_dense(case: PagedCase, window: int) -> torch.Tensor:
    """Dense attention of each request's one query over its last `window` keys."""
    for i in range(len(case.full_keys)):
        keep = case.full_keys[i].shape[0] - window
        if keep > 0:
            case.full_keys[i] = case.full_keys[i][keep:]
            case.full_values[i] = case.full_values[i][keep:]
    return dense_attention(case)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda lv: lv or "portable")
@pytest.mark.parametrize("contexts", sorted(CONTEXTS))
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_kernel_matches_dense(
    level: str, contexts: str, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    out, expected = run_kernel(level, CONTEXTS[contexts], group, head_dim, dtype)
    torch.testing.assert_close(out.float(), expected, atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda lv: lv or "portable")
@pytest.mark.parametrize("group", [2, 4, 5, 6, 7])
def test_every_group_size(level: str, group: int) -> None:
    out, expected = run_kernel(level, CONTEXTS["edges"] + [(700, 1)], group, 64, BF16, 1)
    torch.testing.assert_close(out.float(), expected, atol=tolerance(BF16), rtol=0)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda lv: lv or "portable")
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_split_kv_agrees_with_one_pass(level: str, threads: int) -> None:
    """A lone long request is cut into KV splits (more with more threads); the merged result
    is what dense attention gives, with a sliding window too."""
    for window in (0, 300):
        out, expected = run_kernel(level, [(2999, 1)], 3, 64, F32, 3, window, threads)
        torch.testing.assert_close(out, expected, atol=tolerance(F32), rtol=0)
