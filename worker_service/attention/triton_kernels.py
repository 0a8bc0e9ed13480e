"""Triton kernels for the paged KV pool: a slot writer and a varlen paged attention.

Both kernels take every tensor by pointer and strides, so views (for example K/V split
out of a fused QKV projection) need no copy as long as their last dimension is contiguous.

Paged attention, one program per (query block, kv head):
- the packed new tokens of all requests are cut into blocks of BLOCK_Q tokens per
  request; program 0's axis walks these blocks across requests, and a binary search over
  `query_start_loc` finds the request a block belongs to (no host-side bookkeeping);
- a program handles the whole group of query heads that share its kv head (GQA), so one
  tile of K/V serves BLOCK_Q * group query rows (`BLOCK_M` rows, padded to a power of 2);
- new token j of a request with seq_len keys sits at position seq_len - query_len + j and
  sees keys 0..that position (the cached prefix plus the new tokens up to itself);
- keys are visited in tiles of TILE_N positions; each position's block id comes from the
  block table, so any block size works and a tile may span several blocks;
- softmax is online (running max and sum, base-2 exponentials) in float32;
- batch-invariant mode (`paged_attention(batch_invariant=True)`, --deterministic): one token
  per program (BLOCK_Q = 1, BLOCK_M the decode size), so a token's heads always sit in the
  same rows of the same-shaped dots and its key tiles start where its own position puts them,
  whatever its request's chunking or the step's other tokens (a GEMM's row may round
  differently in another row position: numpy's, under the interpreter, does);
- a quantized pool (KV_QUANT, attention.kv_quant: int8 or float8 e4m3 values, then a
  float16 scale per slot and head in the last two elements of each head row) is read as
  its values widened to the query dtype (exact) with the scales applied to each key's
  scores and to each value's weights; float8 is decoded from its bits, so any GPU (and the
  interpreter) reads it.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when this module is first
imported: with TRITON_INTERPRET=1 set before that, the kernels run on CPU tensors through
the interpreter (how the tests cover them without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from worker_service.attention import kv_quant

_KV_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2}  # the kernel's KV_QUANT per pool dtype


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, negative = skip
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    DIM_PADDED: tl.constexpr,
):
    """One program per token: copy its K and V (all kv heads) into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PADDED)[:, None]  # [HEADS_PADDED, 1]
        dims = tl.arange(0, DIM_PADDED)[None, :]  # [1, DIM_PADDED]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
        v = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
        k_dst = k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_s + heads * stride_kc_h
        v_dst = v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_s + heads * stride_vc_h
        tl.store(k_dst + dims, k, mask=mask)
        tl.store(v_dst + dims, v, mask=mask)


