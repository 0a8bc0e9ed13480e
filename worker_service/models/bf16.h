// bf16 <-> float32 for the CPU kernels (bf16 held as uint16_t): widen exactly, store rounded
// to nearest even. Overloads on float32 make the kernels' templates dtype-generic. And IEEE
// half -> float32 for the scales of GGUF blocks.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

inline float widen(float x) { return x; }
inline float widen(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline float store(float x, float* dst) { return *dst = x; }
inline float store(float x, uint16_t* dst) {  // round to nearest even; returns the rounded value
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *dst = uint16_t(bits >> 16);
  return widen(*dst);
}

// IEEE half (GGUF block scales) -> float32, exactly.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}
