#include "test_util.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <sstream>

#include "core/problem.h"
#include "cpu/backend.h"
#include "cpu/isa.h"
#include "cpu/tiles.h"

namespace fbtest {

// --- Seeds --------------------------------------------------------------------------------------------

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

} // namespace

uint64_t base_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("FLASHBACK_TEST_SEED"); env && *env) return uint64_t{std::strtoull(env, nullptr, 10)};
    std::random_device rd;
    return uint64_t{(static_cast<uint64_t>(rd()) << 32) ^ rd()};
  }();
  return seed;
}

std::mt19937_64 rng_for(const std::string& name) { return std::mt19937_64(splitmix64(base_seed() ^ fnv1a(name))); }

std::string seed_note() {
  return "seed " + std::to_string(base_seed()) + " (rerun with FLASHBACK_TEST_SEED=" + std::to_string(base_seed()) +
         " to reproduce)";
}

// --- Instruction set ----------------------------------------------------------------------------------

std::optional<std::string> isa_skip_reason() {
  using flashback::cpu::Isa;
  const char* emulation = std::getenv("FLASHBACK_EMULATION");
  if (emulation && *emulation && flashback::cpu::active_isa() <= flashback::cpu::machine_isa())
    return std::string("FLASHBACK_EMULATION=") + emulation +
           " runs only levels this machine lacks, on AVX2; this machine runs " + fb_cpu_isa() +
           " for real, which that level's registration tests";
  if (bf16_dot_forced() && flashback::cpu::machine_isa() < Isa::avx512bf16)
    return std::string("FLASHBACK_BF16_DOT=1 runs the vdpbf16ps kernels, which need AVX512_BF16; this machine runs ") +
           fb_cpu_isa() + " (FLASHBACK_EMULATION=avx512bf16, the avx512bf16_emulated registration, tests them here)";
  const char* env = std::getenv("FLASHBACK_ISA");
  if (env == nullptr || *env == '\0') return std::nullopt;
  Isa requested;
  if (!flashback::cpu::parse_isa(env, &requested)) {
    ADD_FAILURE() << "FLASHBACK_ISA=" << env << " names no instruction set (scalar, avx2, avx512, avx512bf16, amx)";
    return std::nullopt;
  }
  const Isa running = flashback::cpu::active_isa();
  if (running > requested) {
    ADD_FAILURE() << "FLASHBACK_ISA=" << env << " did not cap the instruction set: fb_cpu_isa() = " << fb_cpu_isa();
    return std::nullopt;
  }
  if (running == requested) return std::nullopt;
  return std::string("FLASHBACK_ISA=") + env + " but this process runs " + fb_cpu_isa() +
         " kernels (the machine supports up to " + flashback::cpu::isa_name(flashback::cpu::machine_isa()) +
         "): the machine or the build lacks " + env;
}

bool emulated_tiles() {
  return flashback::cpu::active_isa() == flashback::cpu::Isa::amx &&
         flashback::cpu::machine_isa() < flashback::cpu::Isa::amx;
}

bool bf16_dot_forced() {
  const char* env = std::getenv("FLASHBACK_BF16_DOT");
  return env && std::string(env) == "1";
}

bool bf16_dot_kernels() {
  return flashback::cpu::active_isa() >= flashback::cpu::Isa::avx512bf16 && flashback::cpu::bf16_dot_preferred();
}

bool bf16_only_registration() {
  return bf16_dot_forced() ||
         (flashback::cpu::emulated_level() == flashback::cpu::Isa::avx512bf16 &&
          flashback::cpu::active_isa() == flashback::cpu::Isa::avx512bf16);
}

std::vector<fb_dtype> level_dtypes() {
  if (emulated_tiles()) return {FB_BF16, FB_F16};
  if (bf16_only_registration()) return {FB_BF16};
  return {FB_F32, FB_BF16, FB_F16};
}

bool f16_tiles() {
  return flashback::cpu::kernels_for(flashback::cpu::active_isa(), flashback::core::DType::f16).isa ==
         flashback::cpu::Isa::amx;
}

int64_t head_dim_for(fb_dtype dtype, int64_t d) {
  return dtype == FB_F16 && f16_tiles() ? std::max(d, flashback::cpu::kF16TilesMinHeadDim) : d;
}

