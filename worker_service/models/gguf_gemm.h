// GEMMs over GGUF's block formats, kept as the file stores them (ggml's layouts): each weight
// row is K / 32 blocks of 32 weights, w = d * q + m per block, d and m IEEE halves:
//   Q4_0  {half d; uint8 qs[16]}         q = nibble - 8 (m = -8 d), 18 bytes
//   Q4_1  {half d; half m; uint8 qs[16]} q = nibble,                20 bytes
//   Q8_0  {half d; int8 qs[32]}          q = qs,     m = 0,         34 bytes
// (nibbles: value j is qs[j] & 15 and value j + 16 is qs[j] >> 4). The dot product of a row of
// x with a block is d * sum(x q) + m * sum(x): the q are widened in registers and the sums of x
// over each block are taken once per call, so a weight costs its 4.5-8.5 bits of memory.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "small_gemm.h"

namespace gguf_gemm {

using small_gemm::Vec;

constexpr int64_t kBlock = 32;  // weights per block

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

constexpr int kVecs = int(kBlock / Vec::W);  // vectors of one block's values
using Values = typename Vec::V[kVecs];

inline void int8_values(const uint8_t* p, Values& q) {
  for (int c = 0; c < kVecs; ++c) q[c] = Vec::load(reinterpret_cast<const int8_t*>(p) + c * Vec::W);
}

// Each format: its ggml type id, block bytes, whether it has an offset m, and load(): the
// block's 32 values widened into vectors (once, for every row of x), with d and m.
struct Q4_0 {
  static constexpr int kType = 2, kBytes = 18;
  static constexpr bool kHasMin = true;
  static void load(const uint8_t* b, Values& q, float& d, float& m) {
    d = half_at(b);
    m = -8.0f * d;
    Vec::nibbles(b + 2, q);
  }
};

struct Q4_1 {
  static constexpr int kType = 3, kBytes = 20;
  static constexpr bool kHasMin = true;
  static void load(const uint8_t* b, Values& q, float& d, float& m) {
    d = half_at(b);
    m = half_at(b + 2);
    Vec::nibbles(b + 4, q);
  }
};

struct Q8_0 {
  static constexpr int kType = 8, kBytes = 34;
  static constexpr bool kHasMin = false;
  static void load(const uint8_t* b, Values& q, float& d, float& m) {
    d = half_at(b);
    m = 0.0f;
    int8_values(b + 2, q);
  }
};

// x [rows, K] (widened) . row n of F blocks; xsum [rows, K / 32]: the sums of x per block.
template <typename F>
struct BlockDot {
  const float* x;
  const float* xsum;
  const uint8_t* w;
  int64_t K;

  // Independent sums per row: few rows need several chains of FMAs to hide their latency;
  // more rows interleave their own chains (and would run out of vector registers).
  template <int M>
  static constexpr int kChains = M <= 2 ? 4 : (M <= 4 ? 2 : 1);

  template <int M>
  void run(int64_t r0, int64_t n, float (&sums)[M]) const {
    constexpr int C = kChains<M>;
    const int64_t blocks = K / kBlock;
    const uint8_t* row = w + n * blocks * F::kBytes;
    typename Vec::V acc[M][C];
    float offset[M];
    for (int m = 0; m < M; ++m) {
      for (int c = 0; c < C; ++c) acc[m][c] = Vec::zero();
      offset[m] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      float d, mn;
      Values q;
      F::load(row + b * F::kBytes, q, d, mn);
      const typename Vec::V dv = Vec::set1(d);
      for (int c = 0; c < kVecs; ++c) q[c] = Vec::mul(q[c], dv);  // d q: shared by the rows
      for (int m = 0; m < M; ++m) {
        const float* xb = x + (r0 + m) * K + b * kBlock;
        for (int c = 0; c < kVecs; ++c)
          acc[m][c % C] = Vec::fma(Vec::load(xb + c * Vec::W), q[c], acc[m][c % C]);
        if (F::kHasMin) offset[m] += mn * xsum[(r0 + m) * blocks + b];
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int c = 1; c < C; ++c) acc[m][0] = Vec::add(acc[m][0], acc[m][c]);
      sums[m] = Vec::sum(acc[m][0]) + offset[m];
    }
  }
};

template <typename F, typename TX>
void gemm_format(const TX* x, const uint8_t* w, const TX* bias, TX* out, int64_t rows, int64_t K,
                 int64_t N, int num_threads) {
  const std::vector<float> xf = small_gemm::widen_rows(x, rows, K);
  const int64_t blocks = K / kBlock;
  std::vector<float> xsum(rows * blocks, 0.0f);
  for (int64_t i = 0; i < rows * blocks; ++i)
    for (int64_t c = 0; c < kBlock; ++c) xsum[i] += xf[i * kBlock + c];
  const BlockDot<F> dot{xf.data(), xsum.data(), w, K};
  small_gemm::run(dot, bias, out, rows, N, N * blocks * F::kBytes, num_threads);
}

// out = x @ dequantize(w).T + bias, w [N, K / 32 blocks of `type`]. Returns 0, or 2 for
// rows < 1 or K not a multiple of 32, 3 for a type it does not know.
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

}  // namespace gguf_gemm
