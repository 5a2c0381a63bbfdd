// The float64 reference checked on its own: its gradients against central differences of
// L = sum(dout * o), and its outputs against cases whose answer is known in closed form.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Problem {
  ref::Shape s;
  ref::Options o;
  std::vector<double> q, k, v, dout;
};

size_t q_size(const ref::Shape& s) { return s.batch * s.heads_q * s.seqlen_q * s.head_dim; }
size_t k_size(const ref::Shape& s) { return s.batch * s.heads_kv * s.seqlen_k * s.head_dim; }
size_t v_size(const ref::Shape& s) { return s.batch * s.heads_kv * s.seqlen_k * s.head_dim_v; }
size_t o_size(const ref::Shape& s) { return s.batch * s.heads_q * s.seqlen_q * s.head_dim_v; }

Problem random_problem(const ref::Shape& s, const ref::Options& o, const std::string& name) {
  std::mt19937_64 rng = fbtest::rng_for(name);
  std::normal_distribution<double> normal;
  auto draw = [&](size_t n) {
    std::vector<double> x(n);
    for (double& e : x) e = normal(rng);
    return x;
  };
  return {s, o, draw(q_size(s)), draw(k_size(s)), draw(v_size(s)), draw(o_size(s))};
}

double loss(const Problem& p) {
  std::vector<double> o, lse;
  ref::forward(p.s, p.o, p.q, p.k, p.v, o, lse);
  double l = 0;
  for (size_t i = 0; i < o.size(); ++i) l += p.dout[i] * o[i];
  return l;
}

// Central differences of loss() for every element of one input, against the analytic gradient.
void expect_gradient_matches(const char* what, Problem p, std::vector<double> Problem::*input,
                             const std::vector<double>& analytic) {
  constexpr double kStep = 1e-5; // truncation ~ step^2 = 1e-10, rounding ~ 1e-16 / step = 1e-11
  std::vector<double>& x = p.*input;
  ASSERT_EQ(x.size(), analytic.size()) << what;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + kStep;
    const double up = loss(p);
    x[i] = saved - kStep;
    const double down = loss(p);
    x[i] = saved;
    const double fd = (up - down) / (2 * kStep);
    const double err = std::abs(fd - analytic[i]) / std::max(1.0, std::abs(analytic[i]));
    if (err > worst) {
      worst = err;
      at = i;
    }
  }
  EXPECT_LT(worst, 1e-6) << what << ": worst relative difference at element " << at << " (analytic "
                         << analytic[at] << ")";
}

void check_gradients(const std::string& name, const ref::Shape& s, const ref::Options& o) {
  SCOPED_TRACE(name + "; " + fbtest::seed_note());
  const Problem p = random_problem(s, o, name);
  std::vector<double> dq, dk, dv, delta, out, lse;
  ref::backward(s, o, p.q, p.k, p.v, p.dout, dq, dk, dv, delta);
  expect_gradient_matches("dq", p, &Problem::q, dq);
  expect_gradient_matches("dk", p, &Problem::k, dk);
  expect_gradient_matches("dv", p, &Problem::v, dv);
  // delta = rowsum(dout * o)
  ref::forward(s, o, p.q, p.k, p.v, out, lse);
  for (size_t r = 0; r < delta.size(); ++r) {
    double sum = 0;
    for (int64_t x = 0; x < s.head_dim_v; ++x) sum += p.dout[r * s.head_dim_v + x] * out[r * s.head_dim_v + x];
    EXPECT_NEAR(delta[r], sum, 1e-12) << "delta row " << r;
  }
}

ref::Options mask(bool causal, int64_t left = -1, int64_t right = -1, double scale = 0) {
  ref::Options o;
  o.causal = causal;
  o.window_left = left;
  o.window_right = right;
  o.scale = scale;
  return o;
}

TEST(ReferenceGradients, MatchFiniteDifferences) {
  // {B, Hq, Hk, Sq, Sk, D, Dv}
  check_gradients("plain", {1, 1, 1, 3, 4, 3, 3}, mask(false));
  check_gradients("gqa", {2, 4, 2, 3, 5, 2, 3}, mask(false));
  check_gradients("mqa causal", {1, 3, 1, 4, 4, 3, 2}, mask(true));
  check_gradients("causal Sq > Sk: rows that see nothing", {1, 2, 1, 5, 3, 2, 2}, mask(true));
  check_gradients("window (1, 1)", {1, 2, 2, 4, 6, 3, 2}, mask(false, 1, 1));
  check_gradients("window (0, 0) Sq > Sk", {1, 1, 1, 5, 3, 2, 3}, mask(false, 0, 0));
  check_gradients("Dv != D", {1, 2, 1, 3, 4, 4, 1}, mask(false, 2, -1));
  check_gradients("scale", {1, 1, 1, 3, 3, 2, 2}, mask(false, -1, -1, 0.7));
}

