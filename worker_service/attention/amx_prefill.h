// Causal prefill attention on AMX tiles (bf16): one request's new query rows (a prompt or a
// chunk of one) over its K/V read from the paged pool, a cached prefix included, in one pass
// with an online softmax (flash-attention style). It replaces SDPA over gathered K/V.
//
// Each KV head's K and V are first packed once per call into the tiles' pair layout (the
// B side of the two products), shared by every query head of its GQA group and every query
// tile. Then work items (query head, 16 query rows, 64 output dims) run 32 keys at a time:
//   scores S [16, 32] = Q [16, dim] K^T   two column tiles, dim / 32 tile products each
//   online softmax per row                float32, keys after the row's position masked
//   sums   O [16, 64] += P V              in four tiles across steps; P rounded to bf16,
//                                         as flash attention rounds it
// and write O / l in bf16, rounded to nearest even. O stays in its tiles: it is rescaled
// only in the steps where some row's max grows (softmax_step). Heads of more
// than 64 dims take one work item per 64 dims, each computing the scores again.
//
// Layouts (row-major, elements): query, out [query_len, heads, dim] (the request's rows);
// k/v cache [num_blocks, block_size, kv_heads, dim] bf16, or quantized ([.., dim + 2]: int8 or
// float8 e4m3fn values and a half scale per head row, kv_quant.h), widened to bf16 as they are
// packed; blocks [ceil(seq_len / block_size)]
// int32. Query row j sits at position seq_len - query_len + j and sees keys 0 ..= it.
// dim must be a multiple of 32. Compiled in the AVX512_BF16 build with the AMX target
// enabled for these functions only; the caller checks for tiles (amx_gemm::enable()).
//
// CPUs with AVX512-BF16 but no tiles (Zen 4, Cooper Lake) run the same passes through the
// Dots engine (prefill_dots.h): each tile product done by vdpbf16ps over the same packed
// tiles, 16 float32 sums per row, the sums O kept in memory. The engines differ only there;
// the packing, the softmax and the loop are this file's, shared.
#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../models/amx_gemm.h"
#include "kv_quant.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace amx_prefill {

constexpr int64_t kRows = 16;      // query rows per work item
constexpr int64_t kKeys = 32;      // keys per step: two score tiles, one P V tile depth
constexpr int64_t kTile = 16 * 32;  // bf16 values of one packed B tile
constexpr int64_t kChunk = 64;     // output dims per pass: four column tiles of sums

struct Shape {
  int64_t heads, kv_heads, dim, block_size, query_len, seq_len;
  float scale;
  int64_t steps() const { return (seq_len + kKeys - 1) / kKeys; }
  int64_t packed() const { return steps() * kKeys * dim; }  // bf16 values of one head's K (or V)
};

// Tiles (amx_gemm::configure_full): 0-1 scores (keys 0-15, 16-31 of a step), 2-5 sums (16
// dims each), 6 query or P, 7 K or V.

// A head row of the pool as bf16: in place for a bf16 pool; a quantized one's (kv_quant.h)
// values times its scale, rounded to bf16 into `buf` (as kv_quant.dequantize does).
inline const uint16_t* bf16_row(const uint16_t* row, int64_t, uint16_t*) { return row; }
template <typename C>
inline const uint16_t* bf16_row(const C* row, int64_t dim, uint16_t* buf) {
  const float scale = row_scale(row, dim);
  for (int64_t d = 0; d < dim; ++d) store(widen(row[d]) * scale, buf + d);
  return buf;
}

