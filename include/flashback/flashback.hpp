// flashback: the C++ API. A thin layer over the C API in flashback.h (the same core, the same checks):
// tensor views, a params struct and an error type instead of status codes.
#ifndef FLASHBACK_FLASHBACK_HPP
#define FLASHBACK_FLASHBACK_HPP

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "flashback/flashback.h"

namespace flashback {

enum class Status : int {
  success = FB_SUCCESS,
  invalid_argument = FB_ERROR_INVALID_ARGUMENT,
  unsupported = FB_ERROR_UNSUPPORTED,
  out_of_memory = FB_ERROR_OUT_OF_MEMORY,
  internal = FB_ERROR_INTERNAL,
};

enum class DType : int32_t { f32 = FB_F32, bf16 = FB_BF16, f16 = FB_F16 };

// Thrown by every function below when the C API reports an error; what() is the full message.
class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

// A strided view of memory the caller owns: shape and element strides, last dimension contiguous.
struct TensorView {
  fb_tensor t{};

  TensorView() = default;
  explicit TensorView(const fb_tensor& raw) : t(raw) {}

  // Rank-4 view with explicit strides, e.g. a BSHD buffer viewed as [B, H, S, D].
  static TensorView strided(void* data, DType dtype, const int64_t (&shape)[4], const int64_t (&stride)[4]) {
    TensorView v;
    v.t.data = data;
    v.t.dtype = static_cast<int32_t>(dtype);
    v.t.device = FB_DEVICE_CPU;
    v.t.rank = 4;
    for (int i = 0; i < 4; ++i) {
      v.t.shape[i] = shape[i];
      v.t.stride[i] = stride[i];
    }
    return v;
  }
  // Rank-3 view with explicit strides (lse, delta).
  static TensorView strided(void* data, DType dtype, const int64_t (&shape)[3], const int64_t (&stride)[3]) {
    TensorView v;
    v.t.data = data;
    v.t.dtype = static_cast<int32_t>(dtype);
    v.t.device = FB_DEVICE_CPU;
    v.t.rank = 3;
    for (int i = 0; i < 3; ++i) {
      v.t.shape[i] = shape[i];
      v.t.stride[i] = stride[i];
    }
    return v;
  }
  // A contiguous [B, H, S, D] buffer.
  static TensorView bhsd(void* data, DType dtype, int64_t b, int64_t h, int64_t s, int64_t d) {
    return TensorView(fb_tensor_contiguous4(data, static_cast<fb_dtype>(dtype), b, h, s, d));
  }
  // A contiguous [B, S, H, D] buffer (FlashAttention's Python layout), viewed as [B, H, S, D].
  static TensorView bshd(void* data, DType dtype, int64_t b, int64_t s, int64_t h, int64_t d) {
    return strided(data, dtype, {b, h, s, d}, {s * h * d, d, h * d, 1});
  }
  // A contiguous f32 [B, H, S] buffer (lse, delta).
  static TensorView rows(float* data, int64_t b, int64_t h, int64_t s) {
    return TensorView(fb_tensor_contiguous3(data, FB_F32, b, h, s));
  }

  const fb_tensor* raw() const { return &t; }
};

struct Params {
  bool causal = false;
  int64_t window_left = -1;  // -1: unbounded
  int64_t window_right = -1; // -1: unbounded
  std::optional<double> scale; // default 1/sqrt(D); finite and > 0, also once rounded to float32
  int num_threads = 0;         // 0: library default

  fb_params to_c() const {
    fb_params p;
    fb_params_init(&p);
    p.causal = causal ? 1 : 0;
    p.window_left = window_left;
    p.window_right = window_right;
    p.has_scale = scale.has_value() ? 1 : 0;
    p.scale = scale.value_or(0.0);
    p.num_threads = num_threads;
    return p;
  }
};

// Caller-owned workspace; leave it out to let the library allocate (and keep: workspace_cache_bytes).
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

namespace detail {
inline void check(fb_status s) {
  if (s != FB_SUCCESS) throw Error(static_cast<Status>(s), fb_last_error());
}
inline const fb_tensor* opt(const std::optional<TensorView>& v) { return v ? v->raw() : nullptr; }
} // namespace detail

inline size_t forward_workspace_size(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& o, const TensorView& lse, const Params& params = {}) {
  fb_params p = params.to_c();
  size_t bytes = 0;
  detail::check(fb_forward_workspace_size(q.raw(), k.raw(), v.raw(), o.raw(), lse.raw(), &p, &bytes));
  return bytes;
}

// o = softmax(scale * q k^T + mask) v; lse = natural-log logsumexp of each row.
inline void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                    const TensorView& lse, const Params& params = {}, Workspace workspace = {}) {
  fb_params p = params.to_c();
  detail::check(fb_forward(q.raw(), k.raw(), v.raw(), o.raw(), lse.raw(), &p, workspace.data, workspace.bytes));
}

// Outputs of the backward; leave a gradient out (std::nullopt) to skip the work only it needs.
struct Gradients {
  std::optional<TensorView> dq, dk, dv;
  std::optional<TensorView> delta; // rowsum(dout * o), [B, Hq, Sq] f32
};

inline size_t backward_workspace_size(const TensorView& dout, const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o, const TensorView& lse,
                                      const Gradients& grads, const Params& params = {}) {
  fb_params p = params.to_c();
  size_t bytes = 0;
  detail::check(fb_backward_workspace_size(dout.raw(), q.raw(), k.raw(), v.raw(), o.raw(), lse.raw(),
                                           detail::opt(grads.dq), detail::opt(grads.dk), detail::opt(grads.dv),
                                           detail::opt(grads.delta), &p, &bytes));
  return bytes;
}

inline void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& o, const TensorView& lse, const Gradients& grads,
                     const Params& params = {}, Workspace workspace = {}) {
  fb_params p = params.to_c();
  detail::check(fb_backward(dout.raw(), q.raw(), k.raw(), v.raw(), o.raw(), lse.raw(), detail::opt(grads.dq),
                            detail::opt(grads.dk), detail::opt(grads.dv), detail::opt(grads.delta), &p,
                            workspace.data, workspace.bytes));
}

inline std::string cpu_isa() { return fb_cpu_isa(); }
inline std::string cpu_kernels_isa(DType dtype) {
  const char* isa = fb_cpu_kernels_isa(static_cast<fb_dtype>(dtype));
  return isa ? isa : "";
}
inline int default_num_threads() { return fb_default_num_threads(); }
// The library's workspace kept for calls given none (fb_workspace_cache_bytes), and freeing it.
inline size_t workspace_cache_bytes() { return fb_workspace_cache_bytes(); }
inline void release_workspace_cache() { fb_workspace_cache_release(); }
inline std::string version() { return fb_version(); }

} // namespace flashback

#endif // FLASHBACK_FLASHBACK_HPP
