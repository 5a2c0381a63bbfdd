// Compiled with -mavx512f only; called only when the CPU has AVX-512F.
#include <immintrin.h>
#include <omp.h>

// 12 independent accumulators: 2 FMA pipes x 4 cycles latency needs 8; 12 leaves slack.
double fma_probe_avx512(int threads, long iters) {
  double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
    }
    __m512 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
    sink += _mm512_reduce_add_ps(s);
  }
  const double t = omp_get_wtime() - t0;
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 16 * 12 * static_cast<double>(iters) * threads / t;
}
