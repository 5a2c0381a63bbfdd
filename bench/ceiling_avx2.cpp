// Compiled with -mavx2 -mfma only; called only when the CPU has AVX2 and FMA.
#include <immintrin.h>
#include <omp.h>

// 12 independent accumulators: 2 FMA pipes x 4 cycles latency needs 8; 12 fit the 16 registers.
double fma_probe_avx2(int threads, long iters) {
  double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m256 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.001f * static_cast<float>(i));
    const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
    }
    __m256 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    sink += lanes[0];
  }
  const double t = omp_get_wtime() - t0;
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 8 * 12 * static_cast<double>(iters) * threads / t;
}
