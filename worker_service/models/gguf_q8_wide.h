// gguf_q8.h's int8-x GEMM over Q4_0 and Q4_1 blocks, several weight rows a pass (AVX2 and
// up). Q8Dot takes one weight row's block per pass: about 17 instructions for 32 weights (the
// integer dot, its conversion, the block's scale and offset), so a Q4_1 GEMV at a few rows of
// x was bound by instructions, not by memory. Here a block of 16 weight rows (8 with AVX2) is
// transposed so that each 32-bit lane holds 4 consecutive values of one row; the 4 matching
// q_x of a row of x are broadcast to every lane, so each u8 x s8 multiply-add takes 4
// products of every row (vpdpbusd: AVX512-VNNI), and the rows' scales and offsets are one
// vector each: about 60 instructions for 512 weights with VNNI.
// Sums per row of x: each block's integer dot exact, then scaled and added in float32 in
// block order, whatever the number of rows (a row's result does not depend on the others).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>

namespace gguf_q8::wide {

// Prefetch distance (bytes) into the stretch of a pass's rows; prefetch.h's 2048 keeps too few
// lines in flight here (default model's Q4_1 gate_up from memory, 1 row: 0.046 ms, 8192: 0.032).
constexpr int64_t kAhead = 8192;

inline int32_t word(const int8_t* q, int j) {  // q_x j*4 .. j*4 + 3 as one int32
  int32_t w;
  std::memcpy(&w, q + 4 * j, 4);
  return w;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
struct Simd {  // 16 weight rows a pass
  using I = __m512i;
  using V = __m512;
  static constexpr int64_t kColumns = 16;

  // Lane i of a transposed vector holds weight row 4 (i % 4) + i / 4 (four registers of four
  // rows, transposed within each 128-bit lane). The map is its own inverse.
  static I lane_rows() {
    return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  }
  static void load_rows(const uint8_t* p, int64_t stride, I (&r)[4]) {  // r[a], lane L: 4a + L
    for (int a = 0; a < 4; ++a) {
      const uint8_t* q = p + 4 * a * stride;
      r[a] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      for (int l = 1; l < 4; ++l) {
        const __m128i row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + l * stride));
        r[a] = _mm512_inserti32x4(r[a], row, l);
      }
    }
  }
  static I lo32(I a, I b) { return _mm512_unpacklo_epi32(a, b); }
  static I hi32(I a, I b) { return _mm512_unpackhi_epi32(a, b); }
  static I lo64(I a, I b) { return _mm512_unpacklo_epi64(a, b); }
  static I hi64(I a, I b) { return _mm512_unpackhi_epi64(a, b); }
  static I low_nibbles(I g) { return _mm512_and_si512(g, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I g) { return low_nibbles(_mm512_srli_epi16(g, 4)); }
  // Each lane's sum of v[j]'s 4 unsigned bytes times q[j]'s 4 signed ones, over j = 0..7.
  static I dot(const I (&v)[8], const int8_t* q) {
    I sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(word(q, 0)));
    for (int j = 1; j < 8; ++j)
      sum = _mm512_dpbusd_epi32(sum, v[j], _mm512_set1_epi32(word(q, j)));
    return sum;
  }
  static I heads(const uint8_t* p, I offsets) {  // each row's first 4 bytes at p
    return _mm512_i32gather_epi32(offsets, p, 1);
  }
  static V halves(I words) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)); }
  static V high_halves(I words) { return halves(_mm512_srli_epi32(words, 16)); }
  static I offsets(int64_t stride) {
    return _mm512_mullo_epi32(lane_rows(), _mm512_set1_epi32(int32_t(stride)));
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static void store_rows(V sums, float* out) {  // out[row] in row order
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(lane_rows(), sums));
  }
};
#else
struct Simd {  // 8 weight rows a pass; lane i holds row i
  using I = __m256i;
  using V = __m256;
  static constexpr int64_t kColumns = 8;

  static void load_rows(const uint8_t* p, int64_t stride, I (&r)[4]) {  // r[a], lane L: a + 4L
    for (int a = 0; a < 4; ++a) {
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + a * stride));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (a + 4) * stride));
      r[a] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
  }
  static I lo32(I a, I b) { return _mm256_unpacklo_epi32(a, b); }
  static I hi32(I a, I b) { return _mm256_unpackhi_epi32(a, b); }
  static I lo64(I a, I b) { return _mm256_unpacklo_epi64(a, b); }
  static I hi64(I a, I b) { return _mm256_unpackhi_epi64(a, b); }
  static I low_nibbles(I g) { return _mm256_and_si256(g, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I g) { return low_nibbles(_mm256_srli_epi16(g, 4)); }
  // vpmaddubsw's pair sums stay within int16 over all 8 (values <= 15, |q_x| <= 127: 8 x 3810).
  static I dot(const I (&v)[8], const int8_t* q) {
    I pairs = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(word(q, 0)));
    for (int j = 1; j < 8; ++j) {
      const I qj = _mm256_set1_epi32(word(q, j));
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[j], qj));
    }
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
  static I heads(const uint8_t* p, I offsets) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(p), offsets, 1);
  }
  static V halves(I words) {  // low 16 bits of each lane (as int32 below 2^16, packed unsigned)
    const I low = _mm256_and_si256(words, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
  }
  static V high_halves(I words) { return halves(_mm256_srli_epi32(words, 16)); }
  static I offsets(int64_t stride) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                              _mm256_set1_epi32(int32_t(stride)));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static void store_rows(V sums, float* out) { _mm256_storeu_ps(out, sums); }
};
#endif

