// The rule that chooses the vdpbf16ps kernels for bf16 at the avx512bf16 level (cpu/isa.h): the CPUs
// where they were measured faster than converting to f32, and not the others.
#include <gtest/gtest.h>

#include "cpu/isa.h"

namespace {

using flashback::cpu::bf16_dot_fast_on;

TEST(Isa, Bf16DotIsChosenWhereVdpbf16psOutrunsFma) {
  EXPECT_TRUE(bf16_dot_fast_on(true, 0x19));  // AMD Zen 4 (family 25): 2.0x the FMA rate in FLOP
  EXPECT_TRUE(bf16_dot_fast_on(true, 0x1A));  // AMD Zen 5 (family 26): 1.8x
  EXPECT_FALSE(bf16_dot_fast_on(true, 0x17)); // AMD Zen 2 (family 23): no AVX512_BF16
  EXPECT_FALSE(bf16_dot_fast_on(false, 6));   // Intel's Xeons (family 6): 0.5x
  EXPECT_FALSE(bf16_dot_fast_on(false, 0x19));
}

} // namespace
