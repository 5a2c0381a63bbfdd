// Every invalid call gets an error status and a message that names the argument with the expected
// and the actual value, and writes nothing. Through the C API (forward, backward and both
// *_workspace_size) and the C++ API.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "flashback/flashback.hpp"
#include "test_util.h"

namespace {

using fbtest::Layout;
using fbtest::Tensor;

// A valid problem whose arguments a test breaks one at a time: B = 2, Hq = 4, Hk = 2, Sq = 5, Sk = 7,
// D = 8, Dv = 6 (all different, so a message's numbers say which dimension it means). Inputs hold
// random values, outputs a byte pattern; the call must leave every buffer as it was.
struct Args {
  static constexpr int64_t B = 2, Hq = 4, Hk = 2, Sq = 5, Sk = 7, D = 8, Dv = 6;

  Tensor tq = Tensor::make(Layout::bhsd, {B, Hq, Sq, D}), tk = Tensor::make(Layout::bhsd, {B, Hk, Sk, D}),
         tv = Tensor::make(Layout::bhsd, {B, Hk, Sk, Dv}), to = Tensor::make(Layout::bhsd, {B, Hq, Sq, Dv}),
         tlse = Tensor::make(Layout::bhsd, {B, Hq, Sq}), tdout = Tensor::make(Layout::bhsd, {B, Hq, Sq, Dv}),
         tdq = Tensor::make(Layout::bhsd, {B, Hq, Sq, D}), tdk = Tensor::make(Layout::bhsd, {B, Hk, Sk, D}),
         tdv = Tensor::make(Layout::bhsd, {B, Hk, Sk, Dv}), tdelta = Tensor::make(Layout::bhsd, {B, Hq, Sq});

  fb_tensor q = tq.raw(), k = tk.raw(), v = tv.raw(), o = to.raw(), lse = tlse.raw(), dout = tdout.raw(),
            dq = tdq.raw(), dk = tdk.raw(), dv = tdv.raw(), delta = tdelta.raw();
  // What the calls pass; a test may point these elsewhere or at nullptr.
  const fb_tensor *pq = &q, *pk = &k, *pv = &v, *po = &o, *plse = &lse, *pdout = &dout, *pdq = &dq, *pdk = &dk,
                  *pdv = &dv, *pdelta = &delta;
  fb_params params = default_params();
  const fb_params* pparams = &params;

  Args() {
    std::mt19937_64 rng(1);
    for (Tensor* t : {&tq, &tk, &tv, &tdout}) t->fill_normal(rng);
    for (Tensor* t : {&to, &tlse, &tdq, &tdk, &tdv, &tdelta})
      std::memset(t->bytes().data(), 0xA5, t->bytes().size());
  }
  Args(const Args&) = delete;
  Args& operator=(const Args&) = delete;

  static fb_params default_params() {
    fb_params p;
    fb_params_init(&p);
    return p;
  }
  std::vector<const Tensor*> all() const { return {&tq, &tk, &tv, &to, &tlse, &tdout, &tdq, &tdk, &tdv, &tdelta}; }

