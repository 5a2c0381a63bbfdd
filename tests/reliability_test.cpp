// What a long training run needs beyond the correctness sweep: the same bits on every run and every
// thread count (each dtype), numerics at the edges (logits of 1e4, the backward's P at logits of
// hundreds, tiny and subnormal values, Sk = 1, fully masked rows), the policy for NaN and Inf inputs,
// and element offsets beyond 2^31.
// ctest runs this binary once per instruction set (FLASHBACK_ISA), like attention_test; RELIABILITY.md
// says what each test shows. FLASHBACK_TEST_SEED=<seed> replays the inputs of a failed run.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace {

using fbtest::Case;
using fbtest::Inputs;
using fbtest::Layout;
using fbtest::Outputs;
using fbtest::Tensor;
using fbtest::WorkspaceMode;

class Reliability : public ::testing::Test {
 protected:
  void SetUp() override { FBTEST_SKIP_UNLESS_REQUESTED_ISA(); }
};

constexpr double kInf = std::numeric_limits<double>::infinity();

Case make_case(fb_dtype dtype, ref::Shape shape) {
  Case c;
  c.dtype = dtype;
  c.shape = shape;
  return c;
}

Inputs inputs_for(const Case& c) {
  std::mt19937_64 rng = fbtest::rng_for(c.describe());
  return fbtest::make_inputs(c, rng);
}

Outputs run(const Case& c, const Inputs& in, WorkspaceMode ws = WorkspaceMode::library) {
  return fbtest::run_forward_backward(c, in, ws);
}

// The float64 reference on the values the inputs hold (after rounding to the dtype).
struct Reference {
  std::vector<double> o, lse, dq, dk, dv, delta;
};
// With o_given, the backward's of the attention whose forward returned it (ref::backward).
Reference reference(const Case& c, const Inputs& in, const std::vector<double>* o_given = nullptr) {
  Reference r;
  const std::vector<double> q = in.q.read(), k = in.k.read(), v = in.v.read(), dout = in.dout.read();
  ref::forward(c.shape, c.opt, q, k, v, r.o, r.lse);
  ref::backward(c.shape, c.opt, q, k, v, dout, r.dq, r.dk, r.dv, r.delta, o_given);
  return r;
}

// Bound relative to max(max |ref|, 1). f32: kRelTol. Half precision: each output is rounded once from
// an f32 total (u), delta reads the rounded o and dq, dk read delta; the sweep in attention_test
// measures at most 1.6u, so 4u leaves room without hiding a real error (those are O(1)).
double tolerance(fb_dtype dtype) { return dtype == FB_F32 ? fbtest::kRelTol : 4 * fbtest::unit_roundoff(dtype); }

void expect_near_reference(const Outputs& out, const Reference& r, double tol) {
  EXPECT_TRUE(fbtest::near_ref("o", out.o, r.o, tol));
  EXPECT_TRUE(fbtest::lse_near_ref("lse", out.lse, r.lse)); // lse is f32 for every dtype
  if (out.dq.exists()) { EXPECT_TRUE(fbtest::near_ref("dq", out.dq, r.dq, tol)); }
  if (out.dk.exists()) { EXPECT_TRUE(fbtest::near_ref("dk", out.dk, r.dk, tol)); }
  if (out.dv.exists()) { EXPECT_TRUE(fbtest::near_ref("dv", out.dv, r.dv, tol)); }
  if (out.delta.exists()) { EXPECT_TRUE(fbtest::near_ref("delta", out.delta, r.delta, tol)); }
}

// max |out - ref| <= tol * max |ref| + floor: relative to the tensor's own scale, without near_ref's
// floor of 1, for outputs that are tiny on purpose. `floor` covers what underflows to subnormals.
::testing::AssertionResult near_ref_scaled(const char* what, const Tensor& out, const std::vector<double>& ref,
                                           double tol, double floor) {
  const std::vector<double> got = out.read();
  double max_ref = 0;
  for (double r : ref) max_ref = std::max(max_ref, std::abs(r));
  const double bound = tol * max_ref + floor;
  for (size_t i = 0; i < got.size(); ++i)
    if (!std::isfinite(got[i]) || std::abs(got[i] - ref[i]) > bound)
      return ::testing::AssertionFailure() << what << fbtest::index_string(out.shape(), static_cast<int64_t>(i))
                                           << " = " << got[i] << ", reference " << ref[i] << ": more than " << bound
                                           << " = " << tol << " * max |ref| (" << max_ref << ") + " << floor;
  return ::testing::AssertionSuccess();
}

// =====================================================================================================
// Determinism
// =====================================================================================================

// 20 runs of one call, cycling num_threads through 1, 2, 3, 4 (more threads than this machine's two
// cores included), give the bits of the first, forward and backward, for each dtype. The case spans
// several query and key blocks of this ISA's tiles, with grouped heads and a causal band, so the
// threads split heads and blocks and each query block's dQ receives several key blocks' turns. Without
// the mask, one thread's work items take two key blocks each and add their dQ in one product, more
// threads' items one key block (backend.cpp's group_for): the same bits either way. A third case
// decodes against a long cache: the forward splits each row's keys into parts (forward_splits, a
// function of the problem, not of the threads) that the threads share. A fourth has a long query side
// against two key blocks: the backward splits each key block's query blocks (backward_splits).
TEST_F(Reliability, TwentyRunsOverThreadCountsGiveTheSameBits) {
  for (fb_dtype dtype : fbtest::level_dtypes()) for (int variant : {0, 1, 2, 3}) {
    const bool masked = variant == 0;
    const int64_t d = fbtest::head_dim_for(dtype, 40);
    const flashback::cpu::Tiles t = fbtest::tiles_for(d, 24, true, dtype);
    Case c = make_case(dtype, {1, 4, 2, t.bm + 17, 2 * t.bn + 9, d, 24});
    c.opt.causal = masked;
    c.opt.window_left = masked ? t.bn + 5 : -1;
    if (variant == 2) {
      c.shape.seqlen_q = 1;
      c.shape.seqlen_k = 12 * 8 * fbtest::tiles_for(d, 24, false, dtype, flashback::cpu::Keys::few).bn + 5;
      ASSERT_GT(fbtest::forward_splits_of(c), 1) << c.describe();
    }
    if (variant == 3) {
      c.shape.seqlen_q = 3 * t.bm + 17;
      ASSERT_GT(fbtest::backward_splits_of(c), 1) << c.describe();
    }
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    const Inputs in = inputs_for(c);
    c.threads = 1;
    const Outputs first = run(c, in);
    for (int r = 1; r < 20 && !HasFailure(); ++r) {
      c.threads = 1 + r % 4;
      SCOPED_TRACE("run " + std::to_string(r + 1) + " of 20, num_threads = " + std::to_string(c.threads));
      expect_same_bits(first, run(c, in));
    }
  }
}

