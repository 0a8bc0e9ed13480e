// Q4_0, Q4_1 and Q8_0 weights with each 16 rows interleaved (quant.RowsWeight: a layout of
// the same bytes, written at load by quant.interleave) for the u8 x s8 dot products: one
// instruction takes 4 K values of 16 weight rows (AVX512-VNNI's vpdpbusd; 8 rows with AVX2's
// vpmaddubsw) against the same 4 int8 values of a row of x (broadcast), where gguf_q8.h's dots
// transpose the blocks of 16 rows in registers at every pass (or take one row at a time: Q8_0)
// and the bf16 panels (amx_gguf.h) first dequantize every weight.
//
// Layout: for weight rows [16 g, 16 g + 16) and block b (K values [32 b, 32 b + 32)), F::kBytes
// at (g * K / 32 + b) * F::kBytes: the 16 rows' half scales d (Q4_1: then their half offsets
// m), then their values, byte 4 r + e of each 64 for row 16 g + r:
//   Q8_0: 8 vectors j, q[32 b + 4 j + e] + 128 (unsigned);
//   Q4_0, Q4_1: 4 vectors p, q[32 b + 8 p + e] in the low nibble, q[32 b + 8 p + 4 + e] high.
//
// Activations are quantized per 32 values as for gguf_q8.h (quantize_rows: q_x, d_x), so
//   x . w = sum_b d_w d_x sum(q q_x) + m_w sum(x)
// (Q4_0: m = -8 d; Q8_0's u8 q + 128: the int32 sums start at -128 sum(q_x)). A pass holds up
// to kPassRows rows of x by 32 weight rows (two vectors of sums each) in registers; each row's
// sums run over K in one order whatever rows came with it. Default model's layers and LM head,
// 2 threads, Zen 5, time against oneDNN's packed bf16 GEMM over the bf16 weight, this layout vs
// the blocks' own path: Q8_0 at 8 rows 0.63x vs 1.06x, 32 rows 0.66x vs 1.10x, 256 rows 0.68x
// vs 1.09x; Q4_1 at 16 rows 0.56x vs 0.72x, 32 rows 0.64x vs 1.04x, 256 rows 0.73x vs 1.07x;
// one row alike.
//
// AVX2 (the x86-64-v3 build: no AVX-512) takes the Q4 formats, each 16 rows as two vectors of
// 8. vpmaddubsw's pair products are summed in int16 over a block (at most 8 x 2 x 15 x 127 =
// 30480), then widened once (vpmaddwd); the sums and their order are the VNNI build's. Q8_0's
// u8 values (q + 128) would overflow vpmaddubsw's int16 pairs: it keeps its blocks (Q8Dot).
#pragma once

// The vector width of this build's GEMM over the rows layouts; none below AVX2.
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define TESSERA_Q8_ROWS 512
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TESSERA_Q8_ROWS 256
#endif

#if defined(TESSERA_Q8_ROWS)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "small_gemm.h"
#if TESSERA_Q8_ROWS == 512
#include "amx_gemm.h"
#endif

namespace q8_rows {

constexpr int64_t kRows = 16;  // weight rows interleaved (the lanes of a vector)
constexpr int kPassRows = 4;   // rows of x a pass (4-6 measured alike; 8+ slower)

// Quantized rows of x: q [rows, K] int8, d, sum (of q) and, where asked, xsum (of x, exact)
// [rows, K / 32].
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d, xsum;
  std::vector<int32_t> sum;
};

inline Rows quantize(const uint16_t* x, int64_t rows, int64_t K, bool xsum) {
  const std::vector<float> xf = small_gemm::widen_rows(x, rows, K);
  const int64_t blocks = rows * K / 32;
  Rows r{std::vector<int8_t>(rows * K), std::vector<float>(blocks),
         std::vector<float>(xsum ? blocks : 0), std::vector<int32_t>(blocks)};
  gguf_q8::quantize_rows(xf.data(), blocks, r.q.data(), r.d.data());
  for (int64_t i = 0; i < blocks; ++i) {
    int32_t sum = 0;
    for (int64_t c = 0; c < 32; ++c) sum += r.q[i * 32 + c];
    r.sum[i] = sum;
    if (xsum)
      for (int64_t c = 0; c < 32; ++c) r.xsum[i] += xf[i * 32 + c];
  }
  return r;
}

