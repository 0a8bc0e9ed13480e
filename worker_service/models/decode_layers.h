// A decode step through every decoder layer of a Llama-family model in one call: for each
// layer, add + RMSNorm -> qkv GEMM -> RoPE -> K/V into the paged pool -> paged attention ->
// o GEMM -> add + RMSNorm -> gate_up GEMM -> SiLU * up -> down GEMM. At a few rows a step is
// bound by reading the weights, and the ~15 torch calls a layer costs from Python (a few
// microseconds each, 30 layers) are a third of it; here they are plain function calls.
//
// The ops are the ones the layers call one by one (elementwise.h, small_gemm.h, gguf_q8.h),
// so the results are theirs; attention is the paged decode kernel (attention/cpu_decode.cpp,
// another library), reached through the function pointer the caller passes.
//
// Layouts (row-major, elements of the model dtype T: float, or bf16 as uint16_t):
//   residual  [rows, hidden]: in: the token embeddings; out: the residual stream
//   x         [rows, hidden]: out: the last layer's MLP output (the model's final norm
//             adds it to the residual)
//   cos, sin  [rows, head_dim / 2]; slots [rows]: each row's KV slot
//   pools     [blocks, block_size, kv_heads, head_dim] (head_dim + 2 bytes a head row when
//             quantized: kv_quant.h); block_table [num_reqs, table_stride]
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../attention/kv_quant.h"
#include "amx_gemm.h"
#include "elementwise.h"
#include "gguf_q8.h"
#include "small_gemm.h"

extern "C" {

// A GEMM run by another library (models/onednn_bridge.cpp: oneDNN's packed GEMM) over its
// own copy of a weight: out [rows, N] = x [rows, K] @ weight.T + bias in the model dtype.
// Status: 0 ok.
typedef int (*TesseraGemm)(void* context, const void* x, void* out, int64_t rows);

// One GEMM's weight: dense [N, K] in the model dtype (type -1) or GGUF blocks of ggml `type`
// ([N, K / block values * block bytes]); bias [N] in the model dtype or null; amx: the dense
// bf16 weight in amx_gemm.h's tile layout, taken instead of `weight` (or null); gemm (or
// null) with its context: a dense weight's GEMM from gemm_rows rows on.
struct TesseraLinear {
  int64_t type;
  const void* weight;
  const void* bias;
  int64_t K, N;
  const void* amx;
  TesseraGemm gemm;
  void* context;
  int64_t gemm_rows;
};

struct TesseraLayer {
  TesseraLinear qkv, o, gate_up, down;
  const void* input_norm;  // [hidden]
  const void* post_norm;   // [hidden]
  void* k_cache;           // the layer's pools
  void* v_cache;
  int64_t window;  // sliding window (0: full attention)
};

// cache_dtype: the pools' elements, as the paged decode kernel takes them: 0 the model dtype,
// 2 int8, 3 float8 e4m3fn (values and a half scale per slot and KV head: kv_quant.h);
// rotate: K and the queries go through the Hadamard rotation (kv_rotation.py: int8 pools).
struct TesseraDecodeShape {
  int64_t hidden, heads, kv_heads, head_dim, inter, block_size, cache_dtype, rotate;
  float eps, scale;
};

// attention/cpu_decode.cpp's tessera_paged_decode.
// (dtype, cache_dtype, query, k_cache, v_cache, out, block_table, table_stride, seq_lens, reqs,
//  rows, num_decode, heads, kv_heads, head_dim, block_size, window, split_tokens, scale,
//  num_threads)
typedef int (*TesseraPagedDecode)(int, int, const void*, const void*, const void*, void*,
                                  const int32_t*, int64_t, const int32_t*, const int64_t*,
                                  const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, float, int);
}

namespace decode_layers {

// Per-step arguments shared by every layer.
struct Step {
  int64_t rows;
  const int64_t* slots;
  const int32_t* block_table;
  int64_t table_stride;
  const int32_t* seq_lens;
  const int64_t* index;  // 0..rows-1: row i is request i's token
  TesseraPagedDecode attend;
  int num_threads;
};

template <typename T>
constexpr int kDtype = std::is_same_v<T, float> ? 0 : 1;

// out [rows, N] = x [rows, K] @ weight.T + bias. Status: 0 ok, 3 the callback failed, else
// the GEMM's. A step's dense bf16 GEMMs take AMX tiles where the layer has them (at every row
// count: cpu_ops.AMX_ROWS), else the callback from its rows on, else the few-row GEMM.

template <typename T>
int linear(const TesseraLinear& l, const T* x, T* out, const Step& s) {
  const T* bias = static_cast<const T*>(l.bias);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (l.amx)
      return amx_gemm::gemm(x, static_cast<const T*>(l.amx), bias, out, s.rows, l.K, l.N,
                            s.num_threads)
                 ? 0
                 : 2;
  }
#endif
  if (l.gemm && s.rows >= l.gemm_rows) return l.gemm(l.context, x, out, s.rows) ? 3 : 0;
  if (l.type < 0) {
    const T* w = static_cast<const T*>(l.weight);
    return small_gemm::gemm(x, w, bias, out, s.rows, l.K, l.N, s.num_threads) ? 0 : 2;
  }
  // as quant.BlockWeight.linear: the fast path for bf16, float32 stays exact
  const int path = kDtype<T> ? gguf_q8::kFast : gguf_q8::kExact;
  return gguf_q8::gemm_or_float(int(l.type), x, static_cast<const uint8_t*>(l.weight), bias,
                                out, s.rows, l.K, l.N, path, s.num_threads);
}