// KV head h's keys [32 st, 32 st + 32) packed (zero past seq_len):
//   kp[2 st + u][half][r][c][e] = K[32 st + 16 u + c][32 half + 2 r + e]   (scores' B)
//   vp[st][j][r][c][e]          = V[32 st + 2 r + e][16 j + c]             (P V's B)
template <typename C>
void pack_step(const C* k_cache, const C* v_cache, const int32_t* blocks, const Shape& s,
               int64_t h, int64_t st, uint16_t* kp, uint16_t* vp) {
  const int64_t dim = s.dim, halves = dim / 32, width = dim + kScaleElems<C>;
  const int64_t slot = s.kv_heads * width;
  alignas(64) uint16_t zero[256] = {}, buf[2][256];
  auto row = [&](const C* cache, int64_t n, uint16_t* into) {
    if (n >= s.seq_len) return static_cast<const uint16_t*>(zero);
    const int64_t at = int64_t(blocks[n / s.block_size]) * s.block_size + n % s.block_size;
    return bf16_row(cache + at * slot + h * width, dim, into);
  };
  const __m512i across = _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_set_epi32(
      15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));  // pair r -> row r of the tile
  uint16_t* k_step = kp + st * kKeys * dim;
  for (int64_t i = 0; i < kKeys; ++i) {  // key 32 st + i: its pairs down column i % 16
    const uint16_t* k = row(k_cache, st * kKeys + i, buf[0]);
    uint16_t* tile = k_step + (i / 16) * halves * kTile;
    for (int64_t half = 0; half < halves; ++half)
      _mm512_i32scatter_epi32(tile + half * kTile + 2 * (i % 16), across,
                              _mm512_loadu_si512(k + 32 * half), 4);
  }
  // Each pair of keys' rows interleaved: 16 dims of key 2r then 2r + 1, pairwise.
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  uint16_t* v_step = vp + st * kKeys * dim;
  for (int64_t r = 0; r < 16; ++r) {
    const uint16_t* a = row(v_cache, st * kKeys + 2 * r, buf[0]);
    const uint16_t* b = row(v_cache, st * kKeys + 2 * r + 1, buf[1]);
    for (int64_t d = 0; d < dim; d += 32) {  // dims [d, d + 32): column tiles d/16, d/16 + 1
      const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
      _mm512_storeu_si512(v_step + (d / 16) * kTile + r * 32, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(v_step + (d / 16 + 1) * kTile + r * 32,
                          _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// 2^t for t <= 0 (scores minus their running max, in log2 units): 2^n * p(f), |f| <= 1/2.
inline __m512 exp2_ps(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, 0), f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.333355815e-3f);
  for (float c : {9.618129108e-3f, 5.550410866e-2f, 0.2402265070f, 0.6931471806f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Softmax state and sums of one work item's 16 rows. Scores are kept in log2 units (times
// scale * log2 e), so that a weight is one 2^x.
struct Rows {
  alignas(64) uint16_t q[kRows * 256];  // the rows' queries, zero-padded, [16, dim]
  alignas(64) float scores[kRows * kKeys];
  alignas(64) uint16_t p[kRows * kKeys];
  alignas(64) float o[kRows * kChunk];  // the sums' tiles when rescaled or read (Dots: the sums)
  alignas(64) float l[kRows * 16];      // each row's sum of weights, in 16 lanes
  float m[kRows];                       // each row's running max
};

}  // namespace amx_prefill

#include "prefill_dots.h"

namespace amx_prefill {

// The AMX engine: the scores in tiles 0-1, the sums of n (2 or 4) column tiles in tiles 2..
// across steps (the intrinsics take literal tile numbers), P in tile 6, K or V in tile 7.
inline void zero_sums(int n) {
  _tile_zero(2);
  _tile_zero(3);
  if (n > 2) {
    _tile_zero(4);
    _tile_zero(5);
  }
}
inline void store_sums(int n, float* o) {  // o [16, kChunk]
  _tile_stored(2, o, kChunk * 4);
  _tile_stored(3, o + 16, kChunk * 4);
  if (n > 2) {
    _tile_stored(4, o + 32, kChunk * 4);
    _tile_stored(5, o + 48, kChunk * 4);
  }
}
inline void load_sums(int n, const float* o) {
  _tile_loadd(2, o, kChunk * 4);
  _tile_loadd(3, o + 16, kChunk * 4);
  if (n > 2) {
    _tile_loadd(4, o + 32, kChunk * 4);
    _tile_loadd(5, o + 48, kChunk * 4);
  }
}
inline void add_weighted(int n, const uint16_t* v) {  // sums += P (tile 6) x v's column tiles
  _tile_loadd(7, v, 64);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(7, v + kTile, 64);
  _tile_dpbf16ps(3, 6, 7);
  if (n > 2) {
    _tile_loadd(7, v + 2 * kTile, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, v + 3 * kTile, 64);
    _tile_dpbf16ps(5, 6, 7);
  }
}

struct Amx {
  static void begin() { amx_gemm::configure_full(); }
  static void end() { _tile_release(); }
  static void zero(int n, Rows&) { zero_sums(n); }
  static void to_memory(int n, Rows& w) { store_sums(n, w.o); }
  static void from_memory(int n, const Rows& w) { load_sums(n, w.o); }
  // w.scores [16, 32] = w.q [16, dim] K^T over the step's two key tiles k0 [halves] each
  static void scores(Rows& w, const uint16_t* k0, int64_t dim) {
    const int64_t halves = dim / 32;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t half = 0; half < halves; ++half) {
      _tile_loadd(6, w.q + 32 * half, dim * 2);
      _tile_loadd(7, k0 + half * kTile, 64);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(7, k0 + (halves + half) * kTile, 64);
      _tile_dpbf16ps(1, 6, 7);
    }
    _tile_stored(0, w.scores, kKeys * 4);
    _tile_stored(1, w.scores + 16, kKeys * 4);
  }
  static void add_weighted(int n, const uint16_t* v, Rows& w) {
    _tile_loadd(6, w.p, kKeys * 2);
    amx_prefill::add_weighted(n, v);
  }
};

// Rows' sums and weight totals times alpha (where the running max moved).
template <class E>
void rescale(Rows& w, int n, const float* alpha) {
  E::to_memory(n, w);
  for (int64_t r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    _mm512_store_ps(w.l + r * 16, _mm512_mul_ps(_mm512_load_ps(w.l + r * 16), a));
    for (int j = 0; j < n; ++j) {
      float* o = w.o + r * kChunk + 16 * j;
      _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), a));
    }
  }
  E::from_memory(n, w);
}

// Every row's running max brought up to this step's scores (log2 units); the sums rescaled.
template <class E>
void move_max(Rows& w, int n, __m512 c, bool first) {
  float alpha[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const float* sr = w.scores + r * kKeys;
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_load_ps(sr), _mm512_load_ps(sr + 16))) * c[0];
    const float m = std::max(w.m[r], top);
    alpha[r] = exp2f(w.m[r] - m);  // 0 from m = -inf
    w.m[r] = m;
  }
  if (!first) rescale<E>(w, n, alpha);
}