// Each format's layout: its id (quant.ROWS_TYPES), the bytes of one block of 16 rows (kHeader
// of scales, then the values), and whether its values have an offset m (Q8_0: d q).
struct Q8_0Layout {
  static constexpr int kType = 1008, kHeader = 32, kBytes = 34 * kRows;
  static constexpr bool kHasMin = false;
};
struct Q4_0Layout {  // 16 half d; value d q - 8 d
  static constexpr int kType = 1002, kHeader = 32, kBytes = 18 * kRows;
  static constexpr bool kHasMin = true;
};
struct Q4_1Layout {  // 16 half d, 16 half m; value d q + m
  static constexpr int kType = 1003, kHeader = 64, kBytes = 20 * kRows;
  static constexpr bool kHasMin = true;
};

#if TESSERA_Q8_ROWS == 512

inline __m512 halves(const uint8_t* at) {  // 16 IEEE halves -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// Per format: its layout, how many bytes ahead to ask for them (default model's 30 layers from
// memory, one row, 2 threads, Zen 5, against the blocks' own path in the same runs: Q4_1
// 0.92-0.94x with 2048, 0.99-1.00x without; Q8_0 0.97-1.03x with, 0.98-1.00x without),
// values(): the two vectors of u8 values for the 4 q_x words 2 p and 2 p + 1
// of a block, and where the value is not d times them, mins(): the 16 rows' offsets m (times
// the exact sum of x, as gguf_q8.h). Q8_0's u8 is q + 128: the int32 sums start at -128
// sum(q_x).
struct Q8_0 : Q8_0Layout {
  static constexpr int kBias = 128;
  static constexpr int64_t kAhead = 0;
  static __m512 mins(const uint8_t*, __m512) { return _mm512_setzero_ps(); }
  static void values(const uint8_t* block, int p, __m512i& a, __m512i& b) {
    a = _mm512_loadu_si512(block + kHeader + 128 * p);
    b = _mm512_loadu_si512(block + kHeader + 128 * p + 64);
  }
};

// Q4: byte 4 r + e of vector p holds q[r][8 p + e] (low nibble) and q[r][8 p + 4 + e] (high).
inline void nibbles(const uint8_t* at, __m512i& a, __m512i& b) {
  const __m512i v = _mm512_loadu_si512(at), mask = _mm512_set1_epi8(0x0F);
  a = _mm512_and_si512(v, mask);
  b = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
}

struct Q4_0 : Q4_0Layout {
  static constexpr int kBias = 0;
  static constexpr int64_t kAhead = 2048;
  static __m512 mins(const uint8_t*, __m512 d) { return _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)); }
  static void values(const uint8_t* block, int p, __m512i& a, __m512i& b) {
    nibbles(block + kHeader + 64 * p, a, b);
  }
};

struct Q4_1 : Q4_1Layout {
  static constexpr int kBias = 0;
  static constexpr int64_t kAhead = 2048;
  static __m512 mins(const uint8_t* block, __m512) { return halves(block + 32); }
  static void values(const uint8_t* block, int p, __m512i& a, __m512i& b) {
    nibbles(block + kHeader + 64 * p, a, b);
  }
};

