// libFuzzer target: the C API (flashback.h) with arbitrary shapes, strides, dtypes, devices, ranks,
// params, gradient subsets, workspaces and thread counts, over small buffers.
//
// The harness never hands the library memory it does not own. It computes each tensor's extent
// itself (overflow-safe) and gives every tensor that fits the budget an exactly sized buffer (so ASan
// sees a stray byte at either end). It calls fb_forward / fb_backward only when every tensor fits its
// buffer, or when its own model of the contract (flashback.h) says the call must be rejected before
// any memory is touched; otherwise only the *_workspace_size functions, which validate without
// touching tensor data. Work per input is bounded (B Hq (Sq+1) (Sk+1) (D+Dv) <= kMaxWork, and the
// blocks of 16 x 16 it pads to, B Hq ceil(Sq/16) ceil(Sk/16) <= kMaxBlocks).
//
// Checked on every call: the status is the one the model predicts (success, or an error with a
// message; never FB_ERROR_INTERNAL), the size query agrees with the call, a rejected call writes
// nothing, an accepted one leaves its inputs and every byte of its outputs' buffers outside the views
// as they were and writes every element of the views. With finite inputs: rows that see no key get
// o = 0, lse = -inf, dq = 0, delta = 0 exactly and unseen keys dk = dv = 0; small problems match the
// float64 reference (tests/reference.h) and give the same bits with one thread.
//
// Input format (read front to back; missing bytes read as 0, so any input is a case): see decode().
// Build: cmake -DFLASHBACK_FUZZ=ON with clang (RELIABILITY.md); seeds in fuzz/corpus/fuzz_c_api.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "flashback/flashback.h"
#include "reference.h"
#include "safetensors.h" // its f16 / bf16 conversions

namespace {

constexpr int64_t kMaxWork = 1 << 20;          // B Hq (Sq+1) (Sk+1) (D+Dv): a call stays in milliseconds
constexpr int64_t kMaxCheckWork = 1 << 18;     // the float64 reference and the one-thread rerun
// B Hq ceil(Sq/16) ceil(Sk/16): 55042 heads of 3 rows and 1 key took 9 s a call (emulated tiles, ASan)
constexpr int64_t kMaxBlocks = 1 << 12;
constexpr int64_t kMaxTensorBytes = 1 << 20;   // one buffer
constexpr int64_t kMaxTotalBytes = 6 << 20;    // all buffers of one input
// A workspace (the library's or the harness's), over which a call gets only its size query: libFuzzer
// stops at 2 GB, and the work and block bounds bound it only through the library's padding (the amx
// backward of 65535 heads of one row took 2.8 GB at 29f4fbc, 258 MiB since tiles.h: backward_block_rows).
constexpr size_t kMaxWorkspaceBytes = size_t{256} << 20;
constexpr int64_t I64_MAX = std::numeric_limits<int64_t>::max();

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_c_api: %s\n", what.c_str());
  std::abort();
}
void check(bool ok, const std::string& what) {
  if (!ok) fail(what);
}
bool same_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

// --- Reading the input --------------------------------------------------------------------------------

