#include "safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <unistd.h>

namespace flashback::safetensors {

namespace {

using nlohmann::json;

// A legitimate header nests 3 deep ({name: {shape: [..]}}); refuse anything much deeper before it
// reaches the JSON parser.
constexpr int kMaxJsonDepth = 16;

struct DTypeName {
  const char* name;
  bool supported;
  DType dtype;
};
// Every dtype the safetensors format defines; only the first three are read.
constexpr DTypeName kDTypes[] = {
    {"F32", true, DType::F32},       {"F16", true, DType::F16},       {"BF16", true, DType::BF16},
    {"BOOL", false, {}},             {"U8", false, {}},               {"I8", false, {}},
    {"F8_E5M2", false, {}},          {"F8_E4M3", false, {}},          {"F8_E8M0", false, {}},
    {"I16", false, {}},              {"U16", false, {}},              {"I32", false, {}},
    {"U32", false, {}},              {"F64", false, {}},              {"I64", false, {}},
    {"U64", false, {}},              {"C64", false, {}},              {"F4", false, {}},
    {"F6_E2M3", false, {}},          {"F6_E3M2", false, {}},
};

std::string shown(std::string_view s) {
  // Names come from untrusted files: show them escaped and bounded.
  constexpr size_t kMax = 64;
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f || c == '\'' || c == '\\') {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMax) out += "...";
  return out + "'";
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A JSON value for an error message, bounded.
std::string value_str(const json& v) {
  std::string s = v.dump(-1, ' ', true, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 40) + "...";
  return s + " (" + v.type_name() + ")";
}

// Nesting depth of the JSON text, counting brackets outside strings. Returns false past the limit.
bool depth_within_limit(std::span<const std::byte> text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::byte b : text) {
    const char c = static_cast<char>(b);
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '{' || c == '[') {
      if (++depth > limit) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

// A non-negative integer that fits in 64 bits, or nullopt.
std::optional<uint64_t> as_u64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  return std::nullopt;
}

Result<Header> fail(std::string message) { return Result<Header>::failure(std::move(message)); }

Result<Header> parse_header_impl(std::span<const std::byte> file) {
  if (file.size() < 8)
    return fail("truncated file: expected at least 8 bytes (the header size), got " + std::to_string(file.size()));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);
  const uint64_t rest = file.size() - 8;
  if (n > rest)
    return fail("header size " + std::to_string(n) + " is larger than the rest of the file (" + std::to_string(rest) +
                " bytes): truncated file or not a safetensors file");
  if (n > kMaxHeaderBytes)
    return fail("header size " + std::to_string(n) + " is larger than the limit of " + std::to_string(kMaxHeaderBytes) +
                " bytes");
  const auto text = file.subspan(8, n);
  const uint64_t buffer_bytes = rest - n;

