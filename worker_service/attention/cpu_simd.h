// AVX-512 (16 float32 lanes) or AVX2 + FMA (8 lanes) behind one small interface for the
// decode kernel's inner loops, and AVX512-BF16's pair dot products where the build has them
// (TESSERA_BF16). TESSERA_SIMD is 0 elsewhere; callers then keep their portable loops.
#pragma once

#include <cstdint>

#include "kv_quant.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define TESSERA_SIMD 1

struct Simd {
  using V = __m512;
  static constexpr int64_t W = 16;         // float32 lanes per vector
  static constexpr int64_t kAccRegs = 24;  // vectors of sums a loop may keep in registers
  static constexpr int64_t kRegs = 32;     // vector registers

  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {  // W bf16 widened exactly
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V load(const int8_t* p) {  // W int8 widened exactly (quantized KV)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  }
  static V load(const Fp8E4M3* p) {  // W float8 e4m3fn widened exactly, as widen(Fp8E4M3)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m512i x = _mm512_cvtepu8_epi32(raw);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, mag)),
                         _mm512_set1_ps(0x1p120f));
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int64_t n) {  // lanes 0..n-1
    return n >= W ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  }
  static void store_first(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }

  // Lane o = the sum of the lanes of v[slot(o)] (a transposing tree: 15 adds, 30 shuffles):
  // callers put row o's vector in v[slot(o)] to get lane o = row o's sum.
  static V sum_lanes(const float* v) {  // v: 16 vectors, one after the other
    V w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i) {  // halves: vector 2i's 8 partial sums, then 2i + 1's
      const V a = load(v + 32 * i), b = load(v + 32 * i + 16);
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 4; ++i)  // quarters: 4 partials of vectors 4i .. 4i + 3
      x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
      y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  }
  static constexpr int slot(int o) { return 4 * (o % 4) + o / 4; }
};

#if defined(__AVX512BF16__)
#define TESSERA_BF16 1

// bf16 pair dot products (vdpbf16ps): lane i += a[2i] * b[2i] + a[2i + 1] * b[2i + 1] in
// float32, over 32 bf16 elements a vector.
struct Bf16Dots {
  using P = __m512bh;
  static P load(const uint16_t* p) { return (P)_mm512_loadu_si512(p); }
  static P zero() { return (P)_mm512_setzero_si512(); }
  static P pair(uint32_t two) { return (P)_mm512_set1_epi32(int(two)); }  // every lane: a pair
  static __m512 dot(__m512 acc, P a, P b) { return _mm512_dpbf16_ps(acc, a, b); }
  // Rows a and b as (a[d], b[d]) pairs: `lo` holds d = 8L + i and `hi` d = 8L + 4 + i in
  // lane 4L + i (i < 4) of each 32-element chunk, as vpunpck{l,h}wd interleave.
  static P lo(P a, P b) { return (P)_mm512_unpacklo_epi16((__m512i)a, (__m512i)b); }
  static P hi(P a, P b) { return (P)_mm512_unpackhi_epi16((__m512i)a, (__m512i)b); }
  // The element of a 32-element chunk that position k (< 32) of lo (k < 16) then hi holds.
  static constexpr int64_t dim_at(int64_t k) { return 8 * ((k % 16) / 4) + 4 * (k / 16) + k % 4; }
};
#else
#define TESSERA_BF16 0
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TESSERA_SIMD 1
#define TESSERA_BF16 0

struct Simd {
  using V = __m256;
  static constexpr int64_t W = 8;          // float32 lanes per vector
  static constexpr int64_t kAccRegs = 12;  // vectors of sums a loop may keep in registers
  static constexpr int64_t kRegs = 16;     // vector registers

  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {  // W bf16 widened exactly
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static V load(const int8_t* p) {  // W int8 widened exactly (quantized KV)
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  }
  static V load(const Fp8E4M3* p) {  // W float8 e4m3fn widened exactly, as widen(Fp8E4M3)
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, mag)),
                         _mm256_set1_ps(0x1p120f));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, V v, int64_t n) {  // lanes 0..n-1 only
    if (n >= W) return store(p, v);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane), v);
  }

  // Lane o = the sum of the lanes of v[slot(o)] (a transposing tree: 7 adds, 14 shuffles):
  // callers put row o's vector in v[slot(o)] to get lane o = row o's sum.
  static V sum_lanes(const float* v) {  // v: 8 vectors, one after the other
    V w[4], x[2];
    for (int i = 0; i < 4; ++i) {  // halves: vector 2i's 4 partial sums, then 2i + 1's
      const V a = load(v + 16 * i), b = load(v + 16 * i + 8);
      w[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (int i = 0; i < 2; ++i)
      x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                           _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xDD));
  }
  // Lane p of the tree holds v[2 (p % 4) + p / 4]: so row o goes to that slot.
  static constexpr int slot(int o) { return 2 * (o % 4) + o / 4; }
};
#else
#define TESSERA_SIMD 0
#define TESSERA_BF16 0
#endif
