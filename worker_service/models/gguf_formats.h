// GGUF's block formats as the file stores them (ggml's layouts; d, dmin, m IEEE halves), each
// read as groups of 32 weights w = dq + m: dq the group's values already scaled (vectors of
// float32 lanes), m one offset per group (gguf_gemm.h adds m * sum(x) over the group).
//   Q4_0  {d; qs[16]}                    w = d (nibble - 8)                   18 bytes / 32
//   Q4_1  {d; m; qs[16]}                 w = d nibble + m                     20 bytes / 32
//   Q5_0  {d; qh[4]; qs[16]}             w = d (nibble | bit << 4 - 16)       22 bytes / 32
//   Q5_1  {d; m; qh[4]; qs[16]}          w = d (nibble | bit << 4) + m        24 bytes / 32
//   Q8_0  {d; qs[32] int8}               w = d qs                             34 bytes / 32
//   Q4_K  {d; dmin; scales[12]; qs[128]}           8 groups of 32:            144 bytes / 256
//         w = d sc[j] nibble - dmin mn[j]  (sc, mn: 6-bit, packed in `scales`)
//   Q5_K  {d; dmin; scales[12]; qh[32]; qs[128]}   as Q4_K, 5-bit values      176 bytes / 256
//   Q6_K  {ql[128]; qh[64]; scales[16] int8; d}    16 groups of 16:           210 bytes / 256
//         w = d scales[j] (low 4 | high 2 << 4 - 32)
// Nibbles: in Q4_0/Q4_1/Q5_0/Q5_1 value j is qs[j] & 15, value j + 16 qs[j] >> 4; in Q4_K and
// Q5_K group j takes qs[32 (j / 2) + i] >> 4 (j % 2); the 5th bits of Q5_K's group j are bit j
// of qh[i]; Q6_K's layout is spelled out in its struct. Each format: its ggml type id, bytes
// and weights per block, whether it has an offset m, and a Block that decodes a block's scales
// once and then each of its kGroups groups.
#pragma once

#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "small_gemm.h"

