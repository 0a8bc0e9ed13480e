// The quantized KV cache's elements for the decode kernel (attention/kv_quant.py): int8 or
// float8 e4m3fn values, then one IEEE half scale per slot and KV head as two more elements
// of the head row (so x = value * scale). Widening is exact; the kernel's templates pick
// these overloads by the cache's element type.
#pragma once

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
