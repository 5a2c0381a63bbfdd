// The benchmark suite: the FMA ceiling, flashback's forward and backward, and the materialized BLAS
// baseline, in one run. bench/report.py runs it and prints GFLOP/s, the fraction of the ceiling and
// the ratios (see BENCHMARKS.md). Each benchmark reports `flop` (FlashAttention's convention: forward
// 4 B Hq Sq Sk D, halved when causal; backward 2.5x that) per iteration; rates come from real time.
#include <benchmark/benchmark.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "blas_baseline.h"
#include "ceiling.h"
#include "cpu/isa.h"
#include "cpu/kernels.h" // kernels_for: the kernels of a case
#include "flashback/flashback.hpp"
#include "line_aligned.h"
#include "safetensors.h" // f32_to_bf16, f32_to_f16

namespace {

struct Case {
  const char* name;
  int64_t batch, heads, seqlen, head_dim;
  bool causal;
  bool with_blas; // also run the BLAS baseline on this shape
  flashback::DType dtype = flashback::DType::f32;
  int64_t shift = 0; // floats every tensor starts past a cache line (f32 cases only)
};

// Issue 3's shapes: the targets (B=1, Hq=Hk=16, S=4096), causal, the scaling step to 8192, and a
// small-problem shape. Issue 4's: bf16 and f16 at the target shape, and bf16 causal (how training
// runs it; not a target).
const Case kCases[] = {
    {"B1_H16_S4096_D128", 1, 16, 4096, 128, false, true},
    {"B1_H16_S4096_D64", 1, 16, 4096, 64, false, true},
    {"B1_H16_S4096_D128_causal", 1, 16, 4096, 128, true, false},
    {"B1_H16_S4096_D64_causal", 1, 16, 4096, 64, true, false},
    {"B1_H16_S8192_D128", 1, 16, 8192, 128, false, false},
    {"B1_H16_S8192_D64", 1, 16, 8192, 64, false, false},
    {"B8_H16_S512_D128", 8, 16, 512, 128, false, true},
    {"B8_H16_S512_D64", 8, 16, 512, 64, false, true},
    {"B1_H16_S4096_D128_bf16", 1, 16, 4096, 128, false, false, flashback::DType::bf16},
    {"B1_H16_S4096_D64_bf16", 1, 16, 4096, 64, false, false, flashback::DType::bf16},
    {"B1_H16_S4096_D128_bf16_causal", 1, 16, 4096, 128, true, false, flashback::DType::bf16},
    {"B1_H16_S4096_D64_bf16_causal", 1, 16, 4096, 64, true, false, flashback::DType::bf16},
    {"B1_H16_S4096_D128_f16", 1, 16, 4096, 128, false, false, flashback::DType::f16},
    {"B1_H16_S4096_D64_f16", 1, 16, 4096, 64, false, false, flashback::DType::f16},
    // Rows 16 bytes past a cache line, as numpy's and malloc's allocations give: what input that is not
    // 64-byte aligned costs (the kernels load such rows in place, across cache lines).
    {"B1_H16_S4096_D128_shift4", 1, 16, 4096, 128, false, false, flashback::DType::f32, 4},
    {"B1_H16_S4096_D64_shift4", 1, 16, 4096, 64, false, false, flashback::DType::f32, 4},
};

int threads() {
  const char* env = std::getenv("FLASHBACK_NUM_THREADS");
  return env && std::atoi(env) > 0 ? std::atoi(env) : omp_get_max_threads();
}

double forward_flop(const Case& c) {
  return 4.0 * c.batch * c.heads * c.seqlen * c.seqlen * c.head_dim * (c.causal ? 0.5 : 1.0);
}

// 64-byte aligned, as a framework's tensors are: a plain std::vector of this size comes from mmap at
// 16 bytes past a page, which would put every row of D floats across cache lines.
using Floats = std::vector<float, flashback::LineAligned<float>>;

// Random contiguous BHSD inputs and outputs of one case, in its dtype (lse f32).
struct Tensors {
  int64_t n, rows;
  Floats q, k, v, o, lse, dout, dq, dk, dv; // f32 storage, or 16-bit elements in their first half
  explicit Tensors(const Case& c)
      : n(c.batch * c.heads * c.seqlen * c.head_dim), rows(c.batch * c.heads * c.seqlen), q(n + c.shift),
        k(n + c.shift), v(n + c.shift), o(n + c.shift), lse(rows), dout(n + c.shift), dq(n + c.shift),
        dk(n + c.shift), dv(n + c.shift) {
    std::mt19937 rng(42);
    std::normal_distribution<float> dist;
    for (auto* t : {&q, &k, &v, &dout}) {
      for (float& x : *t) x = dist(rng);
      if (c.dtype == flashback::DType::f32) continue;
      auto* half = reinterpret_cast<uint16_t*>(t->data());
      for (int64_t i = 0; i < n; ++i) // in place: element i's two bytes never pass the floats still unread
        half[i] = c.dtype == flashback::DType::bf16 ? flashback::safetensors::f32_to_bf16((*t)[i])
                                                      : flashback::safetensors::f32_to_f16((*t)[i]);
    }
  }
};

flashback::TensorView view(const Case& c, Floats& t) {
  return flashback::TensorView::bhsd(t.data() + c.shift, c.dtype, c.batch, c.heads, c.seqlen, c.head_dim);
}

void set_counters(benchmark::State& state, double flop) {
  state.counters["flop"] = flop;
  state.counters["threads"] = threads();
}

// The guest's stolen time so far, in ms (/proc/stat's first line, all CPUs: the eighth number, in clock
// ticks); -1 where it cannot be read.
double steal_ms() {
  std::ifstream f("/proc/stat");
  std::string cpu;
  long long user, nice, system, idle, iowait, irq, softirq, steal;
  if (!(f >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal) || cpu != "cpu") return -1;
  return 1e3 * static_cast<double>(steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Times `run` (one repetition), with the FMA ceiling measured for 0.3 s just before: the guest's
// speed moves by up to 1.4x within minutes (the host's other tenants), so report.py divides each
// repetition's rate by the ceiling of the same moment rather than by one probe minutes away.
// Where the library runs the case on AMX, the TDPBF16PS ceiling too (`amx`): its rate moves independently
// of the FMA probe's on these guests (1.1 - 2.8 TFLOP/s per core within minutes).
// The probes come before the warm-up run (`warm_up`), which stands between them and the timed run: a
// run right after them is slower (the Xeon with AMX, bf16 backward at B = 1, Hq = 16, S = 4096, D =
// 128: 232 - 233 ms against 223 - 225 ms without the probes, two runs of 5 repetitions each).
// It also records `steal_ms` (steal_ms() over the timed run): time the hypervisor gave something else,
// which no probe before the run can see.
template <class Run>
void timed(benchmark::State& state, Run&& run, bool amx = false, bool warm_up = true) {
  const double ceiling = fma_ceiling_flops(threads(), 0.3);
  const double amx_ceiling = amx ? amx_ceiling_flops(threads(), 0.3) : 0;
  if (warm_up) run();
  const double steal_before = steal_ms();
  for (auto _ : state) run();
  const double steal_after = steal_ms();
  state.counters["steal_ms"] = steal_before < 0 || steal_after < 0 ? -1.0 : steal_after - steal_before;
  state.counters["adjacent_ceiling_flops"] = ceiling;
  if (amx) state.counters["adjacent_amx_ceiling_flops"] = amx_ceiling;
}

// Whether the library runs AMX here (it has then asked Linux for the tile state).
bool library_runs_amx() { return std::string(flashback::cpu_isa()) == "amx"; }

// Whether the library runs a case on AMX tiles (bf16, and f16 from head dims of kF16TilesMinHeadDim):
// the kernel set it chooses for the case.
bool on_amx(const Case& c) {
  using namespace flashback::cpu;
  return library_runs_amx() &&
         kernels_for(active_isa(), static_cast<flashback::core::DType>(c.dtype), c.head_dim).isa == Isa::amx;
}

void set_label(benchmark::State& state, const Case& c) {
  state.SetLabel(std::string(flashback::cpu_isa()) + (c.dtype == flashback::DType::f32    ? " f32"
                                                      : c.dtype == flashback::DType::bf16 ? " bf16"
                                                                                          : " f16"));
}

// The workspace of a call, allocated once outside the timed loop, as `flashback bench` and a framework's
// caching allocator give it: the library's own allocation, when none is passed, is a fresh mmap of up to
// 100 MiB per call for half precision on AMX (the packed operands), whose page faults it would time.
struct Space {
  Floats buf;
  explicit Space(size_t bytes) : buf(bytes / sizeof(float) + 1) {}
  flashback::Workspace get() { return {buf.data(), buf.size() * sizeof(float)}; }
};

void flashback_forward(benchmark::State& state, const Case& c) {
  Tensors t(c);
  flashback::Params p;
  p.causal = c.causal;
  p.num_threads = threads();
  const auto lse = flashback::TensorView::rows(t.lse.data(), c.batch, c.heads, c.seqlen);
  Space ws(flashback::forward_workspace_size(view(c, t.q), view(c, t.k), view(c, t.v), view(c, t.o), lse, p));
  auto run = [&] { flashback::forward(view(c, t.q), view(c, t.k), view(c, t.v), view(c, t.o), lse, p, ws.get()); };
  timed(state, run, on_amx(c));
  set_counters(state, forward_flop(c));
  set_label(state, c);
}

void flashback_backward(benchmark::State& state, const Case& c) {
  Tensors t(c);
  flashback::Params p;
  p.causal = c.causal;
  p.num_threads = threads();
  const auto lse = flashback::TensorView::rows(t.lse.data(), c.batch, c.heads, c.seqlen);
  flashback::forward(view(c, t.q), view(c, t.k), view(c, t.v), view(c, t.o), lse, p);
  flashback::Gradients g;
  g.dq = view(c, t.dq);
  g.dk = view(c, t.dk);
  g.dv = view(c, t.dv);
  Space ws(flashback::backward_workspace_size(view(c, t.dout), view(c, t.q), view(c, t.k), view(c, t.v), view(c, t.o),
                                               lse, g, p));
  auto run = [&] {
    flashback::backward(view(c, t.dout), view(c, t.q), view(c, t.k), view(c, t.v), view(c, t.o), lse, g, p, ws.get());
  };
  timed(state, run, on_amx(c));
  set_counters(state, 2.5 * forward_flop(c));
  set_label(state, c);
}

BlasShape blas_shape(const Case& c) { return {c.batch, c.heads, c.seqlen, c.seqlen, c.head_dim, c.causal}; }

void blas_forward(benchmark::State& state, const Case& c) {
  Tensors t(c);
  blas_set_threads(threads());
  omp_set_num_threads(threads());
  BlasAttention blas(blas_shape(c));
  timed(state, [&] { blas.forward(t.q.data(), t.k.data(), t.v.data(), t.o.data(), t.lse.data()); });
  set_counters(state, forward_flop(c));
}

void blas_backward(benchmark::State& state, const Case& c) {
  Tensors t(c);
  blas_set_threads(threads());
  omp_set_num_threads(threads());
  BlasAttention blas(blas_shape(c));
  blas.forward(t.q.data(), t.k.data(), t.v.data(), t.o.data(), t.lse.data());
  auto run = [&] {
    blas.backward(t.dout.data(), t.q.data(), t.k.data(), t.v.data(), t.o.data(), t.lse.data(), t.dq.data(),
                  t.dk.data(), t.dv.data());
  };
  timed(state, run);
  set_counters(state, 2.5 * forward_flop(c));
}

// One iteration: the probe runs for about a second and reports its FLOP/s.
void fma_ceiling(benchmark::State& state) {
  double flops = 0;
  for (auto _ : state) flops = fma_ceiling_flops(threads(), 1.0);
  state.counters["ceiling_flops"] = flops;
  state.counters["threads"] = threads();
  state.SetLabel(fma_ceiling_isa());
}

// A benchmark this machine cannot run: reported as skipped (report.py leaves it out).
void skip(benchmark::State& state, const char* why) {
  state.SkipWithError(why);
  for (auto _ : state) {
  }
}

// The library's f32 microkernel alone, on L1-resident blocks of the forward's S^T = K Q^T shape
// (64 x 64 x D), one per thread: the part of the gap to the ceiling that is the kernel's.
void f32_microkernel(benchmark::State& state, int head_dim) {
  if (f32_microkernel_flops(1, 0.001, 64, 64, head_dim) == 0) return skip(state, "no AVX-512 or AVX2 here");
  double flops = 0;
  timed(state, [&] { flops = f32_microkernel_flops(threads(), 1.0, 64, 64, head_dim); }, false, false);
  state.counters["kernel_flops"] = flops;
  state.counters["threads"] = threads();
}

// The library's AMX microkernel alone, on L1-resident blocks of the forward's shapes at D = 128
// (64 x 128 x 128: S = Q K^T with A one bf16; P V with A = P as hi + lo), one per thread, next to the
// TDPBF16PS ceiling of the same moment; after_vector: S's shape, each product right after a stretch of
// AVX-512 work (the tile unit's ramp, as after attention's softmax; kernel_amx.cpp).
void amx_microkernel(benchmark::State& state, bool hi_lo, bool after_vector) {
  if (!library_runs_amx()) return skip(state, "the library does not run AMX here");
  double flops = 0;
  const double ceiling = amx_ceiling_flops(threads(), 0.3);
  for (auto _ : state) flops = amx_microkernel_flops(threads(), 1.0, 64, 128, 128, hi_lo, after_vector);
  state.counters["kernel_flops"] = flops;
  state.counters["adjacent_amx_ceiling_flops"] = ceiling;
  state.counters["threads"] = threads();
}

// The library's vdpbf16ps microkernel alone, on L1-resident blocks of the forward's shapes at D = 128
// (64 x 128 x 128: S = Q K^T with A one bf16; P V with A = P as hi + lo), one per thread, next to the
// vdpbf16ps ceiling of the same moment.
void dot_microkernel(benchmark::State& state, bool hi_lo) {
  if (dot_microkernel_flops(1, 0.001, 64, 128, 128, false) == 0) return skip(state, "no AVX512_BF16 here");
  double flops = 0;
  const double ceiling = dpbf16_ceiling_flops(threads(), 0.3);
  for (auto _ : state) flops = dot_microkernel_flops(threads(), 1.0, 64, 128, 128, hi_lo);
  state.counters["kernel_flops"] = flops;
  state.counters["adjacent_bf16_ceiling_flops"] = ceiling;
  state.counters["threads"] = threads();
}

// The bf16 product ceilings: vdpbf16ps, and AMX TDPBF16PS where the library runs AMX (it has asked
// Linux for the tile state). Skipped where the CPU lacks them.
void bf16_ceiling(benchmark::State& state, bool amx) {
  if (amx ? !library_runs_amx() : dpbf16_ceiling_flops(1, 0.01) == 0)
    return skip(state, amx ? "no AMX here" : "no AVX512_BF16 here");
  double flops = 0;
  for (auto _ : state) flops = amx ? amx_ceiling_flops(threads(), 1.0) : dpbf16_ceiling_flops(threads(), 1.0);
  state.counters["bf16_ceiling_flops"] = flops;
  state.counters["threads"] = threads();
}

double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

void configure(benchmark::internal::Benchmark* b) {
  const char* env = std::getenv("FLASHBACK_BENCH_REPS");
  const int reps = env && std::atoi(env) > 0 ? std::atoi(env) : 5;
  b->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(1)->Repetitions(reps);
  b->ComputeStatistics("min", min_of)->ComputeStatistics("max", max_of);
}

int register_all() {
  configure(benchmark::RegisterBenchmark("ceiling/fma_f32", fma_ceiling));
  configure(benchmark::RegisterBenchmark("kernel/f32_64x64x128", f32_microkernel, 128));
  configure(benchmark::RegisterBenchmark("kernel/f32_64x64x64", f32_microkernel, 64));
  configure(benchmark::RegisterBenchmark("ceiling/bf16_dot", bf16_ceiling, false));
  configure(benchmark::RegisterBenchmark("ceiling/bf16_amx", bf16_ceiling, true));
  configure(benchmark::RegisterBenchmark("kernel/bf16_dot_64x128x128", dot_microkernel, false));
  configure(benchmark::RegisterBenchmark("kernel/bf16_dot_64x128x128_hilo", dot_microkernel, true));
  configure(benchmark::RegisterBenchmark("kernel/bf16_amx_64x128x128", amx_microkernel, false, false));
  configure(benchmark::RegisterBenchmark("kernel/bf16_amx_64x128x128_hilo", amx_microkernel, true, false));
  configure(benchmark::RegisterBenchmark("kernel/bf16_amx_64x128x128_after_vector", amx_microkernel, false, true));
  for (const Case& c : kCases) {
    configure(benchmark::RegisterBenchmark((std::string("flashback/forward/") + c.name).c_str(), flashback_forward, c));
    configure(benchmark::RegisterBenchmark((std::string("flashback/backward/") + c.name).c_str(), flashback_backward, c));
    if (!c.with_blas) continue;
    configure(benchmark::RegisterBenchmark((std::string("blas/forward/") + c.name).c_str(), blas_forward, c));
    configure(benchmark::RegisterBenchmark((std::string("blas/backward/") + c.name).c_str(), blas_backward, c));
  }
  // The ceiling once more at the end: the report uses the higher of the two.
  configure(benchmark::RegisterBenchmark("ceiling/fma_f32_end", fma_ceiling));
  return 0;
}

const int registered = register_all();

} // namespace

BENCHMARK_MAIN();
