// GEMMs over GGUF's blocks on bf16 panels: out = x @ dequantize(w).T + bias, on AMX tiles, or
// with AVX512-BF16 pair dot products where the process has no tiles (gguf_dots.h).
//
// The int8 dot products of gguf_q8.h cost a few vector instructions per 32 weights *per row
// of x*: at a decode batch of 32 they are ten times slower than the bf16 weights on AMX. Here
// each 32 weight rows (output columns) are dequantized once per call into a bf16 scratch that
// stays in L1/L2, and every row of x is multiplied by them on the tiles, so a weight costs its
// 4.5-8.5 bits of memory and one dequantization whatever the number of rows. The weights take
// the tiles' A side (16 weight rows by 32 K values: a dequantized row as it is), x the B side
// in the pair layout (packed once per call), so the sums come out transposed: sums[n][m].
//
// The values multiplied are the weights rounded to bf16 (w = d q + m in float32, then bf16,
// as a bf16 checkpoint of the dequantized model holds them) by x in bf16, summed in float32.
// Every block format of gguf_formats.h (Q4_0 ... Q6_K) decodes through its `Block`.
//
// Compiled in the AVX512_BF16 build with the AMX target for these functions only; the tiles
// are taken where amx_gemm::enable() succeeded in this process (amx_gemm::lent()).
#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_gemm.h"
#include "bf16.h"
#include "gguf_formats.h"
#include "prefetch.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace amx_gguf {

using amx_gemm::kTileElems;
using amx_gemm::kTileK;
using gguf_gemm::kGroup;
using gguf_gemm::Values;
constexpr int64_t kPanel = 32;  // weight rows dequantized together: two A tiles

// Tiles (amx_gemm::configure_full): 0-3 sums (A tile a, B tile b: 2 b + a), 4-5 weight rows,
// 6-7 x rows.

// x [rows, K] bf16 -> [ceil(rows / 16), K / 32, 16, 16, 2]: xp[t][kb][r][c][e] = x[16 t + c]
// [32 kb + 2 r + e] (zero past rows): the B side of a tile product, 16 rows of x a tile.
inline std::vector<uint16_t> pack_x(const uint16_t* x, int64_t rows, int64_t K) {
  const int64_t tiles = (rows + 15) / 16, kbs = K / kTileK;
  std::vector<uint16_t> xp(tiles * kbs * kTileElems, 0);
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* tile_row = xp.data() + (m / 16) * kbs * kTileElems + (m % 16) * 2;
    for (int64_t k = 0; k < K; k += 2)  // pair k / 2 % 16 of K block k / 32
      std::memcpy(tile_row + (k / kTileK) * kTileElems + (k % kTileK) / 2 * 32, x + m * K + k,
                  2 * sizeof(uint16_t));
  }
  return xp;
}

// 32 weights q * d + m (q: float32 lanes 0-15, 16-31) -> 32 bf16.
inline __m512i group_bf16(__m512 q0, __m512 q1, float d, float m) {
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(q1, dv, mv), _mm512_fmadd_ps(q0, dv, mv));
}

// Where a dequantized row's groups of 32 go: row-major at dst (the tiles' A side, the dots'
// row pairs); gguf_dots.h's Quads is the other layout.
struct RowMajor {
  uint16_t* dst;
  void operator()(int64_t g, __m512i v) const { _mm512_storeu_si512(dst + g * kGroup, v); }
};

template <typename F>
constexpr bool kSimple = F::kType == gguf_gemm::Q4_0::kType || F::kType == gguf_gemm::Q4_1::kType ||
                         F::kType == gguf_gemm::Q8_0::kType;  // blocks of 32: d (m) values

// d and m of blocks [0, n) from `first` (n <= 16, kSimple formats): one gather of each block's
// first 4 bytes, where a half conversion and a broadcast each a block would cost as much as
// widening its values.
template <typename F>
void block_scales(const uint8_t* first, int n, float* d, float* m) {
  const __m512i at = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(F::kBytes));
  const __m512i raw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(),
                                                  __mmask16((1u << n) - 1), at, first, 1);
  const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
  _mm512_store_ps(d, dv);
  if constexpr (F::kType == gguf_gemm::Q4_1::kType)
    _mm512_store_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(raw, 16))));
  else if constexpr (F::kType == gguf_gemm::Q4_0::kType)
    _mm512_store_ps(m, _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f)));
  else
    _mm512_store_ps(m, _mm512_setzero_ps());
}

