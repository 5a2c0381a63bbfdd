// The register blocking of the avx512 kernels (V512), shared with their emulation on AVX2
// (emulated/v512_pairs.h) so that both block every product alike. No intrinsics: included anywhere.
#pragma once

namespace flashback::cpu {

struct V512Shape {
  static constexpr int lanes = 16;
  static constexpr int kRegisters = 32;
  // 6 x 4 zmm of C: 24 accumulators cover 2 FMA ports x 4 cycles of latency three times over, and
  // a row of B (4 loads) plus 6 broadcasts per k stay well under the 2 loads per cycle.
  static constexpr int kMR = 6, kNV = 4;
  // Panels of C up to 5 vectors wide, where n would leave a panel of 1 vector beside the 4-wide ones
  // (n = 80, 144, 208): 5 rows x 5 vectors also hold 25 accumulators, a row of B and a broadcast
  // (micro_f32.h, for_each_panel).
  static constexpr int kNVWide = 5;
};

} // namespace flashback::cpu