// =====================================================================================================
// Numerics at the edges
// =====================================================================================================

// q_row . k_j in float64, row = h * Sq + i, for a single kv head (Hk = 1).
double dot_qk(const ref::Shape& s, const std::vector<double>& q, const std::vector<double>& k, int64_t row, int64_t j) {
  double d = 0;
  for (int64_t x = 0; x < s.head_dim; ++x) d += q[row * s.head_dim + x] * k[j * s.head_dim + x];
  return d;
}

// max |q_i . k_j| over every query row and key (Hk = 1): what scale multiplies into the largest logit.
double max_abs_dot(const ref::Shape& s, const std::vector<double>& q, const std::vector<double>& k) {
  double m = 0;
  for (int64_t row = 0; row < s.heads_q * s.seqlen_q; ++row)
    for (int64_t j = 0; j < s.seqlen_k; ++j) m = std::max(m, std::abs(dot_qk(s, q, k, row, j)));
  return m;
}

// Logits up to 1e4, the largest a row sees (exp(1e4) overflows any float): the online softmax subtracts the
// running max, so nothing overflows and the results match the float64 reference, within bounds that
// follow from f32 arithmetic (any f32 attention has them):
//  - a logit s carries an absolute error of about |s| 2^-24 (D products are summed, then scaled by
//    scale * log2(e)), which exp turns into a relative error of P: o, lse, dv and delta are held
//    to the dtype's tolerance + 16 |s|max 2^-24, relative to max(max |ref|, 1) (measured: up to
//    0.75 |s|max 2^-24, on dv, since the forward and the backward compute the same raw scores q.k;
//    1.5 before, when the forward scaled Q first);
//  - dq and dk also carry scale (here ~1e3) times the error of dP - delta. The reference's backward
//    reads the o the library returned (o_given: delta = rowsum(dO o) of the same o, as a framework
//    passes it), so delta's error is its f32 sum's: Delta = max_i sum_x |dO o| (Dv + 1) 2^-24. With a
//    saturated softmax the true dq, dk are ~0 and that is all that is left: dq gets 4 scale Delta
//    max|k|, dk 4 scale Delta max|q| times the largest column sum of P. Against the exact o instead, o's
//    rounding (u) would enter Delta and the bound would exceed max |dq| a hundredfold in half precision.
TEST_F(Reliability, LogitsOfTenThousandDoNotOverflow) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    for (bool causal : {false, true}) {
      const int64_t d = fbtest::head_dim_for(dtype, 16);
      const flashback::cpu::Tiles t = fbtest::tiles_for(d, 16, false, dtype);
      Case c = make_case(dtype, {1, 2, 1, 37, t.bn + 21, d, 16}); // two key blocks: the running max moves
      c.opt.causal = causal;
      const Inputs in = inputs_for(c);
      const ref::Shape& s = c.shape;
      const std::vector<double> q = in.q.read(), k = in.k.read(), dout = in.dout.read();
      auto dot = [&](int64_t h, int64_t i, int64_t j) { return dot_qk(s, q, k, h * s.seqlen_q + i, j); };
      // The largest q.k that a row sees becomes a logit of 1e4, so that its row's lse is at least 1e4.
      // (Scaling the largest |q.k| of all pairs instead left the largest lse at 4713 when that pair was
      // masked or negative: FLASHBACK_TEST_SEED=5714877485221624439, scalar, bf16, causal.)
      // The bounds below take |s|max, the largest |logit| a row sees (negative ones may pass 1e4).
      double top = 0, top_abs = 0;
      for (int64_t h = 0; h < s.heads_q; ++h)
        for (int64_t i = 0; i < s.seqlen_q; ++i)
          for (int64_t j = 0; j < s.seqlen_k; ++j)
            if (ref::visible(s, c.opt, i, j)) {
              const double x = dot(h, i, j);
              top = std::max(top, x);
              top_abs = std::max(top_abs, std::abs(x));
            }
      ASSERT_GT(top, 0) << "no row sees a positive q.k";
      c.opt.scale = 1e4 / top;
      const double s_max = c.opt.scale * top_abs;
      SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
      const Outputs out = run(c, in);
      const std::vector<double> o = out.o.read();
      const Reference r = reference(c, in, &o);
      double max_lse = 0;
      for (double x : r.lse) max_lse = std::max(max_lse, std::abs(x));
      EXPECT_GT(max_lse, 5e3) << "the case does not reach large logits";

      const double rel = tolerance(dtype) + 16 * s_max * 0x1p-24;
      EXPECT_TRUE(fbtest::near_ref("o", out.o, r.o, rel));
      EXPECT_TRUE(fbtest::lse_near_ref("lse", out.lse, r.lse, rel));
      EXPECT_TRUE(fbtest::near_ref("dv", out.dv, r.dv, rel));
      EXPECT_TRUE(fbtest::near_ref("delta", out.delta, r.delta, rel));
      // Delta, the column sums of P, and the bounds of dq and dk.
      double delta_err = 0, max_q = 0, max_k = 0, max_colsum = 0;
      for (int64_t row = 0; row < s.heads_q * s.seqlen_q; ++row) {
        double sum = 0;
        for (int64_t x = 0; x < s.head_dim_v; ++x) sum += std::abs(dout[row * s.head_dim_v + x] * o[row * s.head_dim_v + x]);
        delta_err = std::max(delta_err, sum * (s.head_dim_v + 1) * 0x1p-24);
      }
      for (double x : q) max_q = std::max(max_q, std::abs(x));
      for (double x : k) max_k = std::max(max_k, std::abs(x));
      for (int64_t j = 0; j < s.seqlen_k; ++j) {
        double colsum = 0;
        for (int64_t h = 0; h < s.heads_q; ++h)
          for (int64_t i = 0; i < s.seqlen_q; ++i)
            if (ref::visible(s, c.opt, i, j)) colsum += std::exp(c.opt.scale * dot(h, i, j) - r.lse[h * s.seqlen_q + i]);
        max_colsum = std::max(max_colsum, colsum);
      }
      auto bound = [&](const std::vector<double>& ref, double extra) {
        double m = 1;
        for (double x : ref) m = std::max(m, std::abs(x));
        return rel * m + extra;
      };
      EXPECT_TRUE(near_ref_scaled("dq", out.dq, r.dq, 0, bound(r.dq, 4 * c.opt.scale * delta_err * max_k)));
      EXPECT_TRUE(near_ref_scaled("dk", out.dk, r.dk, 0, bound(r.dk, 4 * c.opt.scale * delta_err * max_q * max_colsum)));
    }
  }
}

