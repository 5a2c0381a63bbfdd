// Compiled with -mavx512f -mavx512bf16; called only when the CPU has AVX512_BF16.
#include <immintrin.h>
#include <omp.h>

// vdpbf16ps: 32 bf16 multiply-adds into 16 f32 lanes; 12 independent accumulators as for the FMA probe.
double dpbf16_probe(int threads, long iters) {
  double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
    const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80)); // bf16 1.0
    const __m512bh c = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3800)); // bf16 2^-15
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], b, c);
    }
    __m512 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
    sink += _mm512_reduce_add_ps(s);
  }
  const double t = omp_get_wtime() - t0;
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 32 * 12 * static_cast<double>(iters) * threads / t;
}