namespace gguf_gemm {

using small_gemm::Vec;

constexpr int64_t kGroup = 32;  // weights per group (of one offset m)
constexpr int kVecs = int(kGroup / Vec::W);  // vectors of one group's values
using Values = typename Vec::V[kVecs];

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

inline void scale(Values& q, float d) {
  const typename Vec::V dv = Vec::set1(d);
  for (int c = 0; c < kVecs; ++c) q[c] = Vec::mul(q[c], dv);
}

// 32 bytes of small integers (-128..127) and the bit fiddling that unpacks them.
#if defined(__AVX2__)
struct Bytes {
  __m128i lo, hi;  // bytes 0-15, 16-31
  static Bytes load(const uint8_t* p) {
    return {_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))};
  }
  static Bytes nibbles(const uint8_t* p) {  // 16 bytes: low nibbles, then high nibbles
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return {_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask)};
  }
  static Bytes bits16(uint32_t bits) {  // byte i: 16 if bit i of `bits` is set, else 0
    return {bit_bytes(bits & 0xFFFF), bit_bytes(bits >> 16)};
  }
  Bytes bits(int shift, int mask) const {  // (byte >> shift) & mask
    const __m128i s = _mm_cvtsi32_si128(shift), m = _mm_set1_epi8(char(mask));
    return {_mm_and_si128(_mm_srl_epi16(lo, s), m), _mm_and_si128(_mm_srl_epi16(hi, s), m)};
  }
  Bytes shl4() const { return {_mm_slli_epi16(lo, 4), _mm_slli_epi16(hi, 4)}; }  // bytes < 16
  Bytes operator|(const Bytes& o) const { return {_mm_or_si128(lo, o.lo), _mm_or_si128(hi, o.hi)}; }
  Bytes minus(int v) const {
    const __m128i s = _mm_set1_epi8(char(v));
    return {_mm_sub_epi8(lo, s), _mm_sub_epi8(hi, s)};
  }
  void widen(Values& q) const {  // signed bytes -> float32 lanes
#if defined(__AVX512F__)
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
#else
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
#endif
  }

 private:
  static __m128i bit_bytes(uint32_t bits) {  // 16 bits -> 16 bytes of 16 or 0
    const __m128i spread = _mm_shuffle_epi8(
        _mm_set1_epi16(short(bits)), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i mask = _mm_set1_epi64x(int64_t(0x8040201008040201));
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, mask), mask);
    return _mm_and_si128(set, _mm_set1_epi8(16));
  }
};
#else
struct Bytes {  // portable: one byte at a time
  int8_t v[32];
  static Bytes load(const uint8_t* p) {
    Bytes b;
    std::memcpy(b.v, p, 32);
    return b;
  }
  static Bytes nibbles(const uint8_t* p) {
    Bytes b;
    for (int j = 0; j < 16; ++j) b.v[j] = int8_t(p[j] & 15), b.v[j + 16] = int8_t(p[j] >> 4);
    return b;
  }
  static Bytes bits16(uint32_t bits) {
    Bytes b;
    for (int j = 0; j < 32; ++j) b.v[j] = int8_t(((bits >> j) & 1) << 4);
    return b;
  }
  Bytes bits(int shift, int mask) const {
    Bytes b;
    for (int j = 0; j < 32; ++j) b.v[j] = int8_t((uint8_t(v[j]) >> shift) & mask);
    return b;
  }
  Bytes shl4() const {
    Bytes b;
    for (int j = 0; j < 32; ++j) b.v[j] = int8_t(v[j] << 4);
    return b;
  }
  Bytes operator|(const Bytes& o) const {
    Bytes b;
    for (int j = 0; j < 32; ++j) b.v[j] = int8_t(v[j] | o.v[j]);
    return b;
  }
  Bytes minus(int s) const {
    Bytes b;
    for (int j = 0; j < 32; ++j) b.v[j] = int8_t(v[j] - s);
    return b;
  }
  void widen(Values& q) const {
    for (int c = 0; c < kVecs; ++c) q[c] = Vec::load(v + c * Vec::W);
  }
};
#endif

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Q4_0 {
  static constexpr int kType = 2, kBytes = 18, kGroups = 1;
  static constexpr bool kHasMin = true;
  struct Block {
    const uint8_t* b;
    float d;
    explicit Block(const uint8_t* p) : b(p), d(half_at(p)) {}
    void group(int, Values& q, float& m) const {
      Vec::nibbles(b + 2, q);
      scale(q, d);
      m = -8.0f * d;
    }
  };
};

struct Q4_1 {
  static constexpr int kType = 3, kBytes = 20, kGroups = 1;
  static constexpr bool kHasMin = true;
  struct Block {
    const uint8_t* b;
    float d;
    explicit Block(const uint8_t* p) : b(p), d(half_at(p)) {}
    void group(int, Values& q, float& m) const {
      Vec::nibbles(b + 4, q);
      scale(q, d);
      m = half_at(b + 2);
    }
  };
};

// Q5_0 and Q5_1: `kMin` says whether the block holds m (Q5_1) or m = -16 d (Q5_0).
template <int Type, int NBytes, bool kMin>
struct Q5 {
  static constexpr int kType = Type, kBytes = NBytes, kGroups = 1;
  static constexpr bool kHasMin = true;
  struct Block {
    const uint8_t* b;
    float d;
    explicit Block(const uint8_t* p) : b(p), d(half_at(p)) {}
    void group(int, Values& q, float& m) const {
      const uint8_t* qh = b + (kMin ? 4 : 2);
      (Bytes::nibbles(qh + 4) | Bytes::bits16(u32_at(qh))).widen(q);
      scale(q, d);
      m = kMin ? half_at(b + 2) : -16.0f * d;
    }
  };
};
using Q5_0 = Q5<6, 22, false>;
using Q5_1 = Q5<7, 24, true>;

