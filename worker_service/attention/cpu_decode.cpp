// Paged decode attention for CPUs: one new query token per request, attending over the
// request's K/V read straight from the paged pool (no gather into a padded batch, no mask).
// Built at first use by cpu_kernel.py with the system C++ compiler and called through ctypes.
//
// Layouts (row-major, elements):
//   query, out   [num_tokens, heads, head_dim]; rows[i] is request i's token row
//   k/v cache    [num_blocks, block_size, kv_heads, head_dim] in the query's type, or
//                quantized (int8 / float8 e4m3fn, kv_quant.h): [.., head_dim + 2], each head
//                row's values then its half scale; scores and weights take the scales per row
//   block_table  [num_reqs_in_step, table_stride] int32; seq_lens [num_reqs_in_step] int32
// Query head h attends with KV head h / (heads / kv_heads), as HF's repeat_kv. Scores,
// softmax and the weighted sum are float32; bf16 inputs are widened exactly and the output
// rounded to nearest even. Built for AVX-512 (cpu_simd.h; head sizes a multiple of 16), 16
// rows are scored at once (each row's dot product summed in the portable loop's order, so
// both round alike) and the weighted sum keeps its accumulators in registers; elsewhere
// portable loops.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../models/bf16.h"
#include "cpu_simd.h"
#include "kv_quant.h"

// glibc's vector expf (libmvec): lets the softmax loop vectorize without -ffast-math.
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));

namespace {

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size;
  int64_t window;  // sliding window: attend to the last `window` tokens; 0 = all
};

// Per-thread float32 buffers: the scaled queries, the accumulators, one block's widened
// K or V rows, and the scores of the group's query heads over the whole sequence.
// `parts` holds, per query head, W rows' lane-wise products (the SIMD path, W = 16).
struct Scratch {
  std::vector<float> buf;
  float *q, *acc, *rows, *scores, *parts;
  void reserve(int64_t group, int64_t dim, int64_t block_size, int64_t seq_len) {
    buf.resize(size_t(2 * group * dim + block_size * dim + group * seq_len + group * 256));
    q = buf.data();
    acc = q + group * dim;
    rows = acc + group * dim;
    scores = rows + block_size * dim;
    parts = scores + group * seq_len;
  }
};

// rows[o, :] = float32 of the slot first_slot + o of one KV head, for o < n.
template <typename T, int64_t Dim>
inline void widen_rows(const T* cache, int64_t first_slot, int64_t n, int64_t slot_stride,
                       int64_t dim, float* __restrict rows) {
  for (int64_t o = 0; o < n; ++o) {
    const T* src = cache + (first_slot + o) * slot_stride;
#pragma omp simd
    for (int64_t d = 0; d < (Dim ? Dim : dim); ++d) rows[o * dim + d] = widen(src[d]);
  }
}

// scores[o] = q . rows[o] for o < n.
template <int64_t Dim>
inline void dot_rows(const float* __restrict q, const float* __restrict rows, int64_t n,
                     int64_t dim, float* __restrict scores) {
  for (int64_t o = 0; o < n; ++o) {
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < (Dim ? Dim : dim); ++d) dot += q[d] * rows[o * dim + d];
    scores[o] = dot;
  }
}

// acc += sum over o < n of p[o] * rows[o]; with a compile-time Dim the sums stay in
// registers across the rows.
template <int64_t Dim>
inline void weigh_rows(const float* __restrict p, const float* __restrict rows, int64_t n,
                       int64_t dim, float* __restrict acc) {
  if constexpr (Dim > 0) {
    float a[Dim];
    std::copy(acc, acc + Dim, a);
    for (int64_t o = 0; o < n; ++o) {
      const float po = p[o];
#pragma omp simd
      for (int64_t d = 0; d < Dim; ++d) a[d] += po * rows[o * Dim + d];
    }
    std::copy(a, a + Dim, acc);
  } else {
    for (int64_t o = 0; o < n; ++o) {
      const float po = p[o];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[d] += po * rows[o * dim + d];
    }
  }
}