// --- Closed forms -------------------------------------------------------------------------------------

TEST(ReferenceVisibility, BottomRightAlignment) {
  const ref::Shape s{1, 1, 1, 2, 5, 1, 1}; // Sq = 2, Sk = 5: query i sits on key i + 3
  const ref::Options causal = mask(true);
  EXPECT_TRUE(ref::visible(s, causal, 0, 3));
  EXPECT_FALSE(ref::visible(s, causal, 0, 4));
  EXPECT_TRUE(ref::visible(s, causal, 1, 4));
  const ref::Options win = mask(false, 1, 0); // keys i + 2 .. i + 3
  EXPECT_FALSE(ref::visible(s, win, 0, 1));
  EXPECT_TRUE(ref::visible(s, win, 0, 2));
  EXPECT_TRUE(ref::visible(s, win, 0, 3));
  EXPECT_FALSE(ref::visible(s, win, 0, 4));
  const ref::Shape tall{1, 1, 1, 5, 2, 1, 1}; // Sq = 5, Sk = 2: query i sits on key i - 3
  for (int64_t j = 0; j < 2; ++j) {
    EXPECT_FALSE(ref::visible(tall, causal, 2, j));
    EXPECT_TRUE(ref::visible(tall, causal, 4, j));
  }
  EXPECT_FALSE(ref::visible(tall, causal, 3, 1));
  EXPECT_TRUE(ref::visible(tall, causal, 3, 0));
}

// Window sides up to INT64_MAX (the API accepts any value >= -1) mean unbounded, with no overflow (the
// sanitizer job runs this under UBSan; the fuzzer found one at Sq > Sk).
TEST(ReferenceVisibility, HugeWindowSides) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const ref::Shape tall{1, 1, 1, 80, 5, 1, 1}; // query i sits on key i - 75
  for (int64_t i : {int64_t{0}, int64_t{79}})
    for (int64_t j : {int64_t{0}, int64_t{4}}) {
      EXPECT_TRUE(ref::visible(tall, mask(false, kMax, kMax), i, j));
      EXPECT_EQ(ref::visible(tall, mask(false, kMax, 0), i, j), j <= i - 75);
      EXPECT_EQ(ref::visible(tall, mask(false, 0, kMax), i, j), j >= i - 75);
    }
}

TEST(ReferenceForward, UniformScoresAverageTheVisibleValues) {
  // q = 0: every visible score is 0, so o is the mean of the visible v rows and lse = log(count).
  const ref::Shape s{1, 1, 1, 3, 5, 2, 3};
  std::vector<double> q(q_size(s), 0.0), k(k_size(s)), v(v_size(s)), o, lse;
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::sin(1.0 + i);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i);
  ref::forward(s, mask(true), q, k, v, o, lse);
  for (int64_t i = 0; i < 3; ++i) { // row i sees keys 0 .. i + 2
    const int64_t n = i + 3;
    EXPECT_NEAR(lse[i], std::log(static_cast<double>(n)), 1e-14);
    for (int64_t x = 0; x < 3; ++x) {
      double mean = 0;
      for (int64_t j = 0; j < n; ++j) mean += v[j * 3 + x] / n;
      EXPECT_NEAR(o[i * 3 + x], mean, 1e-12) << "row " << i << " col " << x;
    }
  }
}

TEST(ReferenceForward, OneKeyGivesItsValueRow) {
  const ref::Shape s{1, 2, 1, 4, 1, 3, 2};
  const Problem p = random_problem(s, mask(false), "one key");
  std::vector<double> o, lse;
  ref::forward(s, p.o, p.q, p.k, p.v, o, lse);
  for (int64_t r = 0; r < 2 * 4; ++r) {
    double score = 0;
    for (int64_t x = 0; x < 3; ++x) score += p.q[r * 3 + x] * p.k[x];
    EXPECT_NEAR(lse[r], score / std::sqrt(3.0), 1e-12);
    for (int64_t x = 0; x < 2; ++x) EXPECT_NEAR(o[r * 2 + x], p.v[x], 1e-12);
  }
}

