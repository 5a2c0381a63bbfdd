// flashback bench (timing + a sampled check) and flashback check (every output against float64).
#include <omp.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "commands.h"
#include "host_tensor.h"
#include "reference.h"

namespace flashback::cli {

namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// --- Defaults: change them here ---------------------------------------------------------------------
// bench: ~10 s on the 2-core development machine: forward 4*2*16*2048^2*128 = 69 GFLOP, backward
// 172 GFLOP; 1 warm-up + 5 timed runs of each = 1.4 TFLOP, 7.4 s at the AVX-512 kernels' ~200 GFLOP/s,
// plus ~0.6 s for the sampled float64 check and ~0.5 s of setup. Faster kernels: raise batch.
ProblemFlags bench_defaults() {
  ProblemFlags f;
  f.batch = 2, f.heads = 16, f.seqlen = 2048, f.head_dim = 128;
  return f;
}
constexpr int64_t kBenchWarmup = 1, kBenchRepeats = 5;
// check: the whole float64 reference runs single-threaded, ~1 s for this shape (GQA, a length that is
// no multiple of a tile).
ProblemFlags check_defaults() {
  ProblemFlags f;
  f.batch = 2, f.heads = 8, f.kv_heads = 2, f.seqlen = 500, f.head_dim = 64;
  return f;
}

// Tolerance of every check: max|out - ref| <= tol * max|ref|, per output. f32 keeps ~7 digits through
// sums of Sk terms (error ~ sqrt(Sk) * 6e-8 relative); f16/bf16 outputs are rounded to 11/8 bits
// (5e-4 / 4e-3 relative) and their P and dS in the kernels may be too. Where the reference of dq or dk
// is 0 everywhere (see cancellation_size), the error is relative to the size of what cancels, at 1e-4.
double tolerance(fb_dtype dtype) {
  switch (dtype) {
    case FB_F32: return 1e-4;
    case FB_F16: return 5e-3;
    case FB_BF16: return 2e-2;
  }
  return 0;
}
constexpr const char* kToleranceRule =
    "max|out - ref| <= tol * max|ref| per output; tol = 1e-4 f32, 5e-3 f16, 2e-2 bf16; 1e-4 for lse (always f32); "
    "where the reference of dq or dk is all 0, 1e-4 * the size of what cancels there";

// The error of one output against the reference.
struct ErrorStats {
  std::string name;
  double tol = 0;
  double max_abs_err = 0, max_abs_ref = 0;
  int64_t count = 0;

  void add(double out, double ref) {
    ++count;
    double err;
    if (out == ref) err = 0; // also -inf == -inf: the lse of a row that sees no key
    else if (!std::isfinite(out) || !std::isfinite(ref)) err = std::numeric_limits<double>::infinity();
    else err = std::abs(out - ref);
    if (std::isnan(out)) err = std::numeric_limits<double>::infinity();
    max_abs_err = std::max(max_abs_err, err);
    if (std::isfinite(ref)) max_abs_ref = std::max(max_abs_ref, std::abs(ref));
  }
  void merge(const ErrorStats& o) {
    max_abs_err = std::max(max_abs_err, o.max_abs_err);
    max_abs_ref = std::max(max_abs_ref, o.max_abs_ref);
    count += o.count;
  }
  // Where the reference is all 0 and something cancels to 0 there (zero_scale > 0: dq, dk), the error
  // is relative to the size of what cancels, and held to f32's tolerance in every dtype, since what is
  // left is f32 rounding. Where nothing cancels, an all-zero reference asks for exact zeros.
  bool cancelled() const { return max_abs_ref == 0 && zero_scale > 0; }
  double relative() const {
    const double m = cancelled() ? zero_scale : max_abs_ref;
    if (m > 0) return max_abs_err / std::max(m, static_cast<double>(FLT_MIN));
    return max_abs_err == 0 ? 0 : std::numeric_limits<double>::infinity();
  }
  double limit() const { return cancelled() ? tolerance(FB_F32) : tol; }
  bool passed() const { return relative() <= limit(); }

