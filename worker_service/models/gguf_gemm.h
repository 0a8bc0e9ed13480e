// GEMMs over GGUF's block formats (gguf_formats.h), kept as the file stores them: each weight
// row is K / kBlock blocks, each block kGroups groups of 32 weights w = dq + m. The dot product
// of a row of x with a group is sum(x dq) + m * sum(x): the values are widened and scaled in
// registers once for every row of x, and the sums of x over each group are taken once per call,
// so a weight costs its 4.5-8.5 bits of memory.
#pragma once

#include <cstdint>
#include <vector>

#include "gguf_formats.h"
#include "prefetch.h"
#include "small_gemm.h"

namespace gguf_gemm {

// x [rows, K] (widened) . row n of F blocks; xsum [rows, K / 32]: the sums of x per group.
template <typename F>
struct BlockDot {
  static constexpr int64_t kBlock = kGroup * F::kGroups;  // weights per block
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
    const int64_t blocks = K / kBlock, groups = K / kGroup;
    const uint8_t* row = w + n * blocks * F::kBytes;
    typename Vec::V acc[M][C];
    float offset[M];
    for (int m = 0; m < M; ++m) {
      for (int c = 0; c < C; ++c) acc[m][c] = Vec::zero();
      offset[m] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      prefetch::ahead(row + b * F::kBytes);
      const typename F::Block block(row + b * F::kBytes);
      for (int j = 0; j < F::kGroups; ++j) {
        const int64_t g = b * F::kGroups + j;
        float mn;
        Values q;  // d q: shared by the rows
        block.group(j, q, mn);
        for (int m = 0; m < M; ++m) {
          const float* xg = x + (r0 + m) * K + g * kGroup;
          for (int c = 0; c < kVecs; ++c)
            acc[m][c % C] = Vec::fma(Vec::load(xg + c * Vec::W), q[c], acc[m][c % C]);
          if (F::kHasMin) offset[m] += mn * xsum[(r0 + m) * groups + g];
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int c = 1; c < C; ++c) acc[m][0] = Vec::add(acc[m][0], acc[m][c]);
      sums[m] = Vec::sum(acc[m][0]) + offset[m];
    }
  }
};

// Returns 0, or 2 for rows < 1 or K not a whole number of F's blocks.
template <typename F, typename TX>
int gemm_format(const TX* x, const uint8_t* w, const TX* bias, TX* out, int64_t rows, int64_t K,
                int64_t N, int num_threads) {
  if (rows < 1 || K % BlockDot<F>::kBlock != 0) return 2;
  const std::vector<float> xf = small_gemm::widen_rows(x, rows, K);
  const int64_t groups = K / kGroup;
  std::vector<float> xsum(rows * groups, 0.0f);
  if (F::kHasMin)
    for (int64_t i = 0; i < rows * groups; ++i)
      for (int64_t c = 0; c < kGroup; ++c) xsum[i] += xf[i * kGroup + c];
  const BlockDot<F> dot{xf.data(), xsum.data(), w, K};
  const int64_t row_bytes = K / BlockDot<F>::kBlock * F::kBytes;
  small_gemm::run(dot, bias, out, rows, N, N * row_bytes, num_threads);
  return 0;
}

// out = x @ dequantize(w).T + bias, w [N, K / kBlock blocks of `type`] (ggml's type id).
// Returns 0, or 2 for rows < 1 or K not a whole number of blocks (32 weights; 256 for the
// K-quants), 3 for a type it does not know.
template <typename TX>
int gemm(int type, const TX* x, const uint8_t* w, const TX* bias, TX* out, int64_t rows,
         int64_t K, int64_t N, int num_threads) {
  return with_format(type, [&](auto format) {
    return gemm_format<decltype(format)>(x, w, bias, out, rows, K, N, num_threads);
  });
}

// out [n, K]: weight rows ids[0..n) of w [rows, K / kBlock blocks of `type`], each weight
// d q + m in float32 as the GEMM takes it, then in TX (an embedding's lookup: the blocks stay
// the only copy of the table). Returns 0, or 2 for K not a whole number of blocks, 3 for a
// type it does not know, 4 for an id outside [0, rows).
template <typename TX>
int dequantize_rows(int type, const uint8_t* w, int64_t rows, const int64_t* ids, int64_t n,
                    int64_t K, TX* out) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return 4;
  return with_format(type, [&](auto format) {
    using F = decltype(format);
    if (K % BlockDot<F>::kBlock != 0) return 2;
    const int64_t blocks = K / BlockDot<F>::kBlock;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* row = w + ids[i] * blocks * F::kBytes;
      TX* o = out + i * K;
      for (int64_t b = 0; b < blocks; ++b) {
        const typename F::Block block(row + b * F::kBytes);
        for (int j = 0; j < F::kGroups; ++j, o += kGroup) {
          Values q;  // d q
          float m, v[kGroup];
          block.group(j, q, m);
          std::memcpy(v, q, sizeof v);
          for (int64_t e = 0; e < kGroup; ++e) store(v[e] + m, o + e);
        }
      }
    }
    return 0;
  });
}

}  // namespace gguf_gemm