constexpr int64_t kColumns = Simd::kColumns;  // weight rows a pass
using I = Simd::I;
using V = Simd::V;

// The pass's rows' 16 bytes at p (rows `stride` bytes apart) -> g[c], c = 0..3: each lane
// bytes 4c..4c+3 of its row (Simd::load_rows puts 4 dwords of one row in each 128-bit lane;
// a 4 x 4 dword transpose within the lanes).
inline void transpose(const uint8_t* p, int64_t stride, I* g) {
  I r[4];
  Simd::load_rows(p, stride, r);
  const I t0 = Simd::lo32(r[0], r[1]), t1 = Simd::hi32(r[0], r[1]);
  const I t2 = Simd::lo32(r[2], r[3]), t3 = Simd::hi32(r[2], r[3]);
  g[0] = Simd::lo64(t0, t2);
  g[1] = Simd::hi64(t0, t2);
  g[2] = Simd::lo64(t1, t3);
  g[3] = Simd::hi64(t1, t3);
}

// Q4 nibbles: byte j holds value j (low) and value 16 + j (high). v[c] values 4c..4c+3,
// v[4 + c] values 16 + 4c.., so v[j] meets the j-th 4 q_x of the block.
inline void nibble_values(const uint8_t* p, int64_t stride, I (&v)[8]) {
  I g[4];
  transpose(p, stride, g);
  for (int c = 0; c < 4; ++c) {
    v[c] = Simd::low_nibbles(g[c]);
    v[4 + c] = Simd::high_nibbles(g[c]);
  }
}

// Per format: values() a block's 32 values of the pass's rows as unsigned bytes (8 vectors,
// v[j] with the j-th 4 q_x); scales() d and m from each row's block's first 4 bytes. Q4
// formats only: Q8_0 (signed bytes, 34 a block) measured slower this way than on Q8Dot
// (default model, int8 batch-1 decode step 5.4-5.9 vs 4.4-4.5 ms).
template <typename F>
struct Lanes {
  static constexpr bool kWide = false;  // no wide pass: Q8Dot
};

template <>
struct Lanes<Q4_0> {  // [d, 16 bytes of nibbles]; value = d q - 8 d
  static constexpr bool kWide = true;
  static void values(const uint8_t* p, int64_t stride, I (&v)[8]) {
    nibble_values(p + 2, stride, v);
  }
  static void scales(I head, V& d, V& m) {
    d = Simd::halves(head);
    m = Simd::mul(d, Simd::set1(-8.0f));
  }
};

template <>
struct Lanes<Q4_1> {  // [d, m, 16 bytes of nibbles]; value = d q + m
  static constexpr bool kWide = true;
  static void values(const uint8_t* p, int64_t stride, I (&v)[8]) {
    nibble_values(p + 4, stride, v);
  }
  static void scales(I head, V& d, V& m) {
    d = Simd::halves(head);
    m = Simd::high_halves(head);
  }
};

// Q8Dot with kColumns weight rows a pass (run_columns); single columns (a tail) stay on Q8Dot.
template <typename F>
struct Dot : Q8Dot<F> {
  static constexpr int64_t kColumns = wide::kColumns;

  // sums[m][j] = row r0 + m of x . weight row n + j.
  template <int M>
  void run_columns(int64_t r0, int64_t n, float (&sums)[M][kColumns]) const {
    const int64_t blocks = this->K / kBlock, stride = blocks * F::kBytes;
    const uint8_t* rows = this->w + n * stride;
    const I offsets = Simd::offsets(stride);
    V acc[M];
    for (int m = 0; m < M; ++m) acc[m] = Simd::zero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* p = rows + b * F::kBytes;
      // The pass's rows are one stretch of memory, read across; ask for it (and the next
      // pass's) kAhead bytes ahead of how far this block is through the pass.
      for (int64_t line = 0; line < kColumns * F::kBytes; line += 64)
        __builtin_prefetch(rows + b * kColumns * F::kBytes + line + kAhead);
      I v[8];
      Lanes<F>::values(p, stride, v);
      V d, mn;
      Lanes<F>::scales(Simd::heads(p, offsets), d, mn);
      for (int m = 0; m < M; ++m) add_block(v, d, mn, (r0 + m) * blocks + b, acc[m]);
    }
    for (int m = 0; m < M; ++m) Simd::store_rows(acc[m], sums[m]);
  }

  // x block xb (row and block) against the pass's values, into acc.
  void add_block(const I (&v)[8], V d, V mn, int64_t xb, V& acc) const {
    const I dot = Simd::dot(v, this->qx + xb * kBlock);
    acc = Simd::fmadd(Simd::to_float(dot), Simd::mul(d, Simd::set1(this->dx[xb])), acc);
    if constexpr (F::kHasMin) acc = Simd::fmadd(mn, Simd::set1(this->xsum[xb]), acc);
  }
};

}  // namespace gguf_q8::wide

#endif