// Rows [r0, r0 + M) of x by the 16 V weight rows from n0 (wg: their first group) -> out.
template <typename F, int M, int V>
void pass(const Rows& x, int64_t r0, const uint8_t* wg, int64_t K, const uint16_t* bias,
          uint16_t* out, int64_t N, int64_t n0) {
  const int64_t blocks = K / 32;
  __m512 sums[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) sums[m][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block[V];
    for (int v = 0; v < V; ++v) block[v] = wg + (v * blocks + b) * F::kBytes;
    if constexpr (F::kAhead > 0)
      for (int v = 0; v < V; ++v)
        for (int64_t line = 0; line < F::kBytes; line += 64)
          __builtin_prefetch(block[v] + line + F::kAhead);
    __m512i acc[M][V];
    for (int m = 0; m < M; ++m) {
      const __m512i start = _mm512_set1_epi32(-F::kBias * x.sum[(r0 + m) * blocks + b]);
      for (int v = 0; v < V; ++v) acc[m][v] = start;
    }
    for (int p = 0; p < 4; ++p) {
      __m512i w[V][2];
      for (int v = 0; v < V; ++v) F::values(block[v], p, w[v][0], w[v][1]);
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < 2; ++h) {
          int32_t four;  // q_x[32 b + 8 p + 4 h .. + 4)
          std::memcpy(&four, x.q.data() + (r0 + m) * K + 32 * b + 8 * p + 4 * h, sizeof(four));
          const __m512i xv = _mm512_set1_epi32(four);
          for (int v = 0; v < V; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], w[v][h], xv);
        }
    }
    for (int v = 0; v < V; ++v) {
      const __m512 dw = halves(block[v]), mw = F::mins(block[v], dw);
      for (int m = 0; m < M; ++m) {
        const int64_t at = (r0 + m) * blocks + b;
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[at]));
        sums[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][v]), scale, sums[m][v]);
        if constexpr (F::kHasMin)
          sums[m][v] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.xsum[at]), sums[m][v]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v)
      amx_gemm::store_row16(sums[m][v], bias ? bias + n0 + 16 * v : nullptr,
                            out + (r0 + m) * N + n0 + 16 * v, 16);
}

#else  // TESSERA_Q8_ROWS == 256

inline __m256 halves(const uint8_t* at) {  // 8 IEEE halves -> float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// Per format: its layout, how many bytes ahead to ask for them (default model's Q4_1 GGUF,
// batch-1 decode steps, 2 threads, Zen 3, tokens/s, medians of 8 runs alternated: 0 ahead
// 175, 2048 185, 4096 182, 8192 196, 16384 201 but less steady, 32768 193), and mins(): the
// offsets m of rows [8 h, 8 h + 8) of the 16 (d: their scales).
struct Q4_0 : Q4_0Layout {
  static constexpr int64_t kAhead = 8192;
  static __m256 mins(const uint8_t*, int, __m256 d) {
    return _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  }
};

struct Q4_1 : Q4_1Layout {
  static constexpr int64_t kAhead = 8192;
  static __m256 mins(const uint8_t* block, int h, __m256) { return halves(block + 32 + 16 * h); }
};

// Rows [r0, r0 + M) of x by the 16 V weight rows from n0 (wg: their first group) -> out, as
// vectors h of 8 rows (rows [8 h, 8 h + 8) of group h / 2).
template <typename F, int M, int V>
void pass(const Rows& x, int64_t r0, const uint8_t* wg, int64_t K, const uint16_t* bias,
          uint16_t* out, int64_t N, int64_t n0) {
  constexpr int H = 2 * V;
  const int64_t blocks = K / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 sums[M][H];
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < H; ++h) sums[m][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block[V];
    for (int v = 0; v < V; ++v) {
      block[v] = wg + (v * blocks + b) * F::kBytes;
      for (int64_t line = 0; line < F::kBytes; line += 64)
        __builtin_prefetch(block[v] + line + F::kAhead);
    }
    __m256i pairs[M][H];  // int16 pair sums of the block
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) pairs[m][h] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i xv[M][2];  // q_x[32 b + 8 p .. + 4), [.. + 4 .. + 8) of each row
      for (int m = 0; m < M; ++m)
        for (int e = 0; e < 2; ++e) {
          int32_t four;
          std::memcpy(&four, x.q.data() + (r0 + m) * K + 32 * b + 8 * p + 4 * e, sizeof(four));
          xv[m][e] = _mm256_set1_epi32(four);
        }
      for (int h = 0; h < H; ++h) {
        const __m256i raw = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(block[h / 2] + F::kHeader + 64 * p + 32 * (h % 2)));
        const __m256i low = _mm256_and_si256(raw, mask);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        for (int m = 0; m < M; ++m) {
          const __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(low, xv[m][0]),
                                               _mm256_maddubs_epi16(high, xv[m][1]));
          pairs[m][h] = _mm256_add_epi16(pairs[m][h], two);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m256 dw = halves(block[h / 2] + 16 * (h % 2)), mw = F::mins(block[h / 2], h % 2, dw);
      for (int m = 0; m < M; ++m) {
        const int64_t at = (r0 + m) * blocks + b;
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[at]));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[m][h], ones));
        sums[m][h] = _mm256_fmadd_ps(dot, scale, sums[m][h]);
        sums[m][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.xsum[at]), sums[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < H; ++h) {
      alignas(32) float row[8];
      _mm256_store_ps(row, sums[m][h]);
      const int64_t n = n0 + 8 * h;
      for (int c = 0; c < 8; ++c)
        store(bias ? row[c] + widen(bias[n + c]) : row[c], out + (r0 + m) * N + n + c);
    }
}

