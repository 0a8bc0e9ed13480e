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
// Query head h attends with KV head h / (heads / kv_heads), as HF's repeat_kv.
//
// One pass over the KV, a block at a time, with an online softmax (running max and sum per
// query head, flash-attention style): each block's K rows are scored for all the query heads
// of its GQA group at once, and its V rows weighed while they are in cache. Work is split
// over (request, KV head, KV split): a step with few requests splits their sequences so that
// every thread has work, and the splits' partial sums are merged at the end (in split order).
// With split_tokens > 0 (batch-invariant mode) the splits are instead a function of the row's
// own length only (one per split_tokens of its KV), so a row's bits never depend on the other
// rows of the call; a row's result is computed by one thread either way. Scores, softmax
// and sums are float32 (the weights of a bf16 cache are rounded to bf16 for the weighted
// sum, as flash attention rounds P); bf16 outputs are rounded to nearest even. Inner loops:
// bf16 pair dot products (AVX512-BF16) for bf16 caches where built, else AVX-512 float32
// (cpu_simd.h; head sizes a multiple of 16), else portable loops the compiler vectorizes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../models/bf16.h"
#include "amx_prefill.h"
#include "cpu_decode_blocks.h"

namespace {

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size;
  int64_t window;  // sliding window: attend to the last `window` tokens; 0 = all
  int64_t split_tokens;  // > 0: fixed splits of this many tokens (batch-invariant); 0: adaptive
};

constexpr int64_t kMinSplitTokens = 256;  // a KV split reads at least this many tokens

// One unit of work: request i's query heads over its blocks [block_lo, block_hi) (all its
// KV heads, so that each block's K and V are read as one contiguous span); `part` >= 0
// indexes its partial state when the request's KV is split, else -1.
struct Task {
  int64_t i, block_lo, block_hi, part;
};

// The softmax state of a request's query heads: running max m and sum l per head, and the
// unnormalized weighted sums acc ([heads, dim], in the inner loops' layout).
struct State {
  float *m, *l, *acc;
  static int64_t floats(int64_t heads, int64_t dim) { return heads * (dim + 2); }
  State(float* base, int64_t heads) : m(base), l(base + heads), acc(base + 2 * heads) {}
  State(float* m, float* l, float* acc) : m(m), l(l), acc(acc) {}
  // The state of `group` heads from head h0.
  State heads_from(int64_t h0, int64_t dim) const { return {m + h0, l + h0, acc + h0 * dim}; }
};

// The first token of the window (0 without one).
inline int64_t window_start(int64_t seq_len, const Shape& s) {
  return s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
}

// Asks for `bytes` from `p` into L2 (the pool's blocks are scattered, so the hardware
// prefetcher cannot guess the next one). The L2 hint, two blocks ahead, measured 5-8% faster
// than L1 one block ahead on an AMX Xeon (attention_bench, bf16, batch 48 x 500).
inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch(static_cast<const char*>(p) + line, 0, 1);
}

constexpr int64_t kPrefetchBlocks = 2;  // blocks read ahead

// One block's scores of `group` heads (p, [group, stride]) folded into their state: m and l
// updated, acc rescaled where the max grew, and p turned into the weights exp(score - m).
inline void online_softmax(float* p, int64_t n, int64_t stride, int64_t group, int64_t dim,
                           const State& st) {
  for (int64_t g = 0; g < group; ++g) {
    float* pg = p + g * stride;
    const float top = std::max(st.m[g], max_of(pg, n));
    if (top > st.m[g]) {
      const float alpha = expf(st.m[g] - top);  // 0 on the first block (m = -inf)
      st.l[g] *= alpha;
      float* acc = st.acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[d] *= alpha;
      st.m[g] = top;
    }
    st.l[g] += exp_sum(pg, n, top);
  }
}

