// GEMMs over GGUF's Q4_0, Q4_1 and Q8_0 blocks with the activations quantized to int8, as
// llama.cpp runs them: each 32 values of a row of x become int8 q_x with one float scale
// d_x = max |x| / 127, and a block's dot product is an integer one,
//   x . w = d d_x sum(q q_x) + m sum(x)
// (m: the block's offset, 0 for Q8_0; sum(x) exact in float32). AVX2's u8 x s8 multiply-add
// (vpmaddubsw) takes all 32 products of a block in one instruction where the float path
// widens them to floats 8 at a time: half the instructions a weight, on the bf16 (fast) path;
// VNNI's vpdpbusd (AVX512-VNNI builds) sums them to int32 in that one instruction. Q4_0 and
// Q4_1 go 16 weight rows at a time (8 with AVX2; gguf_q8_wide.h).
// The float path (gguf_gemm.h) stays the exact one: float32 models, builds without AVX2.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_gguf.h"
#include "gguf_gemm.h"
#include "prefetch.h"
#include "small_gemm.h"

#if defined(__AVX2__)
#include <immintrin.h>

namespace gguf_q8 {

using gguf_gemm::half_at;
constexpr int64_t kBlock = gguf_gemm::kGroup;  // values per int8 block of x (and per Q4/Q8 block)

// x [rows, K] float32 -> q [rows, K] int8 and d [rows, K / 32]: d = max |x| / 127 per 32
// values, q = round(x / d) to nearest even (x * (1 / d), as llama.cpp's quantize_row_q8_0).
inline void quantize_rows(const float* x, int64_t n_blocks, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(xb + 8 * c);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.0f;
    d[b] = scale;
    const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
    __m256i i[4];
    for (int c = 0; c < 4; ++c) i[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv));
    // Pack 4 x 8 int32 -> 32 int8; the packs interleave 128-bit lanes, the permute undoes it.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                         _mm256_packs_epi32(i[2], i[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(p, order));
  }
}

inline __m256i nibbles(const uint8_t* p) {  // 16 bytes -> 32 u8: values 0-15, then 16-31
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// Each format: load() gives the block's 32 values (Q4: nibbles; Q8_0: signed bytes), d and m;
// operands() the unsigned and signed bytes whose products are values x q_x.
struct Q4_0 {
  static constexpr int kType = 2, kBytes = 18;
  static constexpr bool kHasMin = true;
  static __m256i load(const uint8_t* b, float& d, float& m) {
    d = half_at(b);
    m = -8.0f * d;
    return nibbles(b + 2);
  }
  static void operands(__m256i&, __m256i&) {}
};

struct Q4_1 {
  static constexpr int kType = 3, kBytes = 20;
  static constexpr bool kHasMin = true;
  static __m256i load(const uint8_t* b, float& d, float& m) {
    d = half_at(b);
    m = half_at(b + 2);
    return nibbles(b + 4);
  }
  static void operands(__m256i&, __m256i&) {}
};

struct Q8_0 {
  static constexpr int kType = 8, kBytes = 34;
  static constexpr bool kHasMin = false;
  static __m256i load(const uint8_t* b, float& d, float& m) {
    d = half_at(b);
    m = 0.0f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
  // s8 x s8 as |w| x (q_x with w's sign): |w| <= 128 keeps the pair sums within int16.
  static void operands(__m256i& w, __m256i& qx) {
    qx = _mm256_sign_epi8(qx, w);
    w = _mm256_sign_epi8(w, w);
  }
};

// The 8 int32 sums of 4 adjacent products each of a block's 32 values and 32 q_x.
template <typename F>
inline __m256i block_dot(__m256i w, __m256i qx) {
  F::operands(w, qx);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, qx);  // u8 x s8 to int32 at once
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, qx), _mm256_set1_epi16(1));
#endif
}

// Rows of quantized x . row n of F blocks.
template <typename F>
struct Q8Dot {
  const int8_t* qx;    // [rows, K]
  const float* dx;     // [rows, K / 32]
  const float* xsum;   // [rows, K / 32]: exact sums of x per block
  const uint8_t* w;    // [N, K / 32 * F::kBytes]
  int64_t K;

  // Independent chains of sums per row (consecutive blocks alternate between them): one or two
  // rows would otherwise wait on the latency of one FMA a block.
  template <int M>
  static constexpr int kChains = M <= 2 ? 2 : 1;

