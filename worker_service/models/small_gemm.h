// GEMMs bound by reading the weight (AVX2, AVX-512F; bf16 pair dot products with AVX512-BF16):
// out[m, n] = sum_k x[m, k] w[n, k] + bias[n], float32 sums, over weight rows
// that a `Dot` reads (here dense bf16 rows; gguf_gemm.h's GGUF blocks).
//
// bf16 weights at a few rows (decode, a speculative verify): oneDNN's float32 GEMM over an
// upcast copy reads 4 bytes a weight; this reads the bf16 weight (2 bytes) and widens it in
// registers, so 1-8 rows cost about what one row does. Products of bf16 values are exact in
// float32; only the order of the float32 sums differs. Rows are taken 8 at a time over each
// chunk of weight rows, so a chunk is read from memory once and from cache for the others.
//
// Layouts (row-major): x, out [rows, K] and [rows, N] (float32 or bf16 as uint16_t, one
// type for x, bias and out); w [N, K]; bias [N] or null.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "prefetch.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace small_gemm {

constexpr int kRowBlock = 8;  // rows whose sums stay in registers together

#if defined(__AVX512F__)
struct Vec {  // 16 float32 lanes
  using V = __m512;
  static constexpr int64_t W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V load(const int8_t* p) {  // GGUF block values
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  }
  static void nibbles(const uint8_t* p, V (&q)[2]) {  // 16 bytes -> low nibbles, high nibbles
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {  // 8 float32 lanes
  using V = __m256;
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static V load(const int8_t* p) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  }
  static void nibbles(const uint8_t* p, V (&q)[4]) {  // 16 bytes -> low nibbles, high nibbles
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
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
  static V set1(float v) { return v; }
  static V load(const float* p) { return *p; }
  static V load(const uint16_t* p) { return widen(*p); }
  static V load(const int8_t* p) { return float(*p); }
  static void nibbles(const uint8_t* p, V (&q)[32]) {
    for (int j = 0; j < 16; ++j) q[j] = float(p[j] & 15), q[j + 16] = float(p[j] >> 4);
  }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static float sum(V v) { return v; }
};
#endif

// sums[m] = x[m] . w for M rows of x (float32) and one weight row: M sums in registers.
// (Several weight rows at once measured slower: the loop is bound by reading w.)
template <int M, typename TW>
inline void dot_rows(const float* x, const TW* w, int64_t K, float (&sums)[M]) {
  typename Vec::V acc[M];
  for (int m = 0; m < M; ++m) acc[m] = Vec::zero();
  int64_t k = 0;
  for (; k + Vec::W <= K; k += Vec::W) {
    prefetch::ahead(w + k);
    const typename Vec::V wv = Vec::load(w + k);
    for (int m = 0; m < M; ++m) acc[m] = Vec::fma(Vec::load(x + m * K + k), wv, acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    float s = Vec::sum(acc[m]);
    for (int64_t t = k; t < K; ++t) s += x[m * K + t] * widen(w[t]);
    sums[m] = s;
  }
}

#if defined(__AVX512BF16__)
// bf16 x and bf16 w where the CPU has pair dot products (vdpbf16ps): 32 products a weight
// load, summed in float32 by pairs, with no widening of either side; the tail is masked.
template <int M>
inline void dot_rows_bf16(const uint16_t* x, const uint16_t* w, int64_t K, float (&sums)[M]) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch::ahead(w + k);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), wv);
  }
  if (k < K) {
    const __mmask32 tail = (__mmask32)((uint64_t(1) << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + k),
                                wv);
  }
  for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]);
}

struct Bf16Dot {  // x [rows, K] . w[n] ([N, K]), both bf16
  const uint16_t* x;
  const uint16_t* w;
  int64_t K;

  template <int M>
  void run(int64_t r0, int64_t n, float (&sums)[M]) const {
    dot_rows_bf16<M>(x + r0 * K, w + n * K, K, sums);
  }
};
#endif

// Rows of dense weights: x [rows, K] (widened) . w[n] ([N, K] in TW).
template <typename TW>
struct DenseDot {
  const float* x;
  const TW* w;
  int64_t K;

  template <int M>
  void run(int64_t r0, int64_t n, float (&sums)[M]) const {
    dot_rows<M>(x + r0 * K, w + n * K, K, sums);
  }
};