namespace {
// The sizes and band of a case, as the library sees them (enough for the split counts).
flashback::core::Problem sizes_of(const Case& c) {
  flashback::core::Problem p;
  p.dtype = static_cast<flashback::core::DType>(c.dtype);
  p.batch = c.shape.batch;
  p.heads_q = c.shape.heads_q;
  p.heads_kv = c.shape.heads_kv;
  p.seqlen_q = c.shape.seqlen_q;
  p.seqlen_k = c.shape.seqlen_k;
  p.head_dim = c.shape.head_dim;
  p.head_dim_v = c.shape.head_dim_v;
  p.window_left = c.opt.window_left;
  p.window_right = c.opt.causal ? 0 : c.opt.window_right; // as core/problem.cpp
  p.band = flashback::core::make_band(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
  return p;
}
} // namespace

int64_t forward_splits_of(const Case& c) { return flashback::cpu::forward_splits(sizes_of(c)); }
int64_t backward_splits_of(const Case& c) { return flashback::cpu::backward_splits(sizes_of(c)); }
bool forward_wide_keys(const Case& c) { return flashback::cpu::wide_keys(sizes_of(c)); }

flashback::cpu::Tiles tiles_for(int64_t head_dim, int64_t head_dim_v, bool backward, fb_dtype dtype,
                                flashback::cpu::Keys keys) {
  using namespace flashback::cpu;
  const Isa isa =
      kernels_for(active_isa(), static_cast<flashback::core::DType>(dtype), std::max(head_dim, head_dim_v)).isa;
  return choose_tiles(isa, head_dim, head_dim_v, backward, keys);
}

// --- Tensors ------------------------------------------------------------------------------------------

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::bhsd: return "bhsd";
    case Layout::bshd: return "bshd";
    case Layout::padded: return "padded";
    case Layout::slice: return "slice";
    case Layout::reversed: return "reversed";
    case Layout::far: return "far";
  }
  return "?";
}

namespace {

// Elements before and after the views of every buffer: 64 bytes, so the views start where the
// buffer's cache lines do (plus the layout's lead and the shift).
int64_t guard(fb_dtype dtype) { return 64 / static_cast<int64_t>(dtype_size(dtype)); }

struct Placement {
  std::vector<int64_t> stride;
  int64_t lead = 0; // offset of element 0 from the end of the front guard
};

// Far strides for dims of size 1, which never move the address: any int64, the extremes included.
Placement far_strides(Placement p, const std::vector<int64_t>& shape) {
  constexpr int64_t kFar[] = {std::numeric_limits<int64_t>::max(), -(int64_t{1} << 62) - 7, (int64_t{1} << 61) + 1,
                              std::numeric_limits<int64_t>::min()};
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] == 1) p.stride[i] = kFar[i];
  return p;
}

Placement place4(Layout l, int64_t b, int64_t h, int64_t s, int64_t x) {
  switch (l) {
    case Layout::bhsd: return {{h * s * x, s * x, x, 1}, 0};
    case Layout::bshd: return {{s * h * x, x, h * x, 1}, 0};
    case Layout::padded: {
      const int64_t row = x + 3, head = s * row + 5, batch = h * head + 2;
      return {{batch, head, row, 1}, 7};
    }
    case Layout::slice: { // [B, S+3, H+2, X+5], taking s in [2, S+2), h in [1, H+1), x in [3, X+3)
      const int64_t xs = x + 5, hs = (h + 2) * xs, bs = (s + 3) * hs;
      return {{bs, xs, hs, 1}, 2 * hs + xs + 3};
    }
    case Layout::reversed: // element [b][h][s] at the mirrored place of a contiguous BHSD buffer
      return {{-h * s * x, -s * x, -x, 1}, std::max<int64_t>(0, ((b * h - 1) * s + s - 1) * x)};
    case Layout::far: return far_strides(place4(Layout::bhsd, b, h, s, x), {b, h, s, x});
  }
  return {};
}

Placement place3(Layout l, int64_t b, int64_t h, int64_t s) {
  switch (l) {
    case Layout::bhsd:
    case Layout::bshd: return {{h * s, s, 1}, 0};
    case Layout::padded: return {{h * (s + 3) + 1, s + 3, 1}, 5};
    case Layout::slice: return {{(h + 1) * (s + 2), s + 2, 1}, (s + 2) + 1}; // [B, H+1, S+2] from (0, 1, 1)
    case Layout::reversed: return {{-h * s, -s, 1}, std::max<int64_t>(0, (b * h - 1) * s)}; // rows stay in order
    case Layout::far: return far_strides(place3(Layout::bhsd, b, h, s), {b, h, s});
  }
  return {};
}

// The largest element offset from element 0 (negative strides reach below it: the layout's lead).
int64_t max_offset(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride) {
  int64_t m = 0;
  for (size_t i = 0; i < shape.size(); ++i) m += std::max<int64_t>(0, (shape[i] - 1) * stride[i]);
  return m;
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// Conversions written here, independent of the library's bit manipulation: by value, with exact
// double arithmetic and std::nearbyint (round to nearest even).
float f16_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  double v;
  if (exp == 0x1F) {
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = exp ? std::ldexp(1024 + man, exp - 25) : std::ldexp(man, -24);
  }
  return static_cast<float>(sign ? -v : v);
}

