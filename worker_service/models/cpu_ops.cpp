// Fused elementwise ops of Llama-family decoders for CPUs: RMSNorm with the residual add,
// rotary embedding in place, and SiLU(gate) * up. One call replaces the 3-8 torch ops of
// each (their dispatch dominates small-batch decode), with HF's bf16 rounding order: every
// torch op's result is rounded to bf16 where HF's is; the math between roundings is
// float32. Built at first use by worker_service/native.py and called through ctypes.
//
// Layouts (row-major, elements); dtype 0 = float32, 1 = bfloat16:
//   add_rms_norm  x, residual, out [n, hidden]; weight [hidden]
//   rope          qk rows of `row_stride` elements, heads x head_dim each; cos, sin [n, head_dim/2]
//   silu_mul      gate_up [n, 2 * inter] (gate first); out [n, inter]
// and the sampler's grammar mask: apply_bitmask (float32 logits, int32 words), and the
// weight-bound GEMMs: few rows over bf16 weights (small_gemm.h: gemm_bf16), and any rows over
// GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as the file stores them
// (gguf_formats.h, gguf_gemm.h: gemm_gguf; with int8 activations, gguf_q8.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "bf16.h"
#include "gguf_gemm.h"
#include "gguf_q8.h"
#include "small_gemm.h"

extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));

namespace {

// Elements per chunk: the float32 working set of one chunk stays in L1.
constexpr int64_t kChunk = 256;

// dst[i] = float of src[i]; and back with rounding. Simple loops, so they vectorize.
template <typename T>
inline void widen_n(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}
template <typename T>
inline void narrow_n(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(src[i], &dst[i]);
}
// x[i] = the value x[i] takes once stored as T (identity for float).
template <typename T>
inline void round_n(float* x, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      T tmp;
      x[i] = store(x[i], &tmp);
    }
  }
}

// Parallelize over rows only when the work is worth waking the threads.
inline int threads_for(int64_t elements, int num_threads) {
  return elements >= 16384 ? num_threads : 1;
}

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t n, int64_t hidden,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(threads_for(n * hidden, num_threads))
  for (int64_t r = 0; r < n; ++r) {
    T* res = residual + r * hidden;
    float a[kChunk], b[kChunk];
    float sum = 0.f;
    for (int64_t c = 0; c < hidden; c += kChunk) {  // HF: x + residual, in dtype
      const int64_t m = std::min(kChunk, hidden - c);
      widen_n(res + c, a, m);
      if (x != nullptr) {
        widen_n(x + r * hidden + c, b, m);
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) a[i] += b[i];
        round_n<T>(a, m);
        narrow_n(a, res + c, m);
      }
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < m; ++i) sum += a[i] * a[i];
    }
    const float inv = 1.f / std::sqrt(sum / float(hidden) + eps);
    for (int64_t c = 0; c < hidden; c += kChunk) {  // HF: weight * (h * rsqrt).to(dtype)
      const int64_t m = std::min(kChunk, hidden - c);
      widen_n(res + c, a, m);
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) a[i] *= inv;
      round_n<T>(a, m);
      widen_n(weight + c, b, m);
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) a[i] *= b[i];
      narrow_n(a, out + r * hidden + c, m);
    }
  }
}

template <typename T>
void rope(T* qk, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, const T* cos,
          const T* sin, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(n * heads * head_dim, num_threads))
  for (int64_t r = 0; r < n; ++r) {
    const T* c = cos + r * half;
    const T* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* x = qk + r * row_stride + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {  // HF: cat(x1*cos - x2*sin, x2*cos + x1*sin)
        const float x1 = widen(x[i]), x2 = widen(x[i + half]);
        const float ci = widen(c[i]), si = widen(s[i]);
        T t1, t2, t3, t4;
        const float a = store(x1 * ci, &t1), b = store(x2 * si, &t2);
        const float d = store(x2 * ci, &t3), e = store(x1 * si, &t4);
        store(a - b, &x[i]);
        store(d + e, &x[i + half]);
      }
    }
  }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t n, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(threads_for(n * inter, num_threads))
  for (int64_t r = 0; r < n; ++r) {
    const T* g = gate_up + r * 2 * inter;
    float a[kChunk], b[kChunk];
    for (int64_t c = 0; c < inter; c += kChunk) {  // HF: silu(gate) in dtype, times up
      const int64_t m = std::min(kChunk, inter - c);
      widen_n(g + c, a, m);
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) a[i] = a[i] / (1.f + expf(-a[i]));
      round_n<T>(a, m);
      widen_n(g + inter + c, b, m);
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) a[i] *= b[i];
      narrow_n(a, out + r * inter + c, m);
    }
  }
}

