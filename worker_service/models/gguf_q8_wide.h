// gguf_q8.h's int8-x GEMM over Q4_0 and Q4_1 blocks 16 weight rows at a time, for builds with
// AVX512-VNNI (the AVX512_BF16 level: every such CPU has it). Q8Dot takes one weight row's block per pass:
// about 17 instructions for 32 weights (a 256-bit dpbusd, its conversion, the block's scale and
// offset), so a Q4_1 GEMV at a few rows of x was bound by instructions, not by memory.
// Here a block of 16 weight rows is transposed so that each 32-bit lane holds 4 consecutive
// values of one row; the 4 matching q_x of a row of x are broadcast to every lane, so one
// vpdpbusd takes 64 products of 16 rows, 8 of them a block, and the 16 rows' scales and
// offsets are one vector each: about 60 instructions for 512 weights.
// Sums per row of x: each block's integer dot exact, then scaled and added in float32 in
// block order, whatever the number of rows (a row's result does not depend on the others).
#pragma once

#include <cstdint>


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace gguf_q8::wide {

constexpr int64_t kColumns = 16;  // weight rows a pass
// Prefetch distance (bytes) into the stretch of 16 rows; prefetch.h's 2048 keeps too few lines
// in flight here (default model's Q4_1 gate_up from memory, 1 row: 0.046 ms, 8192: 0.032).
constexpr int64_t kAhead = 8192;

// Lane i of a transposed vector holds weight row 4 (i % 4) + i / 4 (four registers of four
// rows, transposed within each 128-bit lane). The map is its own inverse.
inline __m512i lane_rows() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// 16 rows' 16 bytes at p (rows `stride` bytes apart) -> g[c], c = 0..3: lane i holds bytes
// 4c..4c+3 of row lane_rows()[i].
inline void transpose(const uint8_t* p, int64_t stride, __m512i* g) {
  __m512i r[4];  // r[a], 128-bit lane L: row 4a + L
  for (int a = 0; a < 4; ++a) {
    const uint8_t* q = p + 4 * a * stride;
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    for (int l = 1; l < 4; ++l) {
      const __m128i row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + l * stride));
      v = _mm512_inserti32x4(v, row, l);
    }
    r[a] = v;
  }
  const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
  g[0] = _mm512_unpacklo_epi64(t0, t2);
  g[1] = _mm512_unpackhi_epi64(t0, t2);
  g[2] = _mm512_unpacklo_epi64(t1, t3);
  g[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Q4 nibbles: byte j holds value j (low) and value 16 + j (high). v[c] values 4c..4c+3,
// v[4 + c] values 16 + 4c.., so v[j] meets the j-th 4 q_x of the block.
inline void nibble_values(const uint8_t* p, int64_t stride, __m512i (&v)[8]) {
  __m512i g[4];
  transpose(p, stride, g);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm512_and_si512(g[c], mask);
    v[4 + c] = _mm512_and_si512(_mm512_srli_epi16(g[c], 4), mask);
  }
}

inline __m512 halves(__m512i words) {  // low 16 bits of each lane: a half -> float32
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
}

// Per format: values() the block's 32 values of 16 rows as unsigned bytes (8 vectors, v[j]
// with the j-th 4 q_x); scales() d and m from each row's block's first 4 bytes. Q4 formats
// only: Q8_0 (signed bytes, 34 a block) measured slower this way than on Q8Dot (default
// model's LM head from memory, 1 row: 1.19 vs 0.65 ms), which already reads at memory speed.
template <typename F>
struct Lanes {
  static constexpr bool kWide = false;  // no 16-row pass: Q8Dot
};

template <>
struct Lanes<Q4_0> {  // [d, 16 bytes of nibbles]; value = d q - 8 d
  static constexpr bool kWide = true;
  static void values(const uint8_t* p, int64_t stride, __m512i (&v)[8]) {
    nibble_values(p + 2, stride, v);
  }
  static void scales(__m512i head, __m512& d, __m512& m) {
    d = halves(head);
    m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
  }
};

template <>
struct Lanes<Q4_1> {  // [d, m, 16 bytes of nibbles]; value = d q + m
  static constexpr bool kWide = true;
  static void values(const uint8_t* p, int64_t stride, __m512i (&v)[8]) {
    nibble_values(p + 4, stride, v);
  }
  static void scales(__m512i head, __m512& d, __m512& m) {
    d = halves(head);
    m = halves(_mm512_srli_epi32(head, 16));
  }
};

// Q8Dot with 16 weight rows a pass (run_columns); single columns (a tail) stay on Q8Dot.
template <typename F>
struct Dot : Q8Dot<F> {
  static constexpr int64_t kColumns = wide::kColumns;

  // sums[m][j] = row r0 + m of x . weight row n + j.
  template <int M>
  void run_columns(int64_t r0, int64_t n, float (&sums)[M][kColumns]) const {
    const int64_t blocks = this->K / kBlock, stride = blocks * F::kBytes;
    const uint8_t* rows = this->w + n * stride;
    const __m512i heads = _mm512_mullo_epi32(lane_rows(), _mm512_set1_epi32(int32_t(stride)));
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* p = rows + b * F::kBytes;
      // The 16 rows are one stretch of memory, read across; ask for it (and the next pass's)
      // kAhead bytes ahead of how far this block is through the pass.
      for (int64_t line = 0; line < kColumns * F::kBytes; line += 64)
        __builtin_prefetch(rows + b * kColumns * F::kBytes + line + kAhead);
      __m512i v[8];
      Lanes<F>::values(p, stride, v);
      __m512 d, mn;
      Lanes<F>::scales(_mm512_i32gather_epi32(heads, p, 1), d, mn);
      for (int m = 0; m < M; ++m) add_block(v, d, mn, (r0 + m) * blocks + b, acc[m]);
    }
    for (int m = 0; m < M; ++m)
      _mm512_storeu_ps(sums[m], _mm512_permutexvar_ps(lane_rows(), acc[m]));
  }

  // x block xb (row and block) against the 16 rows' values, into acc.
  void add_block(const __m512i (&v)[8], __m512 d, __m512 mn, int64_t xb, __m512& acc) const {
    const int32_t* q = reinterpret_cast<const int32_t*>(this->qx + xb * kBlock);
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(q[0]));
    for (int j = 1; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, v[j], _mm512_set1_epi32(q[j]));
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(this->dx[xb]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    if constexpr (F::kHasMin) acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(this->xsum[xb]), acc);
  }
};

}  // namespace gguf_q8::wide

#endif
