// Helpers shared by the test binaries: seeds, tensors (f32, bf16, f16) over backing buffers in several
// layouts, NaN poisoning, comparison against the float64 reference, and one attention case run
// through the C API.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernels.h"
#include "flashback/flashback.h"
#include "line_aligned.h"
#include "reference.h"

namespace fbtest {

// --- Seeds --------------------------------------------------------------------------------------------

// FLASHBACK_TEST_SEED if set, else drawn from std::random_device; fixed for the process.
uint64_t base_seed();
// A generator for one named case: the same name and base seed give the same numbers, whatever the
// test filter or order.
std::mt19937_64 rng_for(const std::string& name);
// For SCOPED_TRACE: how to reproduce this run.
std::string seed_note();

// --- Instruction set ----------------------------------------------------------------------------------

// Why the calling test should be skipped: FLASHBACK_ISA asks for an instruction set above the one
// this process runs (the machine or the build lacks it). Empty when the test should run. A request
// below what runs means the cap is broken: that is reported as a failure, not a skip.
std::optional<std::string> isa_skip_reason();

// Skips the test (from SetUp or a test body) when the requested instruction set does not run here.
#define FBTEST_SKIP_UNLESS_REQUESTED_ISA()                              \
  do {                                                                  \
    if (auto why_ = ::fbtest::isa_skip_reason()) GTEST_SKIP() << *why_; \
  } while (0)

// True at the amx level on a machine without AMX (FLASHBACK_EMULATION=amx): the AMX kernels on
// emulated tiles (about 12x the avx2 kernels' time). Only bf16 runs on tiles there; f32 and f16 run
// avx512's kernels, which that level's registration tests.
bool emulated_tiles();
// FLASHBACK_BF16_DOT=1: the bf16_dot registration, bf16 products with vdpbf16ps at the machine's level.
bool bf16_dot_forced();
// Whether bf16 takes its products with vdpbf16ps here (real or emulated; cpu/isa.h).
bool bf16_dot_kernels();
// The registrations whose own kernels are bf16's alone (f32 and f16 run kernels that other
// registrations test): FLASHBACK_BF16_DOT=1, the emulated avx512bf16 level.
bool bf16_only_registration();
// The dtypes a level's registration tests: f32, bf16 and f16; bf16 alone where bf16_only_registration()
// but on emulated tiles, which test bf16 and f16 (f16's tiles, for head dims of 64 and more).
std::vector<fb_dtype> level_dtypes();
// Whether f16 runs the AMX tiles here for large head dims (max(D, Dv) >= kF16TilesMinHeadDim; cpu/kernels.h).
bool f16_tiles();
// A test's head dim d for dtype: at least kF16TilesMinHeadDim for f16 where f16_tiles(), so that the test
// runs f16's tile kernels there (below it runs the f32 kernels, which the avx512 registration tests).
int64_t head_dim_for(fb_dtype dtype, int64_t d);

// The tiles of the kernels this process runs for a dtype, for problems whose forward takes the given
// key blocks (cpu/tiles.h: forward_keys; usual: masked problems, wide: long unmasked ones, few:
// decoding); sweeps put sequence lengths around them.
flashback::cpu::Tiles tiles_for(int64_t head_dim, int64_t head_dim_v, bool backward, fb_dtype dtype = FB_F32,
                                flashback::cpu::Keys keys = flashback::cpu::Keys::usual);

// --- Tensors over backing buffers ---------------------------------------------------------------------

// How a [d0, d1, d2, d3] tensor ([B, H, S, X]; rank 3 drops X) sits in its buffer.
enum class Layout {
  bhsd,   // contiguous
  bshd,   // contiguous [B, S, H, X] viewed as [B, H, S, X] (rank 3: contiguous)
  padded, // BHSD order with padded row, head and batch strides (odd numbers), not at the buffer start
  slice,  // a sub-block of a larger [B, S+3, H+2, X+5] buffer (rank 3: of a [B, H+1, S+2] buffer)
  reversed, // BHSD with B, H and S reversed: negative strides (numpy's x[::-1, ::-1, ::-1]), element 0 last
            // (rank 3: B and H; its last dim, S, is contiguous)
  far,      // BHSD with every dim of size 1 at a far stride, up to +-2^63: a stride that never moves the
            // address may be anything (PyTorch's is_contiguous() ignores it)
};
const char* layout_name(Layout l);

// Tensor storage on a cache line, so where a view's rows start is decided by its layout and shift.
using Buffer = std::vector<unsigned char, flashback::LineAligned<unsigned char>>;

// A strided view of a backing buffer that may hold other views too, in f32, bf16 or f16. Every
// buffer has guard elements before and after the views, so a stray write next to a view is seen.
// The guard before is 64 bytes, so a contiguous view whose rows are a multiple of 64 bytes has every
// row on a cache line; `shift` elements more move it off (Api.RowAlignmentGivesTheSameBits).
class Tensor {
 public:
  Tensor() = default;
  static Tensor make(Layout layout, const std::vector<int64_t>& shape, fb_dtype dtype = FB_F32, int64_t shift = 0);
  // q, k, v as views of one packed [B, S, 3, H, D] buffer (FlashAttention's qkvpacked layout).
  static std::vector<Tensor> packed3(int64_t b, int64_t s, int64_t h, int64_t d, fb_dtype dtype = FB_F32,
                                     int64_t shift = 0);

