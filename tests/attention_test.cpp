// Forward and backward of the library against the float64 reference, over curated sweeps: sequence
// lengths derived from the tiles, head dims, masks, grouped-query heads, layouts, gradient subsets,
// empty sequences, scales, and half-precision storage. ctest runs this binary once per instruction set
// (FLASHBACK_ISA). FLASHBACK_TEST_SEED=<seed> replays the inputs of a failed run.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace {

using fbtest::Case;
using fbtest::Layout;
using fbtest::Tensor;

class Attention : public ::testing::Test {
 protected:
  void SetUp() override { FBTEST_SKIP_UNLESS_REQUESTED_ISA(); }
};

// --- Building cases -----------------------------------------------------------------------------------

struct Mask {
  bool causal = false;
  int64_t left = -1, right = -1;
};
const Mask kNoMask{};
const Mask kCausal{true, -1, 0};
Mask window(int64_t left, int64_t right) { return {false, left, right}; }

Case make_case(int64_t b, int64_t hq, int64_t hk, int64_t sq, int64_t sk, int64_t d, int64_t dv, Mask m = kNoMask) {
  Case c;
  c.shape = {b, hq, hk, sq, sk, d, dv};
  c.opt.causal = m.causal;
  c.opt.window_left = m.left;
  c.opt.window_right = m.right;
  return c;
}

// --- Checking one case --------------------------------------------------------------------------------

// Elements of [B, H, S, X] rows flagged in `zero_rows` ((b * H + h) * S + s) are exactly 0: a row
// that sees no key (or a key no row sees) gets zeros, not merely small values.
::testing::AssertionResult exact_zero_rows(const char* what, const Tensor& t, const std::vector<bool>& zero_rows) {
  const std::vector<double> got = t.read();
  const int64_t x = t.shape()[3];
  for (size_t i = 0; i < got.size(); ++i)
    if (zero_rows[i / x] && got[i] != 0.0)
      return ::testing::AssertionFailure() << what << fbtest::index_string(t.shape(), static_cast<int64_t>(i)) << " = "
                                           << got[i] << ", expected exactly 0 (its row sees no key)";
  return ::testing::AssertionSuccess();
}

// Keys (b, hk, j) that no query row sees, in [B, Hk, Sk] order.
std::vector<bool> unseen_keys(const Case& c) {
  const ref::Shape& s = c.shape;
  std::vector<bool> unseen(s.batch * s.heads_kv * s.seqlen_k);
  for (int64_t j = 0; j < s.seqlen_k; ++j) {
    bool seen = false;
    for (int64_t i = 0; i < s.seqlen_q && !seen; ++i) seen = ref::visible(s, c.opt, i, j);
    for (int64_t bh = 0; bh < s.batch * s.heads_kv; ++bh) unseen[bh * s.seqlen_k + j] = !seen;
  }
  return unseen;
}

// Bounds on max|out - ref| relative to max(max|ref|, 1). f32 outputs: kRelTol. Half-precision storage
// (exact inputs, f32 arithmetic, each output rounded once, lse and delta f32): rounding costs u, the
// unit roundoff, on o, dq, dk, dv; delta = rowsum(dout * o) reads the rounded o (2u), and dq, dk get
// that delta through dS (3u). Worst seen over 300 random cases: 0.96u on o and dv, 0.94u on delta,
// 1.6u on dq and dk.
struct Tolerance {
  double o, dv, delta, dq_dk;
};
Tolerance tolerance(fb_dtype dtype) {
  if (dtype == FB_F32) return {fbtest::kRelTol, fbtest::kRelTol, fbtest::kRelTol, fbtest::kRelTol};
  const double u = fbtest::unit_roundoff(dtype), f = fbtest::kRelTol;
  return {u + f, u + f, 2 * u + f, 3 * u + f};
}