// One block's 32 values (kSimple formats) as float32 lanes 0-15 and 16-31, before scaling.
template <typename F>
void block_values(const uint8_t* block, __m512& q0, __m512& q1) {
  if constexpr (F::kType == gguf_gemm::Q8_0::kType) {
    const auto* qs = reinterpret_cast<const __m128i*>(block + 2);
    q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs)));
    q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1)));
  } else {
    const int at = F::kType == gguf_gemm::Q4_1::kType ? 4 : 2;
    const __m512i bytes =  // value j: low nibble of byte j, j + 16: its high nibble
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + at)));
    q0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
}

// One weight row of F blocks -> K bf16, put(g, v) each group g of 32. Q4_0, Q4_1 and Q8_0 (what
// int4 and int8 at load make) take their scales 16 blocks at a time; the other formats decode
// through their Block.
template <typename F, typename Put>
void dequantize_row(const uint8_t* row, int64_t blocks, Put put) {
  if constexpr (kSimple<F>) {
    alignas(64) float d[16], m[16];
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
      const int n = int(std::min<int64_t>(16, blocks - b0));
      block_scales<F>(row + b0 * F::kBytes, n, d, m);
      for (int i = 0; i < n; ++i) {
        const uint8_t* block = row + (b0 + i) * F::kBytes;
        prefetch::ahead(block);
        __m512 q0, q1;
        block_values<F>(block, q0, q1);
        put(b0 + i, group_bf16(q0, q1, d[i], m[i]));
      }
    }
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      const typename F::Block block(row + b * F::kBytes);
      prefetch::ahead(row + b * F::kBytes);
      for (int j = 0; j < F::kGroups; ++j) {
        Values q;  // d q, float32
        float m;
        block.group(j, q, m);
        put(b * F::kGroups + j, group_bf16(q[0], q[1], 1.0f, m));
      }
    }
  }
}

}  // namespace amx_gguf

#include "gguf_dots.h"

namespace amx_gguf {

// Weight rows [n0, n0 + count) -> buf [kPanel, K] bf16, row-major or (quads) in gguf_dots.h's
// Quads layout; rows past count zero. Into Quads 4 rows at a time, 512 K values each, so that
// their cache lines are whole before the next rows'.
template <typename F>
void dequantize_panel(const uint8_t* w, int64_t K, int64_t n0, int64_t count, bool quads,
                      uint16_t* buf) {
  const int64_t per_block = kGroup * F::kGroups, blocks = K / per_block;
  const int64_t row_bytes = blocks * F::kBytes, chunk = std::max<int64_t>(1, 512 / per_block);
  if (!quads) {
    for (int64_t c = 0; c < count; ++c)
      dequantize_row<F>(w + (n0 + c) * row_bytes, blocks, RowMajor{buf + c * K});
    std::fill(buf + count * K, buf + kPanel * K, uint16_t(0));
    return;
  }
  for (int64_t c0 = 0; c0 < kPanel; c0 += 4)
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
      const int64_t n = std::min(chunk, blocks - b0);
      for (int64_t c = c0; c < c0 + 4; ++c) {
        const gguf_dots::Quads put{buf, c, b0 * F::kGroups};
        if (c < count)
          dequantize_row<F>(w + (n0 + c) * row_bytes + b0 * F::kBytes, n, put);
        else
          for (int64_t g = 0; g < n * F::kGroups; ++g) put(g, _mm512_setzero_si512());
      }
    }
}

// sums [16 n][16 m] + bias -> out[m0 + m][n0 + n] for the rows and columns that exist.
// (Column m of sums is row m of out: one gather each.)
inline void store_sums(const float* sums, const uint16_t* bias, uint16_t* out, int64_t m0,
                       int64_t rows, int64_t n0, int64_t N) {
  const int64_t ms = std::min<int64_t>(16, rows - m0), ns = std::min<int64_t>(16, N - n0);
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                           192, 208, 224, 240);
  for (int64_t m = 0; m < ms; ++m)
    amx_gemm::store_row16(_mm512_i32gather_ps(column, sums + m, 4), bias ? bias + n0 : nullptr,
                          out + (m0 + m) * N + n0, ns);
}