  if (!depth_within_limit(text, kMaxJsonDepth))
    return fail("header is not a safetensors header: JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                " levels");

  // nlohmann keeps the last of duplicate keys silently; the callback sees every key, so duplicates
  // (tensor names, or fields within an entry) are caught here.
  std::vector<std::set<std::string>> keys_at_depth;
  std::string duplicate;
  auto on_event = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: keys_at_depth.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!keys_at_depth.empty()) keys_at_depth.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys_at_depth.empty() && parsed.is_string() && !keys_at_depth.back().insert(parsed.get<std::string>()).second &&
            duplicate.empty()) {
          duplicate = keys_at_depth.size() == 1
                          ? "duplicate tensor name " + shown(parsed.get<std::string>())
                          : "duplicate key " + shown(parsed.get<std::string>()) + " inside an entry";
        }
        break;
      default: break;
    }
    return true;
  };
  json header;
  try {
    const auto* first = reinterpret_cast<const uint8_t*>(text.data());
    header = json::parse(first, first + text.size(), on_event, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::exception& e) { // a parse error, or a number beyond double (out_of_range.406)
    std::string what = e.what();
    if (auto p = what.find("] "); what.starts_with("[json.exception") && p != std::string::npos) what = what.substr(p + 2);
    // The message quotes the input ("last read: ..."): keep it printable ASCII.
    std::string clean;
    for (unsigned char c : what) {
      if (c >= 0x20 && c < 0x7f) {
        clean += static_cast<char>(c);
      } else {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02x", c);
        clean += buf;
      }
    }
    return fail("header is not valid JSON: " + clean);
  }
  if (!duplicate.empty()) return fail("header: " + duplicate);
  if (!header.is_object()) return fail("header: expected a JSON object, got " + std::string(header.type_name()));

  Header out;
  out.data_start = 8 + n;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return fail("__metadata__: expected an object of strings, got " + value_str(entry));
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          return fail("__metadata__ " + shown(key) + ": expected a string value, got " + value_str(value));
        out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string who = "tensor " + shown(name);
    if (!entry.is_object())
      return fail(who + ": expected an object with dtype, shape and data_offsets, got " + value_str(entry));
    TensorInfo t;
    t.name = name;

    const auto dtype = entry.find("dtype");
    if (dtype == entry.end()) return fail(who + ": missing 'dtype'");
    if (!dtype->is_string()) return fail(who + ": 'dtype' must be a string, got " + value_str(*dtype));
    const std::string& dname = dtype->get_ref<const std::string&>();
    const auto known = std::find_if(std::begin(kDTypes), std::end(kDTypes),
                                    [&](const DTypeName& d) { return dname == d.name; });
    if (known == std::end(kDTypes)) return fail(who + ": unknown dtype " + shown(dname));
    if (!known->supported) return fail(who + ": dtype " + dname + " is not supported (expected F32, F16 or BF16)");
    t.dtype = known->dtype;

    const auto shape = entry.find("shape");
    if (shape == entry.end()) return fail(who + ": missing 'shape'");
    if (!shape->is_array()) return fail(who + ": 'shape' must be an array of integers, got " + value_str(*shape));
    for (size_t i = 0; i < shape->size(); ++i) {
      const auto dim = as_u64((*shape)[i]);
      if (!dim || *dim > static_cast<uint64_t>(INT64_MAX))
        return fail(who + ": shape[" + std::to_string(i) + "] must be a non-negative integer, got " +
                    value_str((*shape)[i]));
      t.shape.push_back(static_cast<int64_t>(*dim));
    }
    // The element count, 0 when any dim is 0 (whatever the others); otherwise it must fit int64.
    const int64_t numel_signed = t.numel();
    if (numel_signed < 0)
      return fail(who + ": shape " + value_str(*shape) + " has more elements than int64 can count");
    const auto numel = static_cast<uint64_t>(numel_signed);

    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end()) return fail(who + ": missing 'data_offsets'");
    if (!offsets->is_array() || offsets->size() != 2)
      return fail(who + ": 'data_offsets' must be an array [begin, end], got " + value_str(*offsets));
    const auto begin = as_u64((*offsets)[0]), end = as_u64((*offsets)[1]);
    if (!begin || !end)
      return fail(who + ": 'data_offsets' must hold two non-negative integers, got " + value_str(*offsets));
    t.begin = *begin;
    t.end = *end;
    const std::string range = "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]";
    if (t.begin > t.end) return fail(who + ": " + range + ": begin is after end");
    if (t.end > buffer_bytes)
      return fail(who + ": " + range + " runs past the end of the data buffer (" + std::to_string(buffer_bytes) +
                  " bytes)");
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(t.dtype)), &bytes))
      return fail(who + ": shape " + shape_str(t.shape) + " of " + dname + " has more bytes than 64 bits can count");
    if (bytes != t.end - t.begin)
      return fail(who + ": " + range + " hold " + std::to_string(t.end - t.begin) + " bytes, but shape " +
                  shape_str(t.shape) + " of " + dname + " needs " + std::to_string(bytes));
    out.tensors.push_back(std::move(t));
  }

  // The tensors must tile the data buffer exactly (the format forbids holes, which would let a file
  // hide other content).
  std::sort(out.tensors.begin(), out.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : out.tensors) {
    if (t.begin < covered)
      return fail("tensors " + shown(previous->name) + " [" + std::to_string(previous->begin) + ", " +
                  std::to_string(previous->end) + "] and " + shown(t.name) + " [" + std::to_string(t.begin) + ", " +
                  std::to_string(t.end) + "] overlap");
    if (t.begin > covered)
      return fail("bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                  ") of the data buffer belong to no tensor (the format allows no holes)");
    covered = t.end;
    previous = &t;
  }
  if (covered != buffer_bytes)
    return fail("the data buffer has " + std::to_string(buffer_bytes) + " bytes but the tensors cover " +
                std::to_string(covered) + " (trailing bytes)");
  return out;
}