uint16_t f16_bits(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::abs(static_cast<double>(x));
  if (std::isnan(x)) return sign | 0x7E00;
  if (a >= 65520.0) return sign | 0x7C00; // rounds past the largest finite 65504
  if (a < 0x1p-14) return sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24)); // 1024 is the smallest normal
  int e;
  std::frexp(a, &e); // a = f * 2^e, f in [0.5, 1)
  double man = std::nearbyint(std::ldexp(a, 11 - e)); // in [1024, 2048]
  if (man == 2048) {
    man = 1024;
    ++e;
  }
  return sign | static_cast<uint16_t>(((e + 14) << 10) | (static_cast<int>(man) - 1024));
}

float load_element(fb_dtype t, const unsigned char* p) {
  uint32_t u = 0;
  switch (t) {
    case FB_F32: std::memcpy(&u, p, 4); return std::bit_cast<float>(u);
    case FB_BF16: std::memcpy(&u, p, 2); return std::bit_cast<float>(u << 16);
    case FB_F16: {
      static const std::vector<float> table = [] { // every f16 value: the sweeps read millions
        std::vector<float> t(65536);
        for (uint32_t h = 0; h < t.size(); ++h) t[h] = f16_value(static_cast<uint16_t>(h));
        return t;
      }();
      std::memcpy(&u, p, 2);
      return table[u];
    }
  }
  return std::nanf("");
}

void store_element(fb_dtype t, unsigned char* p, float x) {
  switch (t) {
    case FB_F32: std::memcpy(p, &x, 4); return;
    case FB_BF16: {
      const uint32_t u = bits_of(x);
      const uint16_t h = std::isnan(x) ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                       : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      std::memcpy(p, &h, 2);
      return;
    }
    case FB_F16: {
      const uint16_t h = f16_bits(x);
      std::memcpy(p, &h, 2);
      return;
    }
  }
}

} // namespace

size_t dtype_size(fb_dtype t) { return t == FB_F32 ? 4 : 2; }

const char* dtype_name(fb_dtype t) {
  switch (t) {
    case FB_F32: return "f32";
    case FB_BF16: return "bf16";
    case FB_F16: return "f16";
  }
  return "?";
}

double unit_roundoff(fb_dtype t) {
  switch (t) {
    case FB_F32: return 0x1p-24;
    case FB_BF16: return 0x1p-8;
    case FB_F16: return 0x1p-11;
  }
  return 1;
}

float round_to(fb_dtype t, float x) {
  unsigned char bytes[4];
  store_element(t, bytes, x);
  return load_element(t, bytes);
}

float value_of_bits(fb_dtype t, uint16_t bits) {
  unsigned char bytes[2];
  std::memcpy(bytes, &bits, 2);
  return load_element(t, bytes);
}

std::vector<float> round_to(fb_dtype t, std::vector<float> x) {
  for (float& e : x) e = round_to(t, e);
  return x;
}

Tensor Tensor::make(Layout layout, const std::vector<int64_t>& shape, fb_dtype dtype, int64_t shift) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = shape;
  const Placement p = shape.size() == 4 ? place4(layout, shape[0], shape[1], shape[2], shape[3])
                                        : place3(layout, shape[0], shape[1], shape[2]);
  t.stride_ = p.stride;
  t.offset_ = guard(dtype) + p.lead + shift;
  const int64_t extent = product(shape) == 0 ? 0 : max_offset(shape, t.stride_) + 1;
  t.buf_ = std::make_shared<Buffer>((t.offset_ + extent + guard(dtype)) * dtype_size(dtype), 0);
  return t;
}

std::vector<Tensor> Tensor::packed3(int64_t b, int64_t s, int64_t h, int64_t d, fb_dtype dtype, int64_t shift) {
  const std::vector<int64_t> stride = {s * 3 * h * d, d, 3 * h * d, 1};
  auto buf = std::make_shared<Buffer>((2 * guard(dtype) + shift + b * s * 3 * h * d) * dtype_size(dtype), 0);
  std::vector<Tensor> views(3);
  for (int i = 0; i < 3; ++i) {
    views[i].buf_ = buf;
    views[i].dtype_ = dtype;
    views[i].shape_ = {b, h, s, d};
    views[i].stride_ = stride;
    views[i].offset_ = guard(dtype) + shift + i * h * d;
  }
  return views;
}

int64_t Tensor::numel() const { return product(shape_); }

std::vector<int64_t> Tensor::element_offsets() const {
  const int64_t n = numel();
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  if (n == 0) return out;
  std::vector<int64_t> idx(shape_.size(), 0);
  const int64_t last = shape_.back(), step = stride_.back();
  while (static_cast<int64_t>(out.size()) < n) { // one innermost row at a time
    int64_t off = offset_;
    for (size_t d = 0; d + 1 < shape_.size(); ++d) off += idx[d] * stride_[d];
    for (int64_t x = 0; x < last; ++x) out.push_back(off + x * step);
    for (int d = rank() - 2; d >= 0 && ++idx[d] == shape_[d]; --d) idx[d] = 0;
  }
  return out;
}

