// flashback_ab: two builds of the library side by side in one process. Loads both shared libraries
// (dlopen, RTLD_LOCAL: each runs its own code), makes one set of inputs and one workspace, and times
// their forward or backward in alternation (A B, then B A, round after round), so that both see the
// same memory, the same pages and the same moments of the machine. Separate processes, as
// bench/interleave.py runs them, differ by a few percent on their own (where their buffers land); on
// a noisy guest that hides changes of that size. Prints each build's best time and the median and
// quartiles over rounds of B's time / A's in the same round. `--workspace library` passes none: each
// build allocates (or keeps) its own, as a caller who passes none sees it.
//
//   build/bench/flashback_ab old/libflashback.so.0 build/libflashback.so.0 --batch 64 --seqlen 128
//     --head-dim 64 --pass forward   (one command line)
#include <dlfcn.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashback/flashback.h"

namespace {

// The entry points of one build.
struct Library {
  void* handle = nullptr;
  decltype(&fb_forward) forward = nullptr;
  decltype(&fb_backward) backward = nullptr;
  decltype(&fb_forward_workspace_size) forward_size = nullptr;
  decltype(&fb_backward_workspace_size) backward_size = nullptr;
  decltype(&fb_tensor_contiguous4) tensor4 = nullptr;
  decltype(&fb_tensor_contiguous3) tensor3 = nullptr;
  decltype(&fb_params_init) params_init = nullptr;
  decltype(&fb_last_error) last_error = nullptr;

  template <class F>
  void bind(F& f, const char* name, const std::string& path) {
    f = reinterpret_cast<F>(dlsym(handle, name));
    if (!f) throw std::runtime_error(path + ": no symbol " + name);
  }
  explicit Library(const std::string& path) {
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) throw std::runtime_error(std::string("dlopen: ") + dlerror());
    bind(forward, "fb_forward", path);
    bind(backward, "fb_backward", path);
    bind(forward_size, "fb_forward_workspace_size", path);
    bind(backward_size, "fb_backward_workspace_size", path);
    bind(tensor4, "fb_tensor_contiguous4", path);
    bind(tensor3, "fb_tensor_contiguous3", path);
    bind(params_init, "fb_params_init", path);
    bind(last_error, "fb_last_error", path);
  }
};

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Bytes 64-byte aligned, as frameworks allocate tensors.
struct Buffer {
  std::vector<char> bytes;
  char* data = nullptr;
  explicit Buffer(size_t n) : bytes(n + 64) {
    data = bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
  }
};