inline void tile_store(int tile, float* sums) {  // _tile_stored takes a constant tile number
  switch (tile) {
    case 0: _tile_stored(0, sums, 64); break;
    case 1: _tile_stored(1, sums, 64); break;
    case 2: _tile_stored(2, sums, 64); break;
    default: _tile_stored(3, sums, 64); break;
  }
}

// Sum tile `tile` -> out's rows m0.., columns n0.. + bias.
inline void flush(int tile, const uint16_t* bias, uint16_t* out, int64_t m0, int64_t rows,
                  int64_t n0, int64_t N) {
  if (m0 >= rows || n0 >= N) return;
  alignas(64) float sums[16 * 16];
  tile_store(tile, sums);
  store_sums(sums, bias, out, m0, rows, n0, N);
}

// The panel buf (weight rows n0 .. n0 + 31, dequantized) times every row of x (packed: xp).
inline void panel_product(const uint16_t* buf, const uint16_t* xp, const uint16_t* bias,
                          uint16_t* out, int64_t rows, int64_t K, int64_t n0, int64_t N) {
  const int64_t kbs = K / kTileK, x_tiles = (rows + 15) / 16, stride = K * 2;
  for (int64_t t = 0; t < x_tiles; t += 2) {
    const bool two = t + 1 < x_tiles;
    const uint16_t* x0 = xp + t * kbs * kTileElems;
    const uint16_t* x1 = x0 + kbs * kTileElems;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kbs; ++kb) {
      _tile_loadd(4, buf + kb * kTileK, stride);
      _tile_loadd(5, buf + 16 * K + kb * kTileK, stride);
      _tile_loadd(6, x0 + kb * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, x1 + kb * kTileElems, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    flush(0, bias, out, 16 * t, rows, n0, N);
    flush(1, bias, out, 16 * t, rows, n0 + 16, N);
    if (two) {
      flush(2, bias, out, 16 * (t + 1), rows, n0, N);
      flush(3, bias, out, 16 * (t + 1), rows, n0 + 16, N);
    }
  }
}

template <typename F>
void gemm_format(const uint16_t* x, const uint8_t* w, const uint16_t* bias, uint16_t* out,
                 int64_t rows, int64_t K, int64_t N, bool tiles, int num_threads) {
  const std::vector<uint16_t> xp = tiles ? pack_x(x, rows, K) : std::vector<uint16_t>();
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const bool quads = !tiles && rows >= gguf_dots::kQuadRows;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, panels)))
  {
    std::vector<uint16_t> buf(kPanel * K);
    if (tiles) amx_gemm::configure_full();
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanel, count = std::min(kPanel, N - n0);
      dequantize_panel<F>(w, K, n0, count, quads, buf.data());
      if (tiles)
        panel_product(buf.data(), xp.data(), bias, out, rows, K, n0, N);
      else if (quads)
        gguf_dots::panel_quads(buf.data(), x, bias, out, rows, K, n0, count, N);
      else
        gguf_dots::panel_pairs(buf.data(), x, bias, out, rows, K, n0, count, N);
    }
    if (tiles) _tile_release();
  }
}

// gguf_gemm::gemm for bf16 x over panels dequantized to bf16: on AMX tiles where `tiles`
// (amx_gemm::lent()), else with AVX512-BF16 dot products. Returns 0, 2 for rows < 1 or K not
// whole blocks, 3 for a type it does not know.
inline int gemm(int type, const uint16_t* x, const uint8_t* w, const uint16_t* bias,
                uint16_t* out, int64_t rows, int64_t K, int64_t N, bool tiles, int num_threads) {
  return gguf_gemm::with_format(type, [&](auto format) {
    using F = decltype(format);
    if (rows < 1 || K % (kGroup * F::kGroups) != 0) return 2;
    gemm_format<F>(x, w, bias, out, rows, K, N, tiles, num_threads);
    return 0;
  });
}

}  // namespace amx_gguf

#pragma GCC pop_options

#endif  // __AVX512BF16__
