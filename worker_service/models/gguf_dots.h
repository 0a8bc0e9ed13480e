// The GGUF GEMM's panels without AMX tiles (amx_gguf.h): a panel of 32 weight rows dequantized
// to bf16 times every row of x with AVX512-BF16 pair dot products (vdpbf16ps), in one of two
// layouts of the panel.
//
// Row pairs (fewer than kQuadRows rows of x): the panel row-major; each row of x by two weight
// rows a pass, 16 lanes of sums per row reduced at the end.
//
// Quads (from kQuadRows rows): the panel in the Quads layout (below), whose vectors hold 4
// weight rows' same 8 K values; each 8 K values of x, broadcast to the four 128-bit lanes, meet
// them in one dot product, 24 vectors of sums in registers (6 rows by 16 weight rows): a weight
// load serves 6 rows and an x load 16 weight rows, against 8 and 2 by row pairs. Default
// model's Q4_1 shapes, 32 rows in Quads against 31 by row pairs (Zen 4, 2 threads): qkv, o and
// gate_up 0.79-0.80x the time, down (K 1536) 1.07x, the LM head 0.84x (3.5 vs 4.2 ms).
// Writing the layout costs more than the row-major panel, so at fewer rows (8-24 measured) the
// row pairs are as fast or faster.
//
// Either way each row's sums run over K in one order whatever the other rows.
#pragma once

namespace gguf_dots {

using amx_gguf::kPanel;
using amx_gguf::kTileK;
constexpr int64_t kQuadRows = 32;  // rows of x from which the panels take the Quads layout
static_assert(kQuadRows >= 20, "panel_quads' passes take 5 or 6 rows");

// The Quads layout: for each 8 K values s (a quarter of a group of 32), the panel's 32 weight
// rows' 8 values each, so that a vector holds 4 weight rows' 4 pairs of the same K values:
//   vq[s][c][e] = w[n0 + c][8 s + e]
// put(g, v) stores group g0 + g of weight row c (32 bf16 in v) there.
struct Quads {
  uint16_t* vq;
  int64_t c;   // the weight row within the panel
  int64_t g0;  // the first group put
  void operator()(int64_t g, __m512i v) const {
    uint16_t* at = vq + (4 * (g0 + g) * kPanel + c) * 8;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_castsi512_si128(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at + kPanel * 8), _mm512_extracti32x4_epi32(v, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at + kPanel * 16), _mm512_extracti32x4_epi32(v, 2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at + kPanel * 24), _mm512_extracti32x4_epi32(v, 3));
  }
};

// Four vectors of 4 weight rows' 4 partial sums each (lane 4 i + t of v: weight row 4 v + i,
// pairs t mod 4) -> their 16 sums in weight-row order (lane j: row j). Every sum is taken in
// the same tree, (t0 + t2) + (t1 + t3), whatever the others hold.
inline __m512 quad_sums(const __m512 (&v)[4]) {
  const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512d x = _mm512_castps_pd(a0), y = _mm512_castps_pd(a1);
  const __m512 b = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));  // lane 4 i + v
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, b);
}

// Rows r0 .. r0 + M of out, the panel's weight rows c0 + [0, 16) (columns n0 + c0 + [0, cols)).
template <int M>
void quad_rows(const uint16_t* vq, const uint16_t* x, const uint16_t* bias, uint16_t* out,
               int64_t r0, int64_t K, int64_t c0, int64_t n0, int64_t cols, int64_t N) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t s = 0; s < K / 8; ++s) {
    const uint16_t* ws = vq + (s * kPanel + c0) * 8;
    __m512bh w[4];
    for (int v = 0; v < 4; ++v) w[v] = (__m512bh)_mm512_loadu_si512(ws + 32 * v);
    for (int m = 0; m < M; ++m) {
      const __m128i xs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + (r0 + m) * K + 8 * s));
      const __m512bh xv = (__m512bh)_mm512_broadcast_i32x4(xs);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
    }
  }
  for (int m = 0; m < M; ++m)
    amx_gemm::store_row16(quad_sums(acc[m]), bias ? bias + n0 + c0 : nullptr,
                          out + (r0 + m) * N + n0 + c0, cols);
}