TEST(ReferenceForward, TwoKeysFollowTheLogistic) {
  // With two keys, o = v0 + sigmoid(scale * q.(k1 - k0)) (v1 - v0).
  const ref::Shape s{1, 1, 1, 1, 2, 2, 1};
  const std::vector<double> q = {0.5, -1.0}, k = {1.0, 2.0, -0.5, 0.25}, v = {3.0, -1.0};
  std::vector<double> o, lse;
  const double scale = 0.8;
  ref::forward(s, mask(false, -1, -1, scale), q, k, v, o, lse);
  const double s0 = scale * (0.5 * 1.0 - 1.0 * 2.0), s1 = scale * (0.5 * -0.5 - 1.0 * 0.25);
  const double p1 = 1.0 / (1.0 + std::exp(s0 - s1));
  EXPECT_NEAR(o[0], 3.0 + p1 * (-1.0 - 3.0), 1e-14);
  EXPECT_NEAR(lse[0], std::log(std::exp(s0) + std::exp(s1)), 1e-14);
}

TEST(ReferenceForward, DiagonalWindowCopiesValues) {
  const ref::Shape s{1, 1, 1, 4, 4, 2, 3};
  const Problem p = random_problem(s, mask(false, 0, 0), "diagonal");
  std::vector<double> o, lse;
  ref::forward(s, p.o, p.q, p.k, p.v, o, lse);
  for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(o[i], p.v[i], 1e-12);
}

TEST(ReferenceForward, GroupedHeadsReadTheirKvHead) {
  // Hq = 4, Hk = 2: heads 0, 1 read kv head 0 and heads 2, 3 kv head 1. q = 0 makes o the mean of v.
  const ref::Shape s{1, 4, 2, 1, 2, 1, 1};
  const std::vector<double> q(4, 0.0), k = {1, 2, 3, 4}, v = {10, 20, 30, 50};
  std::vector<double> o, lse;
  ref::forward(s, mask(false), q, k, v, o, lse);
  EXPECT_DOUBLE_EQ(o[0], 15.0);
  EXPECT_DOUBLE_EQ(o[1], 15.0);
  EXPECT_DOUBLE_EQ(o[2], 40.0);
  EXPECT_DOUBLE_EQ(o[3], 40.0);
}

TEST(ReferenceForward, RowsThatSeeNothing) {
  const ref::Shape s{1, 1, 1, 4, 2, 2, 2}; // causal, Sq > Sk: rows 0 and 1 see no key
  const Problem p = random_problem(s, mask(true), "empty rows");
  std::vector<double> o, lse, dq, dk, dv, delta;
  ref::forward(s, p.o, p.q, p.k, p.v, o, lse);
  ref::backward(s, p.o, p.q, p.k, p.v, p.dout, dq, dk, dv, delta);
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_EQ(lse[r], kNegInf);
    EXPECT_EQ(delta[r], 0.0);
    for (int64_t x = 0; x < 2; ++x) {
      EXPECT_EQ(o[r * 2 + x], 0.0);
      EXPECT_EQ(dq[r * 2 + x], 0.0);
    }
  }
  for (int64_t r = 2; r < 4; ++r) EXPECT_TRUE(std::isfinite(lse[r]));
}

TEST(ReferenceBackward, UniformScoresSpreadDoutOverVisibleKeys) {
  // q = 0: p = 1/n over the n visible keys, so dv_j = sum over rows i that see j of dout_i / n_i.
  const ref::Shape s{1, 1, 1, 3, 3, 1, 1};
  const std::vector<double> q(3, 0.0), k = {0.3, -0.2, 0.9}, v = {1, 2, 4}, dout = {1, 10, 100};
  std::vector<double> dq, dk, dv, delta;
  ref::backward(s, mask(true), q, k, v, dout, dq, dk, dv, delta);
  EXPECT_NEAR(dv[0], 1.0 + 10.0 / 2 + 100.0 / 3, 1e-12);
  EXPECT_NEAR(dv[1], 10.0 / 2 + 100.0 / 3, 1e-12);
  EXPECT_NEAR(dv[2], 100.0 / 3, 1e-12);
  EXPECT_NEAR(delta[1], 10.0 * 1.5, 1e-12); // o_1 = mean(1, 2)
}

} // namespace
