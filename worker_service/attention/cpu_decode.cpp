// Paged decode attention for CPUs: one new query token per request, attending over the
// request's K/V read straight from the paged pool (no gather into a padded batch, no mask).
// Built at first use by cpu_kernel.py with the system C++ compiler and called through ctypes.
//
// Layouts (row-major, elements):
//   query, out   [num_tokens, heads, head_dim]; rows[i] is request i's token row
//   k/v cache    [num_blocks, block_size, kv_heads, head_dim]
//   block_table  [num_reqs_in_step, table_stride] int32; seq_lens [num_reqs_in_step] int32
// Query head h attends with KV head h / (heads / kv_heads), as HF's repeat_kv. Scores,
// softmax and the weighted sum are float32; bf16 inputs are widened exactly and the output
// rounded to nearest even.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// glibc's vector expf (libmvec): lets the softmax loop vectorize without -ffast-math.
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));

namespace {

inline float widen(float x) { return x; }
inline float widen(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline void narrow(float x, float* dst) { *dst = x; }
inline void narrow(float x, uint16_t* dst) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even
  *dst = uint16_t(bits >> 16);
}

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size;
};

// Per-thread float32 buffers: the scaled queries, the accumulators, one block's widened
// K or V rows, and the scores of the group's query heads over the whole sequence.
struct Scratch {
  std::vector<float> buf;
  float *q, *acc, *rows, *scores;
  void reserve(int64_t group, int64_t dim, int64_t block_size, int64_t seq_len) {
    buf.resize(size_t(2 * group * dim + block_size * dim + group * seq_len));
    q = buf.data();
    acc = q + group * dim;
    rows = acc + group * dim;
    scores = rows + block_size * dim;
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

// One request, one KV head: its `group` query heads attend over seq_len tokens, a block
// at a time. Dim is head_dim when known at compile time (loops then unroll), else 0.
template <typename T, int64_t Dim>
void attend(const T* q, const T* k_cache, const T* v_cache, T* out, const int32_t* blocks,
            int64_t seq_len, int64_t kv_head, const Shape& s, float scale, Scratch& w) {
  const int64_t group = s.heads / s.kv_heads, dim = Dim ? Dim : s.head_dim;
  const int64_t bs = s.block_size, slot_stride = s.kv_heads * dim;
  const T* k_head = k_cache + kv_head * dim;
  const T* v_head = v_cache + kv_head * dim;
  w.reserve(group, dim, bs, seq_len);
  for (int64_t i = 0; i < group * dim; ++i) w.q[i] = widen(q[kv_head * group * dim + i]) * scale;

  for (int64_t start = 0, b = 0; start < seq_len; start += bs, ++b) {
    const int64_t n = std::min(bs, seq_len - start);
    widen_rows<T, Dim>(k_head, int64_t(blocks[b]) * bs, n, slot_stride, dim, w.rows);
    for (int64_t g = 0; g < group; ++g)
      dot_rows<Dim>(w.q + g * dim, w.rows, n, dim, w.scores + g * seq_len + start);
  }
  for (int64_t g = 0; g < group; ++g) softmax(w.scores + g * seq_len, seq_len);

  std::fill(w.acc, w.acc + group * dim, 0.f);
  for (int64_t start = 0, b = 0; start < seq_len; start += bs, ++b) {
    const int64_t n = std::min(bs, seq_len - start);
    widen_rows<T, Dim>(v_head, int64_t(blocks[b]) * bs, n, slot_stride, dim, w.rows);
    for (int64_t g = 0; g < group; ++g)
      weigh_rows<Dim>(w.scores + g * seq_len + start, w.rows, n, dim, w.acc + g * dim);
  }

  for (int64_t i = 0; i < group * dim; ++i) narrow(w.acc[i], out + kv_head * group * dim + i);
}

template <typename T, int64_t Dim>
void decode(const T* query, const T* k_cache, const T* v_cache, T* out,
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
      attend<T, Dim>(query + rows[i] * row_stride, k_cache, v_cache, out + rows[i] * row_stride,
             block_table + req * table_stride, seq_lens[req], kv_head, s, scale, w);
    }
  }
}

// The common head sizes get unrolled code; any other runs the generic loops.
template <typename T>
void dispatch(const T* query, const T* k_cache, const T* v_cache, T* out,
              const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens,
              const int64_t* reqs, const int64_t* rows, int64_t num_decode, const Shape& s,
              float scale, int num_threads) {
  auto run = [&](auto dim) {
    decode<T, decltype(dim)::value>(query, k_cache, v_cache, out, block_table, table_stride,
                                    seq_lens, reqs, rows, num_decode, s, scale, num_threads);
  };
  if (s.head_dim == 64)
    run(std::integral_constant<int64_t, 64>{});
  else if (s.head_dim == 128)
    run(std::integral_constant<int64_t, 128>{});
  else
    run(std::integral_constant<int64_t, 0>{});
}

}  // namespace

// dtype: 0 float32, 1 bfloat16 (query, caches and out share it). reqs[i] indexes
// block_table / seq_lens; rows[i] is that request's token row in query and out.
extern "C" int tessera_paged_decode(int dtype, const void* query, const void* k_cache,
                                    const void* v_cache, void* out, const int32_t* block_table,
                                    int64_t table_stride, const int32_t* seq_lens,
                                    const int64_t* reqs, const int64_t* rows, int64_t num_decode,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim,
                                    int64_t block_size, float scale, int num_threads) {
  if (heads % kv_heads != 0) return 1;
  const Shape s{heads, kv_heads, head_dim, block_size};
  if (dtype != 0 && dtype != 1) return 2;
  if (dtype == 0)
    dispatch(static_cast<const float*>(query), static_cast<const float*>(k_cache),
             static_cast<const float*>(v_cache), static_cast<float*>(out), block_table,
             table_stride, seq_lens, reqs, rows, num_decode, s, scale, num_threads);
  else
    dispatch(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(k_cache),
             static_cast<const uint16_t*>(v_cache), static_cast<uint16_t*>(out), block_table,
             table_stride, seq_lens, reqs, rows, num_decode, s, scale, num_threads);
  return 0;
}