  fb_status forward(void* ws = nullptr, size_t bytes = 0) { return fb_forward(pq, pk, pv, po, plse, pparams, ws, bytes); }
  fb_status forward_size(size_t* bytes) { return fb_forward_workspace_size(pq, pk, pv, po, plse, pparams, bytes); }
  fb_status backward(void* ws = nullptr, size_t bytes = 0) {
    return fb_backward(pdout, pq, pk, pv, po, plse, pdq, pdk, pdv, pdelta, pparams, ws, bytes);
  }
  fb_status backward_size(size_t* bytes) {
    return fb_backward_workspace_size(pdout, pq, pk, pv, po, plse, pdq, pdk, pdv, pdelta, pparams, bytes);
  }
};

enum Pass { kForward = 1, kBackward = 2, kBoth = 3 };

std::string quoted_error() { return std::string("fb_last_error() = \"") + fb_last_error() + "\""; }

// The message contains every part.
::testing::AssertionResult says(const std::vector<std::string>& parts) {
  const std::string msg = fb_last_error();
  for (const std::string& part : parts)
    if (msg.find(part) == std::string::npos)
      return ::testing::AssertionFailure() << "\"" << part << "\" missing from " << quoted_error();
  return ::testing::AssertionSuccess();
}

void expect_status(fb_status got, fb_status expected, const char* call, const std::vector<std::string>& parts) {
  EXPECT_EQ(got, expected) << call << " returned " << fb_status_name(got) << ", expected " << fb_status_name(expected)
                           << "; " << quoted_error();
  EXPECT_TRUE(says(parts)) << call;
}

// Runs the passes' calls on `a` (already broken) and checks status, message and that nothing was written:
// no tensor buffer, no workspace size.
void expect_rejected(Args& a, Pass pass, fb_status status, const std::vector<std::string>& parts) {
  const fbtest::Snapshot before(a.all());
  constexpr size_t kUntouched = 0xDEADBEEF;
  if (pass & kForward) {
    size_t bytes = kUntouched;
    expect_status(a.forward_size(&bytes), status, "fb_forward_workspace_size", parts);
    EXPECT_EQ(bytes, kUntouched) << "fb_forward_workspace_size wrote its result on failure";
    expect_status(a.forward(), status, "fb_forward", parts);
  }
  if (pass & kBackward) {
    size_t bytes = kUntouched;
    expect_status(a.backward_size(&bytes), status, "fb_backward_workspace_size", parts);
    EXPECT_EQ(bytes, kUntouched) << "fb_backward_workspace_size wrote its result on failure";
    expect_status(a.backward(), status, "fb_backward", parts);
  }
  EXPECT_TRUE(before.unchanged()) << "a failed call wrote memory";
}

// One way to break a valid call.
struct Breakage {
  std::string name;
  Pass pass;
  std::function<void(Args&)> apply;
  fb_status status;
  std::vector<std::string> message; // parts of fb_last_error()
};

void expect_all_rejected(const std::vector<Breakage>& cases) {
  for (const Breakage& c : cases) {
    SCOPED_TRACE(c.name);
    Args a;
    c.apply(a);
    expect_rejected(a, c.pass, c.status, c.message);
  }
}

// The tensors that carry one problem dimension; changing it in all of them keeps the shapes consistent.
std::vector<fb_tensor*> carriers(Args& a, const std::string& dim) {
  if (dim == "B") return {&a.q, &a.k, &a.v, &a.o, &a.lse, &a.dout, &a.dq, &a.dk, &a.dv, &a.delta};
  if (dim == "Hq" || dim == "Sq") return {&a.q, &a.o, &a.lse, &a.dout, &a.dq, &a.delta};
  if (dim == "Hk" || dim == "Sk") return {&a.k, &a.v, &a.dk, &a.dv};
  if (dim == "D") return {&a.q, &a.k, &a.dq, &a.dk};
  return {&a.o, &a.v, &a.dout, &a.dv}; // Dv
}
int axis_of(const std::string& dim) {
  if (dim == "B") return 0;
  if (dim == "Hq" || dim == "Hk") return 1;
  if (dim == "Sq" || dim == "Sk") return 2;
  return 3;
}
std::function<void(Args&)> set_dim(const std::string& dim, int64_t value) {
  return [=](Args& a) {
    for (fb_tensor* t : carriers(a, dim)) t->shape[axis_of(dim)] = value;
  };
}

constexpr int64_t kBig = int64_t{1} << 62;
constexpr fb_status kInvalid = FB_ERROR_INVALID_ARGUMENT;
constexpr fb_status kUnsupported = FB_ERROR_UNSUPPORTED;

// --- Tensors ------------------------------------------------------------------------------------------

TEST(Errors, NullPointers) {
  std::vector<Breakage> cases;
  struct Slot {
    std::string name;
    const fb_tensor* Args::*pointer;
    Pass pass;
  };
  for (const Slot& slot : {Slot{"q", &Args::pq, kBoth}, Slot{"k", &Args::pk, kBoth}, Slot{"v", &Args::pv, kBoth},
                           Slot{"o", &Args::po, kBoth}, Slot{"lse", &Args::plse, kBoth},
                           Slot{"dout", &Args::pdout, kBackward}})
    cases.push_back({"null " + slot.name, slot.pass, [p = slot.pointer](Args& a) { a.*p = nullptr; }, kInvalid,
                     {slot.name + ": expected a tensor, got a null pointer"}});
  cases.push_back({"null data", kBoth, [](Args& a) { a.k.data = nullptr; }, kInvalid,
                   {"k.data: expected a pointer to", std::to_string(Args::B * Args::Hk * Args::Sk * Args::D), "NULL"}});
  cases.push_back({"null dq data", kBackward, [](Args& a) { a.dq.data = nullptr; }, kInvalid, {"dq.data", "NULL"}});
  cases.push_back({"null params", kBoth, [](Args& a) { a.pparams = nullptr; }, kInvalid,
                   {"params: expected a pointer to fb_params", "got NULL"}});
  expect_all_rejected(cases);
}

TEST(Errors, Rank) {
  expect_all_rejected({
      {"q rank 3", kBoth, [](Args& a) { a.q.rank = 3; }, kInvalid, {"q.rank: expected 4, got 3"}},
      {"v rank 5", kBoth, [](Args& a) { a.v.rank = 5; }, kInvalid, {"v.rank: expected 4, got 5"}},
      {"lse rank 4", kBoth, [](Args& a) { a.lse.rank = 4; }, kInvalid, {"lse.rank: expected 3, got 4"}},
      {"dout rank 0", kBackward, [](Args& a) { a.dout.rank = 0; }, kInvalid, {"dout.rank: expected 4, got 0"}},
      {"dk rank 3", kBackward, [](Args& a) { a.dk.rank = 3; }, kInvalid, {"dk.rank: expected 4, got 3"}},
      {"delta rank 2", kBackward, [](Args& a) { a.delta.rank = 2; }, kInvalid, {"delta.rank: expected 3, got 2"}},
  });
}

// Each dimension of each tensor, one at a time, made 10 larger than the problem says.
TEST(Errors, EveryMismatchedDimension) {
  struct Named {
    const char* name;
    fb_tensor Args::*tensor;
    Pass pass;
  };
  const Named tensors[] = {
      {"q", &Args::q, kBoth},         {"k", &Args::k, kBoth},           {"v", &Args::v, kBoth},
      {"o", &Args::o, kBoth},         {"lse", &Args::lse, kBoth},       {"dout", &Args::dout, kBackward},
      {"dq", &Args::dq, kBackward},   {"dk", &Args::dk, kBackward},     {"dv", &Args::dv, kBackward},
      {"delta", &Args::delta, kBackward},
  };
  for (const Named& t : tensors) {
    const int rank = t.tensor == &Args::lse || t.tensor == &Args::delta ? 3 : 4;
    for (int dim = 0; dim < rank; ++dim) {
      const std::string name = std::string(t.name) + ".shape[" + std::to_string(dim) + "]";
      SCOPED_TRACE(name);
      Args a;
      const int64_t was = (a.*t.tensor).shape[dim], now = was + 10;
      (a.*t.tensor).shape[dim] = now;
      // The message names the changed dimension, either as the wrong one or as the one another
      // tensor's dimension must match (q, then k, v set the problem's sizes).
      const std::string e_now = "expected " + std::to_string(now), g_was = "got " + std::to_string(was);
      const std::string e_was = "expected " + std::to_string(was), g_now = "got " + std::to_string(now);
      const fbtest::Snapshot before(a.all());
      if (t.pass & kForward) {
        EXPECT_EQ(a.forward(), kInvalid) << quoted_error();
        EXPECT_TRUE(says({name}) && (says({e_now, g_was}) || says({e_was, g_now}))) << quoted_error();
      }
      EXPECT_EQ(a.backward(), kInvalid) << quoted_error();
      EXPECT_TRUE(says({name}) && (says({e_now, g_was}) || says({e_was, g_now}))) << quoted_error();
      EXPECT_TRUE(before.unchanged());
    }
  }
}

TEST(Errors, ProblemSizes) {
  expect_all_rejected({
      {"B = 0", kBoth, set_dim("B", 0), kInvalid, {"q.shape[0] (batch): expected >= 1, got 0"}},
      {"Hq = 0", kBoth, set_dim("Hq", 0), kInvalid, {"q.shape[1] (heads): expected >= 1, got 0"}},
      {"Hk = 0", kBoth, set_dim("Hk", 0), kInvalid, {"k.shape[1] (heads): expected >= 1, got 0"}},
      {"Hq % Hk != 0", kBoth, set_dim("Hk", 3), kInvalid,
       {"k.shape[1] (heads): expected a divisor of q.shape[1] = 4", "got 3"}},
      {"D = 0", kBoth, set_dim("D", 0), kInvalid, {"q.shape[3] (head_dim): expected 1..256, got 0"}},
      {"D = 257", kBoth, set_dim("D", 257), kInvalid, {"q.shape[3] (head_dim): expected 1..256, got 257"}},
      {"Dv = 0", kBoth, set_dim("Dv", 0), kInvalid, {"v.shape[3] (head_dim): expected 1..256, got 0"}},
      {"Dv = 257", kBoth, set_dim("Dv", 257), kInvalid, {"v.shape[3] (head_dim): expected 1..256, got 257"}},
      {"negative Sq", kBoth, [](Args& a) { a.q.shape[2] = -1; }, kInvalid, {"q.shape[2] (seqlen): expected >= 0, got -1"}},
      {"negative Sk", kBoth, [](Args& a) { a.k.shape[2] = -3; }, kInvalid, {"k.shape[2] (seqlen): expected >= 0, got -3"}},
      {"negative lse batch", kBoth, [](Args& a) { a.lse.shape[0] = -2; }, kInvalid,
       {"lse.shape[0] (batch): expected >= 0, got -2"}},
      {"negative dq dim", kBackward, [](Args& a) { a.dq.shape[3] = -8; }, kInvalid,
       {"dq.shape[3] (head_dim): expected >= 0, got -8"}},
  });
}

TEST(Errors, Strides) {
  expect_all_rejected({
      {"q last dim reversed", kBoth, [](Args& a) { a.q.stride[3] = -1; }, kInvalid,
       {"q.stride[3]: the last dimension must be contiguous: expected 1, got -1"}},
      // Negative strides are accepted (reversed views); only where they lead is checked.
      {"negative strides below address 0", kBoth,
       [](Args& a) {
         a.q.data = reinterpret_cast<void*>(uintptr_t{64});
         a.q.stride[2] = -Args::D; // rows reach 4 * 8 * 4 = 128 bytes before data
       },
       kInvalid,
       {"q.data: the tensor's negative strides reach 128 bytes before data, below address 0; expected data >= 128"}},
      {"the smallest offset", kBoth, [](Args& a) { a.k.stride[2] = -kBig; }, kInvalid,
       {"k.stride: expected element offsets within +-(2^63 - 1), got the smallest element offset of shape "
        "[2, 2, 7, 8]"}},
      {"q last dim not contiguous", kBoth, [](Args& a) { a.q.stride[3] = 2; }, kInvalid,
       {"q.stride[3]: the last dimension must be contiguous: expected 1, got 2"}},
      {"lse last dim not contiguous", kBoth, [](Args& a) { a.lse.stride[2] = 0; }, kInvalid,
       {"lse.stride[2]", "expected 1, got 0"}},
      {"dv last dim not contiguous", kBackward, [](Args& a) { a.dv.stride[3] = 7; }, kInvalid,
       {"dv.stride[3]", "expected 1, got 7"}},
  });
}

TEST(Errors, SizesAndStridesThatOverflow) {
  expect_all_rejected({
      {"element count", kBoth,
       [](Args& a) {
         a.q.shape[0] = int64_t{1} << 32;
         a.q.shape[1] = int64_t{1} << 32;
       },
       kInvalid, {"q.shape: expected an element count of at most 2^63 - 1, got the count of [4294967296, 4294967296, 5, 8], "
                  "which overflows int64"}},
      {"one stride times its size", kBoth, [](Args& a) { a.k.stride[2] = kBig; }, kInvalid,
       {"k.stride: expected element offsets within +-(2^63 - 1), got the largest element offset of shape [2, 2, 7, 8] "
        "and strides [112, 56, 4611686018427387904, 1], which overflows int64"}},
      {"the sum of the offsets", kBoth,
       [](Args& a) {
         a.v.stride[0] = kBig; // (2 - 1) * 2^62 + (2 - 1) * 2^62 = 2^63
         a.v.stride[1] = kBig;
       },
       kInvalid,
       {"v.stride: expected element offsets within +-(2^63 - 1), got the largest element offset", "overflows int64"}},
      {"the byte extent", kBoth, [](Args& a) { a.o.stride[0] = kBig / 2; }, kInvalid,
       {"o: expected a byte extent of at most 2^63 - 1, got the byte extent of shape [2, 4, 5, 6] and strides "
        "[2305843009213693952, 30, 6, 1], which overflows int64"}},
      {"the address space", kBoth,
       [](Args& a) { a.q.data = reinterpret_cast<void*>(std::numeric_limits<uintptr_t>::max() - 64); }, kInvalid,
       {"q.data: the tensor's 1280 bytes wrap around the address space; expected them to end at most at 2^64, "
        "got data = 0xffffffffffffffbf"}},
      {"Sq + Sk", kBoth,
       [](Args& a) {
         // D = Dv = 1 and zero sequence strides keep every element count and extent inside int64 while
         // Sq + Sk passes 2^62; lse and delta stay contiguous (2^60 floats fit).
         for (const char* dim : {"B", "Hq", "Hk", "D", "Dv"}) set_dim(dim, 1)(a);
         for (fb_tensor* t : carriers(a, "Sk")) {
           t->shape[2] = kBig;
           t->stride[2] = 0;
         }
         for (fb_tensor* t : carriers(a, "Sq")) {
           t->shape[2] = kBig / 4;
           if (t->rank == 4) t->stride[2] = 0;
         }
       },
       kInvalid, {"q.shape[2] + k.shape[2] (seqlen): expected at most 2^62, got 1152921504606846976 + 4611686018427387904"}},
      {"the padded problem", kBoth,
       [](Args& a) {
         // Sq = Sk = 0: no tensor has an element, so B and Hq are free; the workspace pads every row.
         for (fb_tensor* t : carriers(a, "Sq")) t->shape[2] = 0;
         for (fb_tensor* t : carriers(a, "Sk")) t->shape[2] = 0;
         for (fb_tensor* t : carriers(a, "B")) t->shape[0] = int64_t{1} << 44;
       },
       kInvalid, {"the problem is too large", "at most 2^56", "B = 17592186044416"}},
  });
}

TEST(Errors, DtypesAndDevices) {
  expect_all_rejected({
      {"unknown dtype 7", kBoth, [](Args& a) { a.q.dtype = 7; }, kInvalid,
       {"q.dtype: expected one of FB_F32 (0), FB_BF16 (1), FB_F16 (2), got 7"}},
      {"unknown dtype -1 on dq", kBackward, [](Args& a) { a.dq.dtype = -1; }, kInvalid, {"dq.dtype", "got -1"}},
      {"k differs from q", kBoth, [](Args& a) { a.k.dtype = FB_BF16; }, kInvalid,
       {"k.dtype: expected f32 (q.dtype), got bf16"}},
      {"dv differs from q", kBackward, [](Args& a) { a.dv.dtype = FB_F16; }, kInvalid,
       {"dv.dtype: expected f32 (q.dtype), got f16"}},
      {"lse not f32", kBoth, [](Args& a) { a.lse.dtype = FB_BF16; }, kInvalid,
       {"lse.dtype: expected f32 (lse is always f32), got bf16"}},
      {"delta not f32", kBackward, [](Args& a) { a.delta.dtype = FB_F16; }, kInvalid,
       {"delta.dtype: expected f32 (delta is always f32), got f16"}},
      {"CUDA", kBoth, [](Args& a) { a.v.device = FB_DEVICE_CUDA; }, kUnsupported,
       {"v.device: CUDA tensors need the CUDA backend"}},
      {"CUDA dq", kBackward, [](Args& a) { a.dq.device = FB_DEVICE_CUDA; }, kUnsupported, {"dq.device"}},
      {"unknown device", kBoth, [](Args& a) { a.o.device = 9; }, kInvalid,
       {"o.device: expected FB_DEVICE_CPU (0), got 9"}},
      {"CPU device index", kBoth, [](Args& a) { a.k.device_index = 1; }, kInvalid,
       {"k.device_index: expected 0 for the CPU, got 1"}},
  });
}

// --- Params -------------------------------------------------------------------------------------------

TEST(Errors, Params) {
  auto scale = [](double s) {
    return [s](Args& a) {
      a.params.has_scale = 1;
      a.params.scale = s;
    };
  };
  const char* kFinite = "params.scale: expected a finite value > 0, got ";
  const char* kFloat = "params.scale: expected a value that float32 represents as finite and > 0, got ";
  expect_all_rejected({
      {"not initialised", kBoth, [](Args& a) { a.params.struct_size = 0; }, kInvalid,
       {"params.struct_size: expected " + std::to_string(sizeof(fb_params)) + " (call fb_params_init first), got 0"}},
      {"wrong struct size", kBoth, [](Args& a) { a.params.struct_size = 12; }, kInvalid,
       {"params.struct_size", "got 12"}},
      {"window_left -2", kBoth, [](Args& a) { a.params.window_left = -2; }, kInvalid,
       {"params.window_left: expected -1 (unbounded) or >= 0, got -2"}},
      {"window_right -7", kBoth, [](Args& a) { a.params.window_right = -7; }, kInvalid,
       {"params.window_right: expected -1 (unbounded) or >= 0, got -7"}},
      {"num_threads -1", kBoth, [](Args& a) { a.params.num_threads = -1; }, kInvalid,
       {"params.num_threads: expected 0 (default) or 1..1024, got -1"}},
      {"num_threads 1025", kBoth, [](Args& a) { a.params.num_threads = 1025; }, kInvalid,
       {"params.num_threads", "got 1025"}},
      {"scale inf", kBoth, scale(std::numeric_limits<double>::infinity()), kInvalid, {std::string(kFinite) + "inf"}},
      {"scale nan", kBoth, scale(std::nan("")), kInvalid, {std::string(kFinite) + "nan"}},
      {"scale 0", kBoth, scale(0.0), kInvalid, {std::string(kFinite) + "0"}},
      {"scale -1", kBoth, scale(-1.0), kInvalid, {std::string(kFinite) + "-1"}},
      {"scale underflows float", kBoth, scale(1e-50), kInvalid, {std::string(kFloat) + "1e-50"}},
      {"scale overflows float", kBoth, scale(1e300), kInvalid, {std::string(kFloat) + "1e+300"}},
  });
}

TEST(Errors, ReservedParamsAreUnsupported) {
  static const fb_tensor some_tensor = {};
  static fb_tensor some_output = {};
  expect_all_rejected({
      {"softcap", kBoth, [](Args& a) { a.params.softcap = 30.0f; }, kUnsupported,
       {"params.softcap", "expected 0, got 30"}},
      {"dropout_p", kBoth, [](Args& a) { a.params.dropout_p = 0.1f; }, kUnsupported,
       {"params.dropout_p", "expected 0, got 0.1"}},
      {"alibi_slopes", kBoth, [](Args& a) { a.params.alibi_slopes = &some_tensor; }, kUnsupported,
       {"params.alibi_slopes", "expected NULL"}},
      {"bias", kBoth, [](Args& a) { a.params.bias = &some_tensor; }, kUnsupported, {"params.bias", "expected NULL, got 0x"}},
      {"bias_grad", kBoth, [](Args& a) { a.params.bias_grad = &some_output; }, kUnsupported,
       {"params.bias_grad", "expected NULL"}},
      {"cu_seqlens_q", kBoth, [](Args& a) { a.params.cu_seqlens_q = &some_tensor; }, kUnsupported,
       {"params.cu_seqlens_q", "expected NULL"}},
      {"cu_seqlens_k", kBoth, [](Args& a) { a.params.cu_seqlens_k = &some_tensor; }, kUnsupported,
       {"cu_seqlens_k", "expected NULL"}},
  });
}

// flashback.h: "Calls with values other than those fb_params_init sets fail with FB_ERROR_UNSUPPORTED"
// covers every reserved field, dropout_seed included.
TEST(Errors, ReservedDropoutSeedIsUnsupported) {
  expect_all_rejected({{"dropout_seed", kBoth, [](Args& a) { a.params.dropout_seed = 42; }, kUnsupported,
                        {"params.dropout_seed"}}});
}

// --- Overlapping outputs ------------------------------------------------------------------------------

TEST(Errors, OutputsOverlappingInputsOrOutputs) {
  expect_all_rejected({
      {"o on q", kForward, [](Args& a) { a.o.data = a.q.data; }, kInvalid,
       {"o.data: the output overlaps the input q; expected disjoint memory, got bytes [0x", ") and [0x"}},
      {"o inside v", kForward, [](Args& a) { a.o.data = static_cast<float*>(a.v.data) + 5; }, kInvalid,
       {"o.data: the output overlaps the input v"}},
      {"lse in k", kForward, [](Args& a) { a.lse.data = static_cast<float*>(a.k.data) + 3; }, kInvalid,
       {"lse.data: the output overlaps the input k"}},
      {"lse in o", kForward, [](Args& a) { a.lse.data = a.o.data; }, kInvalid,
       {"lse.data: the output overlaps the output o"}},
      {"dq on q", kBackward, [](Args& a) { a.dq.data = a.q.data; }, kInvalid,
       {"dq.data: the output overlaps the input q"}},
      {"dq one row into q", kBackward, [](Args& a) { a.dq.data = static_cast<float*>(a.q.data) + Args::D; }, kInvalid,
       {"dq.data: the output overlaps the input q"}},
      {"dk on dout", kBackward, [](Args& a) { a.dk.data = a.dout.data; }, kInvalid,
       {"dk.data: the output overlaps the input dout"}},
      {"dv on o", kBackward, [](Args& a) { a.dv.data = a.o.data; }, kInvalid,
       {"dv.data: the output overlaps the input o"}},
      {"delta on lse", kBackward, [](Args& a) { a.delta.data = a.lse.data; }, kInvalid,
       {"delta.data: the output overlaps the input lse"}},
      {"dv on dk", kBackward, [](Args& a) { a.dv.data = a.dk.data; }, kInvalid,
       {"dv.data: the output overlaps the output dk"}},
      {"delta in dq", kBackward, [](Args& a) { a.delta.data = static_cast<float*>(a.dq.data) + 1; }, kInvalid,
       {"delta.data: the output overlaps the output dq"}},
      // A reversed view of q's memory: its element 0 at q's last element, its strides negative.
      {"o reversed over q", kForward,
       [](Args& a) {
         a.o = a.q;
         a.o.shape[3] = Args::Dv;
         a.o.data = static_cast<float*>(a.q.data) + (Args::B * Args::Hq * Args::Sq - 1) * Args::D;
         for (int d = 0; d < 3; ++d) a.o.stride[d] = -a.q.stride[d];
       },
       kInvalid, {"o.data: the output overlaps the input q"}},
      {"dk reversed over k", kBackward,
       [](Args& a) {
         a.dk = a.k;
         a.dk.data = static_cast<float*>(a.k.data) + (Args::B * Args::Hk * Args::Sk - 1) * Args::D;
         for (int d = 0; d < 3; ++d) a.dk.stride[d] = -a.k.stride[d];
       },
       kInvalid, {"dk.data: the output overlaps the input k"}},
  });
}

TEST(Errors, OutputsWhoseElementsOverlap) {
  const std::string self = ".stride: the output's elements overlap each other";
  expect_all_rejected({
      {"o zero stride", kForward, [](Args& a) { a.o.stride[2] = 0; }, kInvalid, {"o" + self}},
      {"lse zero stride", kForward, [](Args& a) { a.lse.stride[1] = 0; }, kInvalid, {"lse" + self}},
      {"o interleaved", kForward, [](Args& a) { a.o.stride[1] = 1; }, kInvalid, {"o" + self}},
      {"o heads a row back", kForward, [](Args& a) { a.o.stride[1] = -a.o.stride[2]; }, kInvalid, {"o" + self}},
      {"dq zero stride", kBackward, [](Args& a) { a.dq.stride[0] = 0; }, kInvalid, {"dq" + self}},
      {"dk zero stride", kBackward, [](Args& a) { a.dk.stride[2] = 0; }, kInvalid, {"dk" + self}},
      {"delta zero stride", kBackward, [](Args& a) { a.delta.stride[1] = 0; }, kInvalid, {"delta" + self}},
  });
}

// A packed [B, S, 3, H, D] problem: q, k, v in one buffer, dq, dk, dv in another.
struct Packed {
  static constexpr int64_t B = 2, H = 3, S = 9, D = 8;
  fbtest::Case c;
  fbtest::Inputs in;
  fbtest::Outputs out;