// Logits of hundreds (|scale * q.k| up to 500, softmax neither uniform nor saturated), f32: the
// backward recomputes P = exp2(s * mul - lse2) from the same raw scores s = q.k the forward summed
// (the same FMA chain, the same bits), so its P differs from the forward's only by the rounding of the
// LSE (about 2 ulp of |lse2|). dv = P^T dO then keeps to 2 |s|max 2^-24 of max |dv| (measured: up to
// 1). When the forward scaled Q before the products and the backward scaled the sum, the two
// roundings of every logit differed and dv was off by 2.1 - 3.5 |s|max 2^-24 here (8 of 9 runs over
// 2). o, which only the forward's own rounding touches, is held to 4 (measured: up to 1.3, either way).
TEST_F(Reliability, BackwardRecomputesTheForwardsProbabilities) {
  for (bool causal : {false, true}) {
    const flashback::cpu::Tiles t = fbtest::tiles_for(64, 64, true, FB_F32);
    Case c = make_case(FB_F32, {1, 2, 1, 2 * t.bm + 5, 2 * t.bn + 21, 64, 64});
    c.opt.causal = causal;
    const Inputs in = inputs_for(c);
    constexpr double kMaxLogit = 500;
    c.opt.scale = kMaxLogit / max_abs_dot(c.shape, in.q.read(), in.k.read());
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    const Outputs out = run(c, in);
    const Reference r = reference(c, in);
    const double unit = kMaxLogit * 0x1p-24; // 3e-5
    EXPECT_TRUE(fbtest::near_ref("o", out.o, r.o, 4 * unit));
    EXPECT_TRUE(fbtest::near_ref("dv", out.dv, r.dv, 2 * unit));
  }
}

// Tiny inputs: q and k so small that every logit is ~0 (uniform attention), then v, then dout so small
// that the outputs they scale are tiny, in the normal and in the subnormal range of the dtype. Results
// match the reference relative to their own magnitude (near_ref's floor of 1 would hide anything),
// plus a floor of 16 of the smallest normal values of the output type (f32: 2^-126; f16: 16 of its
// smallest subnormals). In the subnormal range the floor dominates: there the test shows that tiny
// inputs turn into no NaN, no Inf and no value of normal size (AMX, for one, reads subnormal bf16 as
// 0).
TEST_F(Reliability, TinyAndSubnormalValues) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    // f16 has 5 exponent bits: 2^-10 is tiny for it, 2^-20 subnormal (smallest 2^-24).
    const double normal_tiny = dtype == FB_F16 ? 0x1p-10 : 1e-20;
    const double subnormal_tiny = dtype == FB_F16 ? 0x1p-20 : 1e-41;
    const double least = 16 * (dtype == FB_F16 ? 0x1p-24 : 0x1p-126);
    const double tol = tolerance(dtype) * 4; // the sums run over values of mixed, tiny magnitudes
    for (double tiny : {normal_tiny, subnormal_tiny}) {
      for (const char* which : {"qk", "v", "dout"}) {
        const int64_t dim = fbtest::head_dim_for(dtype, 24);
        const flashback::cpu::Tiles t = fbtest::tiles_for(dim, 24, true, dtype);
        Case c = make_case(dtype, {1, 2, 1, t.bm + 3, t.bn + 5, dim, 24});
        c.opt.causal = true;
        SCOPED_TRACE(c.describe() + " tiny " + which + " ~" + std::to_string(tiny) + "; " + fbtest::seed_note());
        Inputs in = inputs_for(c);
        auto shrink = [&](Tensor& x) {
          std::vector<double> d = x.read();
          for (double& e : d) e *= tiny;
          x.write(d);
        };
        if (std::string(which) == "qk") {
          shrink(in.q);
          shrink(in.k);
        } else if (std::string(which) == "v") {
          shrink(in.v);
        } else {
          shrink(in.dout);
        }
        const Outputs out = run(c, in);
        const Reference r = reference(c, in);
        EXPECT_TRUE(near_ref_scaled("o", out.o, r.o, tol, least));
        EXPECT_TRUE(fbtest::lse_near_ref("lse", out.lse, r.lse));
        EXPECT_TRUE(near_ref_scaled("dq", out.dq, r.dq, tol, least));
        EXPECT_TRUE(near_ref_scaled("dk", out.dk, r.dk, tol, least));
        EXPECT_TRUE(near_ref_scaled("dv", out.dv, r.dv, tol, least));
        // delta = rowsum(dout * o) reads o as stored: Dv terms, each off by up to an ulp of o
        EXPECT_TRUE(near_ref_scaled("delta", out.delta, r.delta, tol, least * c.shape.head_dim_v));
      }
    }
  }
}