class Bytes {
 public:
  Bytes(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  uint8_t u8() { return at_ < n_ ? p_[at_++] : 0; }
  uint32_t u32() {
    uint32_t x = 0;
    for (int i = 0; i < 4; ++i) x |= static_cast<uint32_t>(u8()) << (8 * i);
    return x;
  }
  uint64_t u64() { return u32() | static_cast<uint64_t>(u32()) << 32; }

 private:
  const uint8_t* p_;
  size_t n_, at_ = 0;
};

// Values at and around every boundary the validation has.
constexpr int64_t kWild[] = {0, -1, -2, 1, 2, 3, 255, 256, 257, 1023, 1024, 1025, 65535, 65536,
                             (int64_t{1} << 31) - 1, int64_t{1} << 31, int64_t{1} << 32, (int64_t{1} << 32) + 1,
                             3037000499, 3037000500, int64_t{1} << 53, int64_t{1} << 61, int64_t{1} << 62,
                             (int64_t{1} << 62) + 1, I64_MAX / 2, I64_MAX - 1, I64_MAX,
                             std::numeric_limits<int64_t>::min(), -(int64_t{1} << 31)};
constexpr int kWildCount = sizeof kWild / sizeof kWild[0];

int64_t wild(Bytes& in) {
  const uint8_t i = in.u8();
  return i < kWildCount ? kWild[i] : static_cast<int64_t>(in.u64());
}

// --- Tensors --------------------------------------------------------------------------------------------

enum Id { Q, K, V, O, LSE, DOUT, DQ, DK, DV, DELTA, kTensors };
const char* const kNames[] = {"q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "delta"};
bool is_rows(int id) { return id == LSE || id == DELTA; }

size_t elem_size(int32_t dtype) { return dtype == FB_F32 ? 4 : 2; }
bool valid_dtype(int32_t d) { return d == FB_F32 || d == FB_BF16 || d == FB_F16; }

// The harness's own account of one tensor argument.
struct Arg {
  bool present = true; // false: the argument is NULL
  fb_tensor t{};
  bool defect = false;    // the model says the library must reject this tensor on its own
  bool overlaps = false;  // an output whose elements certainly share memory (must reject)
  bool may_overlap = false; // an output with interleaved strides (the library may reject)
  bool aliased = false;     // points into q's buffer with a view that may run past it
  int64_t numel = 0;
  int64_t extent = 0;       // bytes; valid when !defect
  int64_t below = 0;        // bytes of the view before data (negative strides); valid when !defect
  unsigned char* buf = nullptr; // harness-owned, exactly `extent` bytes from the view's lowest byte; null
                                // when it does not fit
  bool fits = false;
};

// What the model predicts for a call.
enum class Expect { accept, reject, either };

// The checks flashback.h promises for one tensor on its own: rank, dtype, device, shapes >= 0, a
// contiguous last dim, an element count and element offsets (above and below data: negative strides)
// and a byte extent that fit int64 (the count as it accumulates dim by dim), data when there are
// elements, and neither end beyond the address space.
void check_alone(Arg& a, int rank) {
  const fb_tensor& t = a.t;
  a.defect = t.rank != rank || !valid_dtype(t.dtype) || t.device != FB_DEVICE_CPU || t.device_index != 0;
  if (a.defect) return;
  int64_t numel = 1;
  for (int d = 0; d < rank; ++d) {
    if (t.shape[d] < 0) a.defect = true;
    if (!a.defect && __builtin_mul_overflow(numel, t.shape[d], &numel)) a.defect = true;
  }
  if (a.defect) return;
  if (t.shape[rank - 1] > 1 && t.stride[rank - 1] != 1) {
    a.defect = true;
    return;
  }
  a.numel = numel;
  a.extent = 0;
  a.below = 0;
  if (numel == 0) return;
  // Each span is below 2^126 in magnitude; the sums stop once out of int64, before they could pass 2^127.
  const __int128 i64_min = -static_cast<__int128>(I64_MAX) - 1;
  __int128 max_offset = 0, min_offset = 0;
  for (int d = 0; d < rank; ++d) {
    const __int128 span = static_cast<__int128>(t.shape[d] - 1) * t.stride[d];
    (span > 0 ? max_offset : min_offset) += span;
    if (max_offset > I64_MAX || min_offset <= i64_min) {
      a.defect = true;
      return;
    }
  }
  const __int128 es = elem_size(t.dtype), extent = max_offset - min_offset + 1, bytes = extent * es;
  const __int128 low = min_offset * es;
  if (extent > I64_MAX || bytes > I64_MAX || low < i64_min || t.data == nullptr) {
    a.defect = true;
    return;
  }
  a.extent = static_cast<int64_t>(bytes);
  a.below = static_cast<int64_t>(-low);
  const __int128 data = reinterpret_cast<uintptr_t>(t.data);
  if (data < -low || data + low + a.extent > static_cast<__int128>(std::numeric_limits<uintptr_t>::max()))
    a.defect = true;
}

// Offsets (in elements) of every element of a view from its lowest one (the start of its buffer),
// row-major; calls fn(offset, flat index).
template <class Fn>
void each_element(const fb_tensor& t, Fn&& fn) {
  int64_t n = 1, low = 0;
  for (int d = 0; d < t.rank; ++d) {
    n *= t.shape[d];
    if (t.shape[d] > 1 && t.stride[d] < 0) low += (t.shape[d] - 1) * t.stride[d];
  }
  int64_t idx[FB_MAX_RANK] = {};
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t off = -low;
    for (int d = 0; d < t.rank; ++d) off += idx[d] * t.stride[d];
    fn(off, flat);
    for (int d = t.rank - 1; d >= 0 && ++idx[d] == t.shape[d]; --d) idx[d] = 0;
  }
}

// Do two elements of an output share an address? Zero strides on dims > 1 certainly; other
// interleaved strides are counted exactly (the buffer is small).
void check_self_overlap(Arg& a) {
  const fb_tensor& t = a.t;
  if (a.numel <= 1) return;
  std::pair<int64_t, int64_t> sorted[FB_MAX_RANK]; // (stride, shape) of the dims > 1
  int n = 0;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] > 1 && t.stride[d] == 0) a.overlaps = true;
    if (t.shape[d] > 1) sorted[n++] = {t.stride[d] < 0 ? -t.stride[d] : t.stride[d], t.shape[d]};
  }
  if (a.overlaps) return;
  std::sort(sorted, sorted + n);
  __int128 inner = 0; // nested (non-interleaved) strides: each beyond the reach of the smaller ones
  bool nested = true;
  for (int i = 0; i < n; ++i) {
    if (sorted[i].first <= inner) nested = false;
    inner += static_cast<__int128>(sorted[i].second - 1) * sorted[i].first;
  }
  if (nested) return;
  a.may_overlap = true;
  if (a.numel > a.extent / static_cast<int64_t>(elem_size(t.dtype))) { // more elements than addresses
    a.overlaps = true;
    return;
  }
  if (!a.buf) return; // too large to count: "either"
  std::vector<bool> seen(static_cast<size_t>(a.extent / elem_size(t.dtype)), false);
  each_element(t, [&](int64_t off, int64_t) {
    if (seen[off]) a.overlaps = true;
    seen[off] = true;
  });
}

// --- Values ---------------------------------------------------------------------------------------------