// The panel's `count` weight rows (vq, in Quads) times every row of x, into out's columns n0..,
// in passes of at most 6 rows, their sizes within one of each other (fewer rows a pass would
// wait on the dot products' latency). The row count is a template argument so that the sums
// live in registers.
inline void panel_quads(const uint16_t* vq, const uint16_t* x, const uint16_t* bias,
                        uint16_t* out, int64_t rows, int64_t K, int64_t n0, int64_t count,
                        int64_t N) {
  const int64_t passes = (rows + 5) / 6;
  for (int64_t i = 0, r0 = 0; i < passes; ++i) {
    const int64_t m = rows / passes + (i < rows % passes ? 1 : 0);  // 5 or 6 (rows >= 32)
    for (int64_t c0 = 0; c0 < count; c0 += 16) {
      const int64_t cols = std::min<int64_t>(16, count - c0);
      if (m == 6)
        quad_rows<6>(vq, x, bias, out, r0, K, c0, n0, cols, N);
      else
        quad_rows<5>(vq, x, bias, out, r0, K, c0, n0, cols, N);
    }
    r0 += m;
  }
}

// Sums of M rows of x (row-major, K) by weight rows n and n + 1 of the panel,
// 32 products a pair dot product (vdpbf16ps). The panel sits in L1/L2, so two weight rows a
// pass halve the loads of x a product (four a pass measured no faster on Zen 4); each row's
// sums run over K in one order whatever M.
template <int M>
inline void dot_pair(const uint16_t* x, const uint16_t* w, int64_t K, float (&sums)[2][M]) {
  __m512 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kTileK) {  // K: whole blocks of 32
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], xv, w0);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], xv, w1);
    }
  }
  for (int m = 0; m < M; ++m) {
    sums[0][m] = _mm512_reduce_add_ps(acc[0][m]);
    sums[1][m] = _mm512_reduce_add_ps(acc[1][m]);
  }
}

// Rows r0 .. r0 + M of out, the panel's columns n0 + [0, count) (count even: the panel's rows
// past count are zero, so an odd count's last pair reads one of them and drops its sums).
template <int M>
void pair_rows(const uint16_t* buf, const uint16_t* x, const uint16_t* bias, uint16_t* out,
               int64_t r0, int64_t K, int64_t n0, int64_t count, int64_t N) {
  for (int64_t n = 0; n < count; n += 2) {
    float sums[2][M];
    dot_pair<M>(x + r0 * K, buf + n * K, K, sums);
    for (int j = 0; j < 2 && n + j < count; ++j) {
      const float b = bias ? widen(bias[n0 + n + j]) : 0.0f;
      for (int m = 0; m < M; ++m) store(sums[j][m] + b, out + (r0 + m) * N + n0 + n + j);
    }
  }
}

// The panel's `count` weight rows (buf, row-major) times every row of x, into out's columns
// n0.., by row pairs.
inline void panel_pairs(const uint16_t* buf, const uint16_t* x, const uint16_t* bias,
                        uint16_t* out, int64_t rows, int64_t K, int64_t n0, int64_t count,
                        int64_t N) {
  int64_t r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8) pair_rows<8>(buf, x, bias, out, r0, K, n0, count, N);
  switch (rows - r0) {  // M is a template argument so that the sums live in registers
    case 1: return pair_rows<1>(buf, x, bias, out, r0, K, n0, count, N);
    case 2: return pair_rows<2>(buf, x, bias, out, r0, K, n0, count, N);
    case 3: return pair_rows<3>(buf, x, bias, out, r0, K, n0, count, N);
    case 4: return pair_rows<4>(buf, x, bias, out, r0, K, n0, count, N);
    case 5: return pair_rows<5>(buf, x, bias, out, r0, K, n0, count, N);
    case 6: return pair_rows<6>(buf, x, bias, out, r0, K, n0, count, N);
    case 7: return pair_rows<7>(buf, x, bias, out, r0, K, n0, count, N);
    default: return;
  }
}

}  // namespace gguf_dots