// Half-precision outputs are rounded once, to nearest even, from their f32 totals, by every path (the
// vector stores of each instruction set included). For every bit pattern a of the dtype whose next
// pattern b is finite and of the same sign, o = (a + b) / 2 (two keys of equal score, values a and b)
// and dv = a + b (one key, two query rows with dout a and b) are exact in f32 and fall halfway
// between two values of the dtype: ties, in every binade, among subnormals, and at the overflow to
// inf. Each must be the test's own rounding of it (test_util.cpp), bit for bit. bf16 on the vdpbf16ps
// kernels: the instruction treats inputs below 2^-126 (bf16 subnormals) as zero, as documented (README),
// and the result must be the rounding of the sum with those inputs made 0. On real AMX tiles, which
// Intel documents to do the same and to flush results below 2^-126 as well (not yet run on AMX
// hardware here), such a result may also be 0.
TEST_F(Reliability, HalfOutputsRoundTiesToEven) {
  constexpr int64_t kHeads = 256, kDv = 256; // a column per bit pattern: 65536
  for (fb_dtype dtype : {FB_BF16, FB_F16}) {
    const bool real_tiles = flashback::cpu::active_isa() == flashback::cpu::Isa::amx &&
                            flashback::cpu::machine_isa() == flashback::cpu::Isa::amx && !fbtest::bf16_dot_kernels();
    const bool flushes = dtype == FB_BF16 && (fbtest::bf16_dot_kernels() || real_tiles);
    // a and b of pattern `bits`, or 0 and 0 where there is no such pair
    std::vector<float> a(kHeads * kDv, 0.0f), b(kHeads * kDv, 0.0f);
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      const float x = fbtest::value_of_bits(dtype, static_cast<uint16_t>(bits));
      const float y = fbtest::value_of_bits(dtype, static_cast<uint16_t>(bits + 1));
      if (std::isfinite(x) && std::isfinite(y) && ((bits + 1) & 0x7FFFu) != 0) a[bits] = x, b[bits] = y;
    }
    auto expect_rounded = [&](const char* what, const Tensor& out, auto exact) {
      const std::vector<double> got = out.read();
      int64_t wrong = 0;
      for (int64_t i = 0; i < kHeads * kDv; ++i) {
        const float want = fbtest::round_to(dtype, exact(a[i], b[i]));
        if (got[i] == want && std::signbit(got[i]) == std::signbit(want)) continue;
        auto daz = [](float x) { return std::fabs(x) < 0x1p-126f ? 0.0f : x; };
        const float want_daz = flushes ? fbtest::round_to(dtype, exact(daz(a[i]), daz(b[i]))) : want;
        if (got[i] == want_daz && std::signbit(got[i]) == std::signbit(want_daz)) continue;
        if (real_tiles && flushes && got[i] == 0.0f && std::fabs(want_daz) < 0x1p-126f) continue;
        if (++wrong <= 5)
          ADD_FAILURE() << fbtest::dtype_name(dtype) << " " << what << " of pattern " << i << " (" << a[i] << ", "
                        << b[i] << "): " << got[i] << ", expected " << want;
      }
      EXPECT_EQ(wrong, 0) << what << ": patterns rounded wrongly";
    };
    // [heads][2][Dv]: row 0 of head h holds a of patterns h * Dv.., row 1 their b
    std::vector<double> two_rows(kHeads * 2 * kDv);
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t x = 0; x < kDv; ++x) {
        two_rows[(h * 2 + 0) * kDv + x] = a[h * kDv + x];
        two_rows[(h * 2 + 1) * kDv + x] = b[h * kDv + x];
      }

    Case fwd = make_case(dtype, {1, kHeads, kHeads, 1, 2, 4, kDv});
    SCOPED_TRACE(fwd.describe() + "; " + fbtest::seed_note());
    Inputs in = inputs_for(fwd);
    in.q.write(std::vector<double>(in.q.read().size(), 0.0)); // every score 0: P = 1/2 for both keys
    in.v.write(two_rows);
    expect_rounded("o", run(fwd, in).o, [](float p, float q) { return (p + q) * 0.5f; });

    Case bwd = make_case(dtype, {1, kHeads, kHeads, 2, 1, 4, kDv});
    Inputs bin = inputs_for(bwd);
    bin.q.write(std::vector<double>(bin.q.read().size(), 0.0)); // one key: P = 1 for both rows
    bin.dout.write(two_rows);
    expect_rounded("dv", run(bwd, bin).dv, [](float p, float q) { return p + q; });
  }
}

// Sk = 1: softmax over one key is 1, so each row that sees it gets o = v exactly (exp2(0) = 1, l = 1)
// and lse = its one logit; the gradients match the reference (dq and dk are ~0: dP - delta cancels).
// Causal with Sq > 1 leaves every row but the last blind (see FullyMaskedRows for those).
TEST_F(Reliability, OneKey) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    const int64_t d = fbtest::head_dim_for(dtype, 32);
    const int64_t bm = fbtest::tiles_for(d, 16, false, dtype).bm;
    for (int64_t sq : {int64_t{1}, int64_t{5}, bm + 3}) {
      for (bool causal : {false, true}) {
        Case c = make_case(dtype, {2, 4, 2, sq, 1, d, 16});
        c.opt.causal = causal;
        SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
        const Inputs in = inputs_for(c);
        const Outputs out = run(c, in);
        expect_near_reference(out, reference(c, in), tolerance(dtype));
        // o = v of the kv head, bit for bit, in every row that sees the key
        const std::vector<bool> blind = blind_rows(c);
        const std::vector<double> o = out.o.read(), v = in.v.read();
        const ref::Shape& s = c.shape;
        for (int64_t b = 0; b < s.batch; ++b)
          for (int64_t h = 0; h < s.heads_q; ++h)
            for (int64_t i = 0; i < sq; ++i) {
              const int64_t row = (b * s.heads_q + h) * sq + i, kv = b * s.heads_kv + h / (s.heads_q / s.heads_kv);
              for (int64_t x = 0; x < s.head_dim_v && !blind[row]; ++x)
                ASSERT_EQ(o[row * s.head_dim_v + x], v[kv * s.head_dim_v + x]) << "o row " << row << " element " << x;
            }
      }
    }
  }
}

