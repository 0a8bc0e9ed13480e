// The quantized KV cache's elements for the decode kernel (attention/kv_quant.py): int8 or
// float8 e4m3fn values, then one IEEE half scale per slot and KV head as two more elements
// of the head row (so x = value * scale). Widening is exact; the kernel's templates pick
// these overloads by the cache's element type.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../models/bf16.h"

// One torch.float8_e4m3fn element (sign, 4 exponent bits biased by 7, 3 mantissa bits).
struct Fp8E4M3 {
  uint8_t bits;
};

inline float widen(int8_t x) { return float(x); }

// The 7 magnitude bits under float32's exponent field, times 2^(127 - 7): exact for normals
// and subnormals alike (NaN, never written, would read as 480).
inline float widen(Fp8E4M3 x) {
  const uint32_t bits = (uint32_t(x.bits & 0x80u) << 24) | (uint32_t(x.bits & 0x7Fu) << 20);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

template <typename C>
inline constexpr bool kQuantized = std::is_same_v<C, int8_t> || std::is_same_v<C, Fp8E4M3>;

// Elements after a head row's `dim` values: the scale's two bytes in a quantized cache.
template <typename C>
inline constexpr int64_t kScaleElems = kQuantized<C> ? 2 : 0;

// The scale stored after the `dim` values of one head row.
template <typename C>
inline float row_scale(const C* row, int64_t dim) {
  uint16_t half;
  std::memcpy(&half, row + dim, sizeof half);
  return half_to_float(half);
}

// Writing rows, as kv_quant.quantize does in torch (bit for bit): scale = half(max(amax /
// qmax, 2^-14)), each value x / scale (float32 division) clamped to +-qmax, then rounded to
// nearest even: to an int8, or to float8 e4m3fn.
namespace kv_write {

constexpr float kMinScale = 0x1p-14f;  // smallest normal half (kv_quant._MIN_SCALE)

// float32 >= 2^-14 and < 65520 -> IEEE half bits, rounded to nearest even.
inline uint16_t normal_half(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0xFFFu + ((bits >> 13) & 1u);  // round the 13 dropped mantissa bits
  return uint16_t(((bits >> 13) - (112u << 10)) & 0x7FFFu);  // exponent bias 127 -> 15
}

inline int8_t encode(float q, int8_t*) { return int8_t(std::nearbyint(q)); }

// |q| <= 448 -> e4m3fn bits: subnormals (below 2^-6) in steps of 2^-9, normals with their
// mantissa rounded to 3 bits (a carry moves into the exponent).
inline Fp8E4M3 encode(float q, Fp8E4M3*) {
  uint32_t bits;
  std::memcpy(&bits, &q, sizeof bits);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  const float a = std::fabs(q);
  if (a < 0x1p-6f) return {uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)))};
  uint32_t mag = bits & 0x7FFFFFFFu;
  mag += 0x7FFFFu + ((mag >> 20) & 1u);
  mag >>= 20;  // float32 exponent and 3 mantissa bits
  return {uint8_t(sign | uint8_t(mag - (120u << 3)))};  // exponent bias 127 -> 7
}

template <typename C>
constexpr float kQmax = std::is_same_v<C, int8_t> ? 127.0f : 448.0f;

// x [dim] -> x H in place (kv_rotation.rotate: H the normalized Sylvester Hadamard matrix,
// dim a power of two <= 1024): the butterflies in float32, scaled once, rounded to T.
template <typename T>
void hadamard(T* x, int64_t dim) {
  float v[1024];
  for (int64_t i = 0; i < dim; ++i) v[i] = widen(x[i]);
  for (int64_t len = 1; len < dim; len <<= 1)
    for (int64_t i = 0; i < dim; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = v[j], b = v[j + len];
        v[j] = a + b;
        v[j + len] = a - b;
      }
  const float s = float(1.0 / std::sqrt(double(dim)));
  for (int64_t i = 0; i < dim; ++i) store(v[i] * s, x + i);
}

// x [dim] (float32 or bf16) -> out [dim + 2]: values, then the half scale's two bytes.
template <typename C, typename T>
void quantize_row(const T* x, int64_t dim, C* out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(widen(x[i])));
  const uint16_t half = normal_half(std::max(amax / kQmax<C>, kMinScale));
  const float scale = half_to_float(half);
  for (int64_t i = 0; i < dim; ++i) {
    const float q = std::clamp(widen(x[i]) / scale, -kQmax<C>, kQmax<C>);
    out[i] = encode(q, static_cast<C*>(nullptr));
  }
  std::memcpy(out + dim, &half, sizeof half);
}

}  // namespace kv_write
