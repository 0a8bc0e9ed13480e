// Fused ops of Llama-family decoders for CPUs, called through ctypes (cpu_ops.py) and built at
// first use by worker_service/native.py: RMSNorm with the residual add, rotary embedding in
// place and SiLU(gate) * up (elementwise.h: HF's bf16 rounding order), each replacing the
// 3-8 torch ops whose dispatch dominates small-batch decode; the sampler's grammar mask
// (apply_bitmask: float32 logits, int32 words) and its greedy pick (argmax_rows); the
// weight-bound GEMMs: few rows over bf16 weights (small_gemm.h: gemm_bf16), and any rows over
// GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as the file stores them
// (gguf_formats.h, gguf_gemm.h: gemm_gguf; with int8 activations, gguf_q8.h; Q4_0, Q4_1 and
// Q8_0 with each 16 rows interleaved, gguf_q8_rows.h); and a whole decode step through every
// decoder layer (decode_layers.h: decode_layers). dtype 0 = float32, 1 = bfloat16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "amx_gemm.h"
#include "bf16.h"
#include "decode_layers.h"
#include "elementwise.h"
#include "gguf_gemm.h"
#include "gguf_q8.h"
#include "small_gemm.h"

namespace {

using elementwise::add_rms_norm;
using elementwise::rope;
using elementwise::silu_mul;
using elementwise::threads_for;

void apply_bitmask(float* logits, int64_t vocab, const int64_t* rows, const uint32_t* bitmask,
                   int64_t n, int64_t words, int num_threads) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  elementwise::for_rows(n, n * vocab, num_threads, [&](int64_t i) {
    float* l = logits + rows[i] * vocab;
    const uint32_t* m = bitmask + i * words;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, vocab - w * 32);
      for (int64_t j = 0; j < end; ++j) {
        if (!((bits >> j) & 1u)) l[w * 32 + j] = neg_inf;
      }
    }
  });
}

// Each row's index of its first maximum, as torch's max(dim) picks it (the first NaN where the
// row has one). One pass: the lanes of one native vector (GCC vector extensions) each keep their
// largest value and where it first came, then the lanes meet. A vector wider than the ISA's is
// split by GCC into selects it cannot vectorize: 16 lanes on AVX2 ran 30x slower than 8.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
using Floats = float __attribute__((vector_size(4 * kLanes)));
using Ints = int32_t __attribute__((vector_size(4 * kLanes)));

int64_t argmax_row(const float* row, int64_t vocab) {
  Floats top = Floats{} - std::numeric_limits<float>::infinity();
  Ints at = Ints{} - 1, nan = Ints{}, index = {};
  for (int j = 0; j < kLanes; ++j) index[j] = j;
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes, index += kLanes) {
    Floats v;
    std::memcpy(&v, row + i, sizeof v);
    const Ints larger = v > top;  // strictly: a lane keeps its first maximum
    top = larger ? v : top;
    at = larger ? index : at;
    nan |= v != v;
  }
  float best = -std::numeric_limits<float>::infinity();
  int64_t where = -1;
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) {
    any_nan |= nan[j] != 0;
    const bool first = at[j] >= 0 && (top[j] > best || (top[j] == best && at[j] < where));
    if (first) best = top[j], where = at[j];
  }
  for (; i < vocab; ++i) {
    any_nan |= row[i] != row[i];
    if (row[i] > best) best = row[i], where = i;
  }
  if (any_nan) {
    where = 0;
    while (row[where] == row[where]) ++where;
  }
  return std::max<int64_t>(where, 0);  // a row of -inf only: 0
}

void argmax_rows(const float* x, int64_t rows, int64_t vocab, int64_t* out, int num_threads) {
  const int threads = static_cast<int>(std::clamp<int64_t>(rows, 1, threads_for(rows * vocab, num_threads)));
#pragma omp parallel for num_threads(threads)  // one row: no region to wake a thread for
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * vocab, vocab);
}

}  // namespace