// Rows that see no key get o = 0 and lse = -inf exactly, dq = 0 and delta = 0 exactly; keys no row
// sees get dk = dv = 0 exactly; everything else matches the reference. Blind rows fill whole query
// blocks and part of one; unseen keys likewise.
TEST_F(Reliability, FullyMaskedRows) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    const int64_t d = fbtest::head_dim_for(dtype, 16);
    const flashback::cpu::Tiles tf = fbtest::tiles_for(d, 8, false, dtype), tb = fbtest::tiles_for(d, 8, true, dtype);
    const int64_t bm = std::max(tf.bm, tb.bm), bn = std::max(tf.bn, tb.bn);
    struct Masked {
      int64_t sq, sk, left, right;
      bool causal;
    };
    const Masked cases[] = {
        {bm + 9 + 20, 20, -1, 0, true},         // causal, Sq > Sk: the first bm + 9 rows see nothing
        {bm + 30, 30, 0, 0, false},             // only the diagonal: the first bm rows see nothing
        {20, 2 * bn + 7, 0, 0, false},          // Sq < Sk, diagonal: the first 2 bn - 13 keys are unseen
        {bm + 40, bn + 3, 3, 2, false},         // a narrow band: the first bm - bn + 32 rows see nothing
        {20, 2 * bn + 7, 1, -1, false},         // left edge only: the first 2 bn - 14 keys are unseen
    };
    for (const Masked& m : cases) {
      Case c = make_case(dtype, {2, 2, 1, m.sq, m.sk, d, 8});
      c.opt.causal = m.causal;
      c.opt.window_left = m.left;
      c.opt.window_right = m.right;
      SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
      const Inputs in = inputs_for(c);
      const Outputs out = run(c, in);
      expect_near_reference(out, reference(c, in), tolerance(dtype));
      const std::vector<bool> blind = blind_rows(c), unseen = unseen_keys(c);
      ASSERT_TRUE(std::count(blind.begin(), blind.end(), true) > 0 || std::count(unseen.begin(), unseen.end(), true) > 0)
          << "the case masks nothing fully";
      EXPECT_TRUE(rows_equal("o", out.o, blind, 0.0));
      EXPECT_TRUE(rows_equal("lse", out.lse, blind, -kInf));
      EXPECT_TRUE(rows_equal("dq", out.dq, blind, 0.0));
      EXPECT_TRUE(rows_equal("delta", out.delta, blind, 0.0));
      EXPECT_TRUE(rows_equal("dk", out.dk, unseen, 0.0));
      EXPECT_TRUE(rows_equal("dv", out.dv, unseen, 0.0));
    }
  }
}

// =====================================================================================================
// NaN and Inf inputs (RELIABILITY.md, "Non-finite inputs")
// =====================================================================================================

// Where one non-finite value goes: tensor (q, k, v or dout), batch, head (a kv head for k and v), row.
struct Poison {
  const char* tensor;
  int64_t b, h, row, x;
  double value;
  std::string describe() const {
    return std::string(tensor) + "[" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(row) +
           ", " + std::to_string(x) + "] = " + std::to_string(value);
  }
};

Tensor& poisoned_tensor(Inputs& in, const Poison& p) {
  const std::string t = p.tensor;
  return t == "q" ? in.q : t == "k" ? in.k : t == "v" ? in.v : in.dout;
}

void apply(Inputs& in, const Poison& p) {
  Tensor& t = poisoned_tensor(in, p);
  std::vector<double> d = t.read();
  const std::vector<int64_t>& s = t.shape();
  d[((p.b * s[1] + p.h) * s[2] + p.row) * s[3] + p.x] = p.value;
  t.write(d);
}

// Which output rows may change when `p` is poisoned: exactly what depends on it mathematically.
// Query rows [B, Hq, Sq] (o, lse, delta, dq) and key rows [B, Hk, Sk] (dk, dv):
//   q[b, h, i]:    o, lse, delta, dq of row i; dk, dv of the keys row i sees.
//   k[b, hk, j]:   o, lse, delta, dq of the rows R that see key j; dk, dv of the keys rows R see
//                  (the softmax normalization couples them).
//   v[b, hk, j]:   o, delta, dq of the rows R that see j; dk of the keys rows R see; not lse, not dv.
//   dout[b, h, i]: delta, dq of row i; dk, dv of the keys row i sees; not o, not lse.
struct Reach {
  std::vector<bool> o, lse, delta, dq, dk, dv;
};

Reach reach_of(const Case& c, const Poison& p) {
  const ref::Shape& s = c.shape;
  const int64_t g = s.heads_q / s.heads_kv;
  const std::string t = p.tensor;
  std::vector<bool> rows(s.batch * s.heads_q * s.seqlen_q, false), keys(s.batch * s.heads_kv * s.seqlen_k, false);
  auto mark_keys_of = [&](int64_t h, int64_t i) {
    for (int64_t j = 0; j < s.seqlen_k; ++j)
      if (ref::visible(s, c.opt, i, j)) keys[(p.b * s.heads_kv + h / g) * s.seqlen_k + j] = true;
  };
  if (t == "q" || t == "dout") {
    rows[(p.b * s.heads_q + p.h) * s.seqlen_q + p.row] = true;
    mark_keys_of(p.h, p.row);
  } else {
    for (int64_t h = p.h * g; h < (p.h + 1) * g; ++h)
      for (int64_t i = 0; i < s.seqlen_q; ++i)
        if (ref::visible(s, c.opt, i, p.row)) {
          rows[(p.b * s.heads_q + h) * s.seqlen_q + i] = true;
          mark_keys_of(h, i);
        }
  }
  const std::vector<bool> none_q(rows.size(), false), none_k(keys.size(), false);
  Reach r;
  r.o = t == "dout" ? none_q : rows;
  r.lse = t == "q" || t == "k" ? rows : none_q;
  r.delta = r.dq = rows;
  r.dk = keys;
  r.dv = t == "v" ? none_k : keys;
  return r;
}