  Packed() {
    c.shape = {B, H, H, S, S, D, D};
    c.packed = true;
    std::mt19937_64 rng(7);
    in = fbtest::make_inputs(c, rng);
    out = fbtest::make_outputs(c);
    EXPECT_EQ(fbtest::run_forward(c, in, out), FB_SUCCESS) << fb_last_error();
  }
  fb_status backward(const fb_tensor& dq, const fb_tensor& dk, const fb_tensor& dv) {
    const fb_params p = c.params();
    const fb_tensor dout = in.dout.raw(), q = in.q.raw(), k = in.k.raw(), v = in.v.raw(), o = out.o.raw(),
                    lse = out.lse.raw();
    return fb_backward(&dout, &q, &k, &v, &o, &lse, &dq, &dk, &dv, nullptr, &p, nullptr, 0);
  }
};

TEST(Errors, GradientsInterleavedInOnePackedBufferAreAccepted) {
  Packed p;
  ASSERT_EQ(fbtest::run_backward(p.c, p.in, p.out), FB_SUCCESS) << fb_last_error();
  EXPECT_TRUE(fbtest::only_views_written(fbtest::backward_outputs(p.out)));
}

TEST(Errors, GradientsAliasingPackedInputsAreRejected) {
  Packed p;
  const fb_tensor q = p.in.q.raw(), k = p.in.k.raw(), v = p.in.v.raw();
  const fb_tensor dq = p.out.dq.raw(), dk = p.out.dk.raw(), dv = p.out.dv.raw();
  const fbtest::Snapshot before({&p.in.q, &p.out.dq, &p.out.o, &p.out.lse, &p.in.dout});
  EXPECT_EQ(p.backward(q, dk, dv), kInvalid);
  EXPECT_TRUE(says({"dq.data: the output overlaps the input q"}));
  EXPECT_EQ(p.backward(k, dk, dv), kInvalid) << "dq over k's part of the packed buffer";
  EXPECT_TRUE(says({"dq.data: the output overlaps the input k"}));
  EXPECT_EQ(p.backward(dq, v, dv), kInvalid);
  EXPECT_TRUE(says({"dk.data: the output overlaps the input v"}));
  EXPECT_EQ(p.backward(dq, dq, dv), kInvalid);
  EXPECT_TRUE(says({"dk.data: the output overlaps the output dq"}));
  EXPECT_TRUE(before.unchanged());
}

// --- Workspace ----------------------------------------------------------------------------------------

TEST(Errors, Workspace) {
  for (Pass pass : {kForward, kBackward}) {
    SCOPED_TRACE(pass == kForward ? "forward" : "backward");
    Args a;
    const fbtest::Snapshot before(a.all());
    size_t bytes = 0;
    ASSERT_EQ(pass == kForward ? a.forward_size(&bytes) : a.backward_size(&bytes), FB_SUCCESS) << quoted_error();
    ASSERT_GT(bytes, 0u);
    std::vector<char> ws(bytes);
    auto call = [&](void* w, size_t n) { return pass == kForward ? a.forward(w, n) : a.backward(w, n); };
    expect_status(call(ws.data(), bytes - 1), kInvalid, "too small",
                  {"workspace_bytes: expected at least " + std::to_string(bytes), "got " + std::to_string(bytes - 1)});
    expect_status(call(nullptr, 100), kInvalid, "NULL with bytes",
                  {"workspace: expected a pointer to 100 bytes (workspace_bytes), got NULL"});
    expect_status(pass == kForward ? a.forward_size(nullptr) : a.backward_size(nullptr), kInvalid, "NULL size",
                  {"workspace_bytes: expected a pointer to receive the size, got NULL"});
    EXPECT_TRUE(before.unchanged());
  }
}

// --- Last error ---------------------------------------------------------------------------------------

TEST(LastError, EmptyAfterSuccess) {
  Args a;
  a.q.rank = 2;
  ASSERT_EQ(a.forward(), kInvalid);
  ASSERT_STRNE(fb_last_error(), "");
  a.q.rank = 4;
  ASSERT_EQ(a.forward(), FB_SUCCESS) << quoted_error();
  EXPECT_STREQ(fb_last_error(), "");
  a.k.rank = 1;
  ASSERT_EQ(a.backward(), kInvalid);
  a.k.rank = 4;
  size_t bytes = 0;
  ASSERT_EQ(a.backward_size(&bytes), FB_SUCCESS);
  EXPECT_STREQ(fb_last_error(), "");
}

TEST(LastError, IsPerThread) {
  Args a;
  a.q.rank = 2;
  ASSERT_EQ(a.forward(), kInvalid);
  const std::string mine = fb_last_error();
  std::string fresh, theirs;
  std::thread([&] {
    fresh = fb_last_error();
    Args b;
    b.params.window_left = -9;
    EXPECT_EQ(b.forward(), kInvalid);
    theirs = fb_last_error();
  }).join();
  EXPECT_EQ(fresh, "") << "a new thread sees another thread's error";
  EXPECT_NE(theirs.find("params.window_left"), std::string::npos) << theirs;
  EXPECT_EQ(std::string(fb_last_error()), mine) << "another thread's failure replaced this thread's message";
}

// --- C++ API ------------------------------------------------------------------------------------------

TEST(CppApi, ThrowsErrorWithStatusAndMessage) {
  using flashback::TensorView;
  Args a;
  const TensorView q(a.q), v(a.v), o(a.o), lse(a.lse), dout(a.dout), dq(a.dq);
  fb_tensor bad_k = a.k;
  bad_k.shape[3] = 9;
  const TensorView k(bad_k);
  const fbtest::Snapshot before(a.all());
  auto expect_throws = [](auto&& call, flashback::Status status, const std::string& part) {
    try {
      call();
      ADD_FAILURE() << "no flashback::Error thrown";
    } catch (const flashback::Error& e) {
      EXPECT_EQ(e.status(), status);
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const std::string k_dim = "k.shape[3] (head_dim): expected 8 (q.shape[3]), got 9";
  expect_throws([&] { flashback::forward(q, k, v, o, lse); }, flashback::Status::invalid_argument, k_dim);
  expect_throws([&] { (void)flashback::forward_workspace_size(q, k, v, o, lse); }, flashback::Status::invalid_argument,
                k_dim);
  flashback::Gradients grads;
  grads.dq = dq;
  expect_throws([&] { flashback::backward(dout, q, k, v, o, lse, grads); }, flashback::Status::invalid_argument, k_dim);
  expect_throws([&] { (void)flashback::backward_workspace_size(dout, q, k, v, o, lse, grads); },
                flashback::Status::invalid_argument, k_dim);

  const TensorView good_k(a.k);
  flashback::Params params;
  params.scale = -1.0;
  expect_throws([&] { flashback::forward(q, good_k, v, o, lse, params); }, flashback::Status::invalid_argument,
                "params.scale");
  fb_tensor cuda_q = a.q;
  cuda_q.device = FB_DEVICE_CUDA;
  expect_throws([&] { flashback::forward(TensorView(cuda_q), good_k, v, o, lse); }, flashback::Status::unsupported,
                "q.device: CUDA tensors need the CUDA backend");
  std::vector<char> ws(16);
  expect_throws([&] { flashback::forward(q, good_k, v, o, lse, {}, {ws.data(), ws.size()}); },
                flashback::Status::invalid_argument, "workspace_bytes: expected at least");
  EXPECT_TRUE(before.unchanged());
}

} // namespace