float load(int32_t dtype, const unsigned char* p) {
  if (dtype == FB_F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return dtype == FB_BF16 ? flashback::safetensors::bf16_to_f32(h) : flashback::safetensors::f16_to_f32(h);
}

void store(int32_t dtype, unsigned char* p, float x) {
  if (dtype == FB_F32) {
    std::memcpy(p, &x, 4);
    return;
  }
  const uint16_t h = dtype == FB_BF16 ? flashback::safetensors::f32_to_bf16(x) : flashback::safetensors::f32_to_f16(x);
  std::memcpy(p, &h, 2);
}

struct Rng { // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

enum class Values { moderate, integers, large, special };

float draw(Rng& r, Values mode) {
  const uint64_t x = r.next();
  switch (mode) {
    case Values::moderate: return static_cast<float>(static_cast<int64_t>(x % 4001) - 2000) / 1000.0f;
    case Values::integers: return static_cast<float>(static_cast<int64_t>(x % 7) - 3);
    case Values::large: return static_cast<float>(static_cast<int64_t>(x % 2001) - 1000);
    case Values::special: {
      constexpr float kSpecial[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                    -std::numeric_limits<float>::infinity(), 3.0e38f, -3.0e38f, 1e-40f, -1e-45f,
                                    0.0f, -0.0f, 65504.0f, 1e5f};
      if (x % 8 == 0) return kSpecial[(x >> 3) % (sizeof kSpecial / sizeof kSpecial[0])];
      return static_cast<float>(static_cast<int64_t>((x >> 8) % 4001) - 2000) / 1000.0f;
    }
  }
  return 0;
}

// --- One case -------------------------------------------------------------------------------------------

enum class Mode { forward, forward_backward, backward_fuzzed_o, sizes_only };
enum class Ws { library, exact, misaligned, too_small, null_with_bytes, larger };

struct Case {
  Mode mode = Mode::forward;
  int64_t b = 1, hq = 1, hk = 1, sq = 1, sk = 1, d = 1, dv = 1;
  fb_params params{};
  bool params_null = false;
  bool params_defect = false; // the model says the params must be rejected
  Arg args[kTensors];
  Ws ws = Ws::library;
  uint8_t ws_extra = 0;
  bool size_out_null = false;
  Values values = Values::moderate;
  uint64_t seed = 0;
  uint8_t late = 0;          // defects that need the buffers: see LLVMFuzzerTestOneInput
  bool o_lse_from_forward = false; // the backward reads the forward's o and lse (else fuzzed ones)
  std::vector<void*> owned; // every allocation, freed at the end

  ~Case() {
    for (void* p : owned) std::free(p);
  }
  void* alloc(size_t n) {
    void* p = std::malloc(n);
    owned.push_back(p);
    return p;
  }
};

int64_t small_or_wild(Bytes& in, int64_t base, int64_t modulo) {
  const uint8_t x = in.u8();
  return x < 250 ? base + x % modulo : wild(in);
}

int64_t head_dim(Bytes& in) {
  constexpr int64_t kDims[] = {128, 256, 257, 0, 96, 200, 255, 1, 16, 32};
  const uint8_t x = in.u8();
  if (x < 240) return 1 + x % 64;
  if (x < 250) return kDims[x - 240];
  return wild(in);
}

double scale_value(Bytes& in) {
  constexpr double kScales[] = {0.125, 1.0, 0.01, 0.5, 2.0, 0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                                std::numeric_limits<double>::infinity(), 1e-50, 1e40,
                                std::numeric_limits<double>::min(), 3.4e38, 10.0};
  const uint8_t x = in.u8();
  if (x < sizeof kScales / sizeof kScales[0]) return kScales[x];
  double d;
  const uint64_t bits = in.u64();
  std::memcpy(&d, &bits, 8);
  return d;
}

int64_t window_value(Bytes& in, int mode) {
  switch (mode) {
    case 0: return -1;
    case 1: return in.u8() % 100;
    case 2: return 0;
    default: return wild(in);
  }
}

// Shape [X] of tensor `id` in the problem: q [B, Hq, Sq, D] ... delta [B, Hq, Sq].
void problem_shape(const Case& c, int id, int64_t* shape) {
  const int64_t bhs_q[3] = {c.b, c.hq, c.sq}, bhs_k[3] = {c.b, c.hk, c.sk};
  const bool kv = id == K || id == V || id == DK || id == DV;
  for (int i = 0; i < 3; ++i) shape[i] = kv ? bhs_k[i] : bhs_q[i];
  const bool dim_d = id == Q || id == K || id == DQ || id == DK;
  shape[3] = dim_d ? c.d : c.dv;
}

// The layout byte of one tensor: strides, or one defect.
void decode_tensor(Bytes& in, Case& c, int id, int32_t dtype) {
  Arg& a = c.args[id];
  fb_tensor& t = a.t;
  const int rank = is_rows(id) ? 3 : 4;
  int64_t shape[4];
  problem_shape(c, id, shape);
  t.dtype = is_rows(id) ? FB_F32 : dtype;
  t.device = FB_DEVICE_CPU;
  t.rank = rank;
  for (int i = 0; i < rank; ++i) t.shape[i] = shape[i];
  auto contiguous = [&](const int* order) { // order: dims from innermost to outermost
    int64_t s = 1;
    for (int i = 0; i < rank; ++i) {
      t.stride[order[i]] = s;
      if (__builtin_mul_overflow(s, std::max<int64_t>(t.shape[order[i]], 1), &s)) s = I64_MAX / 4;
    }
  };
  const int bhsd[4] = {rank - 1, rank - 2, rank - 3, rank - 4};
  const int bshd[4] = {3, 1, 2, 0};
  contiguous(bhsd);
  const uint8_t kind = in.u8() % 16;
  switch (kind) {
    case 6:
      if (rank == 4) contiguous(bshd);
      break;
    case 7: { // padded rows, heads, batches
      const int64_t pad = 1 + in.u8() % 7;
      int64_t s = 1;
      for (int i = rank - 1; i >= 0; --i) {
        t.stride[i] = s;
        int64_t next;
        if (__builtin_mul_overflow(s, std::max<int64_t>(t.shape[i], 1), &next) || __builtin_add_overflow(next, pad, &s))
          s = I64_MAX / 4;
      }
      break;
    }
    case 8: t.stride[in.u8() % (rank - 1)] = 0; break; // broadcast (an input) or aliasing (an output)
    case 9: t.stride[in.u8() % (rank - 1)] = 1 + in.u8() % 4; break; // interleaved
    case 10:
      for (int i = 0; i < rank - 1; ++i) t.stride[i] = in.u8() % 300;
      break;
    case 11: t.stride[in.u8() % (rank - 1)] = int64_t{1} << (32 + in.u8() % 30); break; // valid, far
    case 12: {                                                                          // one defect
      switch (in.u8() % 12) {
        case 0: t.rank = static_cast<int32_t>(wild(in)); break;
        case 1: t.rank = rank == 4 ? 3 : 4; break;
        case 2: t.dtype = static_cast<int32_t>(wild(in)); break;
        case 3: t.dtype = is_rows(id) ? FB_BF16 : (dtype == FB_F32 ? FB_F16 : FB_F32); break;
        case 4: t.device = FB_DEVICE_CUDA; break;
        case 5: t.device = static_cast<int32_t>(wild(in)); break;
        case 6: t.device_index = 1 + in.u8() % 3; break;
        case 7: t.shape[in.u8() % rank] = -1 - in.u8(); break;
        case 8: t.stride[rank - 1] = -1 - in.u8(); break; // the last dim reversed
        case 9: t.stride[rank - 1] = 2 + in.u8() % 3; break;
        case 10: t.stride[in.u8() % rank] = I64_MAX - in.u8(); break;
        default: a.present = false; break; // NULL (an optional gradient: not wanted)
      }
      break;
    }
    case 13: { // disagrees with the others
      int64_t& x = t.shape[in.u8() % rank];
      const int64_t add = 1 + in.u8() % 2;
      x = x <= I64_MAX - add ? x + add : x - add;
      break;
    }
    case 14: t.shape[in.u8() % rank] = wild(in); break;
    case 15: // reversed dims (numpy's x[::-1]): negative strides, element 0 the last of its buffer
      for (int i = 0; i < rank - 1; ++i)
        if (in.u8() & 1) t.stride[i] = -t.stride[i];
      break;
    default: break;
  }
}

// Everything the input says.
void decode(Bytes& in, Case& c) {
  const uint8_t op = in.u8();
  c.mode = static_cast<Mode>(op % 4);
  const uint8_t dsel = (op >> 2) % 4;
  const int32_t dtype = dsel < 3 ? static_cast<int32_t>(dsel) : static_cast<int32_t>(static_cast<int8_t>(in.u8()));
  const bool tamper_fn_pointer = (op >> 4) & 1; // pointer arguments of the call itself
  c.b = small_or_wild(in, 1, 2);
  c.hq = small_or_wild(in, 1, 4);
  const uint8_t g = in.u8();
  c.hk = c.hq;
  if (c.hq >= 1 && c.hq <= 4) {
    int64_t divisors[4], n = 0;
    for (int64_t x = 1; x <= c.hq; ++x)
      if (c.hq % x == 0) divisors[n++] = x;
    c.hk = g < 250 ? divisors[g % n] : wild(in);
  }
  c.sq = small_or_wild(in, 0, 100);
  c.sk = small_or_wild(in, 0, 100);
  c.d = head_dim(in);
  c.dv = head_dim(in);

  fb_params_init(&c.params);
  const uint8_t p = in.u8();
  c.params.causal = p & 1;
  c.params.window_left = window_value(in, (p >> 2) & 3);
  c.params.window_right = window_value(in, (p >> 4) & 3);
  if (p & 2) {
    c.params.has_scale = 1;
    c.params.scale = scale_value(in);
  }
  switch (p >> 6) {
    case 0: c.params.num_threads = 1; break;
    case 1: c.params.num_threads = 2 + in.u8() % 3; break;
    case 2: c.params.num_threads = 0; break;
    default: {
      constexpr int32_t kThreads[] = {-1, 1025, 1024, std::numeric_limits<int32_t>::min(), 8, 64, 3};
      c.params.num_threads = kThreads[in.u8() % 7];
    }
  }
  const uint8_t reserved = in.u8();
  static fb_tensor dummy_tensor{};
  if (reserved >= 240) {
    switch (reserved - 240) {
      case 0: c.params.struct_size = static_cast<uint32_t>(in.u8()); break;
      case 1: c.params.softcap = 30.0f; break;
      case 2: c.params.dropout_p = 0.1f; break;
      case 3: c.params.dropout_seed = 1 + in.u8(); break;
      case 4: c.params.alibi_slopes = &dummy_tensor; break;
      case 5: c.params.bias = &dummy_tensor; break;
      case 6: c.params.bias_grad = &dummy_tensor; break;
      case 7: c.params.cu_seqlens_q = &dummy_tensor; break;
      case 8: c.params.cu_seqlens_k = &dummy_tensor; break;
      case 9: c.params_null = true; break;
      case 10: c.params.softcap = -0.0f; break; // == 0: allowed
      default: break;
    }
  }
  const uint8_t grads = in.u8();
  for (int id = 0; id < kTensors; ++id) decode_tensor(in, c, id, dtype);
  if (!(grads & 1) && (grads & 16)) c.args[DQ].present = false;
  if (!(grads & 2) && (grads & 16)) c.args[DK].present = false;
  if (!(grads & 4) && (grads & 32)) c.args[DV].present = false;
  if (!(grads & 8)) c.args[DELTA].present = false;
  const uint8_t w = in.u8();
  c.ws = static_cast<Ws>(w % 6);
  c.ws_extra = in.u8();
  c.size_out_null = tamper_fn_pointer && (w & 0x80);
  c.values = static_cast<Values>(in.u8() % 4);
  c.seed = in.u64();
  c.late = in.u8();
}

// --- The model ------------------------------------------------------------------------------------------

// The tensors a call reads or writes: the forward's q, k, v, o, lse; the backward's all ten.
bool uses(int id, bool backward) { return backward || id <= LSE; }

// Everything about the params on their own.
bool params_defect(const Case& c) {
  if (c.params_null) return true;
  const fb_params& p = c.params;
  if (p.struct_size != sizeof(fb_params) || p.softcap != 0.0f || p.dropout_p != 0.0f || p.dropout_seed != 0 ||
      p.alibi_slopes || p.bias || p.bias_grad || p.cu_seqlens_q || p.cu_seqlens_k)
    return true;
  if (p.window_left < -1 || p.window_right < -1 || p.num_threads < 0 || p.num_threads > 1024) return true;
  if (p.has_scale) {
    const double s = p.scale;
    if (!std::isfinite(s) || !(s > 0)) return true;
    const float f = static_cast<float>(s);
    if (!std::isfinite(f) || !(f > 0)) return true;
  }
  return false;
}

// The library's bound on a problem (core/problem.cpp, check_sizes), exactly:
// (B Hq (Sq + 256) + B Hk (Sk + 256)) (D + Dv + 64) <= 2^56. Every dim is below 2^62 here.
bool too_large(int64_t b, int64_t hq, int64_t hk, int64_t sq, int64_t sk, int64_t d, int64_t dv) {
  const __int128 limit = static_cast<__int128>(1) << 56;
  const __int128 bq = static_cast<__int128>(b) * hq, bk = static_cast<__int128>(b) * hk; // < 2^126
  if (bq > limit || bk > limit) return true;
  const __int128 rows = bq * (sq + 256) + bk * (sk + 256); // < 2^120
  return rows > limit || rows * (d + dv + 64) > limit;
}

// The prediction for the forward (backward = false) or the backward, assuming buffers are assigned.
Expect predict(const Case& c, bool backward) {
  const Arg* a = c.args;
  const int req[] = {Q, K, V, O, LSE, DOUT};
  for (int id : req) {
    if (id == DOUT && !backward) continue;
    if (!a[id].present || a[id].defect) return Expect::reject;
  }
  if (backward)
    for (int id : {DQ, DK, DV, DELTA})
      if (a[id].present && a[id].defect) return Expect::reject;
  // Dims and dtypes against q (B, Hq, Sq, D), k (Hk, Sk) and v (Dv).
  const fb_tensor &q = a[Q].t, &k = a[K].t, &v = a[V].t, &o = a[O].t;
  const int32_t dt = q.dtype;
  auto same = [&](const fb_tensor& t, std::initializer_list<int64_t> want) {
    int i = 0;
    for (int64_t x : want)
      if (t.shape[i++] != x) return false;
    return true;
  };
  bool ok = k.dtype == dt && v.dtype == dt && o.dtype == dt && a[LSE].t.dtype == FB_F32;
  ok = ok && same(k, {q.shape[0], k.shape[1], k.shape[2], q.shape[3]}) &&
       same(v, {q.shape[0], k.shape[1], k.shape[2], v.shape[3]}) &&
       same(o, {q.shape[0], q.shape[1], q.shape[2], v.shape[3]}) && same(a[LSE].t, {q.shape[0], q.shape[1], q.shape[2]});
  if (backward) {
    ok = ok && a[DOUT].t.dtype == dt && same(a[DOUT].t, {o.shape[0], o.shape[1], o.shape[2], o.shape[3]});
    for (int id : {DQ, DK, DV}) {
      if (!a[id].present) continue;
      const fb_tensor& like = id == DQ ? q : id == DK ? k : v;
      ok = ok && a[id].t.dtype == dt && same(a[id].t, {like.shape[0], like.shape[1], like.shape[2], like.shape[3]});
    }
    if (a[DELTA].present)
      ok = ok && a[DELTA].t.dtype == FB_F32 && same(a[DELTA].t, {q.shape[0], q.shape[1], q.shape[2]});
  }
  if (!ok) return Expect::reject;
  const int64_t b = q.shape[0], hq = q.shape[1], sq = q.shape[2], d = q.shape[3], hk = k.shape[1], sk = k.shape[2],
                dv = v.shape[3];
  if (b < 1 || hq < 1 || hk < 1 || hq % hk != 0 || d < 1 || d > 256 || dv < 1 || dv > 256) return Expect::reject;
  if (static_cast<__int128>(sq) + sk > (int64_t{1} << 62)) return Expect::reject;
  if (too_large(b, hq, hk, sq, sk, d, dv)) return Expect::reject;
  if (params_defect(c)) return Expect::reject;
  // Outputs: on their own, then against the inputs (only the deliberate alias shares a buffer, and
  // the made-up addresses of tensors without a buffer can meet when one spans more than 2^59 bytes).
  Expect e = Expect::accept;
  for (int id = 0; id < kTensors; ++id)
    if ((backward || id <= LSE) && a[id].present && !a[id].fits && a[id].extent >= (int64_t{1} << 59)) e = Expect::either;
  // An input aliasing q (o or lse in the backward) may run past q's buffer into an output's.
  for (int id : {O, LSE})
    if (backward && a[id].present && a[id].aliased) e = Expect::either;
  const int outs_fwd[] = {O, LSE}, outs_bwd[] = {DQ, DK, DV, DELTA};
  for (int id : backward ? std::vector<int>(outs_bwd, outs_bwd + 4) : std::vector<int>(outs_fwd, outs_fwd + 2)) {
    if (!a[id].present) continue;
    if (a[id].overlaps) return Expect::reject;
    if (a[id].may_overlap) e = Expect::either;
  }
  return e;
}

// --- Calls ----------------------------------------------------------------------------------------------

struct Call {
  fb_status status = FB_SUCCESS;
  std::string error;
};

const fb_tensor* ptr(const Arg& a) { return a.present ? &a.t : nullptr; }

Call size_query(const Case& c, bool backward, size_t* bytes) {
  const Arg* a = c.args;
  const fb_params* p = c.params_null ? nullptr : &c.params;
  size_t* out = c.size_out_null ? nullptr : bytes;
  Call r;
  r.status = backward ? fb_backward_workspace_size(ptr(a[DOUT]), ptr(a[Q]), ptr(a[K]), ptr(a[V]), ptr(a[O]),
                                                   ptr(a[LSE]), ptr(a[DQ]), ptr(a[DK]), ptr(a[DV]), ptr(a[DELTA]), p,
                                                   out)
                      : fb_forward_workspace_size(ptr(a[Q]), ptr(a[K]), ptr(a[V]), ptr(a[O]), ptr(a[LSE]), p, out);
  r.error = fb_last_error();
  return r;
}

Call run(const Case& c, bool backward, void* ws, size_t ws_bytes, const fb_params* override_params = nullptr) {
  const Arg* a = c.args;
  const fb_params* p = override_params ? override_params : c.params_null ? nullptr : &c.params;
  Call r;
  r.status = backward ? fb_backward(ptr(a[DOUT]), ptr(a[Q]), ptr(a[K]), ptr(a[V]), ptr(a[O]), ptr(a[LSE]),
                                    ptr(a[DQ]), ptr(a[DK]), ptr(a[DV]), ptr(a[DELTA]), p, ws, ws_bytes)
                      : fb_forward(ptr(a[Q]), ptr(a[K]), ptr(a[V]), ptr(a[O]), ptr(a[LSE]), p, ws, ws_bytes);
  r.error = fb_last_error();
  return r;
}

void check_status(const Call& r, Expect e, const char* what) {
  check(r.status != FB_ERROR_INTERNAL && r.status != FB_ERROR_OUT_OF_MEMORY,
        std::string(what) + ": " + fb_status_name(r.status) + ": " + r.error);
  if (r.status == FB_SUCCESS) {
    check(e != Expect::reject, std::string(what) + " accepted a call the contract rejects");
    check(r.error.empty(), std::string(what) + ": fb_last_error() is not empty after a success");
  } else {
    check(e != Expect::accept, std::string(what) + " rejected a valid call: " + fb_status_name(r.status) + ": " + r.error);
    check(!r.error.empty(), std::string(what) + " failed without a message");
    check(r.status == FB_ERROR_INVALID_ARGUMENT || r.status == FB_ERROR_UNSUPPORTED,
          std::string(what) + ": unexpected status " + fb_status_name(r.status));
  }
}

// A copy of every buffer, to see what a call wrote.
std::vector<std::vector<unsigned char>> snapshot(const Case& c) {
  std::vector<std::vector<unsigned char>> s(kTensors);
  for (int id = 0; id < kTensors; ++id)
    if (c.args[id].buf) s[id].assign(c.args[id].buf, c.args[id].buf + c.args[id].extent);
  return s;
}

bool is_poison(int32_t dtype, const unsigned char* p) {
  for (size_t i = 0; i < elem_size(dtype); ++i)
    if (p[i] != 0xFF) return false;
  return true;
}

// After a success: inputs untouched; outputs written in every element of their views and nowhere else.
void check_writes(const Case& c, const std::vector<std::vector<unsigned char>>& before, const std::vector<int>& outs,
                  const char* what) {
  for (int id = 0; id < kTensors; ++id) {
    const Arg& a = c.args[id];
    if (!a.buf || !a.present) continue;
    const bool out = std::find(outs.begin(), outs.end(), id) != outs.end();
    if (!out) {
      check(same_bytes(a.buf, before[id].data(), a.extent), std::string(what) + " wrote its input " + kNames[id]);
      continue;
    }
    const size_t es = elem_size(a.t.dtype);
    std::vector<bool> in_view(static_cast<size_t>(a.extent / es), false);
    each_element(a.t, [&](int64_t off, int64_t) {
      in_view[off] = true;
      check(!is_poison(a.t.dtype, a.buf + off * es),
            std::string(what) + " left element " + std::to_string(off) + " of " + kNames[id] + " unwritten");
    });
    for (size_t e = 0; e < in_view.size(); ++e)
      if (!in_view[e])
        check(same_bytes(a.buf + e * es, before[id].data() + e * es, es),
              std::string(what) + " wrote outside the view of " + kNames[id]);
  }
}

void check_nothing_written(const Case& c, const std::vector<std::vector<unsigned char>>& before, const char* what) {
  for (int id = 0; id < kTensors; ++id)
    if (c.args[id].buf)
      check(same_bytes(c.args[id].buf, before[id].data(), c.args[id].extent),
            std::string(what) + " failed but wrote " + kNames[id]);
}

std::vector<double> gather(const Arg& a) {
  std::vector<double> out;
  const size_t es = elem_size(a.t.dtype);
  each_element(a.t, [&](int64_t off, int64_t) { out.push_back(load(a.t.dtype, a.buf + off * es)); });
  return out;
}

// Row-level exact results with finite inputs: blind rows and unseen keys.
void check_masked_rows(const Case& c, bool backward) {
  const fb_tensor& q = c.args[Q].t;
  const int64_t sq = q.shape[2], sk = c.args[K].t.shape[2];
  const bool causal = c.params.causal != 0;
  const int64_t left = c.params.window_left, right = causal ? 0 : c.params.window_right;
  // query i sees key j iff j in [i + Sk - Sq - left, i + Sk - Sq + right] and 0 <= j < Sk
  auto first_key = [&](int64_t i) -> __int128 { return left < 0 ? 0 : std::max<__int128>(0, (__int128)i + sk - sq - left); };
  auto last_key = [&](int64_t i) -> __int128 {
    return right < 0 ? sk - 1 : std::min<__int128>(sk - 1, (__int128)i + sk - sq + right);
  };
  std::vector<bool> blind(sq), seen(sk, false);
  for (int64_t i = 0; i < sq; ++i) {
    blind[i] = first_key(i) > last_key(i);
    for (__int128 j = first_key(i); j <= last_key(i); ++j) seen[static_cast<size_t>(j)] = true;
  }
  auto rows_are = [&](int id, const std::vector<bool>& rows, int64_t seq, float value) {
    const Arg& a = c.args[id];
    if (!a.present || !a.buf) return;
    const int64_t x = a.t.rank == 4 ? a.t.shape[3] : 1;
    const std::vector<double> got = gather(a);
    for (size_t e = 0; e < got.size(); ++e) {
      const int64_t s = static_cast<int64_t>(e / x) % seq;
      if (rows[s]) check(got[e] == value, std::string(kNames[id]) + " of a fully masked row or key is " +
                                              std::to_string(got[e]) + ", not exactly " + std::to_string(value));
    }
  };
  std::vector<bool> unseen(sk);
  for (int64_t j = 0; j < sk; ++j) unseen[j] = !seen[j];
  if (!backward) {
    rows_are(O, blind, sq, 0.0f);
    rows_are(LSE, blind, sq, -std::numeric_limits<float>::infinity());
    return;
  }
  rows_are(DQ, blind, sq, 0.0f);
  rows_are(DELTA, blind, sq, 0.0f);
  rows_are(DK, unseen, sk, 0.0f);
  rows_are(DV, unseen, sk, 0.0f);
}

double max_finite(int32_t dtype) { return dtype == FB_F16 ? 65504.0 : 3.4e38; }
double unit_roundoff(int32_t dtype) { return dtype == FB_F32 ? 0x1p-24 : dtype == FB_BF16 ? 0x1p-8 : 0x1p-11; }

// |out - ref| <= tol * max(max |ref|, 1) + extra, where the reference is finite and the output type
// can hold it.
void compare(const Arg& a, const std::vector<double>& ref, double tol, const char* what, double extra = 0) {
  if (!a.present || !a.buf) return;
  const std::vector<double> got = gather(a);
  double max_ref = 1;
  for (double r : ref)
    if (std::isfinite(r)) max_ref = std::max(max_ref, std::abs(r));
  const double bound = tol * max_ref + extra;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(ref[i]) && ref[i] < 0) { // lse of a blind row
      check(got[i] == ref[i], std::string(what) + ": -inf expected");
      continue;
    }
    if (std::abs(ref[i]) > 0.5 * max_finite(a.t.dtype)) continue; // may round to inf in the output type
    check(std::abs(got[i] - ref[i]) <= bound,
          std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(got[i]) + ", the float64 reference has " +
              std::to_string(ref[i]) + " (bound " + std::to_string(bound) + ")");
  }
}