void apply_bitmask(float* logits, int64_t vocab, const int64_t* rows, const uint32_t* bitmask,
                   int64_t n, int64_t words, int num_threads) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for num_threads(threads_for(n * vocab, num_threads))
  for (int64_t i = 0; i < n; ++i) {
    float* l = logits + rows[i] * vocab;
    const uint32_t* m = bitmask + i * words;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, vocab - w * 32);
      for (int64_t j = 0; j < end; ++j) {
        if (!((bits >> j) & 1u)) l[w * 32 + j] = neg_inf;
      }
    }
  }
}

// GGUF blocks: the int8-activation GEMM where asked and built for (AVX2), else the float one.
template <typename TX>
int gemm_gguf(int type, const TX* x, const uint8_t* w, const TX* bias, TX* out, int64_t rows,
              int64_t K, int64_t N, int int8_x, int num_threads) {
  if (int8_x) {
    const int status = gguf_q8::gemm(type, x, w, bias, out, rows, K, N, num_threads);
    if (status != 3) return status;
  }
  return gguf_gemm::gemm(type, x, w, bias, out, rows, K, N, num_threads);
}

}  // namespace

extern "C" {

// x, out [rows, K] and [rows, N] bf16; w [N, K] bf16; bias [N] bf16 or null.
int tessera_gemm_bf16(const void* x, const void* w, const void* bias, void* out, int64_t rows,
                      int64_t K, int64_t N, int num_threads) {
  using T = uint16_t;
  return small_gemm::gemm(static_cast<const T*>(x), static_cast<const T*>(w),
                          static_cast<const T*>(bias), static_cast<T*>(out), rows, K, N,
                          num_threads)
             ? 0
             : 2;
}

// x, out [rows, K] and [rows, N] in `dtype`; w [N, K / 32 or K / 256] blocks of GGUF `type`
// (ggml's id: gguf_formats.h); bias [N] in `dtype` or null.
int tessera_gemm_gguf(int type, int dtype, const void* x, const void* w, const void* bias,
                      void* out, int64_t rows, int64_t K, int64_t N, int int8_x,
                      int num_threads) {
  const auto* q = static_cast<const uint8_t*>(w);
  if (dtype == 0) return gemm_gguf(type, static_cast<const float*>(x), q,
                                   static_cast<const float*>(bias), static_cast<float*>(out),
                                   rows, K, N, int8_x, num_threads);
  if (dtype == 1) return gemm_gguf(type, static_cast<const uint16_t*>(x), q,
                                   static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out),
                                   rows, K, N, int8_x, num_threads);
  return 1;
}

// logits [B, vocab] float32; bitmask [n, words] (bit j of word w: token 32 w + j allowed);
// rows [n]: the logits row of each bitmask row. Disallowed tokens become -inf.
int tessera_apply_bitmask(void* logits, int64_t vocab, const void* rows, const void* bitmask,
                          int64_t n, int64_t words, int num_threads) {
  if (words * 32 < vocab) return 2;
  apply_bitmask(static_cast<float*>(logits), vocab, static_cast<const int64_t*>(rows),
                static_cast<const uint32_t*>(bitmask), n, words, num_threads);
  return 0;
}


int tessera_add_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out,
                         int64_t n, int64_t hidden, float eps, int num_threads) {
  if (dtype == 0) {
    add_rms_norm(static_cast<const float*>(x), static_cast<float*>(residual),
                 static_cast<const float*>(weight), static_cast<float*>(out), n, hidden, eps,
                 num_threads);
  } else if (dtype == 1) {
    add_rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), n, hidden,
                 eps, num_threads);
  } else {
    return 1;
  }
  return 0;
}

int tessera_rope(int dtype, void* qk, int64_t n, int64_t heads, int64_t head_dim,
                 int64_t row_stride, const void* cos, const void* sin, int num_threads) {
  if (head_dim % 2 != 0) return 2;
  if (dtype == 0) {
    rope(static_cast<float*>(qk), n, heads, head_dim, row_stride, static_cast<const float*>(cos),
         static_cast<const float*>(sin), num_threads);
  } else if (dtype == 1) {
    rope(static_cast<uint16_t*>(qk), n, heads, head_dim, row_stride,
         static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin), num_threads);
  } else {
    return 1;
  }
  return 0;
}

int tessera_silu_mul(int dtype, const void* gate_up, void* out, int64_t n, int64_t inter,
                     int num_threads) {
  if (dtype == 0) {
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), n, inter, num_threads);
  } else if (dtype == 1) {
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), n, inter,
             num_threads);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
