// The library's vdpbf16ps microkernel (cpu/dot_bf16_micro.h over AVX512_BF16) on blocks that stay in
// L1, every thread on its own: what the bf16 products reach without the rest of attention, to set
// against the register-only vdpbf16ps ceiling of the same run. Compiled with the avx512bf16 level's
// library flags; called only when the CPU has AVX512_BF16.
#include <omp.h>

#include "bf16_blocks.h"
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
    Bf16Blocks<Math> blk(m, n, k);
    for (long i = 0; i < iters; ++i)
      Micro::gemm(m, n, k, blk.pa(), blk.pl(hi_lo), blk.lda, blk.pb(), blk.ldb, blk.pc(), blk.ldc, i > 0, nullptr);
  }
  return 2.0 * m * n * k * (hi_lo ? 2 : 1) * static_cast<double>(iters) * threads / (omp_get_wtime() - t0);
}