// A Dot's weight rows a pass: its kColumns where it has run_columns, else 1.
template <typename Dot, typename = void>
struct Columns : std::integral_constant<int64_t, 1> {};
template <typename Dot>
struct Columns<Dot, std::void_t<decltype(Dot::kColumns)>>
    : std::integral_constant<int64_t, Dot::kColumns> {};

// out[r, n] = dot(r, n) + bias[n], for any `Dot` with
// `template <int M> void run(int64_t r0, int64_t n, float (&sums)[M])` (sums of rows r0..r0+M)
// and, optionally, kColumns weight rows a pass:
// `template <int M> void run_columns(int64_t r0, int64_t n, float (&sums)[M][kColumns])`.
template <typename Dot, typename TX>
struct Output {
  const Dot& dot;
  const TX* bias;
  TX* out;
  int64_t N;

  // Rows [r0, r0 + M) of out, columns [n0, n1).
  template <int M>
  void block(int64_t r0, int64_t n0, int64_t n1) const {
    int64_t n = n0;
    if constexpr (Columns<Dot>::value > 1) {
      constexpr int64_t C = Columns<Dot>::value;
      for (; n + C <= n1; n += C) {
        float sums[M][C];
        dot.template run_columns<M>(r0, n, sums);
        for (int64_t j = 0; j < C; ++j) {
          const float b = bias ? widen(bias[n + j]) : 0.0f;
          for (int m = 0; m < M; ++m) store(sums[m][j] + b, out + (r0 + m) * N + n + j);
        }
      }
    }
    for (; n < n1; ++n) {
      float sums[M];
      dot.template run<M>(r0, n, sums);
      const float b = bias ? widen(bias[n]) : 0.0f;
      for (int m = 0; m < M; ++m) store(sums[m] + b, out + (r0 + m) * N + n);
    }
  }

  void rows_block(int64_t r0, int64_t rows, int64_t n0, int64_t n1) const {
    switch (rows) {  // M is a template argument so that the M sums live in registers
      case 1: return block<1>(r0, n0, n1);
      case 2: return block<2>(r0, n0, n1);
      case 3: return block<3>(r0, n0, n1);
      case 4: return block<4>(r0, n0, n1);
      case 5: return block<5>(r0, n0, n1);
      case 6: return block<6>(r0, n0, n1);
      case 7: return block<7>(r0, n0, n1);
      default: return block<8>(r0, n0, n1);
    }
  }
};

// Every row block of every chunk of weight rows, chunks spread over the threads. `weight_bytes`
// (of all N rows) decides whether threads pay.
template <typename Dot, typename TX>
void run(const Dot& dot, const TX* bias, TX* out, int64_t rows, int64_t N, int64_t weight_bytes,
         int num_threads) {
  const Output<Dot, TX> o{dot, bias, out, N};
  constexpr int64_t kChunk = 64;  // weight rows per task: a few KB to tens of KB
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  const int threads = rows * weight_bytes >= (int64_t(1) << 16) ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t n0 = i * kChunk, n1 = std::min(N, n0 + kChunk);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
      o.rows_block(r0, std::min<int64_t>(kRowBlock, rows - r0), n0, n1);
  }
}

// x [rows, K] widened to float32 once: every weight row reads all of it.
template <typename TX>
std::vector<float> widen_rows(const TX* x, int64_t rows, int64_t K) {
  std::vector<float> xf(rows * K);
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = widen(x[i]);
  return xf;
}

// out = x @ w.T + bias for any rows >= 1; false if rows < 1.
template <typename TX, typename TW>
bool gemm(const TX* x, const TW* w, const TX* bias, TX* out, int64_t rows, int64_t K, int64_t N,
          int num_threads) {
  if (rows < 1) return false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TX, uint16_t> && std::is_same_v<TW, uint16_t>) {
    const Bf16Dot dot{x, w, K};
    run(dot, bias, out, rows, N, N * K * int64_t(sizeof(TW)), num_threads);
    return true;
  }
#endif
  const std::vector<float> xf = widen_rows(x, rows, K);
  const DenseDot<TW> dot{xf.data(), w, K};
  run(dot, bias, out, rows, N, N * K * int64_t(sizeof(TW)), num_threads);
  return true;
}

}  // namespace small_gemm