  double zero_scale = 0;
};

// dq and dk are 0 where every row sees a single key (Sk = 1, a window (0, 0), ...): dS = P (dP - delta)
// with P = 1 and dP = delta, and the reference is exactly 0. What the library returns there is the f32
// rounding of dP - delta (delta = dout . o from the stored o) carried through scale * k or q into sums
// over n keys or rows, which against a zero reference is an infinite relative error. So an all-zero
// reference of dq or dk is measured against the size of what cancels: scale * max|delta| * max|k|
// * sqrt(Sk) for dq, scale * max|delta| * max|q| * sqrt(Sq * Hq / Hk) for dk (the test suite's rule).
struct CancellationSizes {
  double dq = 0, dk = 0;
};
CancellationSizes cancellation_size(const Problem& p, const HostTensor& q, const HostTensor& k, const HostTensor& o,
                                    const HostTensor& dout) {
  double max_delta = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        double delta = 0;
        for (int64_t x = 0; x < p.head_dim_v; ++x) delta += dout.at(b, h, i, x) * o.at(b, h, i, x);
        if (std::isfinite(delta)) max_delta = std::max(max_delta, std::abs(delta));
      }
  const auto max_abs = [](const HostTensor& t) {
    double m = 0;
    for (int64_t b = 0; b < t.dim(0); ++b)
      for (int64_t h = 0; h < t.dim(1); ++h)
        for (int64_t i = 0; i < t.dim(2); ++i)
          for (int64_t x = 0; x < t.dim(3); ++x) m = std::max(m, std::abs(t.at(b, h, i, x)));
    return m;
  };
  const double base = p.effective_scale() * max_delta;
  const double rows = static_cast<double>(p.seqlen_q * (p.heads_q / p.heads_kv));
  return {base * max_abs(k) * std::sqrt(static_cast<double>(p.seqlen_k)), base * max_abs(q) * std::sqrt(rows)};
}

// lse is f32 whatever the dtype of the tensors: it gets f32's tolerance.
double tolerance_of(const char* output, fb_dtype dtype) {
  return std::string(output) == "lse" ? tolerance(FB_F32) : tolerance(dtype);
}

// No errors yet for one output: its tolerance and, for dq and dk, the size of what cancels.
ErrorStats stats_for(const std::string& name, fb_dtype dtype, const CancellationSizes& c) {
  ErrorStats e;
  e.name = name;
  e.tol = tolerance_of(name.c_str(), dtype);
  e.zero_scale = name == "dq" ? c.dq : name == "dk" ? c.dk : 0;
  return e;
}

struct CheckReport {
  std::vector<ErrorStats> outputs; // o, lse, dq, dk, dv
  std::string what;                // what was compared
  bool passed() const {
    return std::all_of(outputs.begin(), outputs.end(), [&](const ErrorStats& e) { return e.passed(); });
  }
  json to_json() const {
    json j = {{"passed", passed()}, {"rule", kToleranceRule}, {"compared", what}};
    for (const auto& e : outputs) {
      json& x = j["outputs"][e.name];
      x = {{"max_abs_err", e.max_abs_err}, {"max_abs_ref", e.max_abs_ref}, {"relative_err", e.relative()},
           {"tolerance", e.limit()}, {"values", e.count}, {"passed", e.passed()}};
      if (e.cancelled()) x["relative_to_cancelled"] = e.zero_scale;
    }
    return j;
  }
  void print() const {
    std::printf("check (%s):\n", what.c_str());
    std::printf("  %-6s %12s %12s %14s %10s  %s\n", "output", "max|err|", "max|ref|", "err/max|ref|", "tolerance",
                "result");
    for (const auto& e : outputs) {
      std::printf("  %-6s %12.3e %12.3e %14.3e %10.0e  %s", e.name.c_str(), e.max_abs_err, e.max_abs_ref,
                  e.relative(), e.limit(), e.passed() ? "ok" : "FAILED");
      if (e.cancelled()) std::printf(" (the reference is all 0: err / %.3e, the size of what cancels)", e.zero_scale);
      std::printf("\n");
    }
    std::printf("%s (%s)\n", passed() ? "passed" : "FAILED", kToleranceRule);
  }
};

