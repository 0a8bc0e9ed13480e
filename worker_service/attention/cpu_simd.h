// AVX-512 (16 float32 lanes) behind one small interface for the decode kernel's inner loops.
// TESSERA_SIMD is 0 elsewhere (AVX2 measured no faster this way: its gathers cost what they
// save); callers then keep their portable loops.
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
  static void store_first(float* p, V v, int64_t n) {  // lanes 0..n-1 only
    _mm512_mask_storeu_ps(p, n >= W ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1), v);
  }

  // Lane i = the sum of the lanes of vector i of the W vectors at v, added in lane order as
  // a scalar loop over the lanes would (so the scores keep the portable loop's rounding):
  // one gathered column of the W x W block a step.
  static V sum_lanes_in_order(const float* v) {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160,
                                             176, 192, 208, 224, 240);
    V sum = _mm512_i32gather_ps(column, v, 4);
    for (int l = 1; l < W; ++l) sum = _mm512_add_ps(sum, _mm512_i32gather_ps(column, v + l, 4));
    return sum;
  }
};
#else
#define TESSERA_SIMD 0
#endif
