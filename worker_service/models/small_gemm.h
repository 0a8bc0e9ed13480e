// A GEMM of a few rows over bf16 weights, for CPUs without bf16 dot products (AVX2,
// AVX-512F): out[m, n] = bias[n] + sum_k x[m, k] w[n, k], m < kSmallRows.
//
// At a few rows a GEMM is bound by reading the weight. oneDNN's float32 GEMM over an
// upcast copy reads 4 bytes a weight; this reads the bf16 weight (2 bytes), widens it in
// registers and keeps float32 sums, so 1-8 rows (a decode batch, a speculative verify)
// cost about what one row does. Products of bf16 values are exact in float32; only the
// order of the float32 sums differs from a float32 GEMM.
//
// Layouts (row-major, bf16 as uint16_t): x, out [rows, K] and [rows, N]; w [N, K]; bias [N].
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace small_gemm {

constexpr int kSmallRows = 8;

#if defined(__AVX512F__)
struct Vec {  // 16 float32 lanes
  using V = __m512;
  static constexpr int64_t W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {  // 8 float32 lanes
  using V = __m256;
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
};
#else
struct Vec {  // portable: one lane
  using V = float;
  static constexpr int64_t W = 1;
  static V zero() { return 0.0f; }
  static V load(const float* p) { return *p; }
  static V load(const uint16_t* p) { return widen(*p); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static float sum(V v) { return v; }
};
#endif

// sums[m] = x[m] . w for M rows of x and one weight row: M sums in registers. (Several
// weight rows at once measured slower: the loop is bound by reading w.)
template <int M>
inline void dot_rows(const float* x, const uint16_t* w, int64_t K, float (&sums)[M]) {
  typename Vec::V acc[M];
  for (int m = 0; m < M; ++m) acc[m] = Vec::zero();
  int64_t k = 0;
  for (; k + Vec::W <= K; k += Vec::W) {
    const typename Vec::V wv = Vec::load(w + k);
    for (int m = 0; m < M; ++m) acc[m] = Vec::fma(Vec::load(x + m * K + k), wv, acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    float s = Vec::sum(acc[m]);
    for (int64_t t = k; t < K; ++t) s += x[m * K + t] * widen(w[t]);
    sums[m] = s;
  }
}

// Columns [n0, n1) of out for M rows.
template <int M>
void columns(const float* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t K,
             int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    float sums[M];
    dot_rows<M>(x, w + n * K, K, sums);
    const float b = bias ? widen(bias[n]) : 0.0f;
    for (int m = 0; m < M; ++m) store(sums[m] + b, out + m * N + n);
  }
}

template <int M>
void gemm_rows(const float* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
               int64_t K, int64_t N, int num_threads) {
  constexpr int64_t kChunk = 64;  // columns per task: a few KB of weight rows each
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  const int threads = N * K >= (int64_t(1) << 16) ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t n1 = (i + 1) * kChunk < N ? (i + 1) * kChunk : N;
    columns<M>(x, w, bias, out, K, N, i * kChunk, n1);
  }
}

// rows in [1, kSmallRows]; returns false for any other row count.
inline bool gemm(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                 int64_t rows, int64_t K, int64_t N, int num_threads) {
  if (rows < 1 || rows > kSmallRows) return false;
  std::vector<float> xf(rows * K);  // widened once: every column reads all of x
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = widen(x[i]);
  using Fn = void (*)(const float*, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                      int64_t, int);
  static constexpr Fn kByRows[kSmallRows] = {gemm_rows<1>, gemm_rows<2>, gemm_rows<3>,
                                             gemm_rows<4>, gemm_rows<5>, gemm_rows<6>,
                                             gemm_rows<7>, gemm_rows<8>};
  kByRows[rows - 1](xf.data(), w, bias, out, K, N, num_threads);
  return true;
}

}  // namespace small_gemm