uint32_t Tensor::bits_at(int64_t i) const {
  uint32_t u = 0;
  std::memcpy(&u, buf_->data() + i * dtype_size(dtype_), dtype_size(dtype_)); // little-endian
  return u;
}

fb_tensor Tensor::raw() const {
  fb_tensor t;
  std::memset(&t, 0, sizeof t);
  t.data = buf_->data() + offset_ * dtype_size(dtype_);
  t.dtype = dtype_;
  t.device = FB_DEVICE_CPU;
  t.rank = rank();
  for (int i = 0; i < rank(); ++i) {
    t.shape[i] = shape_[i];
    t.stride[i] = stride_[i];
  }
  return t;
}

std::vector<double> Tensor::read() const {
  std::vector<double> dense;
  dense.reserve(static_cast<size_t>(numel()));
  for (int64_t off : element_offsets()) dense.push_back(load_element(dtype_, buf_->data() + off * dtype_size(dtype_)));
  return dense;
}

void Tensor::write(const std::vector<double>& dense) {
  const std::vector<int64_t> offs = element_offsets();
  for (size_t i = 0; i < offs.size(); ++i)
    store_element(dtype_, buf_->data() + offs[i] * dtype_size(dtype_), static_cast<float>(dense[i]));
}

void Tensor::fill_normal(std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t off : element_offsets()) store_element(dtype_, buf_->data() + off * dtype_size(dtype_), normal(rng));
}

uint32_t poison_bits(fb_dtype t) {
  switch (t) {
    case FB_F32: return 0x7FC0BAD0u;
    case FB_BF16: return 0x7FCBu;
    case FB_F16: return 0x7E0Bu;
  }
  return 0;
}

void poison(const std::vector<const Tensor*>& outputs) {
  for (const Tensor* t : outputs) {
    const uint32_t bits = poison_bits(t->dtype());
    const size_t size = dtype_size(t->dtype());
    for (size_t at = 0; at + size <= t->bytes().size(); at += size) std::memcpy(t->bytes().data() + at, &bits, size);
  }
}

::testing::AssertionResult only_views_written(const std::vector<const Tensor*>& outputs) {
  std::map<const Buffer*, std::pair<const Tensor*, std::vector<char>>> inside;
  for (const Tensor* t : outputs) { // buffer -> (a tensor of it, element is in some view)
    auto& [any, mask] = inside[&t->bytes()];
    any = t;
    mask.resize(t->bytes().size() / dtype_size(t->dtype()), 0);
    for (int64_t off : t->element_offsets()) mask[off] = 1;
  }
  for (const auto& [buf, entry] : inside) {
    const auto& [t, mask] = entry;
    for (size_t i = 0; i < mask.size(); ++i)
      if (!mask[i] && t->bits_at(static_cast<int64_t>(i)) != poison_bits(t->dtype()))
        return ::testing::AssertionFailure() << "element " << i << " of an output buffer of " << mask.size()
                                             << " elements lies outside every view but was written (bits 0x"
                                             << std::hex << t->bits_at(static_cast<int64_t>(i)) << ")";
  }
  return ::testing::AssertionSuccess();
}

Snapshot::Snapshot(const std::vector<const Tensor*>& tensors) {
  for (const Tensor* t : tensors) {
    const Buffer* buf = &t->bytes();
    if (std::none_of(copies_.begin(), copies_.end(), [&](const auto& c) { return c.first == buf; }))
      copies_.emplace_back(buf, *buf);
  }
}

::testing::AssertionResult Snapshot::unchanged() const {
  for (const auto& [buf, copy] : copies_)
    for (size_t i = 0; i < copy.size(); ++i)
      if ((*buf)[i] != copy[i])
        return ::testing::AssertionFailure() << "byte " << i << " of a " << copy.size()
                                             << "-byte buffer that must not be written changed";
  return ::testing::AssertionSuccess();
}

// --- Comparison ---------------------------------------------------------------------------------------