// Scores of keys [32 st, 32 st + 32) (tiles 0, 1) -> bf16 weights in w.p, m and l updated.
// Row r sees keys up to pos0 + r. The sums in the tiles are rescaled only in steps where some
// row's max grows. The max is kept exact, not let lag by a slack: then a row's largest weight
// is exactly 1 in bf16, and rounding touches only the smaller ones (a slack of 2^8 rounded the
// dominant weights too: perplexity over an fp8 KV cache 1.012x -> 1.032x the bf16 cache's).
template <class E>
void softmax_step(Rows& w, int64_t st, int64_t pos0, float scale, int n) {
  const __m512 c = _mm512_set1_ps(scale * 1.44269504f), minus_inf = _mm512_set1_ps(-INFINITY);
  const bool diagonal = st * kKeys + kKeys - 1 > pos0;  // some row sees only some keys
  const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(int(st * kKeys)), _mm512_set_epi32(
      15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i key16 = _mm512_add_epi32(key, _mm512_set1_epi32(16));
  __mmask16 keep[kRows][2];
  __mmask16 moved = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    float* sr = w.scores + r * kKeys;
    __m512 s0 = _mm512_load_ps(sr), s1 = _mm512_load_ps(sr + 16);
    keep[r][0] = keep[r][1] = 0xFFFF;
    if (diagonal) {
      const __m512i pos = _mm512_set1_epi32(int(pos0 + r));
      keep[r][0] = _mm512_cmple_epi32_mask(key, pos);
      keep[r][1] = _mm512_cmple_epi32_mask(key16, pos);
      s0 = _mm512_mask_mov_ps(minus_inf, keep[r][0], s0);
      s1 = _mm512_mask_mov_ps(minus_inf, keep[r][1], s1);
      _mm512_store_ps(sr, s0);
      _mm512_store_ps(sr + 16, s1);
    }
    const __m512 limit = _mm512_set1_ps(w.m[r]);
    moved |= _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_max_ps(s0, s1), c), limit, _CMP_GT_OQ);
  }
  if (moved) move_max<E>(w, n, c, st == 0);
  for (int64_t r = 0; r < kRows; ++r) {
    const __m512 m = _mm512_set1_ps(w.m[r]);
    const float* sr = w.scores + r * kKeys;
    const __m512 p0 = _mm512_maskz_mov_ps(keep[r][0], exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(sr), c, m)));
    const __m512 p1 = _mm512_maskz_mov_ps(keep[r][1], exp2_ps(_mm512_fmsub_ps(_mm512_load_ps(sr + 16), c, m)));
    float* l = w.l + r * 16;
    _mm512_store_ps(l, _mm512_add_ps(_mm512_load_ps(l), _mm512_add_ps(p0, p1)));
    _mm512_store_si512(w.p + r * kKeys, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
}

