// The AVX2 microkernel (8-lane ymm, 6 x 16 register tiles); called only when the CPU has AVX2 and FMA.
#include "cpu/avx2/v256.h"
#include "kernel_probe.h"

double f32_microkernel_probe_avx2(int threads, long iters, int m, int n, int k) {
  return microkernel_probe<flashback::cpu::V256>(threads, iters, m, n, k);
}
