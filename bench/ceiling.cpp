#include "ceiling.h"

#include <algorithm>
#include <string>

#include "cpu/isa.h"

double fma_probe_avx512(int threads, long iters);
double fma_probe_avx2(int threads, long iters);
double dpbf16_probe(int threads, long iters);
double amx_probe(int threads, long iters);
double f32_microkernel_probe_avx512(int threads, long iters, int m, int n, int k);
double f32_microkernel_probe_avx2(int threads, long iters, int m, int n, int k);
double amx_microkernel_probe(int threads, long iters, int m, int n, int k, bool hi_lo, bool after_vector);
double dot_microkernel_probe(int threads, long iters, int m, int n, int k, bool hi_lo);

namespace {

// What the probes may run: the library's own probe of the CPU and of what the OS saves and permits
// (cpu/isa.cpp: XCR0, and Linux's permission for the AMX tile state), which cpuid alone does not tell
// (__builtin_cpu_supports, where clang 14 also knows no "amx-tile").
bool machine_has(flashback::cpu::Isa isa) { return flashback::cpu::machine_isa() >= isa; }

// Calibrates a probe to about `seconds`, then keeps the best of three (the machine is shared).
double best_of_three(double (*probe)(int, long), int threads, double seconds, double flops_per_iter) {
  long iters = 1 << 20;
  const double rate = probe(threads, iters);
  iters = std::max<long>(iters, static_cast<long>(seconds / 3 * rate / flops_per_iter));
  double best = 0;
  for (int i = 0; i < 3; ++i) best = std::max(best, probe(threads, iters));
  return best;
}

// A microkernel probe's FLOP/s over about `seconds`: a short calibration run, then one timed run
// (medians, not best of three: the kernels are compared with attention's medians).
template <class Probe>
double calibrated(Probe&& probe, double seconds, double flop_per_iter) {
  const long calib = 1000;
  const double rate = probe(calib);
  return probe(std::max<long>(calib, static_cast<long>(seconds * rate / flop_per_iter)));
}

} // namespace

double dpbf16_ceiling_flops(int threads, double seconds) {
  if (!machine_has(flashback::cpu::Isa::avx512bf16)) return 0;
  return best_of_three(&dpbf16_probe, threads, seconds, 2.0 * 32 * 12 * threads);
}

double amx_ceiling_flops(int threads, double seconds) {
  if (!machine_has(flashback::cpu::Isa::amx)) return 0;
  return best_of_three(&amx_probe, threads, seconds, 2.0 * 16 * 16 * 32 * 4 * threads);
}

double f32_microkernel_flops(int threads, double seconds, int m, int n, int k) {
#if defined(FLASHBACK_BENCH_KERNEL)
  // The kernel the library runs in f32 here, of the ISA the FMA ceiling is measured with.
  const std::string isa = fma_ceiling_isa();
  if (isa == "none") return 0;
  auto probe = isa == "avx512" ? &f32_microkernel_probe_avx512 : &f32_microkernel_probe_avx2;
  return calibrated([&](long iters) { return probe(threads, iters, m, n, k); }, seconds, 2.0 * m * n * k * threads);
#else
  (void)threads, (void)seconds, (void)m, (void)n, (void)k;
  return 0;
#endif
}

double amx_microkernel_flops(int threads, double seconds, int m, int n, int k, bool hi_lo, bool after_vector) {
#if defined(FLASHBACK_BENCH_KERNEL)
  if (!machine_has(flashback::cpu::Isa::amx)) return 0;
  auto probe = [&](long iters) { return amx_microkernel_probe(threads, iters, m, n, k, hi_lo, after_vector); };
  return calibrated(probe, seconds, 2.0 * m * n * k * (hi_lo ? 2 : 1) * threads);
#else
  (void)threads, (void)seconds, (void)m, (void)n, (void)k, (void)hi_lo, (void)after_vector;
  return 0;
#endif
}

double dot_microkernel_flops(int threads, double seconds, int m, int n, int k, bool hi_lo) {
#if defined(FLASHBACK_BENCH_KERNEL)
  if (!machine_has(flashback::cpu::Isa::avx512bf16)) return 0;
  auto probe = [&](long iters) { return dot_microkernel_probe(threads, iters, m, n, k, hi_lo); };
  return calibrated(probe, seconds, 2.0 * m * n * k * (hi_lo ? 2 : 1) * threads);
#else
  (void)threads, (void)seconds, (void)m, (void)n, (void)k, (void)hi_lo;
  return 0;
#endif
}

const char* fma_ceiling_isa() {
  if (machine_has(flashback::cpu::Isa::avx512)) return "avx512";
  if (machine_has(flashback::cpu::Isa::avx2)) return "avx2";
  return "none";
}

double fma_ceiling_flops(int threads, double seconds) {
  const std::string isa = fma_ceiling_isa();
  if (isa == "none") return 0;
  const bool avx512 = isa == "avx512";
  return best_of_three(avx512 ? &fma_probe_avx512 : &fma_probe_avx2, threads, seconds,
                       2.0 * (avx512 ? 16 : 8) * 12 * threads);
}