// Every tensor of one problem; inputs random, outputs poisoned with NaN.
struct Tensors {
  HostTensor q, k, v, dout, o, dq, dk, dv;
  std::vector<float> lse;
  fb_tensor lse_view() const {
    return fb_tensor_contiguous3(const_cast<float*>(lse.data()), FB_F32, q.dim(0), q.dim(1), q.dim(2));
  }
};

Tensors make_tensors(const Problem& p, uint64_t seed) {
  Tensors t;
  const auto make = [&](int64_t h, int64_t s, int64_t d) {
    return HostTensor(p.dtype, p.layout, p.batch, h, s, d);
  };
  t.q = make(p.heads_q, p.seqlen_q, p.head_dim);
  t.k = make(p.heads_kv, p.seqlen_k, p.head_dim);
  t.v = make(p.heads_kv, p.seqlen_k, p.head_dim_v);
  t.dout = make(p.heads_q, p.seqlen_q, p.head_dim_v);
  t.o = make(p.heads_q, p.seqlen_q, p.head_dim_v);
  t.dq = make(p.heads_q, p.seqlen_q, p.head_dim);
  t.dk = make(p.heads_kv, p.seqlen_k, p.head_dim);
  t.dv = make(p.heads_kv, p.seqlen_k, p.head_dim_v);
  t.lse.assign(static_cast<size_t>(p.batch * p.heads_q * p.seqlen_q), std::numeric_limits<float>::quiet_NaN());
  t.q.fill_normal(seed);
  t.k.fill_normal(seed + 1);
  t.v.fill_normal(seed + 2);
  t.dout.fill_normal(seed + 3);
  for (HostTensor* out : {&t.o, &t.dq, &t.dk, &t.dv}) out->fill_nan();
  return t;
}

ref::Shape ref_shape(const Problem& p) {
  return {p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim, p.head_dim_v};
}
ref::Options ref_options(const Problem& p) {
  return {p.causal, p.window_left, p.window_right, p.effective_scale()};
}

std::string describe(const Problem& p) {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "B=%lld Hq=%lld Hk=%lld Sq=%lld Sk=%lld D=%lld Dv=%lld  %s %s  causal=%s window=%lld,%lld scale=%.6g",
                (long long)p.batch, (long long)p.heads_q, (long long)p.heads_kv, (long long)p.seqlen_q,
                (long long)p.seqlen_k, (long long)p.head_dim, (long long)p.head_dim_v, dtype_flag_name(p.dtype),
                layout_name(p.layout), p.causal ? "yes" : "no", (long long)p.window_left,
                (long long)p.right(), p.effective_scale());
  return buf;
}

json problem_json(const char* command, const Problem& p, int threads) {
  return {{"command", command},
          {"shape",
           {{"batch", p.batch}, {"heads_q", p.heads_q}, {"heads_kv", p.heads_kv}, {"seqlen_q", p.seqlen_q},
            {"seqlen_k", p.seqlen_k}, {"head_dim", p.head_dim}, {"head_dim_v", p.head_dim_v}}},
          {"params",
           {{"causal", p.causal}, {"window_left", p.window_left}, {"window_right", p.right()},
            {"scale", p.effective_scale()}, {"dtype", dtype_flag_name(p.dtype)}, {"layout", layout_name(p.layout)}}},
          {"isa", fb_cpu_isa()},
          {"threads", threads},
          {"version", fb_version()}};
}

// --- The sampled check (bench) ---------------------------------------------------------------------

// A few rows of [0, n): both ends, the middle, and random ones.
std::vector<int64_t> sample_rows(int64_t n, std::mt19937_64& rng, int count) {
  std::set<int64_t> rows = {0, std::min<int64_t>(1, n - 1), n / 2, n - 1};
  std::uniform_int_distribution<int64_t> pick(0, n - 1);
  while (static_cast<int>(rows.size()) < std::min<int64_t>(count, n)) rows.insert(pick(rng));
  return {rows.begin(), rows.end()};
}

