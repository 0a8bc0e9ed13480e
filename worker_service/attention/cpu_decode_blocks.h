// One KV block's work in the paged decode kernel (cpu_decode.cpp): score its K rows for the
// query heads of one GQA group, and add its V rows weighed by their softmax weights.
// `BlockRows<T, C, Dim>` picks the inner loops by the query type T, the cache type C and the
// head size Dim (0: only known at run time): bf16 pair dot products for a bf16 cache
// (TESSERA_BF16), AVX-512 or AVX2 float32 for the others (TESSERA_SIMD), else portable loops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../models/bf16.h"
#include "cpu_simd.h"
#include "kv_quant.h"

// glibc's vector expf (libmvec): lets the softmax loops vectorize without -ffast-math.
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));
#if defined(__AVX512F__)
extern "C" __m512 _ZGVeN16v_expf(__m512);  // libmvec's 16-lane expf, called directly
#endif

// The largest of x[0..n).
inline float max_of(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t o = 0; o < n; o += 16)
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, Simd::first(n - o), x + o));
  return _mm512_reduce_max_ps(top);
#elif defined(__AVX2__)
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t o = 0;
  for (; o + 8 <= n; o += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(x + o));
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  float most = _mm_cvtss_f32(half);
  for (; o < n; ++o) most = std::max(most, x[o]);
  return most;
#else
  return *std::max_element(x, x + n);
#endif
}

// x[o] = exp(x[o] - top) for o < n; returns their sum.
inline float exp_sum(float* x, int64_t n, float top) {
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  for (int64_t o = 0; o < n; o += 16) {
    const __mmask16 m = Simd::first(n - o);
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + o), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(x + o, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t o = 0; o < n; ++o) {
    x[o] = expf(x[o] - top);
    sum += x[o];
  }
  return sum;
#endif
}

// Per-thread buffers for `heads` query heads, dim and block size: the float32 (scaled) or
// bf16 queries ([heads, dim]), one block's scores then weights `p` of a GQA group's heads
// ([<= heads, bs]) and their bf16 copy `pb` ([.., bs + 2], an odd block's last pair padded
// with 0), one block's widened rows, and the lane-wise products of 16 rows (`parts`,
// [<= heads, 16, 16]).
struct Scratch {
  std::vector<float> buf;
  std::vector<uint16_t> half;
  float *q, *p, *rows, *parts;
  uint16_t *qb, *pb;
  int64_t bs = 0;
  void reserve(int64_t heads, int64_t dim, int64_t block_size) {
    bs = block_size;
    const int64_t parts_at = (heads * dim + heads * bs + bs * dim + 15) / 16 * 16;
    buf.resize(size_t(parts_at + heads * 256));
    q = buf.data();
    p = q + heads * dim;
    rows = p + heads * bs;
    parts = buf.data() + parts_at;
    half.resize(size_t(heads * dim + heads * (bs + 2)));
    qb = half.data();
    pb = qb + heads * dim;
  }
};

// rows[o, :] = float32 of the slot first_slot + o of one KV head, for o < n.
template <typename C, int64_t Dim>
inline void widen_rows(const C* head, int64_t first_slot, int64_t n, int64_t slot_stride,
                       int64_t dim, float* __restrict rows) {
  for (int64_t o = 0; o < n; ++o) {
    const C* src = head + (first_slot + o) * slot_stride;
#pragma omp simd
    for (int64_t d = 0; d < (Dim ? Dim : dim); ++d) rows[o * dim + d] = widen(src[d]);
  }
}

// A quantized cache: x[g * stride + o] *= the scale of row o (of n from slot first_slot) of
// one KV head, for each of the group's query heads g (scores of K rows, weights of V rows).
template <typename C>
inline void apply_scales(const C* head, int64_t first_slot, int64_t n, int64_t slot_stride,
                         int64_t dim, int64_t group, float* x, int64_t stride) {
  for (int64_t o = 0; o < n; ++o) {
    const float scale = row_scale(head + (first_slot + o) * slot_stride, dim);
    for (int64_t g = 0; g < group; ++g) x[g * stride + o] *= scale;
  }
}