struct Q8_0 {
  static constexpr int kType = 8, kBytes = 34, kGroups = 1;
  static constexpr bool kHasMin = false;
  struct Block {
    const uint8_t* b;
    float d;
    explicit Block(const uint8_t* p) : b(p), d(half_at(p)) {}
    void group(int, Values& q, float& m) const {
      for (int c = 0; c < kVecs; ++c)
        q[c] = Vec::load(reinterpret_cast<const int8_t*>(b + 2) + c * Vec::W);
      scale(q, d);
      m = 0.0f;
    }
  };
};

// Q4_K and Q5_K (`kBits` 4 or 5): a super-block of 8 groups, each with 6-bit scale sc and min mn
// (ggml's get_scale_min_k4), times the block's d and dmin.
template <int Type, int NBytes, int kBits>
struct QK {
  static constexpr int kType = Type, kBytes = NBytes, kGroups = 8;
  static constexpr bool kHasMin = true;
  struct Block {
    const uint8_t* qh;  // Q5_K's 5th bits
    const uint8_t* qs;
    float d[8], m[8];
    explicit Block(const uint8_t* p) : qh(p + 16), qs(p + 16 + (kBits == 5 ? 32 : 0)) {
      const float dd = half_at(p), dmin = half_at(p + 2);
      const uint8_t* s = p + 4;
      for (int j = 0; j < 4; ++j) {
        d[j] = dd * float(s[j] & 63);
        m[j] = -(dmin * float(s[j + 4] & 63));
        d[j + 4] = dd * float((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        m[j + 4] = -(dmin * float((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4)));
      }
    }
    void group(int j, Values& q, float& mn) const {
      const Bytes low = Bytes::load(qs + 32 * (j / 2)).bits(4 * (j % 2), 15);
      if (kBits == 5)
        (low | Bytes::load(qh).bits(j, 1).shl4()).widen(q);
      else
        low.widen(q);
      scale(q, d[j]);
      mn = m[j];
    }
  };
};
using Q4_K = QK<12, 144, 4>;
using Q5_K = QK<13, 176, 5>;

// Q6_K: element t (0..127) of half h takes low bits ql[64 h + t % 64] >> 4 (t / 64) & 15 and
// high bits qh[32 h + t % 32] >> 2 (t / 32) & 3; each 16 elements have their int8 scale.
struct Q6_K {
  static constexpr int kType = 14, kBytes = 210, kGroups = 8;
  static constexpr bool kHasMin = false;
  struct Block {
    const uint8_t* b;
    float d[16];
    explicit Block(const uint8_t* p) : b(p) {
      const float dd = half_at(p + 208);
      for (int j = 0; j < 16; ++j) d[j] = dd * float(int8_t(p[192 + j]));
    }
    void group(int g, Values& q, float& m) const {
      const int h = g / 4, s = g % 4;
      const Bytes low = Bytes::load(b + 64 * h + 32 * (s % 2)).bits(4 * (s / 2), 15);
      const Bytes high = Bytes::load(b + 128 + 32 * h).bits(2 * s, 3).shl4();
      (low | high).minus(32).widen(q);
      for (int c = 0; c < kVecs; ++c)  // lanes c W .. c W + W - 1 of 32: scale 2 g + c W / 16
        q[c] = Vec::mul(q[c], Vec::set1(d[2 * g + int(c * Vec::W / 16)]));
      m = 0.0f;
    }
  };
};

// f(F{}) for the format F of ggml type `type` (f's status), or 3 for a type it does not know:
// the one switch over the block formats, for each GEMM that runs them.
template <typename Fn>
int with_format(int type, const Fn& f) {
  switch (type) {
    case Q4_0::kType: return f(Q4_0{});
    case Q4_1::kType: return f(Q4_1{});
    case Q5_0::kType: return f(Q5_0{});
    case Q5_1::kType: return f(Q5_1{});
    case Q8_0::kType: return f(Q8_0{});
    case Q4_K::kType: return f(Q4_K{});
    case Q5_K::kType: return f(Q5_K{});
    case Q6_K::kType: return f(Q6_K{});
    default: return 3;
  }
}

}  // namespace gguf_gemm