// The scratch of one step, reused by every layer.
template <typename T>
struct Buffers {
  std::vector<T> h, qkv, query, attn, o, gate_up, act;
  Buffers(const TesseraDecodeShape& d, int64_t rows)
      : h(rows * d.hidden),
        qkv(rows * (d.heads + 2 * d.kv_heads) * d.head_dim),
        query(rows * d.heads * d.head_dim),
        attn(rows * d.heads * d.head_dim),
        o(rows * d.hidden),
        gate_up(rows * 2 * d.inter),
        act(rows * d.inter) {}
};

// One row's K or V heads (kv_heads x head_dim, after RoPE) into a pool at `slot`: as they are,
// or quantized per head (kv_write::quantize_row, as kv_quant.write does in torch).
// `heads` is K (rotated first where d.rotate) or V.
template <typename T>
void write_kv(const TesseraDecodeShape& d, const T* heads, void* pool, int64_t slot, bool key) {
  const int64_t dim = d.head_dim, kv = d.kv_heads * dim;
  if (d.cache_dtype == 0) {
    std::memcpy(static_cast<T*>(pool) + slot * kv, heads, kv * sizeof(T));
    return;
  }
  const int64_t width = dim + kScaleElems<int8_t>;  // bytes of a head row
  auto* rows = static_cast<uint8_t*>(pool) + slot * d.kv_heads * width;
  T rotated[1024];  // fused_decode.py fuses a rotated pool only for heads of <= 1024
  for (int64_t h = 0; h < d.kv_heads; ++h) {
    const T* head = heads + h * dim;
    if (key && d.rotate) {
      std::memcpy(rotated, head, dim * sizeof(T));
      kv_write::hadamard(rotated, dim);
      head = rotated;
    }
    if (d.cache_dtype == 2)
      kv_write::quantize_row(head, dim, reinterpret_cast<int8_t*>(rows + h * width));
    else
      kv_write::quantize_row(head, dim, reinterpret_cast<Fp8E4M3*>(rows + h * width));
  }
}

// qkv rows after RoPE: K and V into the layer's pools at the rows' slots, the queries into
// one contiguous [rows, heads, head_dim] block for the attention kernel.
template <typename T>
void scatter_qkv(const TesseraDecodeShape& d, const TesseraLayer& l, Buffers<T>& b,
                 const Step& s) {
  const int64_t q = d.heads * d.head_dim, kv = d.kv_heads * d.head_dim, width = q + 2 * kv;
  for (int64_t r = 0; r < s.rows; ++r) {
    const T* row = b.qkv.data() + r * width;
    T* query = b.query.data() + r * q;
    std::memcpy(query, row, q * sizeof(T));
    if (d.rotate)  // scores against rotated K: q H . k H = q . k
      for (int64_t h = 0; h < d.heads; ++h) kv_write::hadamard(query + h * d.head_dim, d.head_dim);
    write_kv(d, row + q, l.k_cache, s.slots[r], true);
    write_kv(d, row + q + kv, l.v_cache, s.slots[r], false);
  }
}

// Attention half of a layer: h (normed input) -> b.o (o_proj output).
template <typename T>
int attention(const TesseraDecodeShape& d, const TesseraLayer& l, Buffers<T>& b,
              const T* cos, const T* sin, const Step& s) {
  int status = linear(l.qkv, b.h.data(), b.qkv.data(), s);
  if (status) return status;
  const int64_t width = (d.heads + 2 * d.kv_heads) * d.head_dim;
  elementwise::rope(b.qkv.data(), s.rows, d.heads + d.kv_heads, d.head_dim, width, cos, sin,
                    s.num_threads);
  scatter_qkv(d, l, b, s);
  status = s.attend(kDtype<T>, int(d.cache_dtype), b.query.data(), l.k_cache, l.v_cache, b.attn.data(),
                    s.block_table, s.table_stride, s.seq_lens, s.index, s.index, s.rows, d.heads,
                    d.kv_heads, d.head_dim, d.block_size, l.window, /*split_tokens=*/0, d.scale, s.num_threads);
  if (status) return 10 + status;
  return linear(l.o, b.attn.data(), b.o.data(), s);
}

template <typename T>
int run(const TesseraDecodeShape& d, const TesseraLayer* layers, int64_t num_layers, T* x,
        T* residual, const T* cos, const T* sin, const Step& s) {
  Buffers<T> b(d, s.rows);
  const int64_t rows = s.rows, hidden = d.hidden;
  for (int64_t i = 0; i < num_layers; ++i) {
    const TesseraLayer& l = layers[i];
    const T* add = i == 0 ? nullptr : x;  // layer 0: the residual is the embeddings
    elementwise::add_rms_norm(add, residual, static_cast<const T*>(l.input_norm), b.h.data(),
                              rows, hidden, d.eps, s.num_threads);
    int status = attention(d, l, b, cos, sin, s);
    if (status) return status;
    elementwise::add_rms_norm(b.o.data(), residual, static_cast<const T*>(l.post_norm),
                              b.h.data(), rows, hidden, d.eps, s.num_threads);
    status = linear(l.gate_up, b.h.data(), b.gate_up.data(), s);
    if (status) return status;
    elementwise::silu_mul(b.gate_up.data(), b.act.data(), rows, d.inter, s.num_threads);
    status = linear(l.down, b.act.data(), x, s);
    if (status) return status;
  }
  return 0;
}

}  // namespace decode_layers