#endif  // TESSERA_Q8_ROWS

// Every row of x by weight rows [n0, n0 + 16 V), in passes of at most kPassRows rows whose
// sizes are within one of each other. M is a template argument so that the sums stay in
// registers.
template <typename F, int V>
void columns(const Rows& x, int64_t rows, const uint8_t* wg, int64_t K, const uint16_t* bias,
             uint16_t* out, int64_t N, int64_t n0) {
  static_assert(kPassRows == 4, "passes of 1-4 rows");
  const int64_t passes = (rows + kPassRows - 1) / kPassRows;
  for (int64_t i = 0, r0 = 0; i < passes; ++i) {
    const int64_t m = rows / passes + (i < rows % passes ? 1 : 0);
    switch (m) {
      case 1: pass<F, 1, V>(x, r0, wg, K, bias, out, N, n0); break;
      case 2: pass<F, 2, V>(x, r0, wg, K, bias, out, N, n0); break;
      case 3: pass<F, 3, V>(x, r0, wg, K, bias, out, N, n0); break;
      default: pass<F, 4, V>(x, r0, wg, K, bias, out, N, n0); break;
    }
    r0 += m;
  }
}

template <typename F>
void gemm_format(const uint16_t* x, const uint8_t* w, const uint16_t* bias, uint16_t* out,
                 int64_t rows, int64_t K, int64_t N, int num_threads) {
  const Rows q = quantize(x, rows, K, F::kHasMin);
  const int64_t units = (N + 31) / 32;  // 32 weight rows each, the last maybe 16
#pragma omp parallel for num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, units)))
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n0 = 32 * u;
    const uint8_t* wg = w + n0 / kRows * (K / 32) * F::kBytes;
    if (n0 + 32 <= N)
      columns<F, 2>(q, rows, wg, K, bias, out, N, n0);
    else
      columns<F, 1>(q, rows, wg, K, bias, out, N, n0);
  }
}

// Calls run(F{}) with the format of rows layout `type` (quant.ROWS_TYPES); false where this
// build has no GEMM over that layout.
template <typename Run>
bool with_format(int type, Run&& run) {
#if TESSERA_Q8_ROWS == 512
  if (type == Q8_0::kType) return run(Q8_0{}), true;
#endif
  if (type == Q4_0::kType) return run(Q4_0{}), true;
  if (type == Q4_1::kType) return run(Q4_1{}), true;
  return false;
}

}  // namespace q8_rows

#endif  // TESSERA_Q8_ROWS