extern "C" {

// Status 0 where this build has the AMX GEMM and the kernel lends this process the tiles;
// 1: not in this build (below AVX512_BF16), 2: refused by the kernel.
int tessera_amx_enable() {
#if defined(__AVX512BF16__)
  return amx_gemm::enable() ? 0 : 2;
#else
  return 1;
#endif
}

// 0 where this build has a GEMM over rows layout `type` (quant.ROWS_TYPES, gguf_q8_rows.h:
// AVX512-VNNI every one, AVX2 the Q4 formats), else 1.
int tessera_q8_rows(int type) {
#if defined(TESSERA_Q8_ROWS)
  return q8_rows::with_format(type, [](auto) {}) ? 0 : 1;
#else
  (void)type;
  return 1;
#endif
}

// x, out [rows, K] and [rows, N] bf16; packed: w [N, K] bf16 in amx_gemm.h's tile layout;
// bias [N] bf16 or null. Status 1: not in this build, 2: a shape it does not take.
int tessera_gemm_amx(const void* x, const void* packed, const void* bias, void* out, int64_t rows,
                     int64_t K, int64_t N, int num_threads) {
#if defined(__AVX512BF16__)
  using T = uint16_t;
  return amx_gemm::gemm(static_cast<const T*>(x), static_cast<const T*>(packed),
                        static_cast<const T*>(bias), static_cast<T*>(out), rows, K, N,
                        num_threads)
             ? 0
             : 2;
#else
  return 1;
#endif
}

// amx_gemm::gemm_gated: x [rows, K], out [rows, I] bf16; packed: the gate_up weight [2 I, K]
// in tile layout; bias [2 I] bf16 or null.
int tessera_gemm_amx_gated(const void* x, const void* packed, const void* bias, void* out,
                           int64_t rows, int64_t K, int64_t I, int num_threads) {
#if defined(__AVX512BF16__)
  using T = uint16_t;
  return amx_gemm::gemm_gated(static_cast<const T*>(x), static_cast<const T*>(packed),
                              static_cast<const T*>(bias), static_cast<T*>(out), rows, K, I,
                              num_threads)
             ? 0
             : 2;
#else
  (void)x, (void)packed, (void)bias, (void)out, (void)rows, (void)K, (void)I, (void)num_threads;
  return 1;
#endif
}

// x, out [rows, K] and [rows, N] bf16; w [N, K] bf16; bias [N] bf16 or null.
int tessera_gemm_bf16(const void* x, const void* w, const void* bias, void* out, int64_t rows,
                      int64_t K, int64_t N, int num_threads) {
  using T = uint16_t;
  return small_gemm::gemm(static_cast<const T*>(x), static_cast<const T*>(w),
                          static_cast<const T*>(bias), static_cast<T*>(out), rows, K, N,
                          num_threads)
             ? 0
             : 2;
}

// x, out [rows, K] and [rows, N] in `dtype`; w [N, K / 32 or K / 256] blocks of GGUF `type`
// (ggml's id: gguf_formats.h); bias [N] in `dtype` or null; path: gguf_q8::Path.
int tessera_gemm_gguf(int type, int dtype, const void* x, const void* w, const void* bias,
                      void* out, int64_t rows, int64_t K, int64_t N, int path,
                      int num_threads) {
  const auto* q = static_cast<const uint8_t*>(w);
  if (dtype == 0) return gguf_q8::gemm_or_float(type, static_cast<const float*>(x), q,
                                   static_cast<const float*>(bias), static_cast<float*>(out),
                                   rows, K, N, path, num_threads);
  if (dtype == 1) return gguf_q8::gemm_or_float(type, static_cast<const uint16_t*>(x), q,
                                   static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out),
                                   rows, K, N, path, num_threads);
  return 1;
}

// out [n, K] in `dtype` (0 float32, 1 bf16): rows ids [n] (int64) of GGUF blocks w of `type`
// ([rows, K / 32 or K / 256 blocks]), dequantized. Status 2: K not whole blocks, 3: the type,
// 4: an id outside the rows.
int tessera_dequantize_rows(int type, int dtype, const void* w, int64_t rows, const void* ids,
                            int64_t n, int64_t K, void* out) {
  const auto* q = static_cast<const uint8_t*>(w);
  const auto* at = static_cast<const int64_t*>(ids);
  if (dtype == 0)
    return gguf_gemm::dequantize_rows(type, q, rows, at, n, K, static_cast<float*>(out));
  if (dtype == 1)
    return gguf_gemm::dequantize_rows(type, q, rows, at, n, K, static_cast<uint16_t*>(out));
  return 1;
}

