// Runs one forward and one backward on [1, H, S, D] contiguous f32 tensors and prints the bytes of
// the inputs and outputs, for comparison with the peak resident memory that `/usr/bin/time -v` reports
// (bench/peak_memory.sh). flashback's extra memory is O(S), never O(S^2).
//   flashback_peak_memory [seqlen] [head_dim] [heads]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "flashback/flashback.hpp"

int main(int argc, char** argv) {
  const int64_t s = argc > 1 ? std::atoll(argv[1]) : 131072;
  const int64_t d = argc > 2 ? std::atoll(argv[2]) : 128;
  const int64_t h = argc > 3 ? std::atoll(argv[3]) : 1;
  const int64_t n = h * s * d;
  // Untouched pages are not resident: fill every input so the count is honest.
  auto tensor = [&] {
    std::unique_ptr<float[]> t(new float[n]);
    for (int64_t i = 0; i < n; ++i) t[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    return t;
  };
  auto q = tensor(), k = tensor(), v = tensor(), dout = tensor();
  std::unique_ptr<float[]> o(new float[n]), dq(new float[n]), dk(new float[n]), dv(new float[n]), lse(new float[h * s]);
  using flashback::TensorView;
  auto view = [&](std::unique_ptr<float[]>& t) { return TensorView::bhsd(t.get(), flashback::DType::f32, 1, h, s, d); };
  const auto lse_view = TensorView::rows(lse.get(), 1, h, s);
  const double io_bytes = (8.0 * n + h * s) * sizeof(float); // q k v o dout dq dk dv + lse
  try {
    auto t0 = std::chrono::steady_clock::now();
    flashback::forward(view(q), view(k), view(v), view(o), lse_view);
    auto t1 = std::chrono::steady_clock::now();
    flashback::Gradients g;
    g.dq = view(dq);
    g.dk = view(dk);
    g.dv = view(dv);
    const size_t ws = flashback::backward_workspace_size(view(dout), view(q), view(k), view(v), view(o), lse_view, g);
    flashback::backward(view(dout), view(q), view(k), view(v), view(o), lse_view, g);
    auto t2 = std::chrono::steady_clock::now();
    std::printf("shape [1, %lld, %lld, %lld] f32\n", static_cast<long long>(h), static_cast<long long>(s),
                static_cast<long long>(d));
    std::printf("inputs + outputs: %.1f MiB\n", io_bytes / (1 << 20));
    std::printf("backward workspace: %.2f MiB\n", static_cast<double>(ws) / (1 << 20));
    std::printf("forward %.2f s, backward %.2f s\n", std::chrono::duration<double>(t1 - t0).count(),
                std::chrono::duration<double>(t2 - t1).count());
    std::printf("dq[0] %g dk[0] %g dv[0] %g\n", dq[0], dk[0], dv[0]);
  } catch (const flashback::Error& e) {
    std::fprintf(stderr, "flashback: %s\n", e.what());
    return 1;
  }
  return 0;
}