#if TESSERA_SIMD
// p[g * stride + o] = mul * (the lane sum of row o's products for query head g), for o < n,
// W rows at a time: `dots(o, out)` writes row o's lane-wise products for head g at
// out + W * W * g (or zeros for o >= n); Simd::sum_lanes turns W rows' products into W sums.
template <typename Dots>
inline void score_rows(int64_t n, int64_t group, float mul, float* parts, float* p,
                       int64_t stride, Dots dots) {
  for (int64_t o0 = 0; o0 < n; o0 += Simd::W) {
    for (int o = 0; o < Simd::W; ++o) dots(o0 + o, parts + Simd::W * Simd::slot(o));
    for (int64_t g = 0; g < group; ++g)
      Simd::store_first(p + g * stride + o0,
                        Simd::mul(Simd::sum_lanes(parts + Simd::W * Simd::W * g), Simd::set1(mul)), n - o0);
  }
}

// The vectors of a row that weigh_block takes per pass over a block's rows: the most that
// divide the row's V vectors and fit in registers with G heads' sums of each, G weights and
// the row's vector (AVX2's 16 registers hold 3 heads of 64 in two passes; in one, the sums
// spill to the stack and every row waits on a store).
template <int64_t V, int64_t G>
constexpr int64_t pass_vectors() {
  for (int64_t j = V; j > 1; --j)
    if (V % j == 0 && G * j + G + 1 <= Simd::kRegs) return j;
  return 1;
}

// acc[g] += sum over the n rows o (from slot first_slot) of p[g * stride + o] * row o, for
// the G query heads g in float32; acc is [G, Dim], a pass's columns of it in registers
// across the rows.
template <typename C, int64_t Dim, int64_t G>
inline void weigh_block(const float* p, int64_t stride, const C* head, int64_t first_slot,
                        int64_t n, int64_t slot_stride, float* acc) {
  constexpr int64_t W = Simd::W, V = Dim / W, J = pass_vectors<V, G>();
  for (int64_t j0 = 0; j0 < V; j0 += J) {
    typename Simd::V a[G][J];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < J; ++j) a[g][j] = Simd::load(acc + g * Dim + W * (j0 + j));
    for (int64_t o = 0; o < n; ++o) {
      const C* src = head + (first_slot + o) * slot_stride + W * j0;
      typename Simd::V pg[G];
      for (int64_t g = 0; g < G; ++g) pg[g] = Simd::set1(p[g * stride + o]);
      for (int64_t j = 0; j < J; ++j) {
        const typename Simd::V v = Simd::load(src + W * j);
        for (int64_t g = 0; g < G; ++g) a[g][j] = Simd::fma(pg[g], v, a[g][j]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < J; ++j) Simd::store(acc + g * Dim + W * (j0 + j), a[g][j]);
  }
}
#endif

#if TESSERA_BF16
// acc[g] += sum over the n rows o of pb[g * stride + o] * row o (bf16 weights and rows, rows
// taken in pairs), for G query heads; acc is [G, Dim] in Bf16Dots' lo/hi layout per 32-element
// chunk and stays in registers across the rows.
template <int64_t Dim, int64_t G>
inline void weigh_pairs(const uint16_t* pb, int64_t stride, const uint16_t* head,
                        int64_t first_slot, int64_t n, int64_t slot_stride, float* acc) {
  constexpr int64_t K = Dim / 32;  // 32-element chunks a row
  __m512 a[G][2 * K];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < 2 * K; ++j) a[g][j] = _mm512_loadu_ps(acc + g * Dim + 16 * j);
  for (int64_t o = 0; o < n; o += 2) {
    const uint16_t* r0 = head + (first_slot + o) * slot_stride;
    uint32_t two[G];
    for (int64_t g = 0; g < G; ++g) std::memcpy(&two[g], pb + g * stride + o, sizeof two[g]);
    for (int64_t j = 0; j < K; ++j) {
      const Bf16Dots::P x = Bf16Dots::load(r0 + 32 * j);
      const Bf16Dots::P y = o + 1 < n ? Bf16Dots::load(r0 + slot_stride + 32 * j) : Bf16Dots::zero();
      const Bf16Dots::P lo = Bf16Dots::lo(x, y), hi = Bf16Dots::hi(x, y);
      for (int64_t g = 0; g < G; ++g) {
        const Bf16Dots::P w = Bf16Dots::pair(two[g]);
        a[g][2 * j] = Bf16Dots::dot(a[g][2 * j], lo, w);
        a[g][2 * j + 1] = Bf16Dots::dot(a[g][2 * j + 1], hi, w);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < 2 * K; ++j) _mm512_storeu_ps(acc + g * Dim + 16 * j, a[g][j]);
}

// pb[g * stride + o] = bf16(p[g * p_stride + o]) for o < n, and 0 at o = n.
inline void round_weights(const float* p, int64_t p_stride, int64_t n, int64_t group,
                          uint16_t* pb, int64_t stride) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t o = 0; o <= n; o += 16) {
      const int64_t lanes = std::min<int64_t>(16, n - o), keep = std::min<int64_t>(16, n + 1 - o);
      const __m512 x = _mm512_maskz_loadu_ps(__mmask16((1u << lanes) - 1), p + g * p_stride + o);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
      _mm256_mask_storeu_epi16(pb + g * stride + o, __mmask16((1u << keep) - 1), h);
    }
}
#endif

