// The AVX-512 microkernel (16-lane zmm, 6 x 64 register tiles); called only when the CPU has AVX-512F.
#include "cpu/avx512/v512.h"
#include "kernel_probe.h"

double f32_microkernel_probe_avx512(int threads, long iters, int m, int n, int k) {
  return microkernel_probe<flashback::cpu::V512>(threads, iters, m, n, k);
}