std::string index_string(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> idx(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  std::ostringstream s;
  s << "[";
  for (size_t d = 0; d < idx.size(); ++d) s << (d ? ", " : "") << idx[d];
  s << "]";
  return s.str();
}

namespace {

// Shared by near_ref and lse_near_ref: the worst finite difference against a relative bound.
::testing::AssertionResult compare(const char* what, const Tensor& out, const std::vector<double>& ref, double tol,
                                   bool neg_inf_rows, double zero_scale) {
  const std::vector<double> got = out.read();
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " elements, the reference has " << ref.size();
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  double max_ref = 0;
  for (double r : ref)
    if (std::isfinite(r)) max_ref = std::max(max_ref, std::abs(r));
  const double scale = max_ref > 0 ? std::max(max_ref, 1.0) : zero_scale;
  const double bound = tol * scale;
  double worst = -1;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (neg_inf_rows && (ref[i] == kNegInf || got[i] == kNegInf)) {
      if (ref[i] != got[i])
        return ::testing::AssertionFailure() << what << index_string(out.shape(), static_cast<int64_t>(i)) << " = "
                                             << got[i] << ", the reference has " << ref[i]
                                             << " (-inf exactly where the row sees no key)";
      continue;
    }
    if (!std::isfinite(got[i]))
      return ::testing::AssertionFailure() << what << index_string(out.shape(), static_cast<int64_t>(i)) << " = "
                                           << got[i] << " (reference " << ref[i] << ")";
    const double diff = std::abs(got[i] - ref[i]);
    if (diff > worst) {
      worst = diff;
      at = i;
    }
  }
  if (worst <= bound) return ::testing::AssertionSuccess();
  std::ostringstream m;
  m.precision(7);
  m << what << ": max |out - ref| = " << worst << " at " << index_string(out.shape(), static_cast<int64_t>(at))
    << " (out " << got[at] << ", ref " << ref[at] << ") exceeds " << bound << " = " << tol;
  if (max_ref > 0)
    m << " * max(max |ref| = " << max_ref << ", 1)";
  else
    m << " * " << zero_scale << " (the reference is 0 everywhere: the size of what cancels)";
  return ::testing::AssertionFailure() << m.str();
}

} // namespace

::testing::AssertionResult near_ref(const char* what, const Tensor& out, const std::vector<double>& ref, double tol,
                                    double zero_scale) {
  return compare(what, out, ref, tol, false, zero_scale);
}

::testing::AssertionResult lse_near_ref(const char* what, const Tensor& out, const std::vector<double>& ref,
                                        double tol) {
  return compare(what, out, ref, tol, true, 1.0);
}

::testing::AssertionResult within_bar(const char* what, const Tensor& out, const std::vector<double>& naive,
                                      const std::vector<double>& ref, BarResult* result, double zero_scale) {
  constexpr double kFloor = 1e-5;
  const std::vector<double> got = out.read();
  if (got.size() != ref.size() || naive.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " elements, naive " << naive.size()
                                         << ", the reference " << ref.size();
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  BarResult r;
  size_t at = 0, naive_at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    auto where = [&] { return std::string(what) + index_string(out.shape(), static_cast<int64_t>(i)); };
    if (ref[i] == kNegInf || got[i] == kNegInf || naive[i] == kNegInf) {
      if (got[i] != ref[i] || naive[i] != ref[i])
        return ::testing::AssertionFailure() << where() << " = " << got[i] << ", naive " << naive[i]
                                             << ", the reference " << ref[i]
                                             << " (-inf exactly where the row sees no key); " << seed_note();
      continue;
    }
    if (!std::isfinite(ref[i]) || !std::isfinite(naive[i]))
      return ::testing::AssertionFailure() << where() << ": the reference is " << ref[i] << ", naive " << naive[i]
                                           << " (a bug in the test); " << seed_note();
    if (!std::isfinite(got[i]))
      return ::testing::AssertionFailure() << where() << " = " << got[i] << " (reference " << ref[i] << "); "
                                           << seed_note();
    r.max_ref = std::max(r.max_ref, std::abs(ref[i]));
    if (const double e = std::abs(got[i] - ref[i]); e > r.error) {
      r.error = e;
      at = i;
    }
    if (const double e = std::abs(naive[i] - ref[i]); e > r.naive_error) {
      r.naive_error = e;
      naive_at = i;
    }
  }
  // An output that is exactly 0 everywhere (dq and dk when every row sees one key: a softmax over one
  // key is constant) has no magnitude for the floor, and naive gets exact zeros there because it forms
  // dP and delta = dO . O, with O = V_j, by the same loop. Rounding to half precision adds nothing to
  // such values, so what remains is the f32 cancellation in dP - delta: it is held to the f32 checks'
  // bound for an all-zero reference, kRelTol times the size of what cancels (near_ref).
  r.bar = r.max_ref > 0 ? 2 * r.naive_error + kFloor * r.max_ref : kRelTol * zero_scale;
  if (result) *result = r;
  if (r.error <= r.bar) return ::testing::AssertionSuccess();
  std::ostringstream m;
  m.precision(6);
  m << what << ": max |out - ref64| = " << r.error << " at " << index_string(out.shape(), static_cast<int64_t>(at))
    << " (out " << got[at] << ", ref64 " << ref[at] << ", naive " << naive[at] << ") exceeds the bar " << r.bar
    << " (" << r.ratio() << "x)";
  if (r.max_ref > 0) {
    m << " = 2 * max |naive - ref64| (" << r.naive_error << " at "
      << index_string(out.shape(), static_cast<int64_t>(naive_at)) << ") + " << kFloor << " * max |ref64| ("
      << r.max_ref << ")";
  } else {
    m << ", the f32 checks' bound: the reference is all zeros (naive's error " << r.naive_error << ")";
  }
  m << "; " << seed_note();
  return ::testing::AssertionFailure() << m.str();
}

