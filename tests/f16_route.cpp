// Not a test: the measurement behind README's f16 choice. f16 runs its own kernels: the f32 kernels on
// inputs converted to f32, or at the amx level for head dims of 64 and more the AMX tiles with each
// input as hi + lo, two bf16 that sum to it exactly (math_bf16.h). The alternative measured here is to
// round f16 inputs to bf16 and run the bf16 kernels (bf16 products on AMX; FLASHBACK_EMULATION=amx
// runs them on emulated tiles where the CPU has AVX2 but no AMX). This prints, per case and output,
// the f16 accuracy bar (2 * max |naive - ref64| + 1e-5 * max |ref64|, naive.h) and the error of each
// route against the float64 reference on the f16 inputs, as a multiple of that bar (> 1 fails it).
//
//   f16_route                      at the best instruction set here (FLASHBACK_ISA caps it)
//   FLASHBACK_ISA=avx512 f16_route      the f32 kernels for every case
//   FLASHBACK_TEST_SEED=<n> f16_route   the same inputs again
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "naive.h"
#include "reference.h"
#include "test_util.h"

namespace {

using fbtest::Case;
using fbtest::Tensor;

Case make_case(int64_t hq, int64_t hk, int64_t sq, int64_t sk, int64_t d, bool causal) {
  Case c;
  c.shape = {1, hq, hk, sq, sk, d, d};
  c.opt.causal = causal;
  if (causal) c.opt.window_right = 0;
  return c;
}

std::vector<float> floats(const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); }

double max_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) e = std::max(e, std::abs(got[i] - ref[i]));
  return e;
}

// The same values in another storage type (rounded to it).
fbtest::Inputs convert(const fbtest::Inputs& in, fb_dtype dtype) {
  fbtest::Inputs out;
  auto one = [&](const Tensor& t) {
    Tensor c = Tensor::make(fbtest::Layout::bhsd, t.shape(), dtype);
    c.write(t.read());
    return c;
  };
  out.q = one(in.q);
  out.k = one(in.k);
  out.v = one(in.v);
  out.dout = one(in.dout);
  return out;
}

struct Run {
  std::vector<double> o, lse, dq, dk, dv;
};

Run run(const Case& c, const fbtest::Inputs& in) {
  fbtest::Outputs out = fbtest::make_outputs(c);
  if (fbtest::run_forward(c, in, out) != FB_SUCCESS || fbtest::run_backward(c, in, out) != FB_SUCCESS) {
    std::fprintf(stderr, "flashback failed: %s\n", fb_last_error());
    std::exit(1);
  }
  return {out.o.read(), out.lse.read(), out.dq.read(), out.dk.read(), out.dv.read()};
}

} // namespace

int main() {
  struct Named {
    const char* name;
    Case c;
  };
  const std::vector<Named> cases = {
      {"Sq=Sk=256 D=64", make_case(2, 1, 256, 256, 64, false)},
      {"Sq=Sk=256 D=128 causal", make_case(2, 1, 256, 256, 128, true)},
      {"Sq=Sk=300 D=7", make_case(2, 1, 300, 300, 7, false)}, // dq's dS rows sum to zero: cancellation
      {"Sq=5 Sk=8192 D=128", make_case(2, 1, 5, 8192, 128, false)},
      {"Sq=8192 Sk=3 D=64", make_case(2, 1, 8192, 3, 64, false)},
  };
  std::printf("f16 inputs, two routes, at %s; %s\n", fb_cpu_isa(), fbtest::seed_note().c_str());
  std::printf("error = max |out - ref64| over the output, as a multiple of the f16 bar (> 1 fails it)\n\n");
  std::printf("%-24s %-5s %11s %11s %8s %11s %8s\n", "case", "out", "f16 bar", "f16 path", "x bar", "via bf16",
              "x bar");
  for (const Named& n : cases) {
    Case f16 = n.c;
    f16.dtype = FB_F16;
    std::mt19937_64 rng = fbtest::rng_for(n.name);
    const fbtest::Inputs in = fbtest::make_inputs(f16, rng);
    const std::vector<double> q = in.q.read(), k = in.k.read(), v = in.v.read(), dout = in.dout.read();
    Run ref;
    std::vector<double> delta;
    ref::forward(f16.shape, f16.opt, q, k, v, ref.o, ref.lse);
    ref::backward(f16.shape, f16.opt, q, k, v, dout, ref.dq, ref.dk, ref.dv, delta);

    const Run direct = run(f16, in);
    Case bf16 = f16;
    bf16.dtype = FB_BF16;
    const Run routed = run(bf16, convert(in, FB_BF16));

    // The bar: naive f32 on the f16 inputs, outputs rounded to f16; its backward reads the f16 path's
    // o and lse, as the library's backward does.
    std::vector<float> no, nlse, ndq, ndk, ndv, ndelta;
    naive::forward(f16.shape, f16.opt, floats(q), floats(k), floats(v), no, nlse);
    naive::backward(f16.shape, f16.opt, floats(dout), floats(q), floats(k), floats(v), floats(direct.o),
                    floats(direct.lse), ndq, ndk, ndv, ndelta);
    const struct {
      const char* what;
      const std::vector<double>& ref;
      std::vector<float> naive;
      const std::vector<double>&direct, &routed;
    } outputs[] = {
        {"o", ref.o, fbtest::round_to(FB_F16, no), direct.o, routed.o},
        {"lse", ref.lse, nlse, direct.lse, routed.lse},
        {"dq", ref.dq, fbtest::round_to(FB_F16, ndq), direct.dq, routed.dq},
        {"dk", ref.dk, fbtest::round_to(FB_F16, ndk), direct.dk, routed.dk},
        {"dv", ref.dv, fbtest::round_to(FB_F16, ndv), direct.dv, routed.dv},
    };
    for (const auto& out : outputs) {
      double max_ref = 0;
      for (double r : out.ref)
        if (std::isfinite(r)) max_ref = std::max(max_ref, std::abs(r));
      const double bar =
          2 * max_error(std::vector<double>(out.naive.begin(), out.naive.end()), out.ref) + 1e-5 * max_ref;
      const double e1 = max_error(out.direct, out.ref), e2 = max_error(out.routed, out.ref);
      std::printf("%-24s %-5s %11.3e %11.3e %8.2f %11.3e %8.2f\n", n.name, out.what, bar, e1, e1 / bar, e2, e2 / bar);
    }
  }
  return 0;
}
