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
  // AVX2 and AVX-512: see BENCHMARKS.md for the measurements behind these.
  return backward ? Tiles{64, 64} : Tiles{64, 64};
}

static_assert(choose_tiles(Isa::scalar, 64, 64, false).bm > 0);

} // namespace flashback::cpu
