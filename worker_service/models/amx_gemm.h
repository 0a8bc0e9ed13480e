// bf16 GEMMs on AMX tiles (Sapphire Rapids and later): out = x @ w.T + bias, float32 sums.
//
// At 3-64 rows (decode batches) a step is too small for oneDNN's GEMMs to pay their call
// overhead and too large for the pair-dot-product loop of small_gemm.h, which does 32
// multiply-adds a weight load where a tile instruction does 16 x 16 x 32. Here every
// 32 output columns of the weight, pre-packed in the tiles' pair layout, are read from memory
// once per block of up to 128 rows (kRowBlock) and from cache by each of its 32-row passes:
// two row tiles x two column tiles of float32 sums, K in steps of 32.
//
// Compiled in the AVX512_BF16 build with the AMX target enabled for these functions only;
// the caller checks the CPU (amx_bf16, amx_tile) and calls `enable()` before `gemm`.
//
// Layouts: x [rows, K] and out [rows, N] bf16, row-major; bias [N] bf16 or null;
// packed [ceil(N / 16), K / 32, 16, 16, 2] bf16: packed[j][kb][r][c][e] = w[16 j + c][32 kb
// + 2 r + e] (zero past N), i.e. w [N, K] viewed [N/16, 16, K/32, 16, 2] and permuted
// (0, 2, 3, 1, 4). K must be a multiple of 32.
#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "bf16.h"
#include "elementwise.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace amx_gemm {

constexpr int64_t kTileK = 32;           // bf16 values of K per tile row
constexpr int64_t kTileN = 16;           // output columns per tile
constexpr int64_t kTileElems = 16 * 32;  // bf16 values of one packed weight tile
// Rows of x (a multiple of 32) whose passes run over one column pair while its weight is in
// cache: a step's weight is read from memory once per block, not once per 32 rows.
constexpr int64_t kRowBlock = 128;

// Whether this process has the tiles (enable() succeeded): the GEMMs that choose for
// themselves (amx_gguf.h) take them only then.
inline bool& lent() {
  static bool tiles = false;
  return tiles;
}

// Linux lends the tile registers to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA).
inline bool enable() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  lent() = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return lent();
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads `cfg` as the tile configuration. Not _tile_loadconfig: GCC 12 declares its operand as
// 8 bytes, so where a configuring function is not inlined into the tiles' user the compiler
// may drop the stores of rows and columns as dead, and the tiles then fault (SIGILL).
inline void load_config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" ::"m"(cfg)); }

// Tiles: 0-3 sums (row half h, column tile c: 2 c + h), 4-5 x rows, 6-7 weight columns.
// r0 rows in the first half, r1 (0-16) in the second.
inline void configure(int r0, int r1) {
  TileConfig cfg;
  const auto set = [&cfg](int tile, int rows) {
    cfg.rows[tile] = uint8_t(rows);
    cfg.colsb[tile] = 64;
  };
  for (int t : {0, 2, 4}) set(t, r0);
  if (r1) {
    for (int t : {1, 3, 5}) set(t, r1);
  }
  set(6, 16);
  set(7, 16);
  load_config(cfg);
}

// Every tile 16 rows of 64 bytes (the GGUF and prefill-attention kernels).
inline void configure_full() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

// Sums of rows [m0, m0 + r0 + r1) for column tiles j0 and (when j1 >= 0) j1, over all of K.
inline void tile_sums(const uint16_t* x, const uint16_t* packed, int64_t K, int64_t m0, int r1,
                      int64_t j0, int64_t j1) {
  const int64_t kb_count = K / kTileK, stride = K * int64_t(sizeof(uint16_t));
  const bool two = j1 >= 0;
  const uint16_t* w0 = packed + j0 * kb_count * kTileElems;
  const uint16_t* w1 = packed + j1 * kb_count * kTileElems;
  const uint16_t* x0 = x + m0 * K;
  const uint16_t* x1 = x0 + 16 * K;
  _tile_zero(0);  // a tile is touched only where configured (configure(r0, r1))
  _tile_zero(2);
  if (r1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    _tile_loadd(4, x0 + kb * kTileK, stride);
    _tile_loadd(6, w0 + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (r1) {
      _tile_loadd(5, x1 + kb * kTileK, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (two) {
      _tile_loadd(7, w1 + kb * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 7);
      if (r1) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// 16 float32 sums of an output row (+ bias[0, 16) when given) -> out[0, cols) in bf16,
// rounded to nearest even (as bf16.h's store), cols <= 16.
inline void store_row16(__m512 sums, const uint16_t* bias, uint16_t* out, int64_t cols) {
  const __mmask16 mask = __mmask16((1u << cols) - 1);
  if (bias) {
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias));
    sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
  }
  _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}

// sums [rows, 16] float32 (row stride 16) + bias -> out's columns [n0, min(n0 + 16, N)).
inline void store_rows(const float* sums, int rows, const uint16_t* bias, uint16_t* out,
                       int64_t m0, int64_t n0, int64_t N) {
  const int64_t cols = std::min<int64_t>(kTileN, N - n0);
  for (int m = 0; m < rows; ++m)
    store_row16(_mm512_load_ps(sums + m * kTileN), bias ? bias + n0 : nullptr,
                out + (m0 + m) * N + n0, cols);
}

// Rows [begin, end) of x by the column tiles j0 and (j1 >= 0) j1 of packed, 32 rows a pass:
// store(m0, r0, r1) takes the float32 sums of rows [m0, m0 + r0 + r1) in sums[2 c + h] [16, 16]
// (tile c of the pair, row half h). `configured` is the tiles' configuration (r0 + 17 r1;
// -1 for none yet), kept across calls on the thread.
template <typename Store>
inline void pair_rows(const uint16_t* x, const uint16_t* packed, int64_t K, int64_t j0,
                      int64_t j1, int64_t begin, int64_t end, int& configured,
                      float (&sums)[4][16 * kTileN], Store store) {
  for (int64_t m0 = begin; m0 < end; m0 += 32) {
    const int r0 = int(std::min<int64_t>(16, end - m0));
    const int r1 = int(std::clamp<int64_t>(end - m0 - 16, 0, 16));
    if (r0 + 17 * r1 != configured) configure(r0, r1);
    configured = r0 + 17 * r1;
    tile_sums(x, packed, K, m0, r1, j0, j1);
    _tile_stored(0, sums[0], 64);
    if (r1) _tile_stored(1, sums[1], 64);
    if (j1 >= 0) _tile_stored(2, sums[2], 64);
    if (j1 >= 0 && r1) _tile_stored(3, sums[3], 64);
    store(m0, r0, r1);
  }
}

// The GEMMs' loop: the pairs of column tiles (j0, j1) = tiles(p) for p < pairs (j1 -1: j0
// alone) over x's rows, each thread the same pairs in every block of kRowBlock rows;
// store(p, m0, r0, r1, sums) takes the float32 sums of rows [m0, m0 + r0 + r1): sums[2 c + h]
// [16, 16] for tile c of the pair and row half h.
template <typename Tiles, typename Store>
inline void over_pairs(const uint16_t* x, const uint16_t* packed, int64_t rows, int64_t K,
                       int64_t pairs, int num_threads, Tiles tiles, Store store) {
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, pairs)))
  {
    alignas(64) float sums[4][16 * kTileN];
    int configured = -1;  // r0 + 17 r1 of the tiles' configuration
    for (int64_t block = 0; block < rows; block += kRowBlock) {
      const int64_t end = std::min(rows, block + kRowBlock);
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < pairs; ++p) {
        const auto [j0, j1] = tiles(p);
        pair_rows(x, packed, K, j0, j1, block, end, configured, sums,
                  [&](int64_t m0, int r0, int r1) { store(p, m0, r0, r1, sums); });
      }
    }
    _tile_release();
  }
}

