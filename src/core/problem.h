// The problem: one plain description of an attention call, shared by every backend and entry point.
// Built only by validate_forward / validate_backward, so a backend never re-validates.
// No SIMD, no threads here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "flashback/flashback.h"

namespace flashback::core {

enum class DType : int32_t { f32 = FB_F32, bf16 = FB_BF16, f16 = FB_F16 };

// D and Dv lie in [1, kMaxHeadDim].
constexpr int64_t kMaxHeadDim = 256;

inline size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }
const char* dtype_name(DType t);

// The library's internal error; the C API turns it into a status and a thread-local message.
class Error : public std::exception {
 public:
  Error(fb_status status, std::string message) : status_(status), message_(std::move(message)) {}
  fb_status status() const noexcept { return status_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  fb_status status_;
  std::string message_;
};

// A validated [B, H, S, X] tensor: base pointer and element strides of the first three dims (the last
// is contiguous). A tensor that was left out has data == nullptr.
struct Strided4 {
  void* data = nullptr;
  int64_t sb = 0, sh = 0, ss = 0;
  explicit operator bool() const { return data != nullptr; }
};

// A validated [B, H, S] f32 tensor (lse, delta).
struct Rows3 {
  float* data = nullptr;
  int64_t sb = 0, sh = 0;
  explicit operator bool() const { return data != nullptr; }
};

// The mask as a band of diagonals: query i sees key j iff dlo <= j - i <= dhi (and 0 <= j < Sk).
// Unbounded sides are clamped to the extreme diagonals, so dlo, dhi lie in [-Sq, Sk].
struct Band {
  int64_t dlo = 0, dhi = 0;

  bool visible(int64_t i, int64_t j) const { return j - i >= dlo && j - i <= dhi; }
  // Keys [first, last] that some row of [i0, i1) sees, clamped to [0, sk); first > last when none.
  void keys_of_rows(int64_t i0, int64_t i1, int64_t sk, int64_t* first, int64_t* last) const;
  // Rows [first, last] that see some key of [j0, j1), clamped to [0, sq); first > last when none.
  void rows_of_keys(int64_t j0, int64_t j1, int64_t sq, int64_t* first, int64_t* last) const;
  // Every (i, j) of the rectangle is visible: no element mask is needed there.
  bool covers(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return j0 - (i1 - 1) >= dlo && (j1 - 1) - i0 <= dhi;
  }
};

// The band of a window (left, right) over [Sq, Sk] (-1: unbounded on that side), bottom-right aligned.
Band make_band(int64_t sq, int64_t sk, int64_t left, int64_t right);

struct Problem {
  DType dtype = DType::f32; // of q, k, v, o, dout, dq, dk, dv; lse and delta are f32
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0, head_dim_v = 0;
  float scale = 0;
  int64_t window_left = -1, window_right = -1; // after causal was applied
  Band band;
  int num_threads = 0; // 0: the backend's default

  Strided4 q, k, v, o, dout, dq, dk, dv;
  Rows3 lse, delta;

  int64_t group() const { return heads_q / heads_kv; } // query heads per kv head
  // A causal or windowed mask: some key may be hidden from some row (the tile sizes may differ).
  bool masked() const { return window_left >= 0 || window_right >= 0; }
};

// Validate the arguments of fb_forward / fb_backward and describe the problem. Throws Error naming
// the argument with the expected and the actual value.
Problem validate_forward(const fb_tensor* q, const fb_tensor* k, const fb_tensor* v, const fb_tensor* o,
                         const fb_tensor* lse, const fb_params* params);
Problem validate_backward(const fb_tensor* dout, const fb_tensor* q, const fb_tensor* k, const fb_tensor* v,
                          const fb_tensor* o, const fb_tensor* lse, const fb_tensor* dq, const fb_tensor* dk,
                          const fb_tensor* dv, const fb_tensor* delta, const fb_params* params);

} // namespace flashback::core