  bool exists() const { return buf_ != nullptr; }
  fb_dtype dtype() const { return dtype_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& stride() const { return stride_; }
  int64_t numel() const;
  // The whole backing buffer, in bytes.
  Buffer& bytes() const { return *buf_; }
  // Buffer index (in elements) of every element of the view, in row-major order of the shape.
  std::vector<int64_t> element_offsets() const;
  // The bits of buffer element i (zero-extended for 16-bit types).
  uint32_t bits_at(int64_t i) const;

  fb_tensor raw() const;
  std::vector<double> read() const;             // dense, row-major, the exact stored values
  void write(const std::vector<double>& dense); // rounded to the dtype
  void fill_normal(std::mt19937_64& rng);

 private:
  std::shared_ptr<Buffer> buf_;
  fb_dtype dtype_ = FB_F32;
  int64_t offset_ = 0; // elements
  std::vector<int64_t> shape_, stride_;
};

size_t dtype_size(fb_dtype t);
const char* dtype_name(fb_dtype t);
// Unit roundoff of the storage type: the relative error of rounding one value to it.
double unit_roundoff(fb_dtype t);
// x rounded to the storage type (to nearest even), as a float.
float round_to(fb_dtype t, float x);
// The value of a 16-bit pattern of bf16 or f16, as a float.
float value_of_bits(fb_dtype t, uint16_t bits);
std::vector<float> round_to(fb_dtype t, std::vector<float> x);

// The NaN that poisons outputs (for each dtype); its payload makes a copy of it distinguishable from
// a computed NaN.
uint32_t poison_bits(fb_dtype t);
// Fills the whole backing buffer of each tensor with poison.
void poison(const std::vector<const Tensor*>& outputs);
// Every element of the tensors' buffers that lies outside all of their views is still poisoned.
::testing::AssertionResult only_views_written(const std::vector<const Tensor*>& outputs);

// A bitwise copy of the buffers behind some tensors, to prove a call left them alone.
class Snapshot {
 public:
  explicit Snapshot(const std::vector<const Tensor*>& tensors);
  ::testing::AssertionResult unchanged() const;

 private:
  std::vector<std::pair<const Buffer*, Buffer>> copies_;
};

// --- Comparison ---------------------------------------------------------------------------------------

// FlashAttention-style bound for f32 outputs of O(100)-term accumulations: a few hundred ulps of the
// output's magnitude (f32 epsilon is 1.2e-7).
constexpr double kRelTol = 2e-5;

std::string index_string(const std::vector<int64_t>& shape, int64_t flat);
// max|out - ref| <= tol * max(max|ref|, 1); any NaN or infinity fails. Reports the worst element.
// Where the reference is 0 everywhere, the bound is tol * zero_scale: an output that is exactly 0 by
// cancellation has no magnitude of its own; the caller gives the size of what cancels (default 1).
::testing::AssertionResult near_ref(const char* what, const Tensor& out, const std::vector<double>& ref,
                                    double tol = kRelTol, double zero_scale = 1.0);
// The same bound over finite reference values; -inf exactly where the reference has -inf.
::testing::AssertionResult lse_near_ref(const char* what, const Tensor& out, const std::vector<double>& ref,
                                        double tol = kRelTol);
// FlashAttention's accuracy rule for half precision (hopper/test_flash_attn.py), for one output:
//   max |out - ref| <= 2 * max |naive - ref| + 1e-5 * max |ref|
// over the finite reference values, where `naive` is a straightforward f32 implementation on the same
// inputs, rounded as the output is (naive.h). Where the reference is all zeros the bar is the f32
// checks' kRelTol * zero_scale (see the .cpp and near_ref). -inf (the LSE of a row that sees no key) must match exactly, in out
// and in naive; any other NaN or infinity fails. The failure names the output, the error, the bar,
// naive's error, the worst element and the seed.
struct BarResult {
  double error = 0, naive_error = 0, max_ref = 0, bar = 0;
  double ratio() const { // error / bar
    return bar > 0 ? error / bar : error > 0 ? std::numeric_limits<double>::infinity() : 0;
  }
};
::testing::AssertionResult within_bar(const char* what, const Tensor& out, const std::vector<double>& naive,
                                      const std::vector<double>& ref, BarResult* result = nullptr,
                                      double zero_scale = 1.0);

// Bit-identical contents (for determinism checks).
::testing::AssertionResult same_bits(const char* what, const Tensor& a, const Tensor& b);

// --- One attention case through the C API -------------------------------------------------------------

struct Case {
  ref::Shape shape;
  fb_dtype dtype = FB_F32; // of q, k, v, o, dout, dq, dk, dv; lse and delta are always f32
  ref::Options opt; // opt.scale > 0 is passed as params.scale; 0 leaves the library's default
  Layout q = Layout::bhsd, k = Layout::bhsd, v = Layout::bhsd, o = Layout::bhsd, dout = Layout::bhsd;
  Layout dq = Layout::bhsd, dk = Layout::bhsd, dv = Layout::bhsd;
  Layout rows = Layout::bhsd; // lse and delta
  bool packed = false;        // q, k, v from one [B, S, 3, H, D] buffer; dq, dk, dv into another
  int64_t shift = 0;          // elements every tensor's view is moved by in its buffer (Tensor::make)
  bool want_dq = true, want_dk = true, want_dv = true, want_delta = true;
  int threads = 0; // params.num_threads

