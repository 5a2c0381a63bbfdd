// The operands of a bf16 microkernel probe (kernel_amx.cpp, kernel_avx512bf16.cpp): C [m][n] f32 +=
// (A + A_lo) B with A [m][k] bf16 and B in VNNI pairs [k/2][2n], 64-byte aligned and each row one cache
// line longer, as the library's packed operands and f32 blocks are (math_bf16.h: kPad, kPadF, over
// `Math`); 1.0 and 2^-9 in bf16, so nothing grows without bound. Plain C++ (no intrinsics) and internal
// linkage: each probe compiles it with its own ISA's flags.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/half.h"

namespace {

struct alignas(64) Bf16Line {
  uint16_t x[32];
};
struct alignas(64) F32Line {
  float x[16];
};

template <class Math>
struct Bf16Blocks {
  using bf16 = flashback::cpu::bf16;
  int64_t lda, ldb, ldc;
  std::vector<Bf16Line> a, lo, b;
  std::vector<F32Line> c;
  Bf16Blocks(int64_t m, int64_t n, int64_t k)
      : lda(Math::a_ld(k)), ldb(2 * n + Math::kPad), ldc(n + Math::kPadF),
        a(static_cast<size_t>(m * lda / 32 + 1)), lo(a.size()), b(static_cast<size_t>(k / 2 * ldb / 32 + 1)),
        c(static_cast<size_t>(m * ldc / 16 + 1)) {
    for (Bf16Line& l : a) std::fill(l.x, l.x + 32, uint16_t{0x3f80});
    for (Bf16Line& l : lo) std::fill(l.x, l.x + 32, uint16_t{0x3b00});
    for (Bf16Line& l : b) std::fill(l.x, l.x + 32, uint16_t{0x3f80});
  }
  const bf16* pa() const { return reinterpret_cast<const bf16*>(a.data()); }
  const bf16* pl(bool hi_lo) const { return hi_lo ? reinterpret_cast<const bf16*>(lo.data()) : nullptr; }
  const bf16* pb() const { return reinterpret_cast<const bf16*>(b.data()); }
  float* pc() { return c[0].x; }
};

} // namespace