template <class T>
Result<T> guarded(const char* what, auto&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Result<T>::failure(std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    return Result<T>::failure(std::string(what) + ": internal error: " + e.what());
  } catch (...) {
    return Result<T>::failure(std::string(what) + ": internal error");
  }
}

} // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
  }
  return "?";
}

size_t dtype_size(DType dtype) { return dtype == DType::F32 ? 4 : 2; }

int64_t numel_of(std::span<const int64_t> shape) {
  for (int64_t d : shape)
    if (d == 0) return 0;
  int64_t n = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  return n;
}

int64_t TensorInfo::numel() const { return numel_of(shape); }

Result<Header> parse_header(std::span<const std::byte> file) noexcept {
  return guarded<Header>("header", [&] { return parse_header_impl(file); });
}

Result<Archive> Archive::from_bytes(std::vector<std::byte> file) noexcept {
  return guarded<Archive>("reading", [&]() -> Result<Archive> {
    auto header = parse_header(file);
    if (!header) return Result<Archive>::failure(header.error());
    Archive a;
    a.file_ = std::move(file);
    a.header_ = std::move(header).value();
    return a;
  });
}

Result<Archive> Archive::from_file(const std::string& path) noexcept {
  return guarded<Archive>("reading", [&]() -> Result<Archive> {
    auto failure = [&](const std::string& why) { return Result<Archive>::failure("cannot read '" + path + "': " + why); };
    // Only regular files: a FIFO or a device (/dev/zero) could block or never end.
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (std::filesystem::is_directory(status)) return failure("is a directory");
    if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) return failure("not a regular file");
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) return failure(std::strerror(errno));
    std::vector<std::byte> bytes;
    const auto size = std::filesystem::file_size(path, ec);
    if (!ec) bytes.reserve(size);
    std::byte chunk[1 << 16];
    size_t got = 0;
    while ((got = std::fread(chunk, 1, sizeof chunk, f)) > 0) bytes.insert(bytes.end(), chunk, chunk + got);
    const bool bad = std::ferror(f);
    const int err = errno;
    std::fclose(f);
    if (bad) return failure(std::strerror(err));
    auto archive = from_bytes(std::move(bytes));
    if (!archive) return Result<Archive>::failure("'" + path + "': " + archive.error());
    return archive;
  });
}

const TensorInfo* Archive::find(std::string_view name) const {
  for (const TensorInfo& t : header_.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

std::span<const std::byte> Archive::bytes(const TensorInfo& tensor) const {
  return std::span<const std::byte>(file_).subspan(header_.data_start + tensor.begin, tensor.end - tensor.begin);
}

std::vector<float> Archive::to_f32(const TensorInfo& tensor) const {
  const auto raw = bytes(tensor);
  const size_t n = raw.size() / dtype_size(tensor.dtype);
  std::vector<float> out(n);
  if (tensor.dtype == DType::F32) {
    if (n > 0) std::memcpy(out.data(), raw.data(), n * 4);
    return out;
  }
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, raw.data() + 2 * i, 2);
    out[i] = tensor.dtype == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
  }
  return out;
}