  template <int M>
  void run(int64_t r0, int64_t n, float (&sums)[M]) const {
    constexpr int C = kChains<M>;
    const int64_t blocks = K / kBlock;
    const uint8_t* row = w + n * blocks * F::kBytes;
    __m256 acc[M][C];
    float offset[M][C];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps(), offset[m][c] = 0.0f;
    int64_t b = 0;
    for (; b + C <= blocks; b += C)
      for (int c = 0; c < C; ++c) add_block<M>(row, r0, b + c, acc, offset, c);
    for (; b < blocks; ++b) add_block<M>(row, r0, b, acc, offset, 0);
    for (int m = 0; m < M; ++m) {
      for (int c = 1; c < C; ++c) acc[m][0] = _mm256_add_ps(acc[m][0], acc[m][c]);
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m][0]),
                                  _mm256_extractf128_ps(acc[m][0], 1));
      const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
      float off = 0.0f;
      for (int c = 0; c < C; ++c) off += offset[m][c];
      sums[m] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t))) + off;
    }
  }

  // Block b of the weight row into chain c of each row's sums.
  template <int M, int C>
  void add_block(const uint8_t* row, int64_t r0, int64_t b, __m256 (&acc)[M][C],
                 float (&offset)[M][C], int c) const {
    const int64_t blocks = K / kBlock;
    float d, mn;
    prefetch::ahead(row + b * F::kBytes);
    const __m256i q = F::load(row + b * F::kBytes, d, mn);
    for (int m = 0; m < M; ++m) {
      const int64_t r = (r0 + m) * blocks + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * kBlock));
      const __m256 dot = _mm256_cvtepi32_ps(block_dot<F>(q, xq));
      acc[m][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * dx[r]), acc[m][c]);
      if (F::kHasMin) offset[m][c] += mn * xsum[r];
    }
  }
};

}  // namespace gguf_q8

#include "gguf_q8_wide.h"  // Q4_0 and Q4_1 several weight rows a pass (needs Q8Dot)
#include "gguf_q8_rows.h"  // Q4_0, Q4_1 (and Q8_0 with VNNI) with 16 rows interleaved
#include "amx_q8_rows.h"    // ... on AMX tiles

namespace gguf_q8 {

template <typename F, typename TX>
void gemm_format(const TX* x, const uint8_t* w, const TX* bias, TX* out, int64_t rows, int64_t K,
                 int64_t N, int num_threads) {
  const std::vector<float> xf = small_gemm::widen_rows(x, rows, K);
  const int64_t blocks = rows * (K / kBlock);
  std::vector<int8_t> qx(rows * K);
  std::vector<float> dx(blocks), xsum(blocks, 0.0f);
  quantize_rows(xf.data(), blocks, qx.data(), dx.data());
  for (int64_t i = 0; i < blocks; ++i)
    for (int64_t c = 0; c < kBlock; ++c) xsum[i] += xf[i * kBlock + c];
  const Q8Dot<F> dot{qx.data(), dx.data(), xsum.data(), w, K};
  const int64_t weight_bytes = N * (K / kBlock) * F::kBytes;
  if constexpr (wide::Lanes<F>::kWide)
    small_gemm::run(wide::Dot<F>{dot}, bias, out, rows, N, weight_bytes, num_threads);
  else
    small_gemm::run(dot, bias, out, rows, N, weight_bytes, num_threads);
}

// gguf_gemm::gemm with int8 activations; 3 for a type without an int8 path (the caller then
// takes the float one).
template <typename TX>
int gemm(int type, const TX* x, const uint8_t* w, const TX* bias, TX* out, int64_t rows,
         int64_t K, int64_t N, int num_threads) {
  if (rows < 1 || K % kBlock != 0) return 2;
  switch (type) {
    case Q4_0::kType: gemm_format<Q4_0>(x, w, bias, out, rows, K, N, num_threads); return 0;
    case Q4_1::kType: gemm_format<Q4_1>(x, w, bias, out, rows, K, N, num_threads); return 0;
    case Q8_0::kType: gemm_format<Q8_0>(x, w, bias, out, rows, K, N, num_threads); return 0;
    default: return 3;
  }
}

}  // namespace gguf_q8

#else  // no AVX2: every type takes the float path

namespace gguf_q8 {
template <typename TX>
int gemm(int, const TX*, const uint8_t*, const TX*, TX*, int64_t, int64_t, int64_t, int) {
  return 3;
}
}  // namespace gguf_q8

#endif