ref::Options ref_options(const Case& c) {
  ref::Options o;
  o.causal = c.params.causal != 0;
  o.window_left = c.params.window_left;
  o.window_right = c.params.window_right;
  o.scale = c.params.has_scale ? static_cast<double>(static_cast<float>(c.params.scale)) : 0.0;
  return o;
}

ref::Shape ref_shape(const Case& c) {
  const fb_tensor &q = c.args[Q].t, &k = c.args[K].t, &v = c.args[V].t;
  return {q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]};
}

// The float64 reference on the inputs as they are stored; the bound grows with the largest logit
// (f32 carries a logit s with an error of about |s| 2^-24).
void check_reference(const Case& c, bool backward) {
  const ref::Shape s = ref_shape(c);
  const ref::Options opt = ref_options(c);
  const std::vector<double> q = gather(c.args[Q]), k = gather(c.args[K]), v = gather(c.args[V]);
  double mq = 0, mk = 0;
  for (double x : q) mq = std::max(mq, std::abs(x));
  for (double x : k) mk = std::max(mk, std::abs(x));
  const double max_logit = ref::scale_of(s, opt) * static_cast<double>(s.head_dim) * mq * mk;
  // Beyond this, f32 cannot resolve the logits (reported: from |logits| ~1e8 the backward's
  // P = exp(s - lse) exceeds 1 by the rounding of lse and overflows; RELIABILITY.md).
  if (max_logit > 1e5) return;
  const int32_t dt = c.args[Q].t.dtype;
  const double tol = (dt == FB_F32 ? 4e-5 : 6 * unit_roundoff(dt)) + 32 * max_logit * 0x1p-24;
  if (!backward) {
    std::vector<double> o, lse;
    ref::forward(s, opt, q, k, v, o, lse);
    compare(c.args[O], o, tol, "o");
    compare(c.args[LSE], lse, 4e-5 + 32 * max_logit * 0x1p-24, "lse");
    return;
  }
  const std::vector<double> dout = gather(c.args[DOUT]);
  std::vector<double> dq, dk, dv, delta;
  ref::backward(s, opt, q, k, v, dout, dq, dk, dv, delta);
  // delta = rowsum(dO o) reads o as stored (rounded to the dtype) and sums in f32; dq and dk receive
  // its error times scale, through dS = P (dP - delta) scale, where dP - delta may cancel:
  // Delta = max_i sum_x |dO o| (2u + Dv 2^-24); dq += scale Delta max|k|, dk += scale Delta max|q|
  // times the rows that can see a key (the column sums of P), each with a factor 4 of room.
  const std::vector<double> o = gather(c.args[O]);
  double big_delta = 0;
  for (int64_t row = 0; row < s.batch * s.heads_q * s.seqlen_q; ++row) {
    double sum = 0;
    for (int64_t x = 0; x < s.head_dim_v; ++x) sum += std::abs(dout[row * s.head_dim_v + x] * o[row * s.head_dim_v + x]);
    big_delta = std::max(big_delta, sum * (2 * unit_roundoff(dt) + s.head_dim_v * 0x1p-24));
  }
  const double scale = ref::scale_of(s, opt), rows_per_key = static_cast<double>(s.seqlen_q * (s.heads_q / s.heads_kv));
  compare(c.args[DQ], dq, tol, "dq", 4 * scale * big_delta * mk);
  compare(c.args[DK], dk, tol, "dk", 4 * scale * big_delta * mq * rows_per_key);
  compare(c.args[DV], dv, tol, "dv");
  compare(c.args[DELTA], delta, tol, "delta", 4 * big_delta);
}

