// Q8_0 weights with each 16 rows interleaved ("Q8_0 rows", quant.Q8_0_ROWS: a layout of the
// same bytes, written at load by quant.interleave_q8_0) for AVX512-VNNI's u8 x s8 dot product
// vpdpbusd: one instruction takes 4 K values of 16 weight rows (a vector) against the same 4
// int8 values of a row of x (broadcast), 64 products, where gguf_q8.h's row-at-a-time dots
// reduce lanes per row and the bf16 panels (amx_gguf.h) first dequantize every weight.
//
// Layout: for weight rows [16 g, 16 g + 16) and block b (K values [32 b, 32 b + 32)), 544
// bytes at (g * K / 32 + b) * 544: the 16 rows' half scales d, then 8 vectors j of 64 bytes,
// byte 4 r + e of vector j = q[16 g + r][32 b + 4 j + e] + 128 (unsigned).
//
// Activations are quantized per 32 values as for gguf_q8.h (quantize_rows: q_x, d_x), so
//   x . w = sum_b d_w d_x (sum (q + 128) q_x - 128 sum q_x)
// with the correction taken as the int32 sums' start. A pass holds up to kPassRows rows of x
// by 32 weight rows (two vectors of sums each) in registers; each row's sums run over K in one
// order whatever rows came with it. Default model, 2 threads, Zen 5, against oneDNN's packed
// bf16 GEMM over the bf16 weight (all of qkv, o, gate_up, down and the LM head): 0.71x the time
// at 32 rows, 0.73x at 8, 0.79x at 256; against Q8_0's bf16 panels 0.63x at 32 rows.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_gemm.h"
#include "small_gemm.h"

namespace q8_rows {

constexpr int kType = 1008;               // quant.Q8_0_ROWS: not a ggml type
constexpr int64_t kRows = 16;             // weight rows interleaved (the lanes of a vector)
constexpr int64_t kBlockBytes = 34 * kRows;  // one block of 32 K values of 16 rows
constexpr int kPassRows = 4;              // rows of x a pass (4-6 measured alike; 8+ slower)

// Quantized rows of x: q [rows, K] int8, d and start [rows, K / 32] (start = -128 sum q).
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> start;
};

inline Rows quantize(const uint16_t* x, int64_t rows, int64_t K) {
  const std::vector<float> xf = small_gemm::widen_rows(x, rows, K);
  const int64_t blocks = rows * K / 32;
  Rows r{std::vector<int8_t>(rows * K), std::vector<float>(blocks), std::vector<int32_t>(blocks)};
  gguf_q8::quantize_rows(xf.data(), blocks, r.q.data(), r.d.data());
  for (int64_t i = 0; i < blocks; ++i) {
    int32_t sum = 0;
    for (int64_t c = 0; c < 32; ++c) sum += r.q[i * 32 + c];
    r.start[i] = -128 * sum;
  }
  return r;
}

// Rows [r0, r0 + M) of x by the V * 16 weight rows from n0 (wg: their first group) -> out.
template <int M, int V>
void pass(const Rows& x, int64_t r0, const uint8_t* wg, int64_t K, const uint16_t* bias,
          uint16_t* out, int64_t N, int64_t n0) {
  const int64_t blocks = K / 32;
  __m512 sums[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) sums[m][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block[V];
    for (int v = 0; v < V; ++v) block[v] = wg + (v * blocks + b) * kBlockBytes;
    __m512i acc[M][V];
    for (int m = 0; m < M; ++m) {
      const __m512i start = _mm512_set1_epi32(x.start[(r0 + m) * blocks + b]);
      for (int v = 0; v < V; ++v) acc[m][v] = start;
    }
    for (int j = 0; j < 8; ++j) {
      __m512i w[V];
      for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(block[v] + 32 + 64 * j);
      for (int m = 0; m < M; ++m) {
        int32_t four;  // q_x[32 b + 4 j .. + 4)
        std::memcpy(&four, x.q.data() + (r0 + m) * K + 32 * b + 4 * j, sizeof(four));
        const __m512i xv = _mm512_set1_epi32(four);
        for (int v = 0; v < V; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], w[v], xv);
      }
    }
    __m512 dw[V];
    for (int v = 0; v < V; ++v)
      dw[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[v])));
    for (int m = 0; m < M; ++m) {
      const __m512 dx = _mm512_set1_ps(x.d[(r0 + m) * blocks + b]);
      for (int v = 0; v < V; ++v)
        sums[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][v]), _mm512_mul_ps(dw[v], dx),
                                     sums[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v)
      amx_gemm::store_row16(sums[m][v], bias ? bias + n0 + 16 * v : nullptr,
                            out + (r0 + m) * N + n0 + 16 * v, 16);
}

// Every row of x by weight rows [n0, n0 + 16 V), in passes of at most kPassRows rows whose
// sizes are within one of each other. M is a template argument so that the sums stay in
// registers.
template <int V>
void columns(const Rows& x, int64_t rows, const uint8_t* wg, int64_t K, const uint16_t* bias,
             uint16_t* out, int64_t N, int64_t n0) {
  const int64_t passes = (rows + kPassRows - 1) / kPassRows;
  for (int64_t i = 0, r0 = 0; i < passes; ++i) {
    const int64_t m = rows / passes + (i < rows % passes ? 1 : 0);
    switch (m) {
      case 1: pass<1, V>(x, r0, wg, K, bias, out, N, n0); break;
      case 2: pass<2, V>(x, r0, wg, K, bias, out, N, n0); break;
      case 3: pass<3, V>(x, r0, wg, K, bias, out, N, n0); break;
      default: pass<4, V>(x, r0, wg, K, bias, out, N, n0); break;
    }
    r0 += m;
  }
}

// out [rows, N] bf16 = x [rows, K] bf16 @ w.T + bias, w [N, K / 32 * 34] in this layout.
// Returns 0, or 2 for rows < 1, K not whole blocks or N not whole groups of 16 rows.
inline int gemm(const uint16_t* x, const uint8_t* w, const uint16_t* bias, uint16_t* out,
                int64_t rows, int64_t K, int64_t N, int num_threads) {
  static_assert(kPassRows == 4, "columns() dispatches passes of 1-4 rows");
  if (rows < 1 || K % 32 != 0 || N % kRows != 0) return 2;
  const Rows q = quantize(x, rows, K);
  const int64_t units = (N + 31) / 32;  // 32 weight rows each, the last maybe 16
#pragma omp parallel for num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, units)))
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n0 = 32 * u;
    const uint8_t* wg = w + n0 / kRows * (K / 32) * kBlockBytes;
    if (n0 + 32 <= N)
      columns<2>(q, rows, wg, K, bias, out, N, n0);
    else
      columns<1>(q, rows, wg, K, bias, out, N, n0);
  }
  return 0;
}

}  // namespace q8_rows

#endif  // __AVX512BF16__ && __AVX512VNNI__