@triton.jit
def _widen(x, KV_QUANT: tl.constexpr):
    """Values of a quantized pool as float32: int8 as they are (KV_QUANT 1), float8 e4m3fn
    from their bits (2): the 7 magnitude bits under float32's exponent, times 2^(127 - 7)."""
    if KV_QUANT == 2:
        bits = x.to(tl.int32) & 0xFF
        f = (((bits & 0x80) << 24) | ((bits & 0x7F) << 20)).to(tl.float32, bitcast=True)
        return f * 1.329227995784916e36  # 2^120
    return x.to(tl.float32)


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning packed query block `q_block`: request i's blocks start at
    query_start_loc[i] // BLOCK_Q + i, so this is the last i whose start is <= q_block."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 2 quantized)]
    v_cache_ptr,
    k_scale_ptr,  # quantized: the K pool as float16 [.., width / 2]; scale at HEAD_DIM / 2
    v_scale_ptr,
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale_log2,  # softmax scale * log2(e)
    num_reqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_ks_b,  # the scale views' strides (float16 elements)
    stride_ks_s,
    stride_ks_h,
    stride_vs_b,
    stride_vs_s,
    stride_vs_h,
    stride_bt,
    window,  # sliding window (read only when SLIDING): q_pos - kv_pos < window
    softcap,  # score soft-capping (read only when SOFTCAP): softcap * tanh(score / softcap)
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program (BLOCK_Q tokens x GROUP heads, padded)
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # key positions per loop iteration
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the interpreter's bf16 dot is wrong)
    SLIDING: tl.constexpr,  # a sliding window (else every earlier key is seen)
    SOFTCAP: tl.constexpr,  # soft-capped scores (Gemma 2)
    KV_QUANT: tl.constexpr,  # 0: pools in the query dtype; 1: int8, 2: float8 e4m3 (+ scales)
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        q_idx = q_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] new-token index in the request
        head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
        row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = context_len + q_idx  # [BLOCK_M] absolute position
        token = (q_start + q_idx).to(tl.int64)
        dims = tl.arange(0, DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        q_offs = token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
        q = tl.load(query_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base 2)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exponentials
        acc = tl.zeros([BLOCK_M, DIM_PADDED], dtype=tl.float32)
        # Keys the last query row of this block may see.
        kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
        block_row = block_table_ptr + req.to(tl.int64) * stride_bt
        kv_begin = 0
        if SLIDING:  # keys the first query row of this block may see start here
            kv_begin = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
        for tile_start in range(kv_begin, kv_end, TILE_N):
            kv_pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N]
            kv_valid = kv_pos < kv_end
            block_id = tl.load(block_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)
            block_id = block_id.to(tl.int64)
            in_block = kv_pos % BLOCK_SIZE
            k_offs = (
                block_id[None, :] * stride_kc_b
                + in_block[None, :] * stride_kc_s
                + kv_head * stride_kc_h
                + dims[:, None]
            )  # [DIM_PADDED, TILE_N]
            k = tl.load(
                k_cache_ptr + k_offs, mask=dim_valid[:, None] & kv_valid[None, :], other=0.0
            )
            if KV_QUANT:
                k = _widen(k, KV_QUANT).to(query_ptr.dtype.element_ty)
            if DOT_IN_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
            if KV_QUANT:  # each key's scale
                ks_offs = (
                    block_id * stride_ks_b + in_block * stride_ks_s + kv_head * stride_ks_h
                )  # [TILE_N]
                k_scale = tl.load(k_scale_ptr + ks_offs + HEAD_DIM // 2, mask=kv_valid, other=0.0)
                s = s * k_scale.to(tl.float32)[None, :]
            if SOFTCAP:  # on the natural-log scores: tanh(x) = 2 / (1 + exp(-2x)) - 1
                x = s * (0.6931471805599453 / softcap)  # score / softcap (s is in log2 units)
                s = (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0) * (softcap * 1.4426950408889634)
            visible = row_valid[:, None] & kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]
            alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated so far
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_offs = (
                block_id[:, None] * stride_vc_b
                + in_block[:, None] * stride_vc_s
                + kv_head * stride_vc_h
                + dims[None, :]
            )  # [TILE_N, DIM_PADDED]
            v = tl.load(
                v_cache_ptr + v_offs, mask=kv_valid[:, None] & dim_valid[None, :], other=0.0
            )
            if KV_QUANT:  # values widened; each one's scale goes on its weights
                v = _widen(v, KV_QUANT).to(query_ptr.dtype.element_ty)
                vs_offs = block_id * stride_vs_b + in_block * stride_vs_s + kv_head * stride_vs_h
                v_scale = tl.load(v_scale_ptr + vs_offs + HEAD_DIM // 2, mask=kv_valid, other=0.0)
                p_cast = (p * v_scale.to(tl.float32)[None, :]).to(query_ptr.dtype.element_ty)
            else:
                p_cast = p.to(v_cache_ptr.dtype.element_ty)  # probabilities in the KV dtype
            if DOT_IN_FP32:
                v = v.to(tl.float32)
                p_cast = p_cast.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_cast, v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
        tl.store(
            out_ptr + o_offs,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


def interpreted() -> bool:
    """Whether the kernels were built for the CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(_paged_attention_kernel, JITFunction)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Launch the slot writer: one program per token; negative slots are skipped. A
    quantized pool gets each row quantized first (torch), copied as bytes."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if kv_quant.is_quantized(k_cache):
        key = kv_quant.quantize(key, k_cache.dtype).view(torch.uint8)
        value = kv_quant.quantize(value, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        head_dim = key.shape[2]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        DIM_PADDED=triton.next_power_of_2(head_dim),
    )


def block_m_for(max_query_len: int, group: int) -> int:
    """Query rows per program: small for decode (one token x its head group), larger for
    prefill so one K/V tile serves many query rows. Always a power of 2, at least 16."""
    rows = group if max_query_len == 1 else 64
    return max(16, triton.next_power_of_2(max(rows, group)))


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    max_query_len: int,
    scale: float,
    tile_n: int = 32,
    window: int = 0,
    softcap: float = 0.0,
    batch_invariant: bool = False,
) -> None:
    """Launch the paged attention kernel, writing into `out` (each token over the last
    `window` keys up to itself with a sliding window > 0). `batch_invariant`: a token's
    output independent of the step's other tokens and requests (module doc)."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    quant = _KV_QUANT.get(k_cache.dtype, 0)
    # quantized: the pools' float16 views (their scales), and float8 values read as bytes
    k_scale = k_cache.view(torch.float16) if quant else k_cache
    v_scale = v_cache.view(torch.float16) if quant else v_cache
    if quant == 2:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    block_m = block_m_for(1 if batch_invariant else max_query_len, group)
    block_q = 1 if batch_invariant else block_m // group
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_table,
        seq_lens,
        query_start_loc,
        scale * 1.4426950408889634,  # log2(e)
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *(k_scale.stride()[:3] if quant else (0, 0, 0)),
        *(v_scale.stride()[:3] if quant else (0, 0, 0)),
        block_table.stride(0),
        window,
        softcap,
        GROUP=group,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=interpreted() and query.dtype == torch.bfloat16,
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        KV_QUANT=quant,
    )
