"""The CPU attention backend: a paged decode kernel, and batched SDPA over gathered K/V.

Plan per step (built once, shared by all layers):
- decode requests (one new token each) all go to one call of the C++ paged
  decode kernel (`cpu_kernel`), which reads K/V straight from the pool. Where it
  cannot be built, or where HF's exact kernels are asked for, they are sorted by
  length and cut into a few groups (at least DECODE_GROUP requests each), each
  attended in ONE SDPA call: its blocks are gathered into a padded
  [group, kv_heads, max_seq, head_dim] batch with a key-padding mask (no mask
  when the lengths are equal). Grouping by length keeps the padding small;
- every other request (a prefill chunk, possibly after a cached prefix) is one
  call of the prefill kernel (`cpu_kernel.paged_prefill`: bf16 queries over a bf16
  or quantized pool, no sliding window; on the engine the library runs: AMX tiles by
  default where the CPU has them), which reads K/V in place from the pool; or else one SDPA
  call over its gathered K/V with a causal mask offset by its cached length (`is_causal`
  when there is no prefix).
There is no per-token Python loop; the loop is per prefill request.

Batch-invariant mode (--deterministic, `make_batch_invariant`): every new token, prefill or
decode, is a row of the one kernel call with its own causal length (as verified draft tokens
are), and the kernel splits a row's KV at fixed token counts (DETERMINISTIC_SPLIT_TOKENS) rather
than by the step's size; a token's output then depends only on its query and its context's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_service.attention import cpu_kernel, kv_quant
from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.attention.reference import ReferenceAttentionBackend


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [num_decode] token rows (== request rows' query starts)
    block_table: torch.Tensor  # [num_decode, blocks] block ids covering max_seq
    max_seq: int
    mask: torch.Tensor | None  # [num_decode, 1, 1, max_seq] bool; None for one request
    contiguous: bool  # rows are 0..num_decode-1


@dataclass
class _Prefill:
    start: int  # first token row
    end: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks] int32 block ids covering seq_len
    mask: torch.Tensor | None  # [query_len, seq_len] bool; None means is_causal
    window: int  # the sliding window the mask keeps (0: none)


@dataclass
class _Plan:
    decode: list[_DecodeGroup]  # SDPA decode calls (without the kernel)
    kernel_decode: cpu_kernel.DecodeBatch | None  # every decode request in one kernel call
    prefills: list[_Prefill]


# Decode requests per length group: fewer means less padding but more kernel calls.
DECODE_GROUP = 8
# Batch-invariant mode: a row's KV is split (for threads) every this many tokens of its own.
DETERMINISTIC_SPLIT_TOKENS = 512


class CpuAttentionBackend(AttentionBackend):
    """Attention for CPUs (bf16 or fp32): a C++ paged decode kernel, torch SDPA for the rest."""

    name = "cpu"

    def __init__(self, decode_kernel: bool = True) -> None:
        """decode_kernel: use the C++ paged decode kernel when it builds (else SDPA groups)."""
        self._plan_for: AttentionMetadata | None = None
        self._plans: dict[int, _Plan] = {}  # by sliding window (0: none), for _plan_for
        self.fold_gqa = True  # decode: query heads of one KV head as its query rows
        self._kernel = cpu_kernel.load() if decode_kernel else None
        # The prefill kernel (bf16 prompts; the engine the library runs), in the same library.
        engine = self._kernel is not None and cpu_kernel.prefill_engine(self._kernel) is not None
        self._prefill_kernel = self._kernel if engine else None
        self._reference = ReferenceAttentionBackend()
        self.split_tokens = 0  # > 0: batch-invariant mode (make_batch_invariant)

    @property
    def prefill_kernel(self) -> str | None:
        """The prefill kernel's engine ("tiles", "dots"), or None where prefills run SDPA."""
        return (
            None
            if self._prefill_kernel is None
            else cpu_kernel.prefill_engine(self._prefill_kernel)
        )

    @property
    def decode_kernel(self) -> bool:
        """Whether decode requests run the C++ paged kernel (float32 / bf16 inputs)."""
        return self._kernel is not None and self.fold_gqa

    def match_hf_kernels(self) -> None:
        """HF's decode call (enable_gqa, one query row): folding rounds bf16 differently; and
        its prefill call (SDPA), which sums in another order than the prefill kernel."""
        self.fold_gqa = False
        self._prefill_kernel = None

    def make_batch_invariant(self) -> None:
        """Every token a kernel row with fixed KV splits; needs the C++ kernel (module doc)."""
        if not self.decode_kernel:
            why = "HF's kernels were asked for" if self._kernel else "it did not build"
            raise ValueError(f"--deterministic needs the CPU attention kernel, but {why}")
        self.split_tokens = DETERMINISTIC_SPLIT_TOKENS

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if kv_quant.is_quantized(k_cache):
            kv_quant.write(key, k_cache, slot_mapping)
            kv_quant.write(value, v_cache, slot_mapping)
            return
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_pool, v_pool = (c.view(-1, kv_heads, head_dim) for c in (k_cache, v_cache))
        rows_apart = cpu_kernel.rows_apart(key) and cpu_kernel.rows_apart(value)
        if self._kernel is not None and rows_apart:
            cpu_kernel.scatter_rows(self._kernel, key, k_pool, slot_mapping)
            cpu_kernel.scatter_rows(self._kernel, value, v_pool, slot_mapping)
            return
        k_pool.index_copy_(0, slot_mapping, key)
        v_pool.index_copy_(0, slot_mapping, value)

    def _forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        if self.split_tokens and (softcap > 0 or query.dtype not in cpu_kernel.DTYPES):
            raise ValueError(
                "--deterministic: no batch-invariant CPU attention for score "
                f"soft-capping or {query.dtype} (float32 and bfloat16 only)"
            )
        if softcap > 0:  # SDPA cannot soft-cap scores: the plain-torch path (slower)
            return self._reference._forward(query, k_cache, v_cache, meta, scale, window, softcap)
        use_kernel = self.decode_kernel and query.dtype in cpu_kernel.DTYPES
        plan = self._get_plan(meta, k_cache.shape[1], use_kernel, window)
        if len(plan.decode) == 1 and plan.decode[0].contiguous and not plan.prefills:
            return self._decode(query, k_cache, v_cache, plan.decode[0], scale)
        out = torch.empty_like(query)
        if plan.kernel_decode is not None:
            assert self._kernel is not None
            cpu_kernel.paged_decode(
                self._kernel,
                query.contiguous(),
                k_cache,
                v_cache,
                out,
                plan.kernel_decode,
                scale,
                window,
            )
        for group in plan.decode:
            out[group.rows] = self._decode(query[group.rows], k_cache, v_cache, group, scale)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(query[p.start : p.end], k_cache, v_cache, p, scale)
        return out

    def _decode(
        self,
        query: torch.Tensor,  # [num_decode, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        n, heads = query.shape[0], query.shape[1]
        kv_heads, head_dim = k_cache.shape[2], query.shape[2]
        flat = group.block_table.view(-1)  # [n * blocks]
        k = kv_quant.gather(k_cache, flat, query.dtype).view(n, -1, kv_heads, head_dim)
        v = kv_quant.gather(v_cache, flat, query.dtype).view(n, -1, kv_heads, head_dim)
        k, v = k[:, : group.max_seq], v[:, : group.max_seq]
        if not self.fold_gqa:
            out = F.scaled_dot_product_attention(
                query.unsqueeze(2),  # [n, heads, 1, head_dim]
                k.transpose(1, 2),  # [n, kv_heads, max_seq, head_dim]
                v.transpose(1, 2),
                attn_mask=group.mask,  # [n, 1, 1, max_seq] or None
                scale=scale,
                enable_gqa=True,
            )
            return out.reshape(n, heads, head_dim)
        # The query heads sharing a KV head act as that head's query rows: no GQA expansion,
        # and one kernel call per KV head, not per query head (2-4x faster on CPU).
        out = F.scaled_dot_product_attention(
            query.view(n, kv_heads, heads // kv_heads, head_dim),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=group.mask,
            scale=scale,
        )
        return out.reshape(n, heads, head_dim)

    def _prefill(
        self,
        query: torch.Tensor,  # [query_len, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        p: _Prefill,
        scale: float,
    ) -> torch.Tensor:
        kv_heads, head_dim = k_cache.shape[2], query.shape[2]
        if self._prefill_kernel and _kernel_prefills(query, k_cache, p):
            q = query.contiguous()
            lib = self._prefill_kernel
            return cpu_kernel.paged_prefill(lib, q, k_cache, v_cache, p.blocks, p.seq_len, scale)
        k = kv_quant.gather(k_cache, p.blocks, query.dtype).view(-1, kv_heads, head_dim)[
            : p.seq_len
        ]
        v = kv_quant.gather(v_cache, p.blocks, query.dtype).view(-1, kv_heads, head_dim)[
            : p.seq_len
        ]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),  # [1, heads, query_len, head_dim]
            k.transpose(0, 1).unsqueeze(0),  # [1, kv_heads, seq_len, head_dim]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None and p.end - p.start > 1,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [query_len, heads, head_dim]

    def _get_plan(
        self, meta: AttentionMetadata, block_size: int, use_kernel: bool, window: int
    ) -> _Plan:
        if meta is not self._plan_for:
            self._plans, self._plan_for = {}, meta
        plan = self._plans.get(window)
        if plan is None:
            plan = build_plan(meta, block_size, use_kernel, window, self.split_tokens)
            self._plans[window] = plan
        return plan


def build_plan(
    meta: AttentionMetadata,
    block_size: int,
    use_kernel: bool = False,
    window: int = 0,
    split_tokens: int = 0,
) -> _Plan:
    """Split a step's requests into decode calls (one kernel call, or SDPA length groups)
    and per-request prefill calls; masks keep each token to its sliding `window` (0: all).
    split_tokens > 0 (batch-invariant mode): every token one kernel row, fixed KV splits."""
    starts = meta.query_start_loc.tolist()
    if split_tokens:
        every = list(range(meta.num_reqs))
        return _Plan([], _verify_batch(meta, [], every, starts, split_tokens), [])
    decode_reqs = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    verify = set(meta.verify_reqs) if use_kernel else set()
    prefills = [
        _prefill_item(meta, i, starts[i], block_size, window)
        for i, q in enumerate(meta.query_lens_cpu)
        if q > 1 and i not in verify
    ]
    if verify:
        return _Plan([], _verify_batch(meta, decode_reqs, sorted(verify), starts), prefills)
    if use_kernel:
        return _Plan([], _kernel_batch(meta, decode_reqs, starts), prefills)
    groups = _length_groups(decode_reqs, meta.seq_lens_cpu)
    decode = [_decode_group(meta, g, starts, block_size, window) for g in groups]
    return _Plan(decode, None, prefills)


def _kernel_batch(
    meta: AttentionMetadata, decode_reqs: list[int], starts: list[int]
) -> cpu_kernel.DecodeBatch | None:
    if not decode_reqs:
        return None
    rows = torch.tensor([starts[i] for i in decode_reqs], dtype=torch.int64)
    reqs = torch.tensor(decode_reqs, dtype=torch.int64)
    return cpu_kernel.DecodeBatch(meta.block_table, meta.seq_lens, reqs, rows)


def _verify_batch(
    meta: AttentionMetadata,
    decode_reqs: list[int],
    verify: list[int],
    starts: list[int],
    split_tokens: int = 0,
) -> cpu_kernel.DecodeBatch:
    """Decode requests plus each verified token as a decode row of its own: token j of a
    request with q new tokens and seq_len s sees the first s - q + 1 + j keys (causal).
    A prefill chunk's tokens are verified tokens in this sense (batch-invariant mode)."""
    items = [(i, starts[i], meta.seq_lens_cpu[i]) for i in decode_reqs]
    for i in verify:
        q, s = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        items += [(i, starts[i] + j, s - q + 1 + j) for j in range(q)]
    req_rows = torch.tensor([i for i, _, _ in items], dtype=torch.int64)
    table = meta.block_table.index_select(0, req_rows).contiguous()  # [rows, max_blocks]
    seq_lens = torch.tensor([s for _, _, s in items], dtype=torch.int32)
    rows = torch.tensor([r for _, r, _ in items], dtype=torch.int64)
    return cpu_kernel.DecodeBatch(table, seq_lens, torch.arange(len(items)), rows, split_tokens)


def _length_groups(decode_reqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Requests sorted by length, cut into groups of DECODE_GROUP (no tiny last group)."""
    if len(decode_reqs) > DECODE_GROUP:
        decode_reqs = sorted(decode_reqs, key=seq_lens.__getitem__)
    cuts = range(0, len(decode_reqs), DECODE_GROUP)
    groups = [decode_reqs[c : c + DECODE_GROUP] for c in cuts]
    if len(groups) > 1 and len(groups[-1]) < DECODE_GROUP // 2:
        groups[-2:] = [groups[-2] + groups[-1]]
    return groups


def _decode_group(
    meta: AttentionMetadata, reqs: list[int], starts: list[int], block_size: int, window: int
) -> _DecodeGroup:
    device = meta.block_table.device
    seq_lens = [meta.seq_lens_cpu[i] for i in reqs]
    max_seq = max(seq_lens)
    blocks = -(-max_seq // block_size)
    index = torch.tensor(reqs, device=device)
    table = meta.block_table.index_select(0, index)[:, :blocks].long().contiguous()
    mask = None
    windowed = 0 < window < max_seq
    if windowed or (len(reqs) > 1 and min(seq_lens) != max_seq):
        lens = torch.tensor(seq_lens, device=device)[:, None]
        k_pos = torch.arange(max_seq, device=device)
        keep = k_pos < lens  # [n, max_seq]
        if windowed:
            keep &= k_pos >= lens - window
        mask = keep[:, None, None, :]
    rows = torch.tensor([starts[i] for i in reqs], device=device)
    contiguous = reqs == list(range(len(reqs))) and starts[len(reqs)] == len(reqs)
    return _DecodeGroup(rows, table, max_seq, mask, contiguous)


def _kernel_prefills(query: torch.Tensor, k_cache: torch.Tensor, p: _Prefill) -> bool:
    """Whether the prefill kernel takes this prefill: bf16 query over a bf16 or quantized
    pool, no sliding window, heads of 32..256 in steps of 32."""
    pool = k_cache.dtype == torch.bfloat16 or k_cache.dtype in cpu_kernel.CACHE_DTYPES
    bf16 = query.dtype == torch.bfloat16 and pool
    return bf16 and not p.window and query.shape[2] % 32 == 0 and query.shape[2] <= 256


def _prefill_item(
    meta: AttentionMetadata, i: int, start: int, block_size: int, window: int
) -> _Prefill:
    query_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
    blocks = meta.block_table[i, : -(-seq_len // block_size)]
    mask = None
    windowed = 0 < window < seq_len
    if seq_len > query_len or windowed:  # a cached prefix: query j sees keys up to prefix + j
        device = meta.block_table.device
        q_pos = torch.arange(query_len, device=device)[:, None] + (seq_len - query_len)
        k_pos = torch.arange(seq_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if windowed:  # and only the last `window` of them
            mask &= k_pos > q_pos - window
    return _Prefill(start, start + query_len, seq_len, blocks, mask, window if windowed else 0)