// n random values in [-1, 1] stored as `dtype` (bf16: truncated; f16: rounded).
Buffer random_tensor(size_t n, fb_dtype dtype, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const size_t size = dtype == FB_F32 ? 4 : 2;
  Buffer out(n * size);
  for (size_t i = 0; i < n; ++i) {
    const float x = u(rng);
    char* at = out.data + i * size;
    if (dtype == FB_F32) {
      std::memcpy(at, &x, 4);
    } else if (dtype == FB_BF16) {
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(at, &h, 2);
    } else {
      const _Float16 h = static_cast<_Float16>(x);
      std::memcpy(at, &h, 2);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Two builds of libflashback side by side in one process, in alternation"};
  std::string path_a, path_b, dtype_name = "f32", pass = "forward";
  int64_t batch = 1, heads = 16, kv_heads = 0, seqlen = 2048, seqlen_q = 0, seqlen_k = 0, head_dim = 128;
  int rounds = 20, inner = 1;
  bool causal = false;
  std::string workspace_from = "caller";
  app.add_option("library_a", path_a, "The first build's shared library (the baseline)")->required();
  app.add_option("library_b", path_b, "The second build's shared library")->required();
  app.add_option("--batch", batch, "Batch size B")->check(CLI::PositiveNumber);
  app.add_option("--heads", heads, "Query heads Hq")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", kv_heads, "Key/value heads Hk (default: Hq)")->check(CLI::PositiveNumber);
  app.add_option("--seqlen", seqlen, "Sequence length of queries and keys")->check(CLI::PositiveNumber);
  app.add_option("--seqlen-q", seqlen_q, "Query sequence length (default: --seqlen)")->check(CLI::PositiveNumber);
  app.add_option("--seqlen-k", seqlen_k, "Key sequence length (default: --seqlen)")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", head_dim, "Head dim D = Dv")->check(CLI::Range(1, 256));
  app.add_option("--dtype", dtype_name, "Element type")->check(CLI::IsMember({"f32", "bf16", "f16"}));
  app.add_option("--pass", pass, "The pass to time")->check(CLI::IsMember({"forward", "backward"}));
  app.add_flag("--causal", causal, "Bottom-right causal mask");
  app.add_option("--workspace", workspace_from,
                 "caller: one workspace passed to every call; library: none passed (NULL), each build allocates or "
                 "keeps its own")
      ->check(CLI::IsMember({"caller", "library"}));
  app.add_option("--rounds", rounds, "Rounds, each one call series of A and one of B")->check(CLI::Range(2, 100000));
  app.add_option("--inner", inner, "Calls per timed series (median of rounds of their mean)")
      ->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);
  if (kv_heads == 0) kv_heads = heads;
  if (seqlen_q == 0) seqlen_q = seqlen;
  if (seqlen_k == 0) seqlen_k = seqlen;
  const fb_dtype dtype = dtype_name == "f32" ? FB_F32 : dtype_name == "bf16" ? FB_BF16 : FB_F16;
  try {
    const Library lib[2] = {Library(path_a), Library(path_b)};
    std::mt19937 rng(1);
    const size_t nq = batch * heads * seqlen_q * head_dim, nk = batch * kv_heads * seqlen_k * head_dim;
    const size_t size = dtype == FB_F32 ? 4 : 2;
    Buffer q = random_tensor(nq, dtype, rng), k = random_tensor(nk, dtype, rng), v = random_tensor(nk, dtype, rng),
           dout = random_tensor(nq, dtype, rng), o(nq * size), dq(nq * size), dk(nk * size), dv(nk * size);
    std::vector<float> lse(batch * heads * seqlen_q);
    const Library& a = lib[0];
    auto t4 = [&](Buffer& x, int64_t h, int64_t s) { return a.tensor4(x.data, dtype, batch, h, s, head_dim); };
    const fb_tensor tq = t4(q, heads, seqlen_q), tk = t4(k, kv_heads, seqlen_k), tv = t4(v, kv_heads, seqlen_k),
                    to = t4(o, heads, seqlen_q), td = t4(dout, heads, seqlen_q), tdq = t4(dq, heads, seqlen_q),
                    tdk = t4(dk, kv_heads, seqlen_k), tdv = t4(dv, kv_heads, seqlen_k);
    const fb_tensor tl = a.tensor3(lse.data(), FB_F32, batch, heads, seqlen_q);
    fb_params params;
    a.params_init(&params);
    params.causal = causal ? 1 : 0;
    // One workspace, as large as either build asks for either pass.
    size_t bytes = 0;
    for (const Library& l : lib) {
      size_t f = 0, b = 0;
      if (l.forward_size(&tq, &tk, &tv, &to, &tl, &params, &f) != FB_SUCCESS ||
          l.backward_size(&td, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, nullptr, &params, &b) != FB_SUCCESS)
        throw std::runtime_error(l.last_error());
      bytes = std::max({bytes, f, b});
    }
    if (workspace_from == "library") bytes = 0;
    Buffer workspace(bytes);
    void* ws = bytes ? workspace.data : nullptr;
    auto call = [&](const Library& l) {
      const fb_status st =
          pass == "forward" ? l.forward(&tq, &tk, &tv, &to, &tl, &params, ws, bytes)
                            : l.backward(&td, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, nullptr, &params, ws, bytes);
      if (st != FB_SUCCESS) throw std::runtime_error(l.last_error());
    };
    call(a);  // O and LSE for the backward; a warm-up of each
    call(lib[1]);
    std::vector<double> ratio;
    double best[2] = {1e30, 1e30};
    for (int r = 0; r < rounds; ++r) {
      double t[2];
      for (int s = 0; s < 2; ++s) {
        const int x = r % 2 == 0 ? s : 1 - s;  // A B, then B A
        const double start = seconds_now();
        for (int i = 0; i < inner; ++i) call(lib[x]);
        t[x] = (seconds_now() - start) / inner;
        best[x] = std::min(best[x], t[x]);
      }
      ratio.push_back(t[1] / t[0]);
    }
    std::sort(ratio.begin(), ratio.end());
    const size_t n = ratio.size();
    std::printf("%s %s, B = %lld, Hq = %lld, Hk = %lld, Sq = %lld, Sk = %lld, D = %lld%s: "
                "A best %.3f ms, B best %.3f ms, B / A median %.3f (quartiles %.3f - %.3f, %zu rounds)%s\n",
                dtype_name.c_str(), pass.c_str(), static_cast<long long>(batch), static_cast<long long>(heads),
                static_cast<long long>(kv_heads), static_cast<long long>(seqlen_q), static_cast<long long>(seqlen_k),
                static_cast<long long>(head_dim), causal ? ", causal" : "", best[0] * 1e3, best[1] * 1e3,
                ratio[n / 2], ratio[n / 4], ratio[(3 * n) / 4], n,
                bytes ? "" : ", the library's workspace");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashback_ab: %s\n", e.what());
    return 1;
  }
  return 0;
}