void check_case(const Case& c) {
  SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
  std::mt19937_64 rng = fbtest::rng_for(c.describe());
  const fbtest::Inputs in = fbtest::make_inputs(c, rng);
  const std::vector<double> q = in.q.read(), k = in.k.read(), v = in.v.read(), dout = in.dout.read();

  std::vector<double> o, lse, dq, dk, dv, delta;
  ref::forward(c.shape, c.opt, q, k, v, o, lse);
  ref::backward(c.shape, c.opt, q, k, v, dout, dq, dk, dv, delta);

  fbtest::Outputs out = fbtest::make_outputs(c);
  const fbtest::Snapshot inputs({&in.q, &in.k, &in.v, &in.dout});
  ASSERT_EQ(fbtest::run_forward(c, in, out), FB_SUCCESS) << fb_last_error();
  const Tolerance tol = tolerance(c.dtype);
  EXPECT_TRUE(fbtest::near_ref("o", out.o, o, tol.o));
  EXPECT_TRUE(fbtest::lse_near_ref("lse", out.lse, lse));
  EXPECT_TRUE(fbtest::only_views_written(fbtest::forward_outputs(out)));

  std::vector<bool> empty_rows(lse.size());
  for (size_t r = 0; r < lse.size(); ++r) empty_rows[r] = std::isinf(lse[r]);
  EXPECT_TRUE(exact_zero_rows("o", out.o, empty_rows));

  const fbtest::Snapshot forward_results({&out.o, &out.lse});
  ASSERT_EQ(fbtest::run_backward(c, in, out), FB_SUCCESS) << fb_last_error();
  const std::vector<bool> no_keys = unseen_keys(c);
  if (out.dq.exists()) {
    EXPECT_TRUE(fbtest::near_ref("dq", out.dq, dq, tol.dq_dk));
    EXPECT_TRUE(exact_zero_rows("dq", out.dq, empty_rows));
  }
  if (out.dk.exists()) {
    EXPECT_TRUE(fbtest::near_ref("dk", out.dk, dk, tol.dq_dk));
    EXPECT_TRUE(exact_zero_rows("dk", out.dk, no_keys));
  }
  if (out.dv.exists()) {
    EXPECT_TRUE(fbtest::near_ref("dv", out.dv, dv, tol.dv));
    EXPECT_TRUE(exact_zero_rows("dv", out.dv, no_keys));
  }
  if (out.delta.exists()) {
    EXPECT_TRUE(fbtest::near_ref("delta", out.delta, delta, tol.delta));
  }
  EXPECT_TRUE(fbtest::only_views_written(fbtest::backward_outputs(out)));
  EXPECT_TRUE(forward_results.unchanged()) << "the backward wrote its inputs o or lse";
  EXPECT_TRUE(inputs.unchanged()) << "the library wrote its inputs q, k, v or dout";
}

void check_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    check_case(c);
    if (::testing::Test::HasFailure()) return; // the first failing case says enough
  }
}

// --- Sequence lengths around the tiles ----------------------------------------------------------------

// 1, t-1, t, t+1, two blocks, several blocks plus a remainder.
std::vector<int64_t> lengths_around(int64_t t) { return {1, std::max<int64_t>(t - 1, 1), t, t + 1, 2 * t, 3 * t + 5}; }

std::vector<Case> sequence_length_cases(bool backward) {
  const int64_t d = 64;
  const flashback::cpu::Tiles t = fbtest::tiles_for(d, d, backward);
  const std::vector<int64_t> m = lengths_around(t.bm), n = lengths_around(t.bn);
  std::vector<std::pair<int64_t, int64_t>> lens;
  for (size_t i = 0; i < m.size(); ++i) lens.emplace_back(m[i], n[i]); // Sq ~ Sk
  // Sq < Sk
  lens.insert(lens.end(), {{1, 3 * t.bn + 5}, {t.bm - 1, t.bn + 1}, {t.bm, 2 * t.bn}, {t.bm + 1, 3 * t.bn + 5}});
  // Sq > Sk
  lens.insert(lens.end(), {{3 * t.bm + 5, 1}, {t.bm + 1, t.bn - 1}, {2 * t.bm, t.bn}, {3 * t.bm + 5, t.bn + 1}});
  std::vector<Case> cases;
  for (auto [sq, sk] : lens)
    for (Mask mask : {kNoMask, kCausal, window(7, 3)}) cases.push_back(make_case(1, 2, 1, sq, sk, d, d, mask));
  return cases;
}

TEST_F(Attention, SequenceLengthsAroundForwardTiles) { check_cases(sequence_length_cases(false)); }

TEST_F(Attention, SequenceLengthsAroundBackwardTiles) { check_cases(sequence_length_cases(true)); }

// --- Head dims ----------------------------------------------------------------------------------------