// Compares sampled rows with the float64 reference: query rows of O, LSE and dQ on two query heads
// (first of the first batch, last of the last), key rows of dK and dV on their kv heads. Each kv head's
// slice of the problem is extracted so the reference never sees the whole (possibly huge) tensors.
CheckReport sampled_check(const Problem& p, const Tensors& t, uint64_t seed) {
  constexpr int kRowsPerHead = 8;
  const int64_t group = p.heads_q / p.heads_kv;
  struct Task {
    int64_t b, hk;
    std::vector<int64_t> heads; // query heads of this kv head to check
  };
  std::vector<Task> tasks;
  for (const auto& [b, h] : {std::pair<int64_t, int64_t>{0, 0}, {p.batch - 1, p.heads_q - 1}}) {
    const int64_t hk = h / group, batch = b; // (clang 14 does not capture structured bindings)
    auto it = std::find_if(tasks.begin(), tasks.end(), [&](const Task& x) { return x.b == batch && x.hk == hk; });
    if (it == tasks.end()) tasks.push_back({b, hk, {h}});
    else if (std::find(it->heads.begin(), it->heads.end(), h) == it->heads.end()) it->heads.push_back(h);
  }
  std::mt19937_64 rng(seed ^ 0x5eed);
  const auto qrows = sample_rows(p.seqlen_q, rng, kRowsPerHead);
  const auto krows = sample_rows(p.seqlen_k, rng, kRowsPerHead);

  const ref::Shape s{1, group, 1, p.seqlen_q, p.seqlen_k, p.head_dim, p.head_dim_v};
  const ref::Options opt = ref_options(p);
  std::vector<std::array<ErrorStats, 5>> results(tasks.size());
  // The tasks are independent float64 work (kv_head_stats is ~group*Sq*Sk*(D+Dv)*2 FLOPs): one per core.
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t n = 0; n < tasks.size(); ++n) {
    const Task& task = tasks[n];
    auto& r = results[n];
    const int64_t b = task.b, hk = task.hk;
    const auto q = t.q.heads_to_dense(b, hk * group, group), dout = t.dout.heads_to_dense(b, hk * group, group);
    const auto k = t.k.heads_to_dense(b, hk, 1), v = t.v.heads_to_dense(b, hk, 1);
    std::vector<double> row(std::max(p.head_dim, p.head_dim_v)), row2(p.head_dim_v);
    for (int64_t h : task.heads) {
      const int64_t g = h - hk * group;
      for (int64_t i : qrows) {
        const double lse = ref::forward_row(s, opt, q, k, v, 0, g, i, row.data());
        for (int64_t x = 0; x < p.head_dim_v; ++x) r[0].add(t.o.at(b, h, i, x), row[x]);
        r[1].add(t.lse[(b * p.heads_q + h) * p.seqlen_q + i], lse);
        ref::dq_row(s, opt, q, k, v, dout, 0, g, i, row.data());
        for (int64_t x = 0; x < p.head_dim; ++x) r[2].add(t.dq.at(b, h, i, x), row[x]);
      }
    }
    const ref::KvHeadStats stats = ref::kv_head_stats(s, opt, q, k, v, dout, 0, 0);
    for (int64_t j : krows) {
      ref::dkv_row(s, opt, q, k, v, dout, stats, 0, 0, j, row.data(), row2.data());
      for (int64_t x = 0; x < p.head_dim; ++x) r[3].add(t.dk.at(b, hk, j, x), row[x]);
      for (int64_t x = 0; x < p.head_dim_v; ++x) r[4].add(t.dv.at(b, hk, j, x), row2[x]);
    }
  }
  CheckReport report;
  const char* names[] = {"o", "lse", "dq", "dk", "dv"};
  const CancellationSizes cancelled = cancellation_size(p, t.q, t.k, t.o, t.dout);
  for (int i = 0; i < 5; ++i) {
    ErrorStats e = stats_for(names[i], p.dtype, cancelled);
    for (const auto& r : results) e.merge(r[i]);
    report.outputs.push_back(e);
  }
  size_t nheads = 0;
  for (const Task& task : tasks) nheads += task.heads.size();
  report.what = "float64 reference on samples: " + std::to_string(qrows.size()) + " query rows x " +
                std::to_string(nheads) + " heads (o, lse, dq), " + std::to_string(krows.size()) + " key rows x " +
                std::to_string(tasks.size()) + " kv heads (dk, dv)";
  return report;
}