// Task t's query heads (q: [heads, dim]) over its blocks, folded into `st` (started empty).
template <typename T, typename C, int64_t Dim>
void attend(const T* q, const C* k_cache, const C* v_cache, const int32_t* blocks,
            int64_t seq_len, const Task& t, const Shape& s, float scale, Scratch& w,
            const State& st) {
  using Rows = BlockRows<T, C, Dim>;
  const int64_t group = s.heads / s.kv_heads, dim = Dim ? Dim : s.head_dim;
  const int64_t row = dim + kScaleElems<C>, bs = s.block_size, slot_stride = s.kv_heads * row;
  Rows::prepare_query(q, s.heads, dim, scale, w);
  std::fill(st.m, st.m + s.heads, -INFINITY);
  std::fill(st.l, st.l + s.heads, 0.f);
  std::fill(st.acc, st.acc + s.heads * dim, 0.f);
  const int64_t lo = window_start(seq_len, s);
  const int64_t block_bytes = bs * slot_stride * int64_t(sizeof(C));
  for (int64_t a = t.block_lo; a < std::min(t.block_hi, t.block_lo + kPrefetchBlocks); ++a) {
    prefetch_span(k_cache + int64_t(blocks[a]) * bs * slot_stride, block_bytes);
    prefetch_span(v_cache + int64_t(blocks[a]) * bs * slot_stride, block_bytes);
  }
  for (int64_t b = t.block_lo; b < t.block_hi; ++b) {
    const int64_t start = b * bs, n = std::min(bs, seq_len - start), first = blocks[b] * bs;
    // K and V kPrefetchBlocks ahead, a KV head's share before each head's work (one burst
    // of the whole block measured slower).
    const int64_t ahead = b + kPrefetchBlocks;
    const int64_t next = ahead < t.block_hi ? int64_t(blocks[ahead]) * bs * slot_stride : -1;
    const int64_t share = (block_bytes + s.kv_heads - 1) / s.kv_heads;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      if (next >= 0) {
        prefetch_span(reinterpret_cast<const char*>(k_cache + next) + h * share, share);
        prefetch_span(reinterpret_cast<const char*>(v_cache + next) + h * share, share);
      }
      const Rows k{k_cache + h * row, slot_stride, dim}, v{v_cache + h * row, slot_stride, dim};
      k.score(first, n, group, h * group * dim, scale, w);
      for (int64_t g = 0; g < group; ++g)  // tokens of the first block before the window
        std::fill(w.p + g * bs, w.p + g * bs + std::clamp<int64_t>(lo - start, 0, n), -INFINITY);
      const State head = st.heads_from(h * group, dim);
      online_softmax(w.p, n, bs, group, dim, head);
      v.weigh(first, n, group, w, head.acc);
    }
  }
}

// out = acc / l per query head, in natural order (`Rows::dim_at` undoes the inner layout).
template <typename T, typename C, int64_t Dim>
void finish(const State& st, int64_t heads, int64_t dim, T* out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / st.l[h];
    for (int64_t k = 0; k < dim; ++k)
      store(st.acc[h * dim + k] * inv, out + h * dim + BlockRows<T, C, Dim>::dim_at(k));
  }
}

// The splits' states of one request merged into `out` ([heads, dim]).
template <typename T, typename C, int64_t Dim>
void merge(float* parts, int64_t num_splits, int64_t heads, int64_t dim, T* out,
           std::vector<float>& buf) {
  const int64_t floats = State::floats(heads, dim);
  buf.assign(size_t(floats), 0.f);
  const State total(buf.data(), heads);
  for (int64_t h = 0; h < heads; ++h) {
    total.m[h] = -INFINITY;
    for (int64_t sp = 0; sp < num_splits; ++sp)
      total.m[h] = std::max(total.m[h], parts[sp * floats + h]);
  }
  for (int64_t sp = 0; sp < num_splits; ++sp) {
    const State part(parts + sp * floats, heads);
    for (int64_t h = 0; h < heads; ++h) {
      const float weight = expf(part.m[h] - total.m[h]);
      total.l[h] += weight * part.l[h];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) total.acc[h * dim + d] += weight * part.acc[h * dim + d];
    }
  }
  finish<T, C, Dim>(total, heads, dim, out);
}

