// Software prefetch for the kernels that stream a weight (or KV) from memory once per call.
// On the 2-core cloud machines measured, the hardware prefetchers fall far behind one core's
// loop over a weight it has not seen: a Q4_1 GEMV over the default model's 30 layers ran at
// 3 GB/s from memory (19.6 ms) against 7.0 ms from cache; asking for the bytes kAhead ahead
// of the loop brought it to 8.0 ms. Each kernel calls `ahead(p)` once per 64-128 bytes it
// reads at p.
#pragma once

#include <cstdint>

namespace prefetch {

constexpr int64_t kAhead = 2048;  // bytes: 512 measured 14.2 ms, 2048 8.0, 4096 9.4 (above)

inline void ahead(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + kAhead); }

}  // namespace prefetch