// --- Timing -----------------------------------------------------------------------------------------

struct Timing {
  std::vector<double> seconds;
  double median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    const size_t n = s.size();
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  }
  double min() const { return *std::min_element(seconds.begin(), seconds.end()); }
  double max() const { return *std::max_element(seconds.begin(), seconds.end()); }
};

template <class Run>
Timing time_runs(const char* pass, int64_t warmup, int64_t repeats, Progress& progress, Run&& run) {
  Timing t;
  for (int64_t i = 0; i < warmup + repeats; ++i) {
    const bool warm = i < warmup;
    progress.stage(std::string(pass) + (warm ? " warm-up " + std::to_string(i + 1) + "/" + std::to_string(warmup)
                                             : " " + std::to_string(i - warmup + 1) + "/" + std::to_string(repeats)));
    const auto start = Clock::now();
    run();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (!warm) t.seconds.push_back(s);
  }
  return t;
}

// Library-owned memory would be allocated inside the timed call; the bench owns it instead.
struct Workspace {
  explicit Workspace(size_t bytes) : bytes(bytes), data(::operator new[](bytes > 0 ? bytes : 1, std::align_val_t{64})) {}
  ~Workspace() { ::operator delete[](data, std::align_val_t{64}); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  size_t bytes;
  void* data;
};

} // namespace

// --- bench ------------------------------------------------------------------------------------------

CLI::App* add_bench_command(CLI::App& app, BenchFlags& f) {
  auto* cmd = app.add_subcommand("bench", "Time forward and backward on random inputs; check sampled rows");
  cmd->footer(
      "Times forward and backward on random inputs and checks sampled rows of every output against the\n"
      "float64 reference (after timing; --no-check skips it). Without flags: a default shape that takes\n"
      "~10 s. TFLOP/s use FlashAttention's convention: forward 2*B*Hq*pairs*(D+Dv) FLOPs\n"
      "(= 4*B*Hq*Sq*Sk*D when Dv == D) with pairs = Sq*Sk, halved when causal, or the exact count of\n"
      "visible (i, j) pairs with a window; backward = 2.5 x forward. Times are per call (median, min, max\n"
      "of --repeats runs after --warmup runs), the workspace allocated once outside the timed loop.\n\n" +
      app.get_footer());
  f.problem = bench_defaults();
  f.warmup = kBenchWarmup;
  f.repeats = kBenchRepeats;
  add_problem_flags(cmd, f.problem);
  cmd->add_option("--warmup", f.warmup, "Untimed runs of each pass before the timed ones")
      ->check(int_at_least(0))
      ->capture_default_str();
  cmd->add_option("--repeats", f.repeats, "Timed runs of each pass (median, min and max reported)")
      ->check(int_at_least(1))
      ->capture_default_str();
  cmd->add_flag("--json", f.json, "Print one JSON object on stdout instead of the table")->disable_flag_override();
  cmd->add_flag("--no-check", f.no_check, "Skip the sampled check against the float64 reference")
      ->disable_flag_override();
  return cmd;
}