// Query head hq's rows [16 t, 16 t + 16) of the request, output dims [c0, c0 + kChunk) -> out.
// The scores are computed again for each chunk of dims (heads of 128: twice).
template <class E>
void attend(const uint16_t* query, const uint16_t* kp, const uint16_t* vp, uint16_t* out,
            const Shape& s, int64_t hq, int64_t t, int64_t c0, Rows& w) {
  const int64_t dim = s.dim, row_stride = s.heads * dim, j0 = t * kRows;
  const int64_t rows = std::min(kRows, s.query_len - j0), pos0 = s.seq_len - s.query_len + j0;
  const int n = int(std::min(kChunk, dim - c0) / 16);  // column tiles of sums: 2 or 4
  std::fill(w.q, w.q + kRows * dim, uint16_t(0));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(query + (j0 + r) * row_stride + hq * dim, dim, w.q + r * dim);
  std::fill(w.m, w.m + kRows, -INFINITY);
  std::fill(w.l, w.l + kRows * 16, 0.f);
  E::zero(n, w);
  const int64_t steps = (pos0 + rows - 1) / kKeys + 1;
  for (int64_t st = 0; st < steps; ++st) {
    E::scores(w, kp + st * kKeys * dim, dim);  // the step's two key tiles, [halves] each
    softmax_step<E>(w, st, pos0, s.scale, n);
    E::add_weighted(n, vp + st * kKeys * dim + (c0 / 16) * kTile, w);
  }
  E::to_memory(n, w);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = out + (j0 + r) * row_stride + hq * dim + c0;
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(w.l + r * 16)));
    for (int j = 0; j < n; ++j)
      amx_gemm::store_row16(_mm512_mul_ps(_mm512_load_ps(w.o + r * kChunk + 16 * j), inv),
                            nullptr, dst + 16 * j, 16);
  }
}

// The whole call over a pool of C (bf16, or quantized: kv_quant.h) on engine E (Amx, Dots);
// false where the shape is not one it takes.
template <class E, typename C>
bool prefill(const uint16_t* query, const C* k_cache, const C* v_cache, uint16_t* out,
             const int32_t* blocks, const Shape& s, int num_threads) {
  if (s.dim % 32 != 0 || s.dim > 256 || s.heads % s.kv_heads != 0 || s.query_len < 1 ||
      s.seq_len < s.query_len)
    return false;
  thread_local std::vector<uint16_t> packed;  // [kv_heads][K, V][steps * 32 * dim]
  const int64_t per_head = s.packed(), steps = s.steps(), group = s.heads / s.kv_heads;
  packed.resize(size_t(2 * s.kv_heads * per_head));
  uint16_t* base = packed.data();
  const int64_t tiles = (s.query_len + kRows - 1) / kRows, chunks = (s.dim + kChunk - 1) / kChunk;
  const int64_t items = s.heads * tiles * chunks;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for collapse(2) schedule(static)
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t st = 0; st < steps; ++st)
        pack_step(k_cache, v_cache, blocks, s, h, st, base + 2 * h * per_head,
                  base + (2 * h + 1) * per_head);
    E::begin();
    Rows w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {  // the longest (last) query tiles first
      const int64_t t = tiles - 1 - i / (s.heads * chunks), hq = i / chunks % s.heads;
      const int64_t h = hq / group, c0 = i % chunks * kChunk;
      attend<E>(query, base + 2 * h * per_head, base + (2 * h + 1) * per_head, out, s, hq, t, c0, w);
    }
    E::end();
  }
  return true;
}

}  // namespace amx_prefill

#pragma GCC pop_options

#endif  // __AVX512BF16__
