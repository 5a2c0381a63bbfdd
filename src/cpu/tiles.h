// Tile sizes: a small constexpr function of (ISA, head dims, pass), unit-tested in tests/cpu/tiles_test.cpp.
// The tests derive their sequence-length sweeps (1, BM-1, BM, BM+1, ...) from it.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/kernels.h"

namespace flashback::cpu {

constexpr Tiles choose_tiles(Isa isa, int64_t head_dim, int64_t head_dim_v, bool backward) {
  (void)head_dim;
  (void)head_dim_v;
  if (isa == Isa::scalar) return {32, 32};
  // AVX2 and AVX-512 (measured on Zen 4, D = 64 and 128, one thread, min of 5; see BENCHMARKS.md):
  // forward 64 x 64: the Q^T panel (D x 64 floats, 32 KiB at D = 128) is reused by every key block;
  //   BM = 96 or 128 drops to 60-70% of peak.
  // backward 128 x 64: the dK/dV/dQ GEMMs run over k = 128 query rows, halving their C-tile
  //   traffic; 64 x 64 measured 76-79%, 128 x 64 81-88%, 192 x 64 80-91% (more scratch, no gain).
  return backward ? Tiles{128, 64} : Tiles{64, 64};
}

static_assert(choose_tiles(Isa::scalar, 64, 64, false).bm > 0);
static_assert(choose_tiles(Isa::avx512, 128, 128, true).bm % 16 == 0 && choose_tiles(Isa::avx512, 128, 128, true).bn % 16 == 0);

} // namespace flashback::cpu