// Runs f(integral_constant<G>) for G = count (1..6); false for other counts.
template <typename F>
inline bool with_group(int64_t count, F f) {
  switch (count) {
    case 1: f(std::integral_constant<int64_t, 1>{}); return true;
    case 2: f(std::integral_constant<int64_t, 2>{}); return true;
    case 3: f(std::integral_constant<int64_t, 3>{}); return true;
    case 4: f(std::integral_constant<int64_t, 4>{}); return true;
    case 5: f(std::integral_constant<int64_t, 5>{}); return true;
    case 6: f(std::integral_constant<int64_t, 6>{}); return true;
    default: return false;
  }
}


// The rows of one KV head in the pool (cache type C), read by a query of type T.
template <typename T, typename C, int64_t Dim>
struct BlockRows {
  static constexpr bool kPairs = TESSERA_BF16 && std::is_same_v<T, uint16_t> &&
                                 std::is_same_v<C, uint16_t> && Dim > 0 && Dim % 32 == 0;
  static constexpr bool kSimd = TESSERA_SIMD && Dim > 0 && Dim % 16 == 0;

  const C* head;        // slot 0's row of this KV head
  int64_t slot_stride;  // elements from one slot's row to the next
  int64_t dim;

  // The queries of `heads` heads ([heads, dim] at q) as the inner loops read them: bf16
  // as they are (the pair path scales the scores), else float32 times `scale`.
  static void prepare_query(const T* q, int64_t heads, int64_t dim, float scale, Scratch& w) {
    if constexpr (kPairs)
      std::copy(q, q + heads * dim, w.qb);
    else
      for (int64_t i = 0; i < heads * dim; ++i) w.q[i] = widen(q[i]) * scale;
  }

#if TESSERA_SIMD
  // score for G heads (their prepared queries from element q_at), into p[g * w.bs + o].
  template <int64_t G>
  void score_heads(int64_t first_slot, int64_t n, int64_t q_at, float scale, Scratch& w,
                   float* p) const {
    const C* rows = head + first_slot * slot_stride;
#if TESSERA_BF16
    if constexpr (kPairs) {
      constexpr int64_t K = Dim / 32;
      Bf16Dots::P q[G][K];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < K; ++j) q[g][j] = Bf16Dots::load(w.qb + q_at + g * Dim + 32 * j);
      score_rows(n, G, scale, w.parts, p, w.bs, [&](int64_t o, float* out) {
        Bf16Dots::P k[K];
        for (int64_t j = 0; j < K; ++j)
          k[j] = o < n ? Bf16Dots::load(rows + o * slot_stride + 32 * j) : Bf16Dots::zero();
        for (int64_t g = 0; g < G; ++g) {
          __m512 dot = Bf16Dots::dot(_mm512_setzero_ps(), q[g][0], k[0]);
          for (int64_t j = 1; j < K; ++j) dot = Bf16Dots::dot(dot, q[g][j], k[j]);
          _mm512_storeu_ps(out + 256 * g, dot);
        }
      });
      return;
    }
#endif
    constexpr int64_t K = Dim / Simd::W;
    typename Simd::V q[G][K];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < K; ++j) q[g][j] = Simd::load(w.q + q_at + g * Dim + Simd::W * j);
    score_rows(n, G, 1.f, w.parts, p, w.bs, [&](int64_t o, float* out) {
      typename Simd::V k[K];
      for (int64_t j = 0; j < K; ++j)
        k[j] = o < n ? Simd::load(rows + o * slot_stride + Simd::W * j) : Simd::zero();
      for (int64_t g = 0; g < G; ++g) {
        typename Simd::V dot = Simd::mul(q[g][0], k[0]);
        for (int64_t j = 1; j < K; ++j) dot = Simd::fma(q[g][j], k[j], dot);
        Simd::store(out + Simd::W * Simd::W * g, dot);
      }
    });
  }