int run_bench(const BenchFlags& f) {
  const Problem p = resolve(f.problem);
  const int threads = p.threads > 0 ? p.threads : default_threads();
  const fb_params params = p.params();
  std::optional<Progress> progress(std::in_place, "bench");
  progress->stage("allocating");
  Tensors t = make_tensors(p, f.problem.seed);
  const fb_tensor q = t.q.view(), k = t.k.view(), v = t.v.view(), o = t.o.view(), dout = t.dout.view();
  const fb_tensor dq = t.dq.view(), dk = t.dk.view(), dv = t.dv.view(), lse = t.lse_view();

  size_t fwd_bytes = 0, bwd_bytes = 0;
  check_library(fb_forward_workspace_size(&q, &k, &v, &o, &lse, &params, &fwd_bytes), p.dtype, "forward");
  check_library(fb_backward_workspace_size(&dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, nullptr, &params, &bwd_bytes),
                p.dtype, "backward");
  Workspace fwd_ws(fwd_bytes), bwd_ws(bwd_bytes);

  const Timing fwd = time_runs("forward", f.warmup, f.repeats, *progress, [&] {
    check_library(fb_forward(&q, &k, &v, &o, &lse, &params, fwd_ws.data, fwd_ws.bytes), p.dtype, "forward");
  });
  const Timing bwd = time_runs("backward", f.warmup, f.repeats, *progress, [&] {
    check_library(fb_backward(&dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, nullptr, &params, bwd_ws.data, bwd_ws.bytes),
                  p.dtype, "backward");
  });
  std::optional<CheckReport> check;
  if (!f.no_check) {
    progress->stage("checking samples against float64");
    check = sampled_check(p, t, f.problem.seed);
  }
  const Flops flops = count_flops(p);
  const auto tflops = [](double flop, double s) { return s > 0 ? flop / s * 1e-12 : 0.0; };
  // The least traffic a pass can have: read its inputs and write its outputs once.
  const double in_fwd = static_cast<double>(t.q.bytes().size() + t.k.bytes().size() + t.v.bytes().size());
  const double fwd_traffic = in_fwd + static_cast<double>(t.o.bytes().size() + 4 * t.lse.size());
  const double bwd_traffic = fwd_traffic + static_cast<double>(t.dout.bytes().size() + t.dq.bytes().size() +
                                                               t.dk.bytes().size() + t.dv.bytes().size());

  progress.reset(); // clears the line before the results
  if (f.json) {
    json j = problem_json("bench", p, threads);
    j["warmup"] = f.warmup;
    j["repeats"] = f.repeats;
    j["flops"] = {{"convention", flops.convention}, {"pairs_per_head", flops.pairs}, {"forward", flops.forward},
                  {"backward", flops.backward}};
    const auto pass = [&](const Timing& tm, double flop, double bytes) {
      return json{{"median_s", tm.median()},
                  {"min_s", tm.min()},
                  {"max_s", tm.max()},
                  {"seconds", tm.seconds},
                  {"tflops", tflops(flop, tm.median())},
                  {"tflops_best", tflops(flop, tm.min())},
                  {"min_bytes", bytes},
                  {"gbytes_per_s", bytes / tm.median() * 1e-9}};
    };
    j["forward"] = pass(fwd, flops.forward, fwd_traffic);
    j["backward"] = pass(bwd, flops.backward, bwd_traffic);
    j["check"] = check ? check->to_json() : json{{"skipped", true}};
    std::cout << j.dump(2) << std::endl;
  } else {
    std::printf("flashback bench  %s\n", describe(p).c_str());
    std::printf("flashback %s, isa %s, %d threads; %lld warm-up + %lld timed runs per pass\n", fb_version(),
                fb_cpu_isa(), threads, (long long)f.warmup, (long long)f.repeats);
    std::printf("FLOPs: %s; forward %.4g GFLOP, backward 2.5x = %.4g GFLOP\n", flops.convention.c_str(),
                flops.forward * 1e-9, flops.backward * 1e-9);
    // Milliseconds to 4 significant digits: a small problem's microseconds show too (--json: seconds).
    std::printf("%-9s %11s %11s %11s %10s %10s\n", "pass", "median (ms)", "min (ms)", "max (ms)", "TFLOP/s", "(best)");
    std::printf("%-9s %11.4g %11.4g %11.4g %10.4f %10.4f\n", "forward", fwd.median() * 1e3, fwd.min() * 1e3,
                fwd.max() * 1e3, tflops(flops.forward, fwd.median()), tflops(flops.forward, fwd.min()));
    std::printf("%-9s %11.4g %11.4g %11.4g %10.4f %10.4f\n", "backward", bwd.median() * 1e3, bwd.min() * 1e3,
                bwd.max() * 1e3, tflops(flops.backward, bwd.median()), tflops(flops.backward, bwd.min()));
    if (check) check->print();
    else std::printf("check skipped (--no-check)\n");
  }
  return check && !check->passed() ? kCheckFailed : kOk;
}