::testing::AssertionResult same_bits(const char* what, const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return ::testing::AssertionFailure() << what << ": the shapes differ";
  const std::vector<int64_t> oa = a.element_offsets(), ob = b.element_offsets();
  if (a.dtype() != b.dtype()) return ::testing::AssertionFailure() << what << ": the dtypes differ";
  for (size_t i = 0; i < oa.size(); ++i)
    if (a.bits_at(oa[i]) != b.bits_at(ob[i]))
      return ::testing::AssertionFailure() << what << index_string(a.shape(), static_cast<int64_t>(i)) << ": bits 0x"
                                           << std::hex << a.bits_at(oa[i]) << " vs 0x" << b.bits_at(ob[i]);
  return ::testing::AssertionSuccess();
}

// --- Cases --------------------------------------------------------------------------------------------

Case& Case::layout(Layout l) {
  q = k = v = o = dout = dq = dk = dv = l;
  return *this;
}

std::string Case::describe() const {
  const ref::Shape& s = shape;
  std::ostringstream d;
  d << "B=" << s.batch << " Hq=" << s.heads_q << " Hk=" << s.heads_kv << " Sq=" << s.seqlen_q << " Sk=" << s.seqlen_k
    << " D=" << s.head_dim << " Dv=" << s.head_dim_v;
  if (dtype != FB_F32) d << " " << dtype_name(dtype);
  if (opt.causal) d << " causal";
  if (opt.causal ? opt.window_left != -1 : opt.window_left != -1 || opt.window_right != -1)
    d << " window=(" << opt.window_left << "," << (opt.causal ? 0 : opt.window_right) << ")";
  if (opt.scale > 0) d << " scale=" << opt.scale;
  if (packed) {
    d << " packed";
  } else {
    const Layout all[] = {q, k, v, o, dout, dq, dk, dv};
    if (std::all_of(std::begin(all), std::end(all), [&](Layout l) { return l == q; })) {
      d << " layout=" << layout_name(q);
    } else {
      d << " layouts q=" << layout_name(q) << " k=" << layout_name(k) << " v=" << layout_name(v)
        << " o=" << layout_name(o) << " dout=" << layout_name(dout) << " dq=" << layout_name(dq)
        << " dk=" << layout_name(dk) << " dv=" << layout_name(dv);
    }
  }
  if (rows != Layout::bhsd) d << " rows=" << layout_name(rows);
  if (shift) d << " shift=" << shift;
  d << " grads=" << (want_dq ? "dq," : "") << (want_dk ? "dk," : "") << (want_dv ? "dv," : "")
    << (want_delta ? "delta" : "");
  if (threads) d << " threads=" << threads;
  return d.str();
}

fb_params Case::params() const {
  fb_params p;
  fb_params_init(&p);
  p.causal = opt.causal ? 1 : 0;
  p.window_left = opt.window_left;
  p.window_right = opt.window_right;
  if (opt.scale > 0) {
    p.has_scale = 1;
    p.scale = opt.scale;
  }
  p.num_threads = threads;
  return p;
}

Inputs make_inputs(const Case& c, std::mt19937_64& rng) {
  const ref::Shape& s = c.shape;
  Inputs in;
  if (c.packed) {
    std::vector<Tensor> qkv = Tensor::packed3(s.batch, s.seqlen_q, s.heads_q, s.head_dim, c.dtype, c.shift);
    in.q = qkv[0];
    in.k = qkv[1];
    in.v = qkv[2];
  } else {
    in.q = Tensor::make(c.q, {s.batch, s.heads_q, s.seqlen_q, s.head_dim}, c.dtype, c.shift);
    in.k = Tensor::make(c.k, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim}, c.dtype, c.shift);
    in.v = Tensor::make(c.v, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim_v}, c.dtype, c.shift);
  }
  in.dout = Tensor::make(c.dout, {s.batch, s.heads_q, s.seqlen_q, s.head_dim_v}, c.dtype, c.shift);
  for (Tensor* t : {&in.q, &in.k, &in.v, &in.dout}) t->fill_normal(rng);
  return in;
}