#endif

  // w.p[g * w.bs + o] = scale * q[g] . k[o] for the n rows from first_slot (K rows), where
  // q[g] is the prepared query row at element q_at + g * dim.
  void score(int64_t first_slot, int64_t n, int64_t group, int64_t q_at, float scale,
             Scratch& w) const {
#if TESSERA_SIMD
    if constexpr (kSimd) {  // up to 6 heads at a time, their queries held in registers
      for (int64_t g0 = 0; g0 < group; g0 += 6)
        with_group(std::min<int64_t>(6, group - g0), [&](auto g) {
          score_heads<decltype(g)::value>(first_slot, n, q_at + g0 * Dim, scale, w,
                                          w.p + g0 * w.bs);
        });
    }
#endif
    if constexpr (!kSimd) {
      widen_rows<C, Dim>(head, first_slot, n, slot_stride, dim, w.rows);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t o = 0; o < n; ++o) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < (Dim ? Dim : dim); ++d)
            dot += w.q[q_at + g * dim + d] * w.rows[o * dim + d];
          w.p[g * w.bs + o] = dot;
        }
    }
    if constexpr (kQuantized<C>) apply_scales(head, first_slot, n, slot_stride, dim, group, w.p, w.bs);
  }

  // acc[g] += sum over the n rows o from first_slot of w.p[g * w.bs + o] * v[o] (V rows).
  void weigh(int64_t first_slot, int64_t n, int64_t group, Scratch& w, float* acc) const {
    if constexpr (kQuantized<C>) apply_scales(head, first_slot, n, slot_stride, dim, group, w.p, w.bs);
#if TESSERA_BF16
    if constexpr (kPairs) {
      round_weights(w.p, w.bs, n, group, w.pb, w.bs + 2);
      constexpr int64_t most = Simd::kAccRegs / (Dim / 16);
      for (int64_t g0 = 0; g0 < group; g0 += most)
        with_group(std::min(most, group - g0), [&](auto g) {
          weigh_pairs<Dim, decltype(g)::value>(w.pb + g0 * (w.bs + 2), w.bs + 2, head,
                                               first_slot, n, slot_stride, acc + g0 * Dim);
        });
      return;
    }
#endif
#if TESSERA_SIMD
    if constexpr (kSimd) {
      const bool done = with_group(group, [&](auto g) {
        weigh_block<C, Dim, decltype(g)::value>(w.p, w.bs, head, first_slot, n, slot_stride, acc);
      });
      if (done) return;
    }
#endif
    weigh_rows(first_slot, n, group, w, acc);
  }

  // weigh's portable loops (through widened rows).
  void weigh_rows(int64_t first_slot, int64_t n, int64_t group, Scratch& w, float* acc) const {
    widen_rows<C, Dim>(head, first_slot, n, slot_stride, dim, w.rows);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t o = 0; o < n; ++o) {
        const float po = w.p[g * w.bs + o];
#pragma omp simd
        for (int64_t d = 0; d < (Dim ? Dim : dim); ++d) acc[g * dim + d] += po * w.rows[o * dim + d];
      }
  }

  // The element of a query head's row that position k of its acc holds.
  static constexpr int64_t dim_at(int64_t k) {
#if TESSERA_BF16
    if constexpr (kPairs) return 32 * (k / 32) + Bf16Dots::dim_at(k % 32);
#endif
    return k;
  }
};
