// A tensor the program owns: logical [B, H, S, D], stored contiguously in BHSD or BSHD order, in f32,
// bf16 or f16, 64-byte aligned. Values go in and out as double (rounded to the dtype on the way in).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common.h"
#include "flashback/flashback.h"

namespace flashback::cli {

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(fb_dtype dtype, Layout layout, int64_t b, int64_t h, int64_t s, int64_t d);

  fb_tensor view() const; // rank-4 strided view, [B, H, S, D]
  fb_dtype dtype() const { return dtype_; }
  Layout layout() const { return layout_; }
  int64_t numel() const { return numel_; }
  int64_t dim(int i) const { return shape_[i]; }
  // The shape in storage order: [B, H, S, D] or [B, S, H, D] (what a file holds).
  std::vector<int64_t> stored_shape() const;
  std::span<std::byte> bytes() { return {data_.get(), bytes_}; }
  std::span<const std::byte> bytes() const { return {data_.get(), bytes_}; }

  int64_t offset(int64_t b, int64_t h, int64_t s, int64_t d) const {
    return b * stride_[0] + h * stride_[1] + s * stride_[2] + d * stride_[3];
  }
  double get(int64_t offset) const;
  void set(int64_t offset, double value);
  double at(int64_t b, int64_t h, int64_t s, int64_t d) const { return get(offset(b, h, s, d)); }

  // Every element as double in dense [B, H, S, D] order (the reference's layout), or a slice of
  // heads [h0, h0 + nh) of batch b in dense [nh, S, D] order.
  std::vector<double> to_dense() const;
  std::vector<double> heads_to_dense(int64_t b, int64_t h0, int64_t nh) const;
  void fill_normal(uint64_t seed); // N(0, 1), drawn in [B, H, S, D] order so layouts see the same values
  void fill_nan();                 // poison outputs: an element the library never writes stays NaN

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  fb_dtype dtype_ = FB_F32;
  Layout layout_ = Layout::bhsd;
  int64_t shape_[4] = {0, 0, 0, 0};
  int64_t stride_[4] = {0, 0, 0, 0};
  int64_t numel_ = 0;
  size_t bytes_ = 0;
  std::unique_ptr<std::byte[], Free> data_;
};

} // namespace flashback::cli
