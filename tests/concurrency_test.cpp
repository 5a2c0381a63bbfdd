// Eight application threads call forward and backward at once, each on its own problem (dtype, shape,
// mask, layout, gradients, workspace all differ), and get the bits of the same calls made one after
// another. scripts/test.sh also runs the OneThreadPerCall tests under ThreadSanitizer: with
// params.num_threads = 1 a call runs on its caller's thread without entering OpenMP, whose runtime
// TSan does not see into (RELIABILITY.md). The WithTeams tests give each caller an OpenMP team too.
#include <gtest/gtest.h>

#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace {

using fbtest::Case;
using fbtest::Inputs;
using fbtest::Layout;
using fbtest::Outputs;
using fbtest::WorkspaceMode;

constexpr int kCallers = 8;

struct Problem {
  Case c;
  WorkspaceMode ws = WorkspaceMode::library;
  Inputs in;
};

// Eight different problems: every dtype, masks, grouped heads, layouts, gradient subsets, workspaces.
std::vector<Problem> problems(int threads_per_call) {
  const fb_dtype dtypes[] = {FB_F32, FB_BF16, FB_F16};
  const Layout layouts[] = {Layout::bhsd, Layout::bshd, Layout::padded, Layout::slice, Layout::reversed};
  const WorkspaceMode workspaces[] = {WorkspaceMode::library, WorkspaceMode::exact, WorkspaceMode::misaligned};
  std::vector<Problem> out(kCallers);
  for (int i = 0; i < kCallers; ++i) {
    Case& c = out[i].c;
    c.dtype = dtypes[i % 3];
    const int64_t hk = 1 + i % 2, hq = hk * (1 + i % 3);
    c.shape = {1 + i % 2, hq, hk, 40 + 13 * i, 33 + 17 * i, 8 * (1 + i % 4), 8 * (1 + (i + 1) % 3)};
    c.opt.causal = i % 3 == 0;
    if (i % 3 == 1) {
      c.opt.window_left = 9 + i;
      c.opt.window_right = i;
    }
    c.layout(layouts[i % 5]);
    c.want_dq = i != 3;
    c.want_dk = i != 5;
    c.want_dv = i != 6;
    c.want_delta = i % 2 == 0;
    c.threads = threads_per_call;
    out[i].ws = workspaces[i % 3];
    std::mt19937_64 rng = fbtest::rng_for(c.describe());
    out[i].in = fbtest::make_inputs(c, rng);
  }
  return out;
}

struct Result {
  Outputs out;
  fb_status forward = FB_ERROR_INTERNAL, backward = FB_ERROR_INTERNAL;
  std::string error;
};

Result run(const Problem& p) {
  Result r;
  r.out = fbtest::make_outputs(p.c);
  r.forward = fbtest::run_forward(p.c, p.in, r.out, p.ws);
  if (r.forward != FB_SUCCESS) r.error = fb_last_error();
  r.backward = fbtest::run_backward(p.c, p.in, r.out, p.ws);
  if (r.backward != FB_SUCCESS) r.error = fb_last_error();
  return r;
}

void expect_same(const Result& alone, const Result& together) {
  ASSERT_EQ(together.forward, FB_SUCCESS) << together.error;
  ASSERT_EQ(together.backward, FB_SUCCESS) << together.error;
  fbtest::expect_same_bits(alone.out, together.out);
}

// The calls one after another, then kCallers threads released together, each running its problem
// `rounds` times and then a call that fails with a message naming its own thread (fb_last_error is
// per thread). Every result must be the sequential one.
void check_concurrent(int threads_per_call, int rounds) {
  const std::vector<Problem> ps = problems(threads_per_call);
  std::vector<Result> alone;
  for (const Problem& p : ps) {
    alone.push_back(run(p));
    ASSERT_EQ(alone.back().forward, FB_SUCCESS) << p.c.describe() << ": " << alone.back().error;
    ASSERT_EQ(alone.back().backward, FB_SUCCESS) << p.c.describe() << ": " << alone.back().error;
  }
  std::vector<std::vector<Result>> together(kCallers);
  std::vector<std::string> own_error(kCallers);
  std::latch start(kCallers);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i)
    callers.emplace_back([&, i] {
      start.arrive_and_wait();
      for (int r = 0; r < rounds; ++r) together[i].push_back(run(ps[i]));
      Problem bad = ps[i];
      bad.c.threads = -1000 - i; // invalid: the message quotes it
      Outputs out = fbtest::make_outputs(bad.c);
      if (fbtest::run_forward(bad.c, bad.in, out) != FB_SUCCESS) own_error[i] = fb_last_error();
    });
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < kCallers; ++i) {
    SCOPED_TRACE(ps[i].c.describe() + "; " + fbtest::seed_note());
    for (const Result& r : together[i]) expect_same(alone[i], r);
    EXPECT_NE(own_error[i].find(std::to_string(-1000 - i)), std::string::npos)
        << "thread " << i << " read another thread's error: " << own_error[i];
  }
}

TEST(Concurrency, EightCallersOneThreadPerCall) { check_concurrent(1, 3); }

TEST(Concurrency, EightCallersWithTeams) { check_concurrent(2, 2); }

} // namespace