// Every row outside `reach` holds the values of the clean run (-0 == 0; finite, or -inf for a blind
// row's lse, as there).
::testing::AssertionResult unchanged_outside(const char* what, const Tensor& poisoned, const Tensor& clean,
                                             const std::vector<bool>& reach) {
  const std::vector<double> a = poisoned.read(), b = clean.read();
  const int64_t x = poisoned.rank() == 4 ? poisoned.shape()[3] : 1;
  for (size_t i = 0; i < a.size(); ++i)
    if (!reach[i / x] && !(a[i] == b[i]))
      return ::testing::AssertionFailure() << what << fbtest::index_string(poisoned.shape(), static_cast<int64_t>(i))
                                           << " = " << a[i] << " but " << b[i]
                                           << " without the non-finite input, which it does not depend on";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult any_nan_inside(const Outputs& out, const Reach& reach) {
  for (auto [t, rows] : {std::pair{&out.o, &reach.o}, std::pair{&out.lse, &reach.lse}, std::pair{&out.dq, &reach.dq},
                         std::pair{&out.dk, &reach.dk}, std::pair{&out.dv, &reach.dv},
                         std::pair{&out.delta, &reach.delta}}) {
    const std::vector<double> a = t->read();
    const int64_t x = t->rank() == 4 ? t->shape()[3] : 1;
    for (size_t i = 0; i < a.size(); ++i)
      if ((*rows)[i / x] && std::isnan(a[i])) return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "no output that depends on the NaN input is NaN: it was swallowed";
}

// Two batches, two kv heads of two query heads each, a causal mask, two blocks of keys and of
// forward query blocks.
// Poisons sit in batch 0, kv group 0 (query head 1), at the first and last rows and keys: the last
// key is seen by the last row only, the first row sees the first key only, so masked products meet
// the poison in every tile that holds it.
Case poison_case(fb_dtype dtype) {
  const int64_t d = fbtest::head_dim_for(dtype, 16);
  const flashback::cpu::Tiles t = fbtest::tiles_for(d, 16, true, dtype);
  Case c = make_case(dtype, {2, 4, 2, t.bn + 7, t.bn + 7, d, 16});
  c.opt.causal = true;
  return c;
}

// Three rows of each query head against 4 parts of 8 key blocks each: the forward splits the keys
// and combines the parts (cpu/backend.cpp: forward_splits). The poisoned keys lie in the first part.
Case split_poison_case(fb_dtype dtype) {
  const int64_t d = fbtest::head_dim_for(dtype, 16);
  const flashback::cpu::Tiles t = fbtest::tiles_for(d, 16, false, dtype);
  Case c = make_case(dtype, {2, 4, 2, 3, 4 * 8 * t.bn + 7, d, 16});
  c.opt.causal = true;
  return c;
}

// A long query side against two key blocks per kv head, with a window: the backward splits each key
// block's query blocks and adds the parts' dK and dV (cpu/backend.cpp: backward_splits).
Case split_queries_poison_case(fb_dtype dtype) {
  const int64_t d = fbtest::head_dim_for(dtype, 16);
  const flashback::cpu::Tiles t = fbtest::tiles_for(d, 16, true, dtype);
  Case c = make_case(dtype, {2, 4, 2, 3 * t.bm + 5, t.bn + 7, d, 16});
  c.opt.window_right = 3 * t.bm; // the first row still sees keys, the last of them cut off
  return c;
}

std::vector<Case> poison_cases(fb_dtype dtype) {
  return {poison_case(dtype), split_poison_case(dtype), split_queries_poison_case(dtype)};
}

// The first and last rows of q and dout, the first and (up to the query side's last) keys of k and v.
std::vector<Poison> poisons(const Case& c, double value) {
  std::vector<Poison> out;
  for (int64_t row : {int64_t{0}, c.shape.seqlen_q - 1}) {
    const int64_t key = std::min(row, c.shape.seqlen_k - 1);
    out.push_back({"q", 0, 1, row, 3, value});
    out.push_back({"k", 0, 0, key, 5, value});
    out.push_back({"v", 0, 0, key, 2, value});
    out.push_back({"dout", 0, 1, row, 7, value});
  }
  return out;
}

// The policy (RELIABILITY.md, "Non-finite inputs"): a NaN or Inf in q, k, v or dout never crashes nor
// fails the call, changes only the outputs that depend on it mathematically (every other output keeps
// the value it has without it: other rows, other keys, other heads, other batches), and a NaN is never
// swallowed: some output that depends on it is NaN.
// One test per dtype, so that a run can leave one out (scripts/test.sh's sanitized stage).
class NonFiniteInputs : public Reliability, public ::testing::WithParamInterface<fb_dtype> {};

TEST_P(NonFiniteInputs, AffectOnlyWhatDependsOnThem) {
  const fb_dtype dtype = GetParam();
  const std::vector<fb_dtype> dtypes = fbtest::level_dtypes();
  if (std::find(dtypes.begin(), dtypes.end(), dtype) == dtypes.end()) GTEST_SKIP() << "not a dtype of this level";
  for (const Case& c : poison_cases(dtype)) {
    if (c.shape.seqlen_q == 3) {
      ASSERT_GT(fbtest::forward_splits_of(c), 1) << c.describe();
    }
    if (c.shape.seqlen_q > c.shape.seqlen_k) {
      ASSERT_GT(fbtest::backward_splits_of(c), 1) << c.describe();
    }
    const Inputs clean_in = inputs_for(c);
    const Outputs clean = run(c, clean_in);
    for (double value : {std::nan(""), kInf, -kInf}) {
      for (const Poison& p : poisons(c, value)) {
        SCOPED_TRACE(c.describe() + " with " + p.describe() + "; " + fbtest::seed_note());
        Inputs in = fbtest::copy_of(c, clean_in);
        apply(in, p);
        const Outputs out = run(c, in);
        const Reach reach = reach_of(c, p);
        EXPECT_TRUE(unchanged_outside("o", out.o, clean.o, reach.o));
        EXPECT_TRUE(unchanged_outside("lse", out.lse, clean.lse, reach.lse));
        EXPECT_TRUE(unchanged_outside("delta", out.delta, clean.delta, reach.delta));
        EXPECT_TRUE(unchanged_outside("dq", out.dq, clean.dq, reach.dq));
        EXPECT_TRUE(unchanged_outside("dk", out.dk, clean.dk, reach.dk));
        EXPECT_TRUE(unchanged_outside("dv", out.dv, clean.dv, reach.dv));
        if (std::isnan(value)) {
          EXPECT_TRUE(any_nan_inside(out, reach));
        }
        if (HasFailure()) return; // one poison's report says enough
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, NonFiniteInputs, ::testing::Values(FB_F32, FB_BF16, FB_F16),
                         [](const ::testing::TestParamInfo<fb_dtype>& info) {
                           return std::string(fbtest::dtype_name(info.param));
                         });

// An infinity in v or dout reaches the outputs that depend on it as that infinity, where nothing else
// turns them into NaN: v[j][x] = +-inf makes o[i][x] +-inf for each row i that sees key j (P > 0) and
// leaves that row's other columns finite; dout[i][x] = +-inf makes dv[j][x] +-inf for each key j that
// row i sees (P does not depend on dout) and leaves dv[j]'s other columns finite. The poisons of
// poison_case sit in masked tiles, whose products meet the masked zeros (which the tile math may take
// without the infinity and then add it back where it belongs).
TEST_F(Reliability, InfinitiesReachWhatDependsOnThem) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    const Case c = poison_case(dtype);
    const ref::Shape& s = c.shape;
    const int64_t g = s.heads_q / s.heads_kv;
    const Inputs clean_in = inputs_for(c);
    for (double value : {kInf, -kInf}) {
      for (const Poison& p : poisons(c, value)) {
        const std::string t = p.tensor;
        if (t != "v" && t != "dout") continue;
        SCOPED_TRACE(c.describe() + " with " + p.describe() + "; " + fbtest::seed_note());
        Inputs in = fbtest::copy_of(c, clean_in);
        apply(in, p);
        const Outputs out = run(c, in);
        // The rows of o that see the poisoned key (its kv head's query heads), or the rows of dv of
        // the keys that the poisoned row sees.
        const std::vector<double> o = out.o.read(), dv = out.dv.read();
        int64_t checked = 0;
        auto expect_row = [&](const std::vector<double>& a, const char* what, int64_t row, int64_t width) {
          for (int64_t x = 0; x < width; ++x) {
            const double e = a[row * width + x];
            if (x == p.x) {
              EXPECT_EQ(e, value) << what << " row " << row << " column " << x;
            } else {
              EXPECT_TRUE(std::isfinite(e)) << what << " row " << row << " column " << x << " = " << e;
            }
          }
          ++checked;
        };
        if (t == "v") {
          for (int64_t h = p.h * g; h < (p.h + 1) * g; ++h)
            for (int64_t i = 0; i < s.seqlen_q; ++i)
              if (ref::visible(s, c.opt, i, p.row))
                expect_row(o, "o", (p.b * s.heads_q + h) * s.seqlen_q + i, s.head_dim_v);
        } else {
          for (int64_t j = 0; j < s.seqlen_k; ++j)
            if (ref::visible(s, c.opt, p.row, j))
              expect_row(dv, "dv", (p.b * s.heads_kv + p.h / g) * s.seqlen_k + j, s.head_dim_v);
        }
        EXPECT_GT(checked, 0);
        if (HasFailure()) return;
      }
    }
  }
}

// An infinity in v or dout meets probabilities that are bf16 values exactly, whose lo parts (the bf16
// tile products take P and dS as hi + lo) are then 0, in tiles that no mask touches: 0 * inf must not
// turn the infinity into NaN. Every score 0 (q = 0): the forward's P is 1 for every key, the
// backward's 1/Sk, a power of two. v[key 0][1] = +inf makes column 1 of every row of o +inf; dout[row
// 0][2] = -inf makes column 2 of every row of dv -inf; every other column stays finite. (Random inputs
// met this where a row's largest score came out as P = 1 exactly: 1 run in 6 of
// InfinitiesReachWhatDependsOnThem before the fix.)
TEST_F(Reliability, InfinitiesMeetExactProbabilities) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    const int64_t d = fbtest::head_dim_for(dtype, 16);
    const flashback::cpu::Tiles t = fbtest::tiles_for(d, 16, true, dtype);
    int64_t sk = 1;
    while (sk < 2 * t.bn) sk *= 2;
    const Case c = make_case(dtype, {1, 2, 1, t.bm + 3, sk, d, 16});
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    Inputs in = inputs_for(c);
    in.q.write(std::vector<double>(in.q.read().size(), 0.0));
    std::vector<double> v = in.v.read(), dout = in.dout.read();
    v[1] = kInf;
    dout[2] = -kInf;
    in.v.write(v);
    in.dout.write(dout);
    const Outputs out = run(c, in);
    const int64_t dv = c.shape.head_dim_v;
    auto expect_column = [&](const std::vector<double>& a, const char* what, int64_t rows, int64_t x, double want) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t col = 0; col < dv; ++col) {
          const double e = a[r * dv + col];
          if (col == x) {
            EXPECT_EQ(e, want) << what << " row " << r << " column " << col;
          } else {
            EXPECT_TRUE(std::isfinite(e)) << what << " row " << r << " column " << col << " = " << e;
          }
        }
    };
    expect_column(out.o.read(), "o", c.shape.heads_q * c.shape.seqlen_q, 1, kInf);
    expect_column(out.dv.read(), "dv", c.shape.seqlen_k, 2, -kInf);
    if (HasFailure()) return;
  }
}