Result<std::vector<std::byte>> serialize(std::span<const TensorRef> tensors,
                                         const std::map<std::string, std::string>& metadata) noexcept {
  using R = Result<std::vector<std::byte>>;
  return guarded<std::vector<std::byte>>("writing", [&]() -> R {
    json header = json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    uint64_t offset = 0;
    for (const TensorRef& t : tensors) {
      const std::string who = "tensor " + shown(t.name);
      if (t.name == "__metadata__") return R::failure(who + ": the name is reserved for metadata");
      if (header.contains(t.name)) return R::failure(who + ": duplicate name");
      for (int64_t d : t.shape)
        if (d < 0) return R::failure(who + ": shape " + shape_str(t.shape) + " has a negative dim");
      const int64_t count = numel_of(t.shape); // as the reader counts: 0 when a dim is 0
      if (count < 0) return R::failure(who + ": shape " + shape_str(t.shape) + " has more elements than int64 can count");
      const auto numel = static_cast<uint64_t>(count);
      uint64_t bytes = 0;
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(t.dtype)), &bytes) || bytes != t.data.size())
        return R::failure(who + ": shape " + shape_str(t.shape) + " of " + dtype_name(t.dtype) + " needs " +
                          std::to_string(numel) + " elements, got " + std::to_string(t.data.size()) + " bytes");
      header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
    std::string text;
    try {
      text = header.dump();
    } catch (const json::type_error&) {
      return R::failure("a tensor name or metadata string is not valid UTF-8");
    }
    // Spaces after the JSON are allowed; they put the data at a multiple of 8 bytes.
    text.append((8 - text.size() % 8) % 8, ' ');
    std::vector<std::byte> out(8 + text.size() + offset);
    const uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
    std::memcpy(out.data() + 8, text.data(), text.size());
    std::byte* data = out.data() + 8 + text.size();
    for (const TensorRef& t : tensors) {
      if (!t.data.empty()) std::memcpy(data, t.data.data(), t.data.size());
      data += t.data.size();
    }
    return out;
  });
}

std::string write_file(const std::string& path, std::span<const TensorRef> tensors,
                       const std::map<std::string, std::string>& metadata) noexcept {
  try {
    auto bytes = serialize(tensors, metadata);
    if (!bytes) return bytes.error();
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    auto failure = [&](int err) {
      std::remove(tmp.c_str());
      return "cannot write '" + path + "': " + std::strerror(err);
    };
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) return "cannot write '" + path + "': " + std::strerror(errno);
    const auto& data = bytes.value();
    const bool wrote = std::fwrite(data.data(), 1, data.size(), f) == data.size();
    const int write_err = errno;
    const bool closed = std::fclose(f) == 0;
    const int close_err = errno;
    if (!wrote) return failure(write_err ? write_err : EIO);
    if (!closed) return failure(close_err ? close_err : EIO);
    if (std::rename(tmp.c_str(), path.c_str()) != 0) return failure(errno);
    return "";
  } catch (const std::exception& e) {
    return std::string("writing: internal error: ") + e.what();
  } catch (...) {
    return "writing: internal error";
  }
}

// --- float conversions -------------------------------------------------------------------------------

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13)); // inf, NaN
  if (exp == 0) {
    const float mag = std::ldexp(static_cast<float>(man), -24); // zero or subnormal: man * 2^-24
    return sign ? -mag : mag;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13)); // rebias 15 -> 127
}

float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

namespace {
// m >> shift, rounded to nearest, ties to even.
uint32_t shift_round_even(uint32_t m, int shift) {
  const uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return r + ((rem > half || (rem == half && (r & 1))) ? 1 : 0);
}
} // namespace

uint16_t f32_to_f16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7fffffff;
  if (a > 0x7f800000) return sign | 0x7e00 | ((a >> 13) & 0x3ff); // NaN stays a (quiet) NaN
  const int exp = static_cast<int>(a >> 23) - 127 + 15;      // f16-biased exponent
  if (exp >= 31) return sign | 0x7c00;                          // inf, or too large
  if (exp <= 0) {
    if (exp < -10) return sign; // below half the smallest subnormal (2^-25)
    return sign | static_cast<uint16_t>(shift_round_even((a & 0x7fffff) | 0x800000, 14 - exp));
  }
  // A carry out of the mantissa bumps the exponent, up to inf: the encoding makes that right.
  return sign | static_cast<uint16_t>(shift_round_even((static_cast<uint32_t>(exp) << 23) | (a & 0x7fffff), 13));
}

uint16_t f32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40); // quiet NaN
  return static_cast<uint16_t>(shift_round_even(x, 16)); // a carry into the exponent rounds up to inf
}

} // namespace flashback::safetensors
