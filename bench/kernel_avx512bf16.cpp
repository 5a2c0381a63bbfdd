// The library's vdpbf16ps microkernel (cpu/dot_bf16_micro.h over AVX512_BF16) on blocks that stay in
// L1, every thread on its own: what the bf16 products reach without the rest of attention, to set
// against the register-only vdpbf16ps ceiling of the same run. Compiled with the avx512bf16 level's
// library flags; called only when the CPU has AVX512_BF16.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/avx512/pack_bf16.h"
#include "cpu/avx512/v512.h"
#include "cpu/avx512bf16/bf16_words.h"
#include "cpu/dot_bf16_micro.h"
#include "cpu/math_bf16.h"

double dot_microkernel_probe(int threads, long iters, int m, int n, int k, bool hi_lo) {
  using namespace flashback::cpu;
  using Micro = DotBf16Micro<V512, Bf16Words, PackBf16>;
  using Math = MathBf16<Micro>; // the row padding of its packed operands and f32 blocks
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    // C [m][n] f32 += (A + A_lo) B: A [m][k] bf16, B in VNNI pairs [k/2][2n], each row one cache line
    // longer, as the library's packed operands and f32 blocks are (math_bf16.h: kPad, kPadF); 1.0 and
    // 2^-9 in bf16 (0x3f80, 0x3b00), so nothing grows without bound.
    const int64_t lda = Math::a_ld(k), ldb = 2 * n + Math::kPad, ldc = n + Math::kPadF;
    struct alignas(64) Line {
      uint16_t x[32];
    };
    std::vector<Line> a(static_cast<size_t>(m * lda / 32 + 1)), lo(a.size());
    std::vector<Line> b(static_cast<size_t>(k / 2 * ldb / 32 + 1));
    for (Line& l : a) std::fill(l.x, l.x + 32, uint16_t{0x3f80});
    for (Line& l : lo) std::fill(l.x, l.x + 32, uint16_t{0x3b00});
    for (Line& l : b) std::fill(l.x, l.x + 32, uint16_t{0x3f80});
    struct alignas(64) FLine {
      float x[16];
    };
    std::vector<FLine> c(static_cast<size_t>(m * ldc / 16 + 1));
    auto* pa = reinterpret_cast<const bf16*>(a.data());
    auto* pl = hi_lo ? reinterpret_cast<const bf16*>(lo.data()) : nullptr;
    auto* pb = reinterpret_cast<const bf16*>(b.data());
    for (long i = 0; i < iters; ++i)
      Micro::gemm(m, n, k, pa, pl, lda, pb, ldb, reinterpret_cast<float*>(c.data()), ldc, i > 0, nullptr);
  }
  return 2.0 * m * n * k * (hi_lo ? 2 : 1) * static_cast<double>(iters) * threads / (omp_get_wtime() - t0);
}