TEST_F(Attention, HeadDims) {
  std::vector<Case> cases;
  int i = 0;
  for (int64_t d : {1, 7, 16, 32, 64, 80, 96, 128, 200, 256}) {
    const int64_t sq = fbtest::tiles_for(d, d, false).bm + 1, sk = 2 * fbtest::tiles_for(d, d, true).bn + 3;
    cases.push_back(make_case(1, 2, 1, sq, sk, d, d, i++ % 2 ? kCausal : kNoMask));
  }
  for (auto [d, dv] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 7}, {7, 1}, {16, 256}, {256, 16}, {64, 32}, {32, 64}, {80, 96}, {200, 128}, {128, 200},
           {33, 47}, {129, 65}, {250, 255}}) { // the last ones: remainders of every vector width
    const int64_t sq = fbtest::tiles_for(d, dv, false).bm + 1, sk = 2 * fbtest::tiles_for(d, dv, true).bn + 3;
    cases.push_back(make_case(1, 2, 1, sq, sk, d, dv, i++ % 2 ? kCausal : window(5, 9)));
  }
  check_cases(cases);
}

// --- Masks --------------------------------------------------------------------------------------------

TEST_F(Attention, Masks) {
  constexpr int64_t kHuge = int64_t{1} << 62;
  const int64_t d = 32;
  const flashback::cpu::Tiles t = fbtest::tiles_for(d, d, true);
  const Mask masks[] = {
      kNoMask,
      kCausal,
      {true, 9, 0},          // causal with a left window
      window(0, 0),          // the diagonal only
      window(1, 2),
      window(5, -1),
      window(-1, 3),
      window(0, -1),
      window(t.bm + t.bn, 1),
      window(1000, 1000),    // wider than the problem: no mask at all
      window(kHuge, kHuge),  // far wider: the band's arithmetic must not overflow
      {true, kHuge, 0},
  };
  const std::pair<int64_t, int64_t> lens[] = {
      {t.bm + 3, 2 * t.bn + 5},   // Sq < Sk: under small windows whole key blocks are never seen
      {2 * t.bm + 5, 2 * t.bm + 5}, // Sq = Sk
      {2 * t.bm + 7, t.bn + 1},   // Sq > Sk: under causal whole query blocks see no key
  };
  std::vector<Case> cases;
  for (auto [sq, sk] : lens)
    for (const Mask& m : masks) cases.push_back(make_case(1, 2, 1, sq, sk, d, d, m));
  // Most rows see nothing: a narrow band far below the rows.
  cases.push_back(make_case(1, 2, 1, 3 * t.bm, 4, d, d, window(2, 2)));
  cases.push_back(make_case(1, 2, 1, 3 * t.bm + 1, 1, d, d, kCausal));
  check_cases(cases);
}

// --- Grouped-query heads ------------------------------------------------------------------------------

TEST_F(Attention, GroupedQueryHeads) {
  const int64_t d = 32, dv = 48;
  const flashback::cpu::Tiles t = fbtest::tiles_for(d, dv, true);
  const Mask masks[] = {kNoMask, kCausal, window(4, 6)};
  std::vector<Case> cases;
  const std::pair<int64_t, int64_t> heads[] = {{3, 3}, {4, 2}, {8, 1}, {16, 2}, {6, 1}}; // ratios 1, 2, 8, MQA
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 2; ++j) // two of the three masks each
      cases.push_back(make_case(2, heads[i].first, heads[i].second, t.bm + 5, 2 * t.bn + 3, d, dv, masks[(i + j) % 3]));
  check_cases(cases);
}

// --- Layouts ------------------------------------------------------------------------------------------

