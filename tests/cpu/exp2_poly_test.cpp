// The vector exp2's polynomial (cpu/exp2_poly.h) in the f32 Horner steps the kernels take (one FMA
// each): its relative error over f32 arguments in [-1/2, 1/2], and 2^0 = 1 exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/exp2_poly.h"

namespace {

using flashback::cpu::kExp2Poly;
using flashback::cpu::kExp2Terms;

float poly(float f) {
  float p = kExp2Poly[0];
  for (int i = 1; i < kExp2Terms; ++i) p = std::fma(p, f, kExp2Poly[i]);
  return p;
}

TEST(Exp2Poly, ExactAtZero) {
  EXPECT_EQ(poly(0.0f), 1.0f);
  EXPECT_EQ(poly(-0.0f), 1.0f);
}

// Every 61st f32 from 0 to 1/2 in magnitude, both signs (2.21e-7 over all of them: exp2_poly.h).
TEST(Exp2Poly, RelativeErrorOverHalfAnOctave) {
  double worst = 0;
  float worst_at = 0;
  const uint32_t half = 0x3F000000u; // 0.5f
  for (uint32_t u = 0; u <= half; u += 61)
    for (uint32_t sign : {0u, 0x80000000u}) {
      float f;
      const uint32_t bits = u | sign;
      std::memcpy(&f, &bits, sizeof f);
      const double e = std::abs(static_cast<double>(poly(f)) / std::exp2(static_cast<double>(f)) - 1.0);
      if (e > worst) {
        worst = e;
        worst_at = f;
      }
    }
  EXPECT_LE(worst, 2.21e-7) << "at " << worst_at;
  EXPECT_GT(worst, 1e-7) << "at " << worst_at; // the f32 steps' rounding shows: the loop saw the range
}

} // namespace