  Case& layout(Layout l); // every rank-4 tensor
  std::string describe() const;
  fb_params params() const;
};

struct Inputs {
  Tensor q, k, v, dout;
};
struct Outputs {
  Tensor o, lse;
  Tensor dq, dk, dv, delta; // left empty when the case does not want them
};

// The parts the forward of this process cuts each query block's keys into for case `c` (1: none;
// cpu/backend.cpp: forward_splits), so that tests of split keys can check that they split.
int64_t forward_splits_of(const Case& c);
// The parts the backward cuts each key block's query blocks into (cpu/backend.cpp: backward_splits).
int64_t backward_splits_of(const Case& c);
// Whether the problem of case `c` may take wide key blocks in the forward (cpu/tiles.h: wide_keys).
bool forward_wide_keys(const Case& c);

// Random normal inputs in the case's layouts.
Inputs make_inputs(const Case& c, std::mt19937_64& rng);
// The values of `in` in the layouts of case `c` (the same shape), in buffers of their own: the same
// problem in another layout or alignment, or a copy that can be poisoned without touching `in`.
Inputs copy_of(const Case& c, const Inputs& in);
// The outputs in the case's layouts, every buffer poisoned.
Outputs make_outputs(const Case& c);

// Where the workspace comes from.
enum class WorkspaceMode {
  library,    // NULL, 0: the library allocates
  exact,      // exactly *_workspace_size bytes, 64-byte aligned
  misaligned, // exactly *_workspace_size bytes at an odd address
};

// fb_forward_workspace_size / fb_backward_workspace_size of case `c` on these tensors (the backward's with
// the gradients the case wants).
fb_status forward_workspace_bytes(const Case& c, const Inputs& in, const Outputs& out, size_t* bytes);
fb_status backward_workspace_bytes(const Case& c, const Inputs& in, const Outputs& out, size_t* bytes);
// fb_forward into out.o, out.lse. With a caller workspace, also checks that no byte around it was
// written (a failure is added to the test).
fb_status run_forward(const Case& c, const Inputs& in, Outputs& out, WorkspaceMode ws = WorkspaceMode::library);
// fb_backward on out.o and out.lse into the wanted gradients.
fb_status run_backward(const Case& c, const Inputs& in, Outputs& out, WorkspaceMode ws = WorkspaceMode::library);

// Every output tensor of `out` that exists.
std::vector<const Tensor*> forward_outputs(const Outputs& out);
std::vector<const Tensor*> backward_outputs(const Outputs& out);

// Forward, then backward on its o and lse, on fixed inputs; a failed call is added to the test.
Outputs run_forward_backward(const Case& c, const Inputs& in, WorkspaceMode ws = WorkspaceMode::library);
// Every output of `a` that exists has the bits of the same output of `b`.
void expect_same_bits(const Outputs& a, const Outputs& b);

// Query rows (b, h, i) that see no key, in [B, Hq, Sq] order.
std::vector<bool> blind_rows(const Case& c);
// Keys (b, hk, j) that no query row sees, in [B, Hk, Sk] order.
std::vector<bool> unseen_keys(const Case& c);
// Rows (the leading three dims, flattened) of a [B, H, S, X] or [B, H, S] tensor flagged in `rows`
// hold exactly `value` (-0 == 0).
::testing::AssertionResult rows_equal(const char* what, const Tensor& t, const std::vector<bool>& rows, double value);

} // namespace fbtest
