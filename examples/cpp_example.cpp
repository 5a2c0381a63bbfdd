// Causal attention forward and backward through flashback's C++ API, on [B, S, H, D] buffers.
#include <cstdio>
#include <vector>

#include <flashback/flashback.hpp>

int main() {
  const int64_t b = 1, s = 16, h = 2, d = 32; // batch, sequence length, heads, head dim
  const size_t n = b * s * h * d;
  std::vector<float> q(n), k(n), v(n), o(n), lse(b * h * s), dout(n, 1.0f), dq(n), dk(n), dv(n);
  for (size_t i = 0; i < n; ++i) {
    q[i] = static_cast<float>(i % 13) / 13.0f - 0.5f;
    k[i] = static_cast<float>(i % 11) / 11.0f - 0.5f;
    v[i] = static_cast<float>(i % 7) / 7.0f - 0.5f;
  }

  using flashback::DType;
  using flashback::TensorView;
  auto bshd = [&](std::vector<float>& x) { return TensorView::bshd(x.data(), DType::f32, b, s, h, d); };
  flashback::Params params;
  params.causal = true;

  try {
    flashback::forward(bshd(q), bshd(k), bshd(v), bshd(o), TensorView::rows(lse.data(), b, h, s), params);
    flashback::Gradients grads;
    grads.dq = bshd(dq);
    grads.dk = bshd(dk);
    grads.dv = bshd(dv);
    flashback::backward(bshd(dout), bshd(q), bshd(k), bshd(v), bshd(o), TensorView::rows(lse.data(), b, h, s),
                        grads, params);
  } catch (const flashback::Error& e) {
    std::fprintf(stderr, "flashback error %d: %s\n", static_cast<int>(e.status()), e.what());
    return 1;
  }
  std::printf("flashback %s on %s: o[0] = %.6f, lse[0] = %.6f, dk[0] = %.6f\n", flashback::version().c_str(),
              flashback::cpu_isa().c_str(), o[0], lse[0], dk[0]);
  return 0;
}