// The step's tasks: one per request, each request's blocks cut into a few splits of at
// least kMinSplitTokens when there are fewer than 4 requests per thread (or, with
// s.split_tokens, one split per split_tokens of its own KV); `splits[i]` is request i's count
// and `first_part[i]` the index of its first partial state.
std::vector<Task> plan(const int32_t* seq_lens, const int64_t* reqs, int64_t num_decode,
                       const Shape& s, int num_threads, std::vector<int64_t>& splits,
                       std::vector<int64_t>& first_part) {
  const int64_t want = 4 * int64_t(num_threads);
  const int64_t ask = num_decode >= want ? 1 : (want + num_decode - 1) / num_decode;
  std::vector<Task> tasks;
  int64_t parts = 0;
  splits.assign(size_t(num_decode), 1);
  first_part.assign(size_t(num_decode), -1);
  for (int64_t i = 0; i < num_decode; ++i) {
    const int64_t seq_len = seq_lens[reqs[i]], bs = s.block_size;
    const int64_t b0 = window_start(seq_len, s) / bs, nb = (seq_len + bs - 1) / bs - b0;
    const int64_t n = s.split_tokens > 0
                          ? std::max<int64_t>(1, nb * bs / s.split_tokens)
                          : std::clamp<int64_t>(nb * bs / kMinSplitTokens, 1, ask);
    splits[size_t(i)] = n;
    if (n > 1) first_part[size_t(i)] = parts;
    for (int64_t sp = 0; sp < n; ++sp)
      tasks.push_back({i, b0 + nb * sp / n, b0 + nb * (sp + 1) / n, n > 1 ? parts + sp : -1});
    if (n > 1) parts += n;
  }
  return tasks;
}

template <typename T, typename C, int64_t Dim>
void decode(const T* query, const C* k_cache, const C* v_cache, T* out,
            const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens,
            const int64_t* reqs, const int64_t* rows, int64_t num_decode, const Shape& s,
            float scale, int num_threads) {
  const int64_t row_stride = s.heads * s.head_dim, dim = s.head_dim;
  const int64_t floats = State::floats(s.heads, dim);
  std::vector<int64_t> splits, first_part;
  const std::vector<Task> tasks =
      plan(seq_lens, reqs, num_decode, s, num_threads, splits, first_part);
  int64_t num_parts = 0;
  for (const Task& t : tasks) num_parts += t.part >= 0;
  std::vector<float> parts(size_t(num_parts * floats));
  const int64_t num_tasks = int64_t(tasks.size());
  const int threads = int(std::clamp<int64_t>(num_tasks, 1, num_threads));
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
    std::vector<float> own(static_cast<size_t>(floats));
    w.reserve(s.heads, dim, s.block_size);
#pragma omp for schedule(dynamic)
    for (int64_t n = 0; n < num_tasks; ++n) {
      const Task& t = tasks[size_t(n)];
      const int64_t req = reqs[t.i];
      const State st(t.part >= 0 ? parts.data() + t.part * floats : own.data(), s.heads);
      attend<T, C, Dim>(query + rows[t.i] * row_stride, k_cache, v_cache,
                        block_table + req * table_stride, seq_lens[req], t, s, scale, w, st);
      if (t.part < 0) finish<T, C, Dim>(st, s.heads, dim, out + rows[t.i] * row_stride);
    }
    if (num_parts)
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < num_decode; ++i)
      if (splits[size_t(i)] > 1)
        merge<T, C, Dim>(parts.data() + first_part[size_t(i)] * floats, splits[size_t(i)],
                         s.heads, dim, out + rows[i] * row_stride, own);
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
// is that request's token row in query and out. split_tokens: 0 adaptive KV splits (by the
// step's size), > 0 fixed splits of that many tokens (a row's bits independent of the batch).
extern "C" int tessera_paged_decode(int dtype, int cache_dtype, const void* query, const void* k_cache,
                                    const void* v_cache, void* out, const int32_t* block_table,
                                    int64_t table_stride, const int32_t* seq_lens,
                                    const int64_t* reqs, const int64_t* rows, int64_t num_decode,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t block_size, int64_t window,
                                    int64_t split_tokens, float scale, int num_threads) {
  if (heads % kv_heads != 0) return 1;
  if (window < 0 || split_tokens < 0) return 3;
  const Shape s{heads, kv_heads, head_dim, block_size, window, split_tokens};
  if (dtype != 0 && dtype != 1) return 2;
  if (dtype == 0)
    return dispatch_cache(cache_dtype, static_cast<const float*>(query), k_cache, v_cache,
                          static_cast<float*>(out), block_table, table_stride, seq_lens, reqs,
                          rows, num_decode, s, scale, num_threads);
  return dispatch_cache(cache_dtype, static_cast<const uint16_t*>(query), k_cache, v_cache,
                        static_cast<uint16_t*>(out), block_table, table_stride, seq_lens, reqs,
                        rows, num_decode, s, scale, num_threads);
}