// logits [B, vocab] float32; bitmask [n, words] (bit j of word w: token 32 w + j allowed);
// rows [n]: the logits row of each bitmask row. Disallowed tokens become -inf.
int tessera_apply_bitmask(void* logits, int64_t vocab, const void* rows, const void* bitmask,
                          int64_t n, int64_t words, int num_threads) {
  if (words * 32 < vocab) return 2;
  apply_bitmask(static_cast<float*>(logits), vocab, static_cast<const int64_t*>(rows),
                static_cast<const uint32_t*>(bitmask), n, words, num_threads);
  return 0;
}

int tessera_argmax_rows(const void* x, int64_t rows, int64_t vocab, void* out, int num_threads) {
  if (vocab < 1) return 2;
  argmax_rows(static_cast<const float*>(x), rows, vocab, static_cast<int64_t*>(out), num_threads);
  return 0;
}

int tessera_add_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out,
                         int64_t n, int64_t hidden, float eps, int num_threads) {
  if (dtype == 0) {
    add_rms_norm(static_cast<const float*>(x), static_cast<float*>(residual),
                 static_cast<const float*>(weight), static_cast<float*>(out), n, hidden, eps,
                 num_threads);
  } else if (dtype == 1) {
    add_rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), n, hidden,
                 eps, num_threads);
  } else {
    return 1;
  }
  return 0;
}

int tessera_rope(int dtype, void* qk, int64_t n, int64_t heads, int64_t head_dim,
                 int64_t row_stride, const void* cos, const void* sin, int num_threads) {
  if (head_dim % 2 != 0) return 2;
  if (dtype == 0) {
    rope(static_cast<float*>(qk), n, heads, head_dim, row_stride, static_cast<const float*>(cos),
         static_cast<const float*>(sin), num_threads);
  } else if (dtype == 1) {
    rope(static_cast<uint16_t*>(qk), n, heads, head_dim, row_stride,
         static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin), num_threads);
  } else {
    return 1;
  }
  return 0;
}

int tessera_silu_mul(int dtype, const void* gate_up, void* out, int64_t n, int64_t inter,
                     int num_threads) {
  if (dtype == 0) {
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), n, inter, num_threads);
  } else if (dtype == 1) {
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), n, inter,
             num_threads);
  } else {
    return 1;
  }
  return 0;
}

// One decode step through `num_layers` decoder layers (decode_layers.h): `rows` decode
// tokens, row i being request i's; x, residual, cos, sin in `dtype`; `attend` is the paged
// decode kernel's entry point. Status: 0 ok, 1 bad dtype, 2-3 a GEMM's, 10 + the kernel's.
int tessera_decode_layers(int dtype, const TesseraDecodeShape* shape, const TesseraLayer* layers,
                          int64_t num_layers, void* x, void* residual, int64_t rows,
                          const void* cos, const void* sin, const int64_t* slots,
                          const int32_t* block_table, int64_t table_stride,
                          const int32_t* seq_lens, const int64_t* index,
                          TesseraPagedDecode attend, int num_threads) {
  const decode_layers::Step step{rows,     slots, block_table, table_stride,
                                 seq_lens, index, attend,      num_threads};
  if (dtype == 0)
    return decode_layers::run(*shape, layers, num_layers, static_cast<float*>(x),
                              static_cast<float*>(residual), static_cast<const float*>(cos),
                              static_cast<const float*>(sin), step);
  if (dtype == 1)
    return decode_layers::run(*shape, layers, num_layers, static_cast<uint16_t*>(x),
                              static_cast<uint16_t*>(residual), static_cast<const uint16_t*>(cos),
                              static_cast<const uint16_t*>(sin), step);
  return 1;
}

}  // extern "C"
