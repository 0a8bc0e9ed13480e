// The rows layouts of gguf_q8_rows.h (Q4_0, Q4_1, Q8_0 with each 16 weight rows interleaved)
// on AMX bf16 tiles, for many rows of x: each 32 weight rows are dequantized once per call into
// amx_gemm.h's packed layout, which a block of 16 interleaved rows maps onto directly (its
// vector of 4 K values of 16 rows is two tile rows of K pairs), and every row of x is
// multiplied by them with amx_gemm's passes. The weights multiplied are w = d q + m rounded to
// bf16, as amx_gguf.h's panels hold them.
//
// Fewer rows take vpdpbusd (gguf_q8_rows.h), below kMinRows. Default model's 30 layers and head
// (weights in the L3), 2 threads, AMX Xeon, ms, Q8_0 / Q4_1, the blocks' own path (int8 x to
// 5 rows, then amx_gguf.h's panels) vs this layout: 1 row 3.6 / 2.6 vs 2.0 / 1.8; 8 rows
// 11.8 / 12.2 vs 4.3 / 5.2; 16 rows 12.7 / 13.2 vs 8.1 / 9.4; 32 rows 15.0 / 15.0 vs 11.2 /
// 11.5; 128 rows 40.4 / 37.3 vs 25.8 / 24.4 (the bf16 weights' AMX GEMM: 3.1, 3.2, 3.7, 5.1,
// 17.8). An int8 tile product a block (tdpbsud) measured no faster than vpdpbusd: each block's
// sums must be stored and scaled, which is the dots' own cost.
//
// Compiled in the AVX512_BF16 build with the AMX target for these functions only; taken where
// the process has the tiles (amx_gemm::lent()).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_gemm.h"
#include "gguf_q8_rows.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace amx_rows {

using amx_gemm::kTileElems;
using q8_rows::kRows;
// Rows of x from which the tiles take the GEMM (below, vpdpbusd): Q4 at 20, Q8_0 at 28 (the
// default model's shapes, 2 threads, ms, int8 x vs tiles: Q4_1 16 rows 9.4 vs 10.5, 24 rows
// 13.9 vs 11.5; Q8_0 24 rows 10.9 vs 11.8, 32 rows 14.5 vs 12.7).
template <typename F>
constexpr int64_t kMinRows = std::is_same_v<F, q8_rows::Q8_0> ? 28 : 20;

// One vector of a block (byte 4 r + e: K value e of row r, u8) -> its two rows of the packed
// tile (K values 0-1, then 2-3, of each row), w = u8 d + m; d and m per quarter of the vector
// (lane l: row 4 c + l / 4), m holding -F::kBias d (exact: a power of two times d).
template <typename F>
inline void vector_rows(__m512i v, const __m512 (&d)[4], const __m512 (&m)[4], uint16_t* tile) {
  __m512 w[4];
  for (int c = 0; c < 4; ++c) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, c));
    w[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d[c], m[c]);
  }
  const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);  // rows 0-7: [r][2 K pairs]
  const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]);  // rows 8-15
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  _mm512_storeu_si512(tile, _mm512_permutex2var_epi32(lo, even, hi));
  _mm512_storeu_si512(tile + 32, _mm512_permutex2var_epi32(lo, odd, hi));
}

// The 16 rows of group wg, `blocks` blocks -> packed [blocks][16 K pairs][16 rows][2] bf16.
template <typename F>
void dequantize_group(const uint8_t* wg, int64_t blocks, uint16_t* packed) {
  const __m512i quarter =  // lane l: row l / 4 of a quarter of the vector
      _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = wg + b * F::kBytes;
    const __m512 dw = q8_rows::halves(block);
    const __m512 mw = _mm512_fmadd_ps(dw, _mm512_set1_ps(-float(F::kBias)), F::mins(block, dw));
    __m512 d[4], m[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i row = _mm512_add_epi32(quarter, _mm512_set1_epi32(4 * c));
      d[c] = _mm512_permutexvar_ps(row, dw);
      m[c] = _mm512_permutexvar_ps(row, mw);
    }
    uint16_t* tile = packed + b * kTileElems;
    for (int p = 0; p < 4; ++p) {  // values() p: K values 8 p .. 8 p + 3, then + 4 .. + 7
      __m512i low, high;
      F::values(block, p, low, high);
      vector_rows<F>(low, d, m, tile + 4 * p * 32);
      vector_rows<F>(high, d, m, tile + (4 * p + 2) * 32);
    }
  }
}

template <typename F>
void gemm_format(const uint16_t* x, const uint8_t* w, const uint16_t* bias, uint16_t* out,
                 int64_t rows, int64_t K, int64_t N, int num_threads) {
  const int64_t blocks = K / 32, groups = N / kRows, pairs = (groups + 1) / 2;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, pairs)))
  {
    std::vector<uint16_t> packed(2 * blocks * kTileElems);
    alignas(64) float sums[4][16 * amx_gemm::kTileN];
    int configured = -1;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t tiles = std::min<int64_t>(2, groups - 2 * p);
      for (int64_t t = 0; t < tiles; ++t)
        dequantize_group<F>(w + (2 * p + t) * blocks * F::kBytes, blocks,
                            packed.data() + t * blocks * kTileElems);
      const auto store = [&](int64_t m0, int r0, int r1) {
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t n0 = (2 * p + t) * kRows;
          amx_gemm::store_rows(sums[2 * t], r0, bias, out, m0, n0, N);
          if (r1) amx_gemm::store_rows(sums[2 * t + 1], r1, bias, out, m0 + 16, n0, N);
        }
      };
      amx_gemm::pair_rows(x, packed.data(), K, 0, tiles - 1, 0, rows, configured, sums, store);
    }
    _tile_release();
  }
}

}  // namespace amx_rows

#pragma GCC pop_options

#endif  // __AVX512BF16__ && __AVX512VNNI__