// =====================================================================================================
// 64-bit offsets
// =====================================================================================================

// Gigabytes of address space, reserved only (PROT_NONE: no memory, and no commit charge even where
// the kernel counts writable mappings whole, vm.overcommit_memory = 2), of which open() makes the
// pages that hold elements readable and writable. A touch of any other byte faults: the library must
// read and write the elements of a view and nothing between them.
class Mapping {
 public:
  explicit Mapping(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
  }
  ~Mapping() {
    if (data_) munmap(data_, bytes_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  unsigned char* data() const { return data_; }
  // Bytes [begin, end) and the rest of their pages readable and writable.
  bool open(size_t begin, size_t end) const {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    begin = begin / page * page;
    end = (end + page - 1) / page * page;
    return mprotect(data_ + begin, end - begin, PROT_READ | PROT_WRITE) == 0;
  }

 private:
  size_t bytes_;
  unsigned char* data_ = nullptr;
};

// A view whose element offsets reach past 2^31 (and its byte offsets past 2^32) inside its own mapping.
// Values move in and out through a dense fbtest::Tensor, as raw bits.
struct FarTensor {
  std::unique_ptr<Mapping> map;
  fb_dtype dtype = FB_F32;
  std::vector<int64_t> shape, stride;

  // The `far` dim gets a stride that puts its last index beyond 2^31 elements; dims inside it are
  // contiguous, dims outside it stack above it.
  static FarTensor make(fb_dtype dtype, const std::vector<int64_t>& shape, int far) {
    FarTensor t;
    t.dtype = dtype;
    t.shape = shape;
    const int rank = static_cast<int>(shape.size());
    t.stride.assign(rank, 1);
    for (int d = rank - 2; d >= 0; --d) {
      const int64_t inner = t.stride[d + 1] * shape[d + 1];
      t.stride[d] = d == far ? (int64_t{1} << 31) / std::max<int64_t>(shape[d] - 1, 1) + inner + 7 : inner + (d < far ? 3 : 0);
    }
    int64_t max_offset = 0;
    for (int d = 0; d < rank; ++d) max_offset += (shape[d] - 1) * t.stride[d];
    const size_t es = fbtest::dtype_size(dtype);
    t.map = std::make_unique<Mapping>(static_cast<size_t>(max_offset + 1) * es);
    if (!t.map->data()) return t;
    // The pages of the elements, a run of consecutive bytes at a time (offsets rise in row-major order).
    size_t begin = 0, end = 0;
    bool opened = true;
    t.each([&](int64_t off, int64_t) {
      const size_t at = static_cast<size_t>(off) * es;
      if (end > begin && at == end) {
        end += es;
        return;
      }
      if (end > begin) opened = opened && t.map->open(begin, end);
      begin = at;
      end = at + es;
    });
    if (end > begin) opened = opened && t.map->open(begin, end);
    if (!opened) t.map = std::make_unique<Mapping>(0); // no data(): the test skips
    return t;
  }

  int64_t max_offset() const {
    int64_t m = 0;
    for (size_t d = 0; d < shape.size(); ++d) m += (shape[d] - 1) * stride[d];
    return m;
  }

  fb_tensor raw() const {
    fb_tensor t;
    std::memset(&t, 0, sizeof t);
    t.data = map->data();
    t.dtype = dtype;
    t.device = FB_DEVICE_CPU;
    t.rank = static_cast<int32_t>(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) {
      t.shape[d] = shape[d];
      t.stride[d] = stride[d];
    }
    return t;
  }

  // Calls fn(offset in the mapping, index in row-major order) for every element.
  template <class Fn>
  void each(Fn&& fn) const {
    std::vector<int64_t> idx(shape.size(), 0);
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    for (int64_t flat = 0; flat < n; ++flat) {
      int64_t off = 0;
      for (size_t d = 0; d < shape.size(); ++d) off += idx[d] * stride[d];
      fn(off, flat);
      for (int d = static_cast<int>(shape.size()) - 1; d >= 0 && ++idx[d] == shape[d]; --d) idx[d] = 0;
    }
  }

  void copy_from(const Tensor& dense) {
    const std::vector<int64_t> offs = dense.element_offsets();
    const size_t es = fbtest::dtype_size(dtype);
    each([&](int64_t off, int64_t flat) {
      const uint32_t bits = dense.bits_at(offs[flat]);
      std::memcpy(map->data() + off * es, &bits, es);
    });
  }

  Tensor dense() const {
    Tensor t = Tensor::make(Layout::bhsd, shape, dtype);
    const std::vector<int64_t> offs = t.element_offsets();
    const size_t es = fbtest::dtype_size(dtype);
    each([&](int64_t off, int64_t flat) { std::memcpy(t.bytes().data() + offs[flat] * es, map->data() + off * es, es); });
    return t;
  }
};

// Every tensor of a forward and backward lies in its own mapping with one dim's stride putting its
// far end past 2^31 elements (the batch, head or sequence dim, in turn), so any offset computed in
// 32 bits would land elsewhere. Results match the reference. Only the elements' pages are accessible
// (Mapping): a stray read or write between them faults. Skipped where the kernel refuses the address
// space (a limit on it, ulimit -v) or the pages.
TEST_F(Reliability, ElementOffsetsBeyondTwoToThe31) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    const int64_t d = fbtest::head_dim_for(dtype, 24);
    const flashback::cpu::Tiles t = fbtest::tiles_for(d, 16, true, dtype);
    Case c = make_case(dtype, {2, 2, 1, t.bm + 5, t.bn + 9, d, 16});
    c.opt.causal = true;
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    const Inputs in = inputs_for(c);
    const ref::Shape& s = c.shape;
    FarTensor q = FarTensor::make(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim}, 0);
    FarTensor k = FarTensor::make(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim}, 2);
    FarTensor v = FarTensor::make(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim_v}, 0);
    FarTensor o = FarTensor::make(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim_v}, 1);
    FarTensor lse = FarTensor::make(FB_F32, {s.batch, s.heads_q, s.seqlen_q}, 0);
    FarTensor dout = FarTensor::make(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim_v}, 2);
    FarTensor dq = FarTensor::make(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim}, 1);
    FarTensor dk = FarTensor::make(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim}, 0);
    FarTensor dv = FarTensor::make(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim_v}, 2);
    FarTensor delta = FarTensor::make(FB_F32, {s.batch, s.heads_q, s.seqlen_q}, 1);
    for (const FarTensor* x : {&q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv, &delta}) {
      if (!x->map->data())
        GTEST_SKIP() << "mmap(PROT_NONE) of " << x->max_offset() << " elements, or mprotect of their pages, failed";
      ASSERT_GT(x->max_offset(), int64_t{1} << 31);
    }
    q.copy_from(in.q);
    k.copy_from(in.k);
    v.copy_from(in.v);
    dout.copy_from(in.dout);

    const fb_params params = c.params();
    const fb_tensor tq = q.raw(), tk = k.raw(), tv = v.raw(), to = o.raw(), tlse = lse.raw(), tdout = dout.raw(),
                    tdq = dq.raw(), tdk = dk.raw(), tdv = dv.raw(), tdelta = delta.raw();
    ASSERT_EQ(fb_forward(&tq, &tk, &tv, &to, &tlse, &params, nullptr, 0), FB_SUCCESS) << fb_last_error();
    ASSERT_EQ(fb_backward(&tdout, &tq, &tk, &tv, &to, &tlse, &tdq, &tdk, &tdv, &tdelta, &params, nullptr, 0),
              FB_SUCCESS)
        << fb_last_error();

    Outputs out;
    out.o = o.dense();
    out.lse = lse.dense();
    out.dq = dq.dense();
    out.dk = dk.dense();
    out.dv = dv.dense();
    out.delta = delta.dense();
    expect_near_reference(out, reference(c, in), tolerance(dtype));
  }
}

// =====================================================================================================
// A small run for valgrind (scripts/test.sh runs it under memcheck with FLASHBACK_ISA=avx2)
// =====================================================================================================

// Every dtype, grouped heads, a causal mask, odd sizes, the library's and a caller's workspace (at
// an odd address), every gradient and then a subset: small enough for memcheck.
TEST_F(Reliability, SmallForwardBackward) {
  for (fb_dtype dtype : fbtest::level_dtypes()) {
    Case c = make_case(dtype, {1, 2, 1, 19, 23, 8, 12});
    c.opt.causal = true;
    c.layout(Layout::padded);
    for (WorkspaceMode ws : {WorkspaceMode::library, WorkspaceMode::misaligned}) {
      for (bool all : {true, false}) {
        c.want_dq = all;
        c.want_delta = all;
        SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
        const Inputs in = inputs_for(c);
        const Outputs out = run(c, in, ws);
        expect_near_reference(out, reference(c, in), tolerance(dtype));
        EXPECT_TRUE(fbtest::only_views_written(fbtest::forward_outputs(out)));
        EXPECT_TRUE(fbtest::only_views_written(fbtest::backward_outputs(out)));
      }
    }
  }
}

} // namespace