Inputs copy_of(const Case& c, const Inputs& in) {
  std::mt19937_64 unused(0);
  Inputs out = make_inputs(c, unused);
  for (auto [to, from] : {std::pair{&out.q, &in.q}, std::pair{&out.k, &in.k}, std::pair{&out.v, &in.v},
                          std::pair{&out.dout, &in.dout}})
    to->write(from->read());
  return out;
}

Outputs make_outputs(const Case& c) {
  const ref::Shape& s = c.shape;
  Outputs out;
  out.o = Tensor::make(c.o, {s.batch, s.heads_q, s.seqlen_q, s.head_dim_v}, c.dtype, c.shift);
  out.lse = Tensor::make(c.rows, {s.batch, s.heads_q, s.seqlen_q});
  Tensor dq, dk, dv;
  if (c.packed) {
    std::vector<Tensor> g = Tensor::packed3(s.batch, s.seqlen_q, s.heads_q, s.head_dim, c.dtype, c.shift);
    dq = g[0];
    dk = g[1];
    dv = g[2];
  } else {
    dq = Tensor::make(c.dq, {s.batch, s.heads_q, s.seqlen_q, s.head_dim}, c.dtype, c.shift);
    dk = Tensor::make(c.dk, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim}, c.dtype, c.shift);
    dv = Tensor::make(c.dv, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim_v}, c.dtype, c.shift);
  }
  if (c.want_dq) out.dq = dq;
  if (c.want_dk) out.dk = dk;
  if (c.want_dv) out.dv = dv;
  if (c.want_delta) out.delta = Tensor::make(c.rows, {s.batch, s.heads_q, s.seqlen_q});
  // Poison the whole packed buffer, also where a gradient that is not wanted would go.
  poison({&out.o, &out.lse, &dq, &dk, &dv});
  if (out.delta.exists()) poison({&out.delta});
  return out;
}

namespace {

// Runs `call(workspace, bytes)` on a workspace placed as `mode` says, inside a larger buffer whose
// bytes around the workspace must stay as they were. Every byte starts as 0xFF: a NaN in each dtype,
// which reaches an output if a call reads a workspace element it did not write first.
template <class Size, class Call>
fb_status with_workspace(WorkspaceMode mode, Size&& size, Call&& call) {
  if (mode == WorkspaceMode::library) return call(nullptr, 0);
  size_t bytes = 0;
  if (const fb_status s = size(&bytes); s != FB_SUCCESS) return s;
  constexpr size_t kAround = 128;
  constexpr unsigned char kPattern = 0xFF;
  std::vector<unsigned char> buf(bytes + 3 * kAround, kPattern);
  const uintptr_t base = reinterpret_cast<uintptr_t>(buf.data()) + kAround;
  const size_t start = (base + 63) / 64 * 64 - reinterpret_cast<uintptr_t>(buf.data()) +
                       (mode == WorkspaceMode::misaligned ? 3 : 0);
  const fb_status s = call(buf.data() + start, bytes);
  for (size_t i = 0; i < buf.size(); ++i)
    if ((i < start || i >= start + bytes) && buf[i] != kPattern) {
      ADD_FAILURE() << "a byte " << (i < start ? "before" : "after") << " the " << bytes
                    << "-byte caller workspace was written";
      break;
    }
  return s;
}

fb_tensor raw_or_empty(const Tensor& t) { return t.exists() ? t.raw() : fb_tensor{}; }

// The C API's arguments of case `c`'s forward on its tensors: its workspace query and the call.
struct ForwardArgs {
  fb_params p;
  fb_tensor q, k, v, o, lse;
  ForwardArgs(const Case& c, const Inputs& in, const Outputs& out)
      : p(c.params()), q(in.q.raw()), k(in.k.raw()), v(in.v.raw()), o(out.o.raw()), lse(out.lse.raw()) {}
  fb_status size(size_t* bytes) const { return fb_forward_workspace_size(&q, &k, &v, &o, &lse, &p, bytes); }
  fb_status run(void* w, size_t bytes) const { return fb_forward(&q, &k, &v, &o, &lse, &p, w, bytes); }
};

// The backward's: the gradients the case does not want (and delta) are NULL.
struct BackwardArgs {
  fb_params p;
  fb_tensor dout, q, k, v, o, lse, dq, dk, dv, delta;
  const fb_tensor *pdq, *pdk, *pdv, *pdelta;
  BackwardArgs(const Case& c, const Inputs& in, const Outputs& out)
      : p(c.params()), dout(in.dout.raw()), q(in.q.raw()), k(in.k.raw()), v(in.v.raw()), o(out.o.raw()),
        lse(out.lse.raw()), dq(raw_or_empty(out.dq)), dk(raw_or_empty(out.dk)), dv(raw_or_empty(out.dv)),
        delta(raw_or_empty(out.delta)), pdq(out.dq.exists() ? &dq : nullptr),
        pdk(out.dk.exists() ? &dk : nullptr), pdv(out.dv.exists() ? &dv : nullptr),
        pdelta(out.delta.exists() ? &delta : nullptr) {}
  BackwardArgs(const BackwardArgs&) = delete; // the pointers are to its own members
  BackwardArgs& operator=(const BackwardArgs&) = delete;
  fb_status size(size_t* bytes) const {
    return fb_backward_workspace_size(&dout, &q, &k, &v, &o, &lse, pdq, pdk, pdv, pdelta, &p, bytes);
  }
  fb_status run(void* w, size_t bytes) const {
    return fb_backward(&dout, &q, &k, &v, &o, &lse, pdq, pdk, pdv, pdelta, &p, w, bytes);
  }
};

} // namespace