// dst's rows slots[i] = src's row i (row_bytes each; src's rows src_stride bytes apart), for
// i < n: a step's K or V rows into the pool of num_slots rows (Python's index_copy_ runs
// several times slower). 0 done; 1 a slot out of range, and nothing written.
extern "C" int tessera_scatter_rows(const void* src, int64_t src_stride, void* dst,
                                    int64_t row_bytes, int64_t num_slots, const int64_t* slots,
                                    int64_t n, int num_threads) {
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= num_slots) return 1;
  const auto* from = static_cast<const char*>(src);
  auto* to = static_cast<char*>(dst);
#pragma omp parallel for num_threads(n * row_bytes >= (1 << 16) ? num_threads : 1)
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(to + slots[i] * row_bytes, from + i * src_stride, size_t(row_bytes));
  return 0;
}

// The engine tessera_paged_prefill runs (amx_prefill.h): 0 none (not in this build), 1 AMX
// tiles, 2 AVX512-BF16 dot products.
static int prefill_engine = 0;

// want 1: the AMX tiles where Linux lends them (the caller checks the CPU's flags first:
// asking for tiles needs them), else none; 2: the dot products; 0: none; -1: no change.
// Returns the engine then chosen (always 0 outside the AVX512_BF16 build).
extern "C" int tessera_prefill_engine(int want) {
#if defined(__AVX512BF16__)
  if (want == 1) prefill_engine = amx_gemm::lent() || amx_gemm::enable() ? 1 : 0;
  if (want == 2 || want == 0) prefill_engine = want;
#else
  (void)want;
#endif
  return prefill_engine;
}

// Causal prefill attention of one request's new rows (amx_prefill.h for layouts), bf16 queries
// over a pool of cache_dtype (as tessera_paged_decode's: 0 bf16, 2 int8, 3 float8 e4m3fn):
// 0 done, 1 not in this build, 2 a shape it does not take, 3 no engine chosen yet, 4 a cache
// dtype it does not know.
extern "C" int tessera_paged_prefill(int cache_dtype, const void* query, const void* k_cache,
                                     const void* v_cache, void* out, const int32_t* blocks,
                                     int64_t query_len, int64_t seq_len, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                     float scale, int num_threads) {
#if defined(__AVX512BF16__)
  if (!prefill_engine) return 3;
  const amx_prefill::Shape s{heads, kv_heads, head_dim, block_size, query_len, seq_len, scale};
  auto run = [&](auto* cache) {
    using C = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
    const auto* q = static_cast<const uint16_t*>(query);
    const auto *k = static_cast<const C*>(k_cache), *v = static_cast<const C*>(v_cache);
    auto* o = static_cast<uint16_t*>(out);
    const bool done =
        prefill_engine == 1
            ? amx_prefill::prefill<amx_prefill::Amx>(q, k, v, o, blocks, s, num_threads)
            : amx_prefill::prefill<amx_prefill::Dots>(q, k, v, o, blocks, s, num_threads);
    return done ? 0 : 2;
  };
  if (cache_dtype == 0) return run(static_cast<const uint16_t*>(nullptr));
  if (cache_dtype == 2) return run(static_cast<const int8_t*>(nullptr));
  if (cache_dtype == 3) return run(static_cast<const Fp8E4M3*>(nullptr));
  return 4;
#else
  (void)cache_dtype, (void)query, (void)k_cache, (void)v_cache, (void)out, (void)blocks;
  (void)query_len, (void)seq_len, (void)heads, (void)kv_heads, (void)head_dim;
  (void)block_size, (void)scale, (void)num_threads;
  return 1;
#endif
}