#if TESSERA_SIMD
// scores[g * stride + o] = q[g] . row o, for the n <= W rows of one KV head starting at
// slot first_slot; q is [group, Dim] float32. The W rows' lane-wise products go through
// `parts` ([group, W, W]) to one column-wise sum per query head.
template <typename T, int64_t Dim>
inline void score_rows(const float* q, int64_t group, const T* head, int64_t first_slot,
                       int64_t n, int64_t slot_stride, float* parts, float* scores,
                       int64_t stride) {
  constexpr int64_t W = Simd::W, V = Dim / W;
  for (int64_t o = 0; o < W; ++o) {
    if (o >= n) {
      for (int64_t g = 0; g < group; ++g) Simd::store(parts + (g * W + o) * W, Simd::zero());
      continue;
    }
    const T* src = head + (first_slot + o) * slot_stride;
    typename Simd::V k[V];
    for (int64_t j = 0; j < V; ++j) k[j] = Simd::load(src + W * j);
    for (int64_t g = 0; g < group; ++g) {
      typename Simd::V dot = Simd::mul(Simd::load(q + g * Dim), k[0]);
      for (int64_t j = 1; j < V; ++j) dot = Simd::fma(Simd::load(q + g * Dim + W * j), k[j], dot);
      Simd::store(parts + (g * W + o) * W, dot);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    Simd::store_first(scores + g * stride, Simd::sum_lanes_in_order(parts + g * W * W), n);
}

// acc[g] += sum over the n rows o of one KV head (from slot first_slot) of
// p[g * stride + o] * row o, for each of the G query heads g; acc is [G, Dim] float32 and
// stays in registers across the rows.
template <typename T, int64_t Dim, int64_t G>
inline void weigh_block(const float* p, int64_t stride, const T* head, int64_t first_slot,
                        int64_t n, int64_t slot_stride, float* acc) {
  constexpr int64_t W = Simd::W, V = Dim / W;
  typename Simd::V a[G][V];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < V; ++j) a[g][j] = Simd::load(acc + g * Dim + W * j);
  for (int64_t o = 0; o < n; ++o) {
    const T* src = head + (first_slot + o) * slot_stride;
    typename Simd::V v[V];
    for (int64_t j = 0; j < V; ++j) v[j] = Simd::load(src + W * j);
    for (int64_t g = 0; g < G; ++g) {
      const typename Simd::V pg = Simd::set1(p[g * stride + o]);
      for (int64_t j = 0; j < V; ++j) a[g][j] = Simd::fma(pg, v[j], a[g][j]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < V; ++j) Simd::store(acc + g * Dim + W * j, a[g][j]);
}

// weigh_block for a run-time group size; false where its sums would not fit in registers.
template <typename T, int64_t Dim>
inline bool weigh_block_any(const float* p, int64_t stride, int64_t group, const T* head,
                            int64_t first_slot, int64_t n, int64_t slot_stride, float* acc) {
  bool done = false;
  auto run = [&](auto g) {
    constexpr int64_t G = decltype(g)::value;
    if constexpr (G * (Dim / Simd::W) <= Simd::kAccRegs) {
      weigh_block<T, Dim, G>(p, stride, head, first_slot, n, slot_stride, acc);
      done = true;
    }
  };
  switch (group) {
    case 1: run(std::integral_constant<int64_t, 1>{}); break;
    case 2: run(std::integral_constant<int64_t, 2>{}); break;
    case 3: run(std::integral_constant<int64_t, 3>{}); break;
    case 4: run(std::integral_constant<int64_t, 4>{}); break;
    case 5: run(std::integral_constant<int64_t, 5>{}); break;
    case 6: run(std::integral_constant<int64_t, 6>{}); break;
    default: break;
  }
  return done;
}
#endif

// In place: scores = softmax(scores).
inline void softmax(float* scores, int64_t n) {
  const float top = *std::max_element(scores, scores + n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = expf(scores[t] - top);
    sum += scores[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) scores[t] *= inv;
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

// Asks for the rows of one KV head in the request's next block while this one is read
// (the pool's blocks are scattered, so the hardware prefetcher cannot guess them).
template <typename T, int64_t Dim>
inline void prefetch_block(const T* head, const int32_t* blocks, int64_t b, int64_t num_blocks,
                           int64_t bs, int64_t slot_stride) {
  if (b + 1 >= num_blocks) return;
  const char* first = reinterpret_cast<const char*>(head + int64_t(blocks[b + 1]) * bs * slot_stride);
  for (int64_t o = 0; o < bs; ++o)
    for (int64_t line = 0; line < int64_t(Dim * sizeof(T)); line += 64)
      __builtin_prefetch(first + o * slot_stride * int64_t(sizeof(T)) + line);
}

// One request, one KV head: its `group` query heads attend over seq_len tokens (the last
// s.window of them with a sliding window: blocks before it are skipped, earlier tokens of
// its first block get a zero weight), a block at a time. Dim is head_dim when known at
// compile time (loops then unroll), else 0. T: the query's and output's type, C: the cache's.
template <typename T, typename C, int64_t Dim>
void attend(const T* q, const C* k_cache, const C* v_cache, T* out, const int32_t* blocks,
            int64_t seq_len, int64_t kv_head, const Shape& s, float scale, Scratch& w) {
  const int64_t group = s.heads / s.kv_heads, dim = Dim ? Dim : s.head_dim;
  const int64_t row = dim + kScaleElems<C>;  // elements of one slot's head row
  const int64_t bs = s.block_size, slot_stride = s.kv_heads * row;
  const C* k_head = k_cache + kv_head * row;
  const C* v_head = v_cache + kv_head * row;
  const int64_t num_blocks = (seq_len + bs - 1) / bs;
  w.reserve(group, dim, bs, seq_len);
  for (int64_t i = 0; i < group * dim; ++i) w.q[i] = widen(q[kv_head * group * dim + i]) * scale;
  const int64_t lo = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
  const int64_t b0 = lo / bs;  // first block holding a token of the window

  for (int64_t start = b0 * bs, b = b0; start < seq_len; start += bs, ++b) {
    const int64_t n = std::min(bs, seq_len - start);
    bool scored = false;
#if TESSERA_SIMD
    if constexpr (Dim > 0 && Dim % Simd::W == 0) {
      prefetch_block<C, Dim>(k_head, blocks, b, num_blocks, bs, slot_stride);
      for (int64_t o = 0; o < n; o += Simd::W)
        score_rows<C, Dim>(w.q, group, k_head, int64_t(blocks[b]) * bs + o,
                           std::min(Simd::W, n - o), slot_stride, w.parts,
                           w.scores + start + o, seq_len);
      scored = true;
    }
#endif
    if (!scored) {
      widen_rows<C, Dim>(k_head, int64_t(blocks[b]) * bs, n, slot_stride, dim, w.rows);
      for (int64_t g = 0; g < group; ++g)
        dot_rows<Dim>(w.q + g * dim, w.rows, n, dim, w.scores + g * seq_len + start);
    }
    if constexpr (kQuantized<C>)
      apply_scales(k_head, int64_t(blocks[b]) * bs, n, slot_stride, dim, group,
                   w.scores + start, seq_len);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = w.scores + g * seq_len;
    std::fill(row + b0 * bs, row + lo, -INFINITY);
    softmax(row + b0 * bs, seq_len - b0 * bs);
  }

  std::fill(w.acc, w.acc + group * dim, 0.f);
  for (int64_t start = b0 * bs, b = b0; start < seq_len; start += bs, ++b) {
    const int64_t n = std::min(bs, seq_len - start);
    if constexpr (kQuantized<C>)  // the weights of this block's rows take their V scales
      apply_scales(v_head, int64_t(blocks[b]) * bs, n, slot_stride, dim, group,
                   w.scores + start, seq_len);
#if TESSERA_SIMD
    if constexpr (Dim > 0 && Dim % Simd::W == 0) {
      prefetch_block<C, Dim>(v_head, blocks, b, num_blocks, bs, slot_stride);
      if (weigh_block_any<C, Dim>(w.scores + start, seq_len, group, v_head,
                                  int64_t(blocks[b]) * bs, n, slot_stride, w.acc))
        continue;
    }
#endif
    widen_rows<C, Dim>(v_head, int64_t(blocks[b]) * bs, n, slot_stride, dim, w.rows);
    for (int64_t g = 0; g < group; ++g)
      weigh_rows<Dim>(w.scores + g * seq_len + start, w.rows, n, dim, w.acc + g * dim);
  }

  for (int64_t i = 0; i < group * dim; ++i) store(w.acc[i], out + kv_head * group * dim + i);
}

template <typename T, typename C, int64_t Dim>
void decode(const T* query, const C* k_cache, const C* v_cache, T* out,
            const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens,
            const int64_t* reqs, const int64_t* rows, int64_t num_decode, const Shape& s,
            float scale, int num_threads) {
  const int64_t row_stride = s.heads * s.head_dim;
  const int64_t tasks = num_decode * s.kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch w;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t i = task / s.kv_heads, kv_head = task % s.kv_heads, req = reqs[i];
      attend<T, C, Dim>(query + rows[i] * row_stride, k_cache, v_cache, out + rows[i] * row_stride,
             block_table + req * table_stride, seq_lens[req], kv_head, s, scale, w);
    }
  }
}

// The common head sizes get unrolled code; any other runs the generic loops.
template <typename T, typename C>
void dispatch(const T* query, const C* k_cache, const C* v_cache, T* out,
              const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens,
              const int64_t* reqs, const int64_t* rows, int64_t num_decode, const Shape& s,
              float scale, int num_threads) {
  auto run = [&](auto dim) {
    decode<T, C, decltype(dim)::value>(query, k_cache, v_cache, out, block_table, table_stride,
                                    seq_lens, reqs, rows, num_decode, s, scale, num_threads);
  };
  if (s.head_dim == 64)
    run(std::integral_constant<int64_t, 64>{});
  else if (s.head_dim == 128)
    run(std::integral_constant<int64_t, 128>{});
  else
    run(std::integral_constant<int64_t, 0>{});
}

// The cache read as C (the query's type T, or a quantized one), for one query type T.
template <typename T>
int dispatch_cache(int cache_dtype, const T* query, const void* k_cache, const void* v_cache,
                   T* out, const int32_t* block_table, int64_t table_stride,
                   const int32_t* seq_lens, const int64_t* reqs, const int64_t* rows,
                   int64_t num_decode, const Shape& s, float scale, int num_threads) {
  auto run = [&](auto* cache) {
    using C = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
    dispatch<T, C>(query, static_cast<const C*>(k_cache), static_cast<const C*>(v_cache), out,
                   block_table, table_stride, seq_lens, reqs, rows, num_decode, s, scale,
                   num_threads);
  };
  if (cache_dtype == 0)
    run(static_cast<const T*>(nullptr));
  else if (cache_dtype == 2)
    run(static_cast<const int8_t*>(nullptr));
  else if (cache_dtype == 3)
    run(static_cast<const Fp8E4M3*>(nullptr));
  else
    return 4;
  return 0;
}

}  // namespace

// dtype: 0 float32, 1 bfloat16 (query and out share it); cache_dtype: 0 the same, 2 int8,
// 3 float8 e4m3fn (quantized, with scales). reqs[i] indexes block_table / seq_lens; rows[i]
// is that request's token row in query and out.
extern "C" int tessera_paged_decode(int dtype, int cache_dtype, const void* query, const void* k_cache,
                                    const void* v_cache, void* out, const int32_t* block_table,
                                    int64_t table_stride, const int32_t* seq_lens,
                                    const int64_t* reqs, const int64_t* rows, int64_t num_decode,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t block_size, int64_t window, float scale,
                                    int num_threads) {
  if (heads % kv_heads != 0) return 1;
  if (window < 0) return 3;
  const Shape s{heads, kv_heads, head_dim, block_size, window};
  if (dtype != 0 && dtype != 1) return 2;
  if (dtype == 0)
    return dispatch_cache(cache_dtype, static_cast<const float*>(query), k_cache, v_cache,
                          static_cast<float*>(out), block_table, table_stride, seq_lens, reqs,
                          rows, num_decode, s, scale, num_threads);
  return dispatch_cache(cache_dtype, static_cast<const uint16_t*>(query), k_cache, v_cache,
                        static_cast<uint16_t*>(out), block_table, table_stride, seq_lens, reqs,
                        rows, num_decode, s, scale, num_threads);
}
