// Probe for amx_gemm's tile configuration (test_amx_gemm.py): configured from a function
// compiled without the AMX target, so that amx_gemm::configure_full() runs out of line, then
// used from one compiled with it. tessera_probe_tiles() returns 1 when tile 0 held the
// configured 16 rows of 64 bytes (zeroed, then stored), 0 when the CPU lends no tiles.
#include "../../../worker_service/models/amx_gemm.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
__attribute__((noinline)) static int zero_and_store(float* out) {
  _tile_zero(0);
  _tile_stored(0, out, 64);
  _tile_release();
  return 1;
}
#pragma GCC pop_options

extern "C" int tessera_probe_tiles() {
  if (!amx_gemm::enable()) return 0;
  alignas(64) float out[256];
  for (float& x : out) x = 1.f;
  amx_gemm::configure_full();
  zero_and_store(out);
  for (float x : out)
    if (x != 0.f) return 2;
  return 1;
}