// --- check ------------------------------------------------------------------------------------------

CLI::App* add_check_command(CLI::App& app, CheckFlags& f) {
  auto* cmd = app.add_subcommand("check", "Compare every output with the float64 reference on random inputs");
  cmd->footer(
      "Runs forward and backward on random inputs and compares every output (o, lse, dq, dk, dv) with the\n"
      "float64 reference. Exits 1 when an output is over tolerance: max|out - ref| <= tol * max|ref|,\n"
      "tol = 1e-4 (f32), 5e-3 (f16), 2e-2 (bf16); lse is always f32 (1e-4). Where every row sees one key\n"
      "(Sk = 1, --window 0,0) dq and dk are 0 by cancellation: there the error is relative to the size of\n"
      "what cancels (scale * max|delta| * max|k or q| * sqrt(terms summed)), at 1e-4. The reference costs\n"
      "O(B*Hq*Sq*Sk*(D+Dv)) in float64 on one core: keep shapes small (the default takes ~1 s).\n\n" +
      app.get_footer());
  f.problem = check_defaults();
  add_problem_flags(cmd, f.problem);
  cmd->add_flag("--json", f.json, "Print one JSON object on stdout instead of the table")->disable_flag_override();
  return cmd;
}

int run_check(const CheckFlags& f) {
  const Problem p = resolve(f.problem);
  const int threads = p.threads > 0 ? p.threads : default_threads();
  const fb_params params = p.params();
  std::optional<Progress> progress(std::in_place, "check");
  progress->stage("flashback forward + backward");
  Tensors t = make_tensors(p, f.problem.seed);
  const fb_tensor q = t.q.view(), k = t.k.view(), v = t.v.view(), o = t.o.view(), dout = t.dout.view();
  const fb_tensor dq = t.dq.view(), dk = t.dk.view(), dv = t.dv.view(), lse = t.lse_view();
  check_library(fb_forward(&q, &k, &v, &o, &lse, &params, nullptr, 0), p.dtype, "forward");
  check_library(fb_backward(&dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, nullptr, &params, nullptr, 0), p.dtype,
                "backward");

  progress->stage("float64 reference");
  const ref::Shape s = ref_shape(p);
  const ref::Options opt = ref_options(p);
  const auto rq = t.q.to_dense(), rk = t.k.to_dense(), rv = t.v.to_dense(), rdo = t.dout.to_dense();
  std::vector<double> ro, rlse, rdq, rdk, rdv, rdelta;
  ref::forward(s, opt, rq, rk, rv, ro, rlse);
  ref::backward(s, opt, rq, rk, rv, rdo, rdq, rdk, rdv, rdelta);

  CheckReport report;
  report.what = "every element against the float64 reference";
  const CancellationSizes cancelled = cancellation_size(p, t.q, t.k, t.o, t.dout);
  const auto compare = [&](const char* name, const HostTensor& out, const std::vector<double>& r) {
    ErrorStats e = stats_for(name, p.dtype, cancelled);
    const auto got = out.to_dense();
    for (size_t i = 0; i < got.size(); ++i) e.add(got[i], r[i]);
    report.outputs.push_back(e);
  };
  compare("o", t.o, ro);
  {
    ErrorStats e = stats_for("lse", p.dtype, cancelled);
    for (size_t i = 0; i < t.lse.size(); ++i) e.add(t.lse[i], rlse[i]);
    report.outputs.push_back(e);
  }
  compare("dq", t.dq, rdq);
  compare("dk", t.dk, rdk);
  compare("dv", t.dv, rdv);

  progress.reset();
  if (f.json) {
    json j = problem_json("check", p, threads);
    j["check"] = report.to_json();
    std::cout << j.dump(2) << std::endl;
  } else {
    std::printf("flashback check  %s\n", describe(p).c_str());
    std::printf("flashback %s, isa %s, %d threads\n", fb_version(), fb_cpu_isa(), threads);
    report.print();
  }
  return report.passed() ? kOk : kCheckFailed;
}

} // namespace flashback::cli