TEST_F(Attention, Layouts) {
  const int64_t d = 24, dv = 40;
  const flashback::cpu::Tiles t = fbtest::tiles_for(d, dv, true);
  std::vector<Case> cases;
  for (Layout l : {Layout::bshd, Layout::padded, Layout::slice})
    for (Mask m : {kNoMask, kCausal}) {
      Case c = make_case(2, 4, 2, t.bm + 3, t.bn + 9, d, dv, m);
      c.layout(l);
      c.rows = l;
      cases.push_back(c);
    }
  Case mixed = make_case(2, 4, 2, 2 * t.bm + 1, t.bn - 3, d, dv, window(3, 8));
  mixed.q = Layout::bshd;
  mixed.k = Layout::padded;
  mixed.v = Layout::slice;
  mixed.o = Layout::slice;
  mixed.dout = Layout::padded;
  mixed.dq = Layout::padded;
  mixed.dk = Layout::slice;
  mixed.dv = Layout::bshd;
  mixed.rows = Layout::slice;
  cases.push_back(mixed);
  // Packed QKV [B, S, 3, H, D] in, packed dQKV out (Hq = Hk, Sq = Sk, D = Dv).
  for (Mask m : {kNoMask, kCausal}) {
    Case packed = make_case(2, 3, 3, t.bm + 7, t.bm + 7, d, d, m);
    packed.packed = true;
    packed.o = Layout::bshd;
    packed.dout = Layout::bshd;
    cases.push_back(packed);
  }
  // Only dk into the packed buffer: the dq and dv parts of it stay poisoned.
  Case only_dk = make_case(1, 2, 2, t.bn + 1, t.bn + 1, d, d, kCausal);
  only_dk.packed = true;
  only_dk.want_dq = only_dk.want_dv = false;
  cases.push_back(only_dk);
  check_cases(cases);
}

// --- Gradient subsets ---------------------------------------------------------------------------------

TEST_F(Attention, GradientSubsets) {
  const flashback::cpu::Tiles t = fbtest::tiles_for(16, 16, true);
  std::vector<Case> cases;
  for (int mask = 0; mask < 16; ++mask) { // every subset of {dq, dk, dv, delta}, the empty one too
    Case c = make_case(1, 4, 2, t.bm + 2, 2 * t.bn + 1, 16, 16, mask % 2 ? kCausal : window(3, 5));
    c.want_dq = mask & 1;
    c.want_dk = mask & 2;
    c.want_dv = mask & 4;
    c.want_delta = mask & 8;
    cases.push_back(c);
  }
  check_cases(cases);
}

// --- Empty sequences ----------------------------------------------------------------------------------

TEST_F(Attention, EmptySequences) {
  const flashback::cpu::Tiles t = fbtest::tiles_for(8, 8, true);
  std::vector<Case> cases;
  for (auto [sq, sk] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {0, t.bn + 1}, {5, 0}, {t.bm + 1, 0}, {0, 0}})
    for (Mask m : {kNoMask, kCausal, window(2, 1)}) cases.push_back(make_case(2, 2, 1, sq, sk, 8, 8, m));
  check_cases(cases);
}

// --- Scale --------------------------------------------------------------------------------------------

TEST_F(Attention, NonDefaultScale) {
  const flashback::cpu::Tiles t = fbtest::tiles_for(32, 32, true);
  std::vector<Case> cases;
  for (double scale : {0.03, 0.3, 2.0})
    for (Mask m : {kNoMask, kCausal}) {
      Case c = make_case(1, 2, 1, t.bm + 1, t.bn + 4, 32, 32, m);
      c.opt.scale = scale;
      cases.push_back(c);
    }
  check_cases(cases);
}

// --- Half-precision storage --------------------------------------------------------------------------

TEST_F(Attention, HalfPrecisionStorage) {
  std::vector<Case> cases;
  for (fb_dtype dtype : {FB_BF16, FB_F16}) {
    const flashback::cpu::Tiles t = fbtest::tiles_for(64, 64, true, dtype), f = fbtest::tiles_for(64, 64, false, dtype);
    std::vector<Case> some = {
        make_case(2, 4, 2, t.bm + 1, 2 * t.bn + 3, 64, 64, kCausal),
        make_case(1, 8, 1, 3 * f.bm + 5, f.bn - 1, 64, 64, kCausal), // Sq > Sk: rows that see nothing
        make_case(1, 2, 2, f.bm - 1, 3 * f.bn + 5, 7, 200, window(9, 4)),
        make_case(1, 2, 1, t.bm, t.bn + 1, 256, 256, kNoMask),
        make_case(2, 2, 1, 5, 0, 32, 32, kNoMask),
    };
    some[2].layout(Layout::slice);
    some[2].rows = Layout::padded;
    some[3].want_dk = some[3].want_delta = false;
    Case packed = make_case(1, 3, 3, t.bm + 7, t.bm + 7, 40, 40, window(20, 0));
    packed.packed = true;
    packed.o = packed.dout = Layout::bshd;
    some.push_back(packed);
    for (Case& c : some) {
      c.dtype = dtype;
      cases.push_back(c);
    }
  }
  check_cases(cases);
}

} // namespace
