// The vector width of the machine the kernels are built for, behind one small interface, so
// the decode kernel's inner loops are written once: AVX-512 (16 float32 lanes) or AVX2 + FMA
// (8 lanes). TESSERA_SIMD is 0 where neither is available; callers keep portable loops.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define TESSERA_SIMD 1
#else
#define TESSERA_SIMD 0
#endif

#if defined(__AVX512F__)
struct Simd {
  using V = __m512;
  static constexpr int64_t W = 16;         // float32 lanes per vector
  static constexpr int64_t kAccRegs = 24;  // vectors of sums a loop may keep in registers

  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {  // W bf16 widened exactly
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, V v, int64_t n) {  // lanes 0..n-1 only
    _mm512_mask_storeu_ps(p, n >= W ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1), v);
  }

  // Lane i = the sum of the lanes of vector i of the W vectors at v: a transposing tree of
  // W - 1 folds instead of W separate horizontal sums.
  static V sum_lanes(const float* v) {
    const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    V a[8], b[4], c[2];
    for (int j = 0; j < 8; ++j) a[j] = fold(load(v + 32 * j), load(v + 32 * j + 16), lo1, 8);
    for (int j = 0; j < 4; ++j) b[j] = fold(a[2 * j], a[2 * j + 1], lo2, 4);
    for (int j = 0; j < 2; ++j) c[j] = fold(b[2 * j], b[2 * j + 1], lo3, 2);
    return fold(c[0], c[1], lo4, 1);
  }

 private:
  // Lane i = x[lo[i]] + x[lo[i] + shift], x the 32 lanes of a then b.
  static V fold(V a, V b, __m512i lo, int shift) {
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(shift));
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
  }
};
#elif TESSERA_SIMD
struct Simd {
  using V = __m256;
  static constexpr int64_t W = 8;
  static constexpr int64_t kAccRegs = 10;

  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, V v, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes), v);
  }

  // Lane i = the sum of the lanes of vector i of the 8 vectors at v (pairwise hadds).
  static V sum_lanes(const float* v) {
    const V t0 = _mm256_hadd_ps(load(v), load(v + 8)), t1 = _mm256_hadd_ps(load(v + 16), load(v + 24));
    const V t2 = _mm256_hadd_ps(load(v + 32), load(v + 40)), t3 = _mm256_hadd_ps(load(v + 48), load(v + 56));
    const V u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#endif