// out [rows, N] = x [rows, K] @ w.T + bias over the packed weight; false if the shape is not
// one it takes (rows < 1, K not a multiple of 32).
inline bool gemm(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* out,
                 int64_t rows, int64_t K, int64_t N, int num_threads) {
  if (rows < 1 || K % kTileK != 0 || K == 0) return false;
  const int64_t col_tiles = (N + kTileN - 1) / kTileN, pairs = (col_tiles + 1) / 2;
  const auto tiles = [col_tiles](int64_t p) {  // neighbours
    return std::pair<int64_t, int64_t>(2 * p, 2 * p + 1 < col_tiles ? 2 * p + 1 : -1);
  };
  over_pairs(x, packed, rows, K, pairs, num_threads, tiles,
             [&](int64_t p, int64_t m0, int r0, int r1, float (&sums)[4][16 * kTileN]) {
               for (int c = 0; c < (2 * p + 1 < col_tiles ? 2 : 1); ++c) {
                 const int64_t n0 = (2 * p + c) * kTileN;
                 store_rows(sums[2 * c], r0, bias, out, m0, n0, N);
                 if (r1) store_rows(sums[2 * c + 1], r1, bias, out, m0 + 16, n0, N);
               }
             });
  return true;
}

// The gated MLP's first GEMM and its SiLU in one pass: out [rows, I] = silu(x @ gate.T) *
// (x @ up.T) for a weight [2 I, K] holding gate's rows then up's (the fused gate_up, packed
// as one), bias [2 I] or null. Each product is rounded to bf16 as gemm stores it, then
// elementwise::silu_mul_chunk: the same bits as gemm then silu_mul, without the [rows, 2 I]
// product written and read back. false if the shape is not one it takes (gemm's, and I not
// a multiple of 16).
inline bool gemm_gated(const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
                       uint16_t* out, int64_t rows, int64_t K, int64_t I, int num_threads) {
  if (rows < 1 || K % kTileK != 0 || K == 0 || I % kTileN != 0 || I == 0) return false;
  const int64_t up = I / kTileN;  // the column tile of up's first row
  const auto tiles = [up](int64_t p) { return std::pair<int64_t, int64_t>(p, up + p); };
  over_pairs(x, packed, rows, K, up, num_threads, tiles,
             [&](int64_t p, int64_t m0, int r0, int r1, float (&sums)[4][16 * kTileN]) {
               const int64_t n0 = p * kTileN, n = (r0 + r1) * kTileN;  // values of the pass
               alignas(64) uint16_t g[32 * kTileN], u[32 * kTileN], h[32 * kTileN];
               for (int m = 0; m < r0 + r1; ++m) {  // [rows, 16] products in bf16
                 const int64_t at = (m % 16) * kTileN;
                 store_row16(_mm512_load_ps(sums[m < 16 ? 0 : 1] + at), bias ? bias + n0 : nullptr,
                             g + m * kTileN, kTileN);
                 store_row16(_mm512_load_ps(sums[m < 16 ? 2 : 3] + at),
                             bias ? bias + I + n0 : nullptr, u + m * kTileN, kTileN);
               }
               for (int64_t c = 0; c < n; c += elementwise::kChunk)
                 elementwise::silu_mul_chunk(g + c, u + c, h + c, std::min(elementwise::kChunk, n - c));
               for (int m = 0; m < r0 + r1; ++m)
                 std::copy(h + m * kTileN, h + (m + 1) * kTileN, out + (m0 + m) * I + n0);
             });
  return true;
}

}  // namespace amx_gemm

#pragma GCC pop_options

#endif  // __AVX512BF16__