namespace gguf_q8 {

// How a GEMM over blocks multiplies: kExact keeps x in float32 (the parity path); kInt8
// quantizes x to int8 per 32 values (above); kFast, the bf16 default, takes AMX tiles
// (amx_gguf.h) from kAmxRows rows where this process has them, else bf16 panels with
// AVX512-BF16 dots from bf16_rows(type) rows, else int8 x.
enum Path { kExact = 0, kInt8 = 1, kFast = 2 };
// From this many rows the tiles beat int8 x (default model's 30 layers, 2 threads, Q4_1 / Q8_0,
// ms: 5 rows 10.6 / 11.4 vs 11.5 / 13.1; 6 rows 11.7 / 12.4 vs 11.3 / 13.0; 8 rows 15.4 /
// 15.8 vs 11.4 / 13.4; 32 rows 69 / 72 vs 16.6 / 18.5).
constexpr int64_t kAmxRows = 6;
// Without tiles, from this many rows bf16 panels with AVX512-BF16 dots beat int8 x (AMD EPYC
// Zen 4, 2 threads, ms, default model MLP + o shapes, int8 x vs panels: Q4_1 6 rows 0.20 vs
// 0.24, 8 rows 0.30 vs 0.23, 32 rows 0.94 vs 0.53; Q8_0 32 rows 0.86 vs 0.55).
constexpr int64_t kBf16Rows = 8;
// For Q4_0 and Q4_1, whose int8 x takes 16 weight rows a pass (gguf_q8_wide.h), from this many
// (AMD EPYC Zen 5, 2 threads, from memory, ms, int8 x vs panels: 16 rows qkv 0.039 vs 0.048,
// gate_up 0.096 vs 0.139, down 0.070 vs 0.063; 24 rows 0.064 / 0.146 / 0.104 vs 0.065 / 0.187
// / 0.083; 28 rows 0.075 / 0.178 / 0.124 vs 0.074 / 0.222 / 0.096).
constexpr int64_t kWideBf16Rows = 24;

#if defined(__AVX512BF16__)
inline int64_t bf16_rows(int type) {  // the panels' first row count without tiles
  return type == Q4_0::kType || type == Q4_1::kType ? kWideBf16Rows : kBf16Rows;
}
#endif

#if defined(TESSERA_Q8_ROWS)
// out [rows, N] bf16 = x [rows, K] bf16 @ w.T + bias, w [N, K / 32 blocks] in rows layout
// `type` (gguf_q8_rows.h): from amx_rows::kMinRows rows on AMX tiles where `tiles` and the
// process has them, else int8 x. Status: 0 ok; 2 rows < 1, K not whole blocks or N not whole
// groups of 16 rows; 3 a layout this build has no GEMM for.
inline int rows_gemm(int type, const uint16_t* x, const uint8_t* w, const uint16_t* bias,
                     uint16_t* out, int64_t rows, int64_t K, int64_t N, [[maybe_unused]] bool tiles,
                     int num_threads) {
  int status = 3;
  q8_rows::with_format(type, [&](auto format) {
    using F = decltype(format);
    status = rows < 1 || K % 32 != 0 || N % q8_rows::kRows != 0 ? 2 : 0;
    if (status != 0) return;
#if TESSERA_Q8_ROWS == 512
    if (tiles && amx_gemm::lent() && rows >= amx_rows::kMinRows<F>)
      return amx_rows::gemm_format<F>(x, w, bias, out, rows, K, N, num_threads);
#endif
    q8_rows::gemm_format<F>(x, w, bias, out, rows, K, N, num_threads);
  });
  return status;
}
#endif

// The GEMM `path` asks for where this build has it (AVX2 for int8 x, AVX512_BF16 and AMX for
// the tiles) and the type has one, else the float one (gguf_gemm.h). The rows layouts
// (gguf_q8_rows.h: their own ids, written at load for a bf16 model) take int8 x whatever the
// path, but for kFast's many rows on AMX tiles (amx_q8_rows.h). Status: 0 ok, 2 K not whole
// blocks, 3 unknown type.
template <typename TX>
int gemm_or_float(int type, const TX* x, const uint8_t* w, const TX* bias, TX* out,
                  int64_t rows, int64_t K, int64_t N, int path, int num_threads) {
#if defined(TESSERA_Q8_ROWS)
  if constexpr (std::is_same_v<TX, uint16_t>) {  // the rows layouts (bf16 x only)
    const int status = rows_gemm(type, x, w, bias, out, rows, K, N, path == kFast, num_threads);
    if (status != 3) return status;
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TX, uint16_t>) {  // bf16 x: AMX tiles where this process has them
    if (path == kFast && amx_gemm::lent() && rows >= kAmxRows)
      return amx_gguf::gemm(type, x, w, bias, out, rows, K, N, true, num_threads);
    if (path == kFast && !amx_gemm::lent() && rows >= bf16_rows(type))
      return amx_gguf::gemm(type, x, w, bias, out, rows, K, N, false, num_threads);
  }
#endif
  if (path != kExact) {
    const int status = gemm(type, x, w, bias, out, rows, K, N, num_threads);
    if (status != 3) return status;
  }
  return gguf_gemm::gemm(type, x, w, bias, out, rows, K, N, num_threads);
}

}  // namespace gguf_q8
