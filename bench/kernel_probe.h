// The library's f32 microkernel (cpu/micro_f32.h over an ISA's vector type V) on blocks that stay in
// L1, every thread on its own block: what the kernel reaches without the rest of attention (softmax,
// packing, L2 traffic), to set against the register-only FMA ceiling of the same run. Included by one
// translation unit per ISA (kernel_avx512.cpp, kernel_avx2.cpp), compiled with that ISA's library flags.
#pragma once

#include <omp.h>

#include <vector>

#include "cpu/micro_f32.h"

template <class V>
double microkernel_probe(int threads, long iters, int m, int n, int k) {
  using Micro = flashback::cpu::MicroF32<V>;
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    // C = A B with A [m][k] row-major (as K for S^T = K Q^T), B [k][n]; accumulate after the first.
    std::vector<float> a(static_cast<size_t>(m) * k, 0.001f), b(static_cast<size_t>(k) * n, 0.002f),
        c(static_cast<size_t>(m) * n, 0.0f);
    for (long i = 0; i < iters; ++i)
      Micro::gemm(m, n, k, a.data(), k, 1, b.data(), n, c.data(), n, i > 0, nullptr);
  }
  return 2.0 * m * n * k * static_cast<double>(iters) * threads / (omp_get_wtime() - t0);
}
