// Runs a tiny forward and backward through the installed headers and library.
#include <cmath>
#include <cstdio>
#include <vector>

#include <flashback/flashback.hpp>

int main() {
  const int64_t b = 1, h = 1, s = 3, d = 4;
  std::vector<float> q(b * h * s * d, 0.5f), k(q), v(q), o(q.size()), lse(b * h * s), dout(q.size(), 1.0f), dq(q.size());
  using flashback::DType;
  using flashback::TensorView;
  auto view = [&](std::vector<float>& x) { return TensorView::bhsd(x.data(), DType::f32, b, h, s, d); };
  try {
    flashback::forward(view(q), view(k), view(v), view(o), TensorView::rows(lse.data(), b, h, s));
    flashback::Gradients grads;
    grads.dq = view(dq);
    flashback::backward(view(dout), view(q), view(k), view(v), view(o), TensorView::rows(lse.data(), b, h, s), grads);
  } catch (const flashback::Error& e) {
    std::fprintf(stderr, "flashback: %s\n", e.what());
    return 1;
  }
  // Equal keys: o is v, lse = log(3) + q.k / sqrt(d), dq = 0.
  const double want_lse = std::log(3.0) + 4 * 0.25 / 2;
  if (std::abs(o[0] - 0.5f) > 1e-6f || std::abs(lse[2] - want_lse) > 1e-5 || std::abs(dq[0]) > 1e-6f) {
    std::fprintf(stderr, "unexpected results: o[0] = %g, lse[2] = %g (want %g), dq[0] = %g\n", o[0], lse[2], want_lse,
                 dq[0]);
    return 1;
  }
  std::printf("flashback %s (%s) from the installed package: ok\n", flashback::version().c_str(),
              flashback::cpu_isa().c_str());
  return 0;
}
