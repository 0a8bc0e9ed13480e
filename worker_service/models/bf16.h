// bf16 <-> float32 for the CPU kernels (bf16 held as uint16_t): widen exactly, store rounded
// to nearest even. Overloads on float32 make the kernels' templates dtype-generic.
#pragma once

#include <cstdint>
#include <cstring>

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
