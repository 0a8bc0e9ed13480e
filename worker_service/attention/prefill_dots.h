// The prefill kernel's engine for CPUs with AVX512-BF16 but no AMX tiles (Zen 4, Cooper Lake):
// amx_prefill.h's tile products done by vdpbf16ps over the same packed tiles. Included by
// amx_prefill.h after its Shape, Rows and packing, which it shares.
//
// A tile product C [16, 16] += A [16, 32] B, with B packed as the tiles take it (row r: the 16
// columns' pair r, two bf16 each), is for each row i and pair r one vdpbf16ps of B's row r with
// A's pair (i, r) broadcast to every lane: lane c gains A[i][2r] B[r][c][0] + A[i][2r+1]
// B[r][c][1]. Rows go four at a time, so that each B row loaded serves four rows' sums (which
// stay in registers across a work item's dims). The sums O of P V live in w.o (float32, the
// AMX engine's spill buffer): to_memory and from_memory have nothing to do.
#pragma once

namespace amx_prefill {

struct Dots {
  static constexpr int64_t kBlock = 4;  // rows per pass

  static void begin() {}
  static void end() {}
  static void to_memory(int, Rows&) {}
  static void from_memory(int, const Rows&) {}
  static void zero(int, Rows& w) { std::fill(w.o, w.o + kRows * kChunk, 0.f); }

  // A's pair r of row i as every lane's pair.
  static __m512bh pair(const uint16_t* row, int64_t r) {
    int32_t bits;
    std::memcpy(&bits, row + 2 * r, 4);
    return (__m512bh)_mm512_set1_epi32(bits);
  }

  // w.scores [16, 32] = w.q [16, dim] K^T: key tiles u = 0, 1 (keys 0-15, 16-31 of the step),
  // each [halves] tiles of 32 dims, at k0 + (u halves + half) kTile.
  static void scores(Rows& w, const uint16_t* k0, int64_t dim) {
    const int64_t halves = dim / 32;
    for (int64_t i0 = 0; i0 < kRows; i0 += kBlock) {
      __m512 acc[kBlock][2];
      for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
      for (int64_t half = 0; half < halves; ++half) {
        const uint16_t* b0 = k0 + half * kTile;
        const uint16_t* b1 = k0 + (halves + half) * kTile;
        for (int64_t r = 0; r < 16; ++r) {
          const __m512bh x = (__m512bh)_mm512_loadu_si512(b0 + 32 * r);
          const __m512bh y = (__m512bh)_mm512_loadu_si512(b1 + 32 * r);
          for (int64_t i = 0; i < kBlock; ++i) {
            const __m512bh a = pair(w.q + (i0 + i) * dim + 32 * half, r);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, x);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, y);
          }
        }
      }
      for (int64_t i = 0; i < kBlock; ++i) {
        _mm512_store_ps(w.scores + (i0 + i) * kKeys, acc[i][0]);
        _mm512_store_ps(w.scores + (i0 + i) * kKeys + 16, acc[i][1]);
      }
    }
  }

  // w.o [16, kChunk] += w.p [16, 32 keys] V over N column tiles of 16 dims (v + j kTile).
  template <int N>
  static void add_tiles(const uint16_t* v, Rows& w) {
    for (int64_t i0 = 0; i0 < kRows; i0 += kBlock) {
      __m512 acc[kBlock][N];
      for (int64_t i = 0; i < kBlock; ++i)
        for (int j = 0; j < N; ++j) acc[i][j] = _mm512_load_ps(w.o + (i0 + i) * kChunk + 16 * j);
      for (int64_t r = 0; r < 16; ++r) {
        __m512bh b[N];
        for (int j = 0; j < N; ++j) b[j] = (__m512bh)_mm512_loadu_si512(v + j * kTile + 32 * r);
        for (int64_t i = 0; i < kBlock; ++i) {
          const __m512bh a = pair(w.p + (i0 + i) * kKeys, r);
          for (int j = 0; j < N; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
      }
      for (int64_t i = 0; i < kBlock; ++i)
        for (int j = 0; j < N; ++j) _mm512_store_ps(w.o + (i0 + i) * kChunk + 16 * j, acc[i][j]);
    }
  }
  static void add_weighted(int n, const uint16_t* v, Rows& w) {
    if (n > 2)
      add_tiles<4>(v, w);
    else
      add_tiles<2>(v, w);
  }
};

}  // namespace amx_prefill
