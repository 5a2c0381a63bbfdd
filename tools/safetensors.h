// Safetensors files: read (from bytes or a file) and write (named tensors).
//
// Format (https://github.com/huggingface/safetensors):
//   [8 bytes: N, u64 little-endian] [N bytes: JSON header] [data buffer]
//   header = {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//             "__metadata__": {"key": "value", ...}}            (metadata optional, string values)
//   Offsets are relative to the start of the data buffer. The tensors cover the buffer exactly:
//   no overlaps, no holes, nothing after the last tensor.
//
// The reader never throws, never reads outside the bytes it was given and bounds everything it
// allocates by the input size: every problem comes back as an error message (it is meant to be driven
// by a fuzzer). dtypes F32, F16 and BF16 are parsed; the other valid safetensors dtypes are reported as
// "dtype X is not supported".
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flashback::safetensors {

enum class DType : uint8_t { F32, F16, BF16 };

const char* dtype_name(DType dtype); // "F32", "F16", "BF16" (the spelling in the header)
size_t dtype_size(DType dtype);

// The header refuses sizes above this (the reference implementation's limit), so a corrupt size
// field cannot make the reader allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// A value or the message of why there is none.
template <class T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}
  static Result failure(std::string message) {
    Result r;
    r.error_ = std::move(message);
    return r;
  }
  bool ok() const { return value_.has_value(); }
  explicit operator bool() const { return ok(); }
  const T& value() const& { return *value_; }
  T& value() & { return *value_; }
  T&& value() && { return std::move(*value_); }
  const std::string& error() const { return error_; }

 private:
  Result() = default;
  std::optional<T> value_;
  std::string error_;
};

// Elements of a shape: 0 when a dim is 0 (whatever the others), -1 when a dim is negative or the
// count does not fit int64.
int64_t numel_of(std::span<const int64_t> shape);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape; // [] is a scalar (one element)
  uint64_t begin = 0, end = 0; // byte range in the data buffer
  int64_t numel() const; // 0 when a dim is 0; -1 when the count does not fit int64 (never in a read file)
};

struct Header {
  std::vector<TensorInfo> tensors; // in data-buffer order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0; // file offset of the data buffer: 8 + N
};

// Parses and validates the header of a whole file held in `file` (size field, header and the data
// buffer's extent; the data itself is not inspected).
Result<Header> parse_header(std::span<const std::byte> file) noexcept;

// A parsed file in memory.
class Archive {
 public:
  static Result<Archive> from_bytes(std::vector<std::byte> file) noexcept;
  static Result<Archive> from_file(const std::string& path) noexcept;

  const Header& header() const { return header_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const TensorInfo* find(std::string_view name) const;
  // The tensor's bytes (little-endian, row-major); may be unaligned.
  std::span<const std::byte> bytes(const TensorInfo& tensor) const;
  // The tensor's values widened to float (F16 and BF16 are converted exactly).
  std::vector<float> to_f32(const TensorInfo& tensor) const;

 private:
  std::vector<std::byte> file_;
  Header header_;
};

// One tensor to write: its bytes must be numel(shape) * dtype_size(dtype) long, little-endian.
struct TensorRef {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
};

inline TensorRef f32_tensor(std::string name, std::vector<int64_t> shape, std::span<const float> values) {
  return {std::move(name), DType::F32, std::move(shape), std::as_bytes(values)};
}

// The whole file as bytes. The header is padded with spaces so that the data starts at a multiple of
// 8 bytes. Tensors are laid out in the order given. Errors: bad names (empty, "__metadata__",
// duplicates, not UTF-8), negative dims, data of the wrong size.
Result<std::vector<std::byte>> serialize(std::span<const TensorRef> tensors,
                                         const std::map<std::string, std::string>& metadata = {}) noexcept;

// serialize() then write to `path` (through a temporary file renamed over it, so a failed write never
// leaves a truncated file behind). Returns "" on success, else the error.
std::string write_file(const std::string& path, std::span<const TensorRef> tensors,
                       const std::map<std::string, std::string>& metadata = {}) noexcept;

// IEEE half and bfloat16 <-> float (round to nearest even; NaN stays NaN).
float f16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
uint16_t f32_to_bf16(float f);

} // namespace flashback::safetensors
