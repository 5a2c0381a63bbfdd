#include "host_tensor.h"

#include <cstring>
#include <limits>
#include <new>
#include <random>

#include "safetensors.h"

namespace flashback::cli {

namespace st = flashback::safetensors;

// 64 bytes: one cache line, one AVX-512 register.
constexpr std::align_val_t kAlignment{64};

void HostTensor::Free::operator()(std::byte* p) const { ::operator delete[](p, kAlignment); }

HostTensor::HostTensor(fb_dtype dtype, Layout layout, int64_t b, int64_t h, int64_t s, int64_t d)
    : dtype_(dtype), layout_(layout), shape_{b, h, s, d}, numel_(b * h * s * d) {
  if (layout == Layout::bhsd) {
    stride_[3] = 1, stride_[2] = d, stride_[1] = s * d, stride_[0] = h * s * d;
  } else { // [B, S, H, D] viewed as [B, H, S, D]
    stride_[3] = 1, stride_[1] = d, stride_[2] = h * d, stride_[0] = s * h * d;
  }
  bytes_ = static_cast<size_t>(numel_) * dtype_bytes(dtype);
  // Never a zero-size allocation, so data() is a valid pointer for empty tensors too.
  data_.reset(static_cast<std::byte*>(::operator new[](bytes_ > 0 ? bytes_ : 64, kAlignment)));
  if (bytes_ > 0) std::memset(data_.get(), 0, bytes_);
}

fb_tensor HostTensor::view() const {
  fb_tensor t;
  std::memset(&t, 0, sizeof t);
  t.data = data_.get();
  t.dtype = dtype_;
  t.device = FB_DEVICE_CPU;
  t.rank = 4;
  for (int i = 0; i < 4; ++i) t.shape[i] = shape_[i], t.stride[i] = stride_[i];
  return t;
}

std::vector<int64_t> HostTensor::stored_shape() const {
  if (layout_ == Layout::bhsd) return {shape_[0], shape_[1], shape_[2], shape_[3]};
  return {shape_[0], shape_[2], shape_[1], shape_[3]};
}

double HostTensor::get(int64_t offset) const {
  const std::byte* p = data_.get();
  switch (dtype_) {
    case FB_F32: {
      float f;
      std::memcpy(&f, p + 4 * offset, 4);
      return f;
    }
    case FB_BF16:
    case FB_F16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * offset, 2);
      return dtype_ == FB_BF16 ? st::bf16_to_f32(h) : st::f16_to_f32(h);
    }
  }
  return 0;
}

void HostTensor::set(int64_t offset, double value) {
  std::byte* p = data_.get();
  const float f = static_cast<float>(value);
  if (dtype_ == FB_F32) {
    std::memcpy(p + 4 * offset, &f, 4);
    return;
  }
  const uint16_t h = dtype_ == FB_BF16 ? st::f32_to_bf16(f) : st::f32_to_f16(f);
  std::memcpy(p + 2 * offset, &h, 2);
}

std::vector<double> HostTensor::heads_to_dense(int64_t b, int64_t h0, int64_t nh) const {
  std::vector<double> out(static_cast<size_t>(nh * shape_[2] * shape_[3]));
  size_t n = 0;
  for (int64_t h = h0; h < h0 + nh; ++h)
    for (int64_t s = 0; s < shape_[2]; ++s)
      for (int64_t d = 0; d < shape_[3]; ++d) out[n++] = at(b, h, s, d);
  return out;
}

std::vector<double> HostTensor::to_dense() const {
  std::vector<double> out;
  out.reserve(static_cast<size_t>(numel_));
  for (int64_t b = 0; b < shape_[0]; ++b) {
    const auto part = heads_to_dense(b, 0, shape_[1]);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

void HostTensor::fill_normal(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t b = 0; b < shape_[0]; ++b)
    for (int64_t h = 0; h < shape_[1]; ++h)
      for (int64_t s = 0; s < shape_[2]; ++s)
        for (int64_t d = 0; d < shape_[3]; ++d) set(offset(b, h, s, d), normal(rng));
}

void HostTensor::fill_nan() {
  for (int64_t i = 0; i < numel_; ++i) set(i, std::numeric_limits<double>::quiet_NaN());
}

} // namespace flashback::cli
