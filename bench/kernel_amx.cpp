// The library's AMX microkernel (cpu/amx/amx_micro.h over the real tile instructions) on blocks that
// stay in L1, every thread on its own: what the bf16 products reach without the rest of attention, to
// set against the register-only TDPBF16PS ceiling of the same run. With after_vector, each product
// follows a stretch of AVX-512 work (3,072 FMAs on a buffer of its own, as the softmax between
// attention's products) and only the products are timed (TSC): what the tile unit's ramp after vector
// work costs them. Compiled with the amx level's library flags; called only when the library runs AMX
// (it has asked Linux for the tile state).
#include <omp.h>
#include <x86intrin.h>

#include <cstdint>
#include <vector>

#include "bf16_blocks.h"
#include "cpu/amx/amx_micro.h"
#include "cpu/amx/real_tiles.h"
#include "cpu/avx512/pack_bf16.h"
#include "cpu/avx512/v512.h"
#include "cpu/math_bf16.h"

double amx_microkernel_probe(int threads, long iters, int m, int n, int k, bool hi_lo, bool after_vector) {
  using namespace flashback::cpu;
  using Micro = AmxMicro<RealTiles, V512, PackBf16>;
  using Math = MathBf16<Micro>; // the row padding of its packed operands and f32 blocks
  const double t0 = omp_get_wtime();
  double share = 0; // the threads' mean seconds in the products
#pragma omp parallel num_threads(threads)
  {
    Bf16Blocks<Math> blk(m, n, k);
    std::vector<F32Line> work(after_vector ? 512 : 0);
    const unsigned long long tsc0 = __rdtsc();
    unsigned long long in_products = 0;
    Micro::begin();
    // S and dP start from zero; the products with P and dS accumulate onto C (O, dV, dK, dQ)
    for (long i = 0; i < iters; ++i) {
      if (after_vector)
        for (F32Line& l : work) { // 6 dependent FMAs per vector, 512 vectors
          __m512 x = _mm512_load_ps(l.x);
          for (int j = 0; j < 6; ++j) x = _mm512_fmadd_ps(x, _mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
          _mm512_store_ps(l.x, x);
        }
      const unsigned long long t = __rdtsc();
      Micro::gemm(m, n, k, blk.pa(), blk.pl(hi_lo), blk.lda, blk.pb(), blk.ldb, blk.pc(), blk.ldc, hi_lo && i > 0,
                  nullptr);
      in_products += __rdtsc() - t;
    }
    Micro::end();
    const double seconds = omp_get_wtime() - t0;
#pragma omp atomic
    share += static_cast<double>(in_products) / static_cast<double>(__rdtsc() - tsc0) * seconds / threads;
  }
  return 2.0 * m * n * k * (hi_lo ? 2 : 1) * static_cast<double>(iters) * threads / share;
}