fb_status forward_workspace_bytes(const Case& c, const Inputs& in, const Outputs& out, size_t* bytes) {
  return ForwardArgs(c, in, out).size(bytes);
}

fb_status backward_workspace_bytes(const Case& c, const Inputs& in, const Outputs& out, size_t* bytes) {
  return BackwardArgs(c, in, out).size(bytes);
}

fb_status run_forward(const Case& c, const Inputs& in, Outputs& out, WorkspaceMode ws) {
  const ForwardArgs a(c, in, out);
  return with_workspace(
      ws, [&](size_t* bytes) { return a.size(bytes); }, [&](void* w, size_t bytes) { return a.run(w, bytes); });
}

fb_status run_backward(const Case& c, const Inputs& in, Outputs& out, WorkspaceMode ws) {
  const BackwardArgs a(c, in, out);
  return with_workspace(
      ws, [&](size_t* bytes) { return a.size(bytes); }, [&](void* w, size_t bytes) { return a.run(w, bytes); });
}

std::vector<const Tensor*> forward_outputs(const Outputs& out) { return {&out.o, &out.lse}; }

std::vector<const Tensor*> backward_outputs(const Outputs& out) {
  std::vector<const Tensor*> v;
  for (const Tensor* t : {&out.dq, &out.dk, &out.dv, &out.delta})
    if (t->exists()) v.push_back(t);
  return v;
}

Outputs run_forward_backward(const Case& c, const Inputs& in, WorkspaceMode ws) {
  Outputs out = make_outputs(c);
  EXPECT_EQ(run_forward(c, in, out, ws), FB_SUCCESS) << fb_last_error();
  EXPECT_EQ(run_backward(c, in, out, ws), FB_SUCCESS) << fb_last_error();
  return out;
}

void expect_same_bits(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(same_bits("o", a.o, b.o));
  EXPECT_TRUE(same_bits("lse", a.lse, b.lse));
  for (auto [name, x, y] : {std::tuple{"dq", &a.dq, &b.dq}, std::tuple{"dk", &a.dk, &b.dk},
                            std::tuple{"dv", &a.dv, &b.dv}, std::tuple{"delta", &a.delta, &b.delta}})
    if (x->exists()) { EXPECT_TRUE(same_bits(name, *x, *y)); }
}

namespace {
// For each query row (by_rows) or key: does it see, or is it seen by, any key or row? Broadcast over
// batches and heads, [B, H, S] order.
std::vector<bool> without_partner(const Case& c, bool by_rows) {
  const ref::Shape& s = c.shape;
  const int64_t n = by_rows ? s.seqlen_q : s.seqlen_k, m = by_rows ? s.seqlen_k : s.seqlen_q;
  const int64_t heads = s.batch * (by_rows ? s.heads_q : s.heads_kv);
  std::vector<bool> alone(heads * n);
  for (int64_t a = 0; a < n; ++a) {
    bool meets = false;
    for (int64_t b = 0; b < m && !meets; ++b) meets = by_rows ? ref::visible(s, c.opt, a, b) : ref::visible(s, c.opt, b, a);
    for (int64_t bh = 0; bh < heads; ++bh) alone[bh * n + a] = !meets;
  }
  return alone;
}
} // namespace

std::vector<bool> blind_rows(const Case& c) { return without_partner(c, true); }
std::vector<bool> unseen_keys(const Case& c) { return without_partner(c, false); }

::testing::AssertionResult rows_equal(const char* what, const Tensor& t, const std::vector<bool>& rows, double value) {
  const std::vector<double> got = t.read();
  const int64_t x = t.rank() == 4 ? t.shape()[3] : 1;
  for (size_t i = 0; i < got.size(); ++i)
    if (rows[i / x] && !(got[i] == value))
      return ::testing::AssertionFailure() << what << index_string(t.shape(), static_cast<int64_t>(i)) << " = "
                                           << got[i] << ", expected exactly " << value;
  return ::testing::AssertionSuccess();
}

} // namespace fbtest
