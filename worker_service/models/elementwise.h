// RMSNorm with the residual add, rotary embedding in place and SiLU(gate) * up for CPUs, with
// HF's bf16 rounding order: every torch op's result is rounded to bf16 where HF's is; the
// math between roundings is float32. Used by cpu_ops.cpp's entry points and by
// decode_layers.h. Element types: float, or bf16 as uint16_t (bf16.h).
//
// Layouts (row-major, elements):
//   add_rms_norm  x, residual, out [n, hidden]; weight [hidden]
//   rope          qk rows of `row_stride` elements, heads x head_dim each; cos, sin [n, head_dim/2]
//   silu_mul      gate_up [n, 2 * inter] (gate first); out [n, inter]
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "bf16.h"

extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));

namespace elementwise {


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

// row(r) for every r < n, on threads_for(elements, num_threads) threads; on this one alone
// without forming a team (a team of one still costs ~0.4 us, and a batch-1 decode step of
// the default model calls these ops 120 times).
template <typename Row>
void for_rows(int64_t n, int64_t elements, int num_threads, const Row& row) {
  const int threads = threads_for(elements, num_threads);
  if (threads == 1) {
    for (int64_t r = 0; r < n; ++r) row(r);
    return;
  }
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < n; ++r) row(r);
}

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t n, int64_t hidden,
                  float eps, int num_threads) {
  for_rows(n, n * hidden, num_threads, [&](int64_t r) {
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
  });
}

template <typename T>
void rope(T* qk, int64_t n, int64_t heads, int64_t head_dim, int64_t row_stride, const T* cos,
          const T* sin, int num_threads) {
  const int64_t half = head_dim / 2;
  for_rows(n, n * heads * head_dim, num_threads, [&](int64_t r) {
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
  });
}

// out[i] = silu(gate[i]) * up[i] for i < m <= kChunk, as HF rounds them: silu(gate) in T,
// then the product. Not inlined: silu_mul and the AMX GEMM's gated epilogue (amx_gemm.h)
// share this one compiled loop, so their results agree to the bit.
template <typename T>
__attribute__((noinline)) void silu_mul_chunk(const T* gate, const T* up, T* out, int64_t m) {
  float a[kChunk], b[kChunk];
  widen_n(gate, a, m);
#pragma omp simd
  for (int64_t i = 0; i < m; ++i) a[i] = a[i] / (1.f + expf(-a[i]));
  round_n<T>(a, m);
  widen_n(up, b, m);
#pragma omp simd
  for (int64_t i = 0; i < m; ++i) a[i] *= b[i];
  narrow_n(a, out, m);
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t n, int64_t inter, int num_threads) {
  for_rows(n, n * inter, num_threads, [&](int64_t r) {
    const T* g = gate_up + r * 2 * inter;
    for (int64_t c = 0; c < inter; c += kChunk)
      silu_mul_chunk(g + c, g + inter + c, out + r * inter + c, std::min(kChunk, inter - c));
  });
}

}  // namespace elementwise