void fill(const Case& c, int id, Rng& rng) {
  const Arg& a = c.args[id];
  if (!a.buf) return;
  const size_t es = elem_size(a.t.dtype);
  for (int64_t e = 0; e < a.extent / static_cast<int64_t>(es); ++e) store(a.t.dtype, a.buf + e * es, draw(rng, c.values));
}

// One accepted-or-rejected call with all the checks; returns its status.
fb_status exercise(Case& c, bool backward, int64_t work) {
  const char* what = backward ? "fb_backward" : "fb_forward";
  Expect e = predict(c, backward);
  // The size query first: it validates without touching tensor data.
  size_t needed = 0;
  const Call sized = size_query(c, backward, &needed);
  check_status(sized, c.size_out_null ? Expect::reject : e, backward ? "fb_backward_workspace_size" : "fb_forward_workspace_size");
  if (c.size_out_null) return sized.status;

  bool all_fit = true;
  for (int id = 0; id < kTensors; ++id)
    if (uses(id, backward) && c.args[id].present && !c.args[id].fits) all_fit = false;
  if (work > kMaxWork) all_fit = false;
  if (!all_fit && e != Expect::reject) return sized.status; // the library would touch memory it may not
  if (sized.status == FB_SUCCESS && needed > kMaxWorkspaceBytes) return sized.status; // over libFuzzer's memory

  // The workspace.
  void* ws = nullptr;
  size_t ws_bytes = 0;
  const size_t base = sized.status == FB_SUCCESS ? needed : 64;
  switch (c.ws) {
    case Ws::library: break;
    case Ws::exact: ws = c.alloc(base); ws_bytes = base; break;
    case Ws::misaligned: {
      const size_t off = 1 + c.ws_extra % 63;
      ws = static_cast<char*>(c.alloc(base + off)) + off;
      ws_bytes = base;
      break;
    }
    case Ws::too_small: {
      ws_bytes = base > 1u + c.ws_extra ? base - 1 - c.ws_extra : 0;
      ws = c.alloc(ws_bytes + 1);
      if (sized.status == FB_SUCCESS) e = Expect::reject;
      break;
    }
    case Ws::null_with_bytes: ws_bytes = 1 + c.ws_extra; e = Expect::reject; break;
    case Ws::larger: ws = c.alloc(base + c.ws_extra); ws_bytes = base + c.ws_extra; break;
  }
  if (sized.status != FB_SUCCESS && e == Expect::either) e = Expect::reject; // the same validation

  // Outputs poisoned (all-ones bytes: a NaN in every dtype that no arithmetic produces).
  std::vector<int> outs = backward ? std::vector<int>{DQ, DK, DV, DELTA} : std::vector<int>{O, LSE};
  for (int id : outs)
    if (c.args[id].buf && c.args[id].present) std::memset(c.args[id].buf, 0xFF, c.args[id].extent);
  const auto before = snapshot(c);
  const Call r = run(c, backward, ws, ws_bytes);
  check_status(r, e, what);
  if (c.ws != Ws::too_small && c.ws != Ws::null_with_bytes)
    check((r.status == FB_SUCCESS) == (sized.status == FB_SUCCESS),
          std::string(what) + " and its size query disagree: " + r.error + " / " + sized.error);
  if (r.status != FB_SUCCESS) {
    check_nothing_written(c, before, what);
    return r.status;
  }
  check_writes(c, before, outs, what);

  const bool finite = c.values != Values::special && (!backward || c.o_lse_from_forward);
  if (finite) check_masked_rows(c, backward);
  if (finite && work <= kMaxCheckWork) {
    if (c.values != Values::large) check_reference(c, backward);
    if (c.params.num_threads != 1) { // the same bits with one thread
      std::vector<std::vector<unsigned char>> first(kTensors);
      for (int id : outs)
        if (c.args[id].buf && c.args[id].present) first[id].assign(c.args[id].buf, c.args[id].buf + c.args[id].extent);
      fb_params one = c.params;
      one.num_threads = 1;
      const Call again = run(c, backward, nullptr, 0, &one);
      check(again.status == FB_SUCCESS, std::string(what) + " with one thread failed: " + again.error);
      for (int id : outs)
        if (!first[id].empty())
          check(same_bytes(first[id].data(), c.args[id].buf, first[id].size()),
                std::string(what) + ": " + kNames[id] + " differs between " + std::to_string(c.params.num_threads) +
                    " threads and one");
    }
  }
  return r.status;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  Case c;
  decode(in, c);
  // flashback.h's functions that take an enum, with the value q's dtype took (a wild one too), as a C
  // caller may pass it: the library reads it as the int it is (c_api.cpp: enum_value), not as the enum,
  // which UBSan checks; an unknown one is answered as unknown.
  const int32_t raw = c.args[Q].t.dtype;
  check((fb_cpu_kernels_isa(static_cast<fb_dtype>(raw)) == nullptr) == !valid_dtype(raw), "fb_cpu_kernels_isa");
  const bool a_status = raw >= FB_SUCCESS && raw <= FB_ERROR_INTERNAL;
  check((std::strcmp(fb_status_name(static_cast<fb_status>(raw)), "FB_STATUS_UNKNOWN") == 0) == !a_status,
        "fb_status_name");
  check(fb_tensor_contiguous4(nullptr, static_cast<fb_dtype>(raw), 1, 2, 3, 4).dtype == raw, "fb_tensor_contiguous4");

  // Buffers: each tensor that is sane and small gets exactly its extent. The others get an address of
  // their own, 2^59 bytes apart and far above any heap, that nothing ever reads: the library only sees
  // them in calls that validate without touching data (the size queries, and calls it must reject).
  int64_t total = 0;
  for (int id = 0; id < kTensors; ++id) {
    Arg& a = c.args[id];
    const int rank = is_rows(id) ? 3 : 4;
    a.t.data = reinterpret_cast<void*>(static_cast<uintptr_t>(id + 1) << 59);
    check_alone(a, rank);
    if (!a.present || a.defect) continue;
    if (a.extent <= kMaxTensorBytes && total + a.extent <= kMaxTotalBytes) { // extent 0: malloc(0)
      a.buf = static_cast<unsigned char*>(c.alloc(static_cast<size_t>(a.extent)));
      a.t.data = a.buf + a.below; // element 0; negative strides reach the bytes before it
      a.fits = true;
      total += a.extent;
    }
  }
  // Defects that need the buffers: NULL data, a pointer near the top of the address space, an output
  // aliasing q. A tensor without elements needs no memory at all.
  const uint8_t l = c.late;
  const int victim = l % kTensors;
  if (((l >> 4) == 1 || (l >> 4) == 2) && c.args[victim].present && !c.args[victim].defect) {
    Arg& a = c.args[victim];
    a.t.data = (l >> 4) == 1 ? nullptr : reinterpret_cast<void*>(std::numeric_limits<uintptr_t>::max() - 63);
    a.buf = nullptr;
    check_alone(a, is_rows(victim) ? 3 : 4);
    a.fits = !a.defect && a.extent == 0;
  } else if ((l >> 4) == 3 && c.args[Q].fits && c.args[Q].extent > 0) {
    const int out = std::vector<int>{O, LSE, DQ, DK, DV, DELTA}[l % 6];
    Arg& a = c.args[out];
    if (a.present && !a.defect && a.extent > 0) {
      a.t.data = c.args[Q].buf; // as an output, the library must see the overlap and refuse
      a.buf = nullptr;
      a.fits = false;
      a.overlaps = true;
      a.aliased = true;
    }
  }
  for (int id : {O, LSE, DQ, DK, DV, DELTA})
    if (c.args[id].present && !c.args[id].defect && !c.args[id].overlaps) check_self_overlap(c.args[id]);

  // Inputs (and, for the fuzzed backward, o and lse) filled from the seed.
  Rng rng{c.seed};
  for (int id : {Q, K, V, DOUT}) fill(c, id, rng);
  if (c.mode == Mode::backward_fuzzed_o) {
    const Values keep = c.values;
    c.values = Values::special;
    fill(c, O, rng);
    fill(c, LSE, rng);
    c.values = keep;
  }

  // The work of the call, from the problem's dims, and the blocks of 16 x 16 it pads to, which each
  // cost a tile of work however few their elements (each product saturating just past its bound).
  auto capped_product = [](std::initializer_list<__int128> xs, int64_t cap) {
    __int128 p = 1;
    for (__int128 x : xs) {
      p *= std::max<__int128>(x, 1);
      if (p > cap) p = cap + 1;
    }
    return static_cast<int64_t>(p);
  };
  const fb_tensor &tq = c.args[Q].t, &tk = c.args[K].t, &tv = c.args[V].t;
  const __int128 b = tq.shape[0], hq = tq.shape[1], sq = tq.shape[2], sk = tk.shape[2];
  int64_t w = capped_product({b, hq, sq + 1, sk + 1, __int128{tq.shape[3]} + tv.shape[3]}, kMaxWork);
  if (capped_product({b, hq, (sq + 15) / 16, (sk + 15) / 16}, kMaxBlocks) > kMaxBlocks) w = kMaxWork + 1;

  switch (c.mode) {
    case Mode::forward: exercise(c, false, w); break;
    case Mode::forward_backward:
      if (exercise(c, false, w) == FB_SUCCESS) {
        c.o_lse_from_forward = true;
        exercise(c, true, w);
      } else {
        // o and lse were not written: give the backward finite ones to read
        Rng r2{c.seed ^ 1};
        fill(c, O, r2);
        fill(c, LSE, r2);
        exercise(c, true, w);
      }
      break;
    case Mode::backward_fuzzed_o: exercise(c, true, w); break;
    case Mode::sizes_only: {
      size_t bytes = 0;
      check_status(size_query(c, false, &bytes), c.size_out_null ? Expect::reject : predict(c, false),
                   "fb_forward_workspace_size");
      check_status(size_query(c, true, &bytes), c.size_out_null ? Expect::reject : predict(c, true),
                   "fb_backward_workspace_size");
      break;
    }
  }
  return 0;
}
