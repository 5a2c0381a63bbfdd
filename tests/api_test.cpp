// The API's promises beyond correctness: a caller's workspace (any alignment) gives the same bits as
// the library's own; any thread count and any repetition give the same bits; the C++ API is the C
// API; the small informational functions answer. Runs once per instruction set, like the sweep.
#include <gtest/gtest.h>

#include <algorithm>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "flashback/flashback.hpp"
#include "test_util.h"

namespace {

using fbtest::Case;
using fbtest::Outputs;
using fbtest::WorkspaceMode;

class Api : public ::testing::Test {
 protected:
  void SetUp() override { FBTEST_SKIP_UNLESS_REQUESTED_ISA(); }
};

// B * Hq = 1 with many blocks: the threads split one head's blocks (and share its dQ).
Case long_sequence(bool causal) {
  Case c;
  const int64_t bm = std::max(fbtest::tiles_for(64, 64, false).bm, fbtest::tiles_for(64, 64, true).bm);
  c.shape = {1, 1, 1, 8 * bm + 3, 8 * bm + 5, 64, 64};
  c.opt.causal = causal;
  return c;
}

// Enough blocks that work items group them (cpu/backend.cpp: group_for): forward 4 query blocks per
// item for 1 to 6 threads, 2 for 8; backward 4 key blocks for 1 or 2 threads, 2 for 3, 1 for 4 and 8.
// Causal with Sq > Sk: the first query blocks see no key.
Case grouped_blocks() {
  Case c;
  const flashback::cpu::Tiles f = fbtest::tiles_for(64, 64, false), b = fbtest::tiles_for(64, 64, true);
  c.shape = {2, 4, 2, 9 * f.bm + 3, 5 * b.bn + 5, 64, 64};
  c.opt.causal = true;
  return c;
}

// Decoding against a long cache: the forward splits each row's keys into parts that the threads
// share (cpu/backend.cpp: forward_splits).
Case split_keys() {
  Case c;
  c.shape = {1, 8, 2, 1, 10 * 8 * fbtest::tiles_for(64, 64, false, FB_F32, flashback::cpu::Keys::few).bn + 3, 64, 64};
  return c;
}

// A long query side against two key blocks per kv head: the backward splits each key block's (query
// head, query block) pairs into parts that the threads share (cpu/backend.cpp: backward_splits); a
// window, so that the two key blocks see different query blocks.
Case split_queries() {
  Case c;
  const flashback::cpu::Tiles b = fbtest::tiles_for(64, 64, true);
  c.shape = {1, 4, 2, 6 * b.bm + 5, b.bn + 3, 64, 48};
  c.opt.window_left = 3 * b.bm;
  c.opt.window_right = 6 * b.bm;
  return c;
}

// Many heads, grouped, with a window: the threads split heads and kv heads.
Case many_heads() {
  Case c;
  const flashback::cpu::Tiles t = fbtest::tiles_for(32, 48, true);
  c.shape = {2, 8, 2, t.bm + 9, 2 * t.bn + 1, 32, 48};
  c.opt.window_left = 20;
  c.opt.window_right = 3;
  return c;
}

// A decoding step with grouped heads, which the forward swaps into one block per kv head
// (cpu/backend.cpp: swap_decoding_heads) and sizes its workspace for; rows lie apart (BSHD), so the
// backward copies Q and dO.
Case decoding_bshd() {
  Case c;
  const flashback::cpu::Tiles f = fbtest::tiles_for(64, 64, false);
  c.shape = {2, 8, 2, 1, 3 * f.bn + 5, 64, 64};
  c.layout(fbtest::Layout::bshd);
  return c;
}

// Sq = 0 next to Sk = 0: the workspace of a problem with nothing to do.
Case empty_sequences(int64_t sq, int64_t sk) {
  Case c;
  c.shape = {2, 2, 1, sq, sk, 16, 8};
  c.opt.causal = true;
  return c;
}

// Forward then backward of `c` on fixed inputs.
Outputs run(const Case& c, const fbtest::Inputs& in, WorkspaceMode ws = WorkspaceMode::library) {
  return fbtest::run_forward_backward(c, in, ws);
}
using fbtest::expect_same_bits;

fbtest::Inputs inputs_for(const Case& c) {
  std::mt19937_64 rng = fbtest::rng_for(c.describe());
  return fbtest::make_inputs(c, rng);
}

TEST_F(Api, CallerWorkspaceGivesTheSameBits) {
  for (const Case& c :
       {long_sequence(true), many_heads(), decoding_bshd(), split_keys(), split_queries(), empty_sequences(0, 9),
        empty_sequences(9, 0)}) {
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    const fbtest::Inputs in = inputs_for(c);
    const Outputs library = run(c, in);
    for (WorkspaceMode ws : {WorkspaceMode::exact, WorkspaceMode::misaligned}) {
      SCOPED_TRACE(ws == WorkspaceMode::exact ? "exact size, aligned" : "exact size, misaligned");
      expect_same_bits(library, run(c, in, ws));
    }
  }
}

// A workspace of 2 MiB or more that the library allocates itself is a mapping of its own, with huge
// pages asked for (api/c_api.cpp: OwnedWorkspace), rather than the heap's: the same bits as a caller's
// workspace, in each dtype (each packs, converts or copies operands into it).
TEST_F(Api, LargeLibraryWorkspaceGivesTheSameBits) {
  for (fb_dtype dtype : {FB_F32, FB_BF16, FB_F16}) {
    Case c;
    // Many query rows and few keys: a workspace of megabytes (it grows with the rows: Q and dO packed
    // or copied, dQ's f32 sums) for little work, which the sanitized and emulated runs repeat
    // (700 x 700 took 130 s under ASan on emulated tiles, this 10 s).
    c.shape = {2, 4, 2, 1024, 40, 96, 96};
    c.dtype = dtype;
    c.layout(fbtest::Layout::bshd); // rows apart: f32 copies Q and dO into the workspace too
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    const fbtest::Inputs in = inputs_for(c);
    size_t backward = 0;
    ASSERT_EQ(fbtest::backward_workspace_bytes(c, in, fbtest::make_outputs(c), &backward), FB_SUCCESS)
        << fb_last_error();
    ASSERT_GE(backward, size_t{2} << 20) << "a backward workspace of a size the library takes from the heap";
    expect_same_bits(run(c, in), run(c, in, WorkspaceMode::exact));
  }
}

// The library's workspace is kept for the next call that passes none (api/c_api.cpp: WorkspaceCache): the
// largest one a call needed, whatever smaller calls come after, until it is released; none at all
// under FLASHBACK_WORKSPACE_CACHE=0 (ctest runs this test a second time so: api.WorkspaceCache.off).
TEST_F(Api, LibraryWorkspaceIsKeptForTheNextCall) {
  const char* env = std::getenv("FLASHBACK_WORKSPACE_CACHE");
  const bool off = env && std::string(env) == "0";
  Case small = many_heads(), large = grouped_blocks();
  large.dtype = FB_BF16; // packed copies of Q and dO: a backward workspace larger than the forward's
  const fbtest::Inputs small_in = inputs_for(small), large_in = inputs_for(large);
  Outputs small_out = fbtest::make_outputs(small), large_out = fbtest::make_outputs(large);
  size_t forward_small = 0, backward_large = 0;
  ASSERT_EQ(fbtest::forward_workspace_bytes(small, small_in, small_out, &forward_small), FB_SUCCESS)
      << fb_last_error();
  ASSERT_EQ(fbtest::run_forward(large, large_in, large_out), FB_SUCCESS) << fb_last_error();
  ASSERT_EQ(fbtest::backward_workspace_bytes(large, large_in, large_out, &backward_large), FB_SUCCESS)
      << fb_last_error();
  ASSERT_GT(backward_large, forward_small);

  fb_workspace_cache_release();
  EXPECT_EQ(fb_workspace_cache_bytes(), 0u);
  ASSERT_EQ(fbtest::run_forward(small, small_in, small_out), FB_SUCCESS) << fb_last_error();
  if (off) {
    EXPECT_EQ(flashback::workspace_cache_bytes(), 0u) << "FLASHBACK_WORKSPACE_CACHE=0 keeps no workspace";
  } else {
    EXPECT_GE(flashback::workspace_cache_bytes(), forward_small);
  }
  ASSERT_EQ(fbtest::run_backward(large, large_in, large_out), FB_SUCCESS) << fb_last_error();
  ASSERT_EQ(fbtest::run_forward(small, small_in, small_out), FB_SUCCESS) << fb_last_error();
  if (off) {
    EXPECT_EQ(fb_workspace_cache_bytes(), 0u);
  } else {
    EXPECT_GE(fb_workspace_cache_bytes(), backward_large) << "the larger workspace is the one kept";
  }
  flashback::release_workspace_cache();
  EXPECT_EQ(fb_workspace_cache_bytes(), 0u);
}

// A kept workspace holds what the last call left there: here non-finite values everywhere the same
// problem's call wrote (its inputs all NaN). No call reads what it did not write first: the next call
// on that workspace gives the bits of a call on a fresh caller's workspace, in each dtype of the
// level, under masks, split keys and queries, and with grouped heads swapped for decoding.
TEST_F(Api, KeptWorkspaceOfNonFiniteValuesGivesTheSameBits) {
  for (fb_dtype dtype : fbtest::level_dtypes()) { // the dtypes whose kernels this level runs
    for (Case c : {grouped_blocks(), split_keys(), split_queries(), decoding_bshd()}) {
      c.dtype = dtype;
      SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
      const fbtest::Inputs in = inputs_for(c);
      fbtest::Inputs nan = fbtest::copy_of(c, in);
      fbtest::poison({&nan.q, &nan.k, &nan.v, &nan.dout});
      const Outputs fresh = run(c, in, WorkspaceMode::exact);
      fb_workspace_cache_release();
      run(c, nan); // leaves its workspace, full of NaN, for the next call
      ASSERT_GT(fb_workspace_cache_bytes(), 0u);
      expect_same_bits(fresh, run(c, in));
    }
  }
}

// Tensors need no alignment beyond their element's: rows 1 or 4 elements past a cache line (numpy's and
// malloc's 16-byte alignment) give the same bits as rows on cache lines (the test buffers start on
// one, like a framework's tensors). Shapes of several blocks, remainders, grouped heads, masked and
// unmasked tiles, the packed layout; half precision too, whose copies are converted or packed.
TEST_F(Api, RowAlignmentGivesTheSameBits) {
  const flashback::cpu::Tiles f = fbtest::tiles_for(64, 64, false), b = fbtest::tiles_for(64, 64, true);
  std::vector<Case> cases(4);
  cases[0].shape = {1, 4, 2, 2 * b.bm + 5, 3 * f.bn + 7, 64, 64};
  cases[1].shape = {2, 2, 1, f.bm + 3, 2 * b.bn + 1, 128, 80};
  cases[1].opt.causal = true;
  cases[2].shape = {1, 2, 2, 2 * b.bm + 1, b.bn + 9, 48, 32};
  cases[2].opt.window_left = 40;
  cases[2].opt.window_right = 5;
  cases[3].shape = {1, 2, 2, f.bm + 9, f.bm + 9, 64, 64};
  cases[3].packed = true;
  for (size_t i = 0; i < cases.size(); ++i) {
    for (fb_dtype dtype : {FB_F32, FB_BF16, FB_F16}) {
      if (dtype != FB_F32 && i > 0) continue; // half precision runs on converted or packed copies anyway
      Case c = cases[i];
      c.dtype = dtype;
      c.shift = 0;
      SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
      const fbtest::Inputs in = inputs_for(c);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(in.q.raw().data) % 64, 0u) << "shift 0 should start on a cache line";
      const Outputs aligned = run(c, in);
      for (int64_t shift : {1, 4}) {
        Case moved = c;
        moved.shift = shift;
        SCOPED_TRACE("shift=" + std::to_string(shift));
        const fbtest::Inputs in_moved = fbtest::copy_of(moved, in);
        ASSERT_NE(reinterpret_cast<uintptr_t>(in_moved.q.raw().data) % 64, 0u);
        expect_same_bits(aligned, run(moved, in_moved));
      }
    }
  }
}

// Rows that lie apart (BSHD, padded rows, slices, packed QKV) are copied into f32 blocks before the
// products (cpu/math_f32.h: copies_kv, copies_qdo), or read in place where the forward has few query
// blocks: either way the same bits as BHSD, whose rows are read in place. Shapes with many query
// blocks (the forward copies K and V) and with few (it reads them in place), masked and unmasked; and
// with dims of size 1, whose far strides (Layout::far) move no address.
TEST_F(Api, LayoutsGiveTheSameBits) {
  const flashback::cpu::Tiles f = fbtest::tiles_for(64, 64, false), b = fbtest::tiles_for(64, 64, true);
  std::vector<Case> cases(5);
  cases[0].shape = {2, 4, 2, 2 * b.bm + 5, 3 * f.bn + 7, 64, 64};
  cases[1].shape = {1, 4, 4, 2 * f.bm + 1, 2 * b.bn + 3, 48, 80};
  cases[1].opt.causal = true;
  cases[2].shape = {1, 4, 4, 3, 2 * f.bn + 1, 64, 64}; // decoding-like: few query blocks
  cases[3].shape = {1, 4, 1, 1, f.bn + 3, 64, 1};      // dims of 1 (Layout::far), grouped heads swapped
  cases[4].shape = {2, 2, 2, 2 * b.bm + 1, 1, 1, 32};  // one key; D = 1
  for (Case c : cases) {
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    const fbtest::Inputs in = inputs_for(c);
    const Outputs contiguous = run(c, in);
    std::vector<Case> others;
    for (fbtest::Layout l :
         {fbtest::Layout::bshd, fbtest::Layout::padded, fbtest::Layout::slice, fbtest::Layout::reversed,
          fbtest::Layout::far}) {
      Case moved = c;
      moved.layout(l);
      others.push_back(moved);
    }
    if (c.shape.seqlen_q == c.shape.seqlen_k && c.shape.head_dim == c.shape.head_dim_v &&
        c.shape.heads_q == c.shape.heads_kv) {
      Case packed = c;
      packed.packed = true;
      others.push_back(packed);
    }
    for (const Case& moved : others) {
      SCOPED_TRACE(moved.describe());
      expect_same_bits(contiguous, run(moved, fbtest::copy_of(moved, in)));
    }
  }
}

// Decoding with grouped heads is swapped into one block of the group's heads per kv head
// (cpu/backend.cpp: swap_decoding_heads) only when the lse rows of a group are adjacent: lse and delta
// in the padded layout keep the heads apart. Both give the same bits, at 1 and 2 threads, in each dtype
// of the level: both take the same tiles (cpu/tiles.h: few_query_rows), a group of 20 heads too.
TEST_F(Api, DecodingHeadsSwappedGiveTheSameBits) {
  const flashback::cpu::Tiles f = fbtest::tiles_for(64, 64, false, FB_F32, flashback::cpu::Keys::few);
  std::vector<Case> cases(5);
  cases[4] = split_keys(); // and split keys: the same parts either way
  ASSERT_GT(fbtest::forward_splits_of(cases[4]), 1);
  cases[0].shape = {2, 8, 2, 1, 3 * f.bn + 5, 64, 64};
  cases[1].shape = {1, 16, 1, 1, 2 * f.bn + 1, 48, 80};
  cases[1].opt.causal = true;
  cases[2].shape = {1, 40, 2, 1, f.bn + 7, 32, 32}; // G = 20: a block of the main path
  cases[3].shape = {2, 4, 1, 1, 3 * f.bn, 64, 64};
  cases[3].opt.window_right = 5; // leaves every key: swapped
  for (fb_dtype dtype : fbtest::level_dtypes())
    for (Case c : cases) for (int threads : {1, 2}) {
      c.dtype = dtype;
      c.threads = threads;
      SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
      const fbtest::Inputs in = inputs_for(c);
      const Outputs swapped = run(c, in);
      Case apart = c;
      apart.rows = fbtest::Layout::padded;
      expect_same_bits(swapped, run(apart, fbtest::copy_of(apart, in)));
    }
}

TEST_F(Api, ThreadCountsGiveTheSameBits) {
  ASSERT_GT(fbtest::backward_splits_of(split_queries()), 1);
  for (Case c :
       {long_sequence(true), long_sequence(false), many_heads(), grouped_blocks(), split_keys(), split_queries()}) {
    SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
    const fbtest::Inputs in = inputs_for(c);
    c.threads = 1;
    const Outputs one = run(c, in);
    for (int threads : {2, 3, 4, 8}) { // 3, 4 and 8 threads on fewer cores: the dQ turns must still pass
      SCOPED_TRACE("threads=" + std::to_string(threads));
      c.threads = threads;
      expect_same_bits(one, run(c, in));
    }
  }
}

TEST_F(Api, RepeatedRunsGiveTheSameBits) {
  const Case c = many_heads();
  SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
  const fbtest::Inputs in = inputs_for(c);
  const Outputs first = run(c, in);
  for (int i = 0; i < 3; ++i) expect_same_bits(first, run(c, in));
}

// Calls from several application threads at once (each with its own OpenMP team) do not interfere.
TEST_F(Api, ConcurrentCallsGiveTheSameBits) {
  const Case cases[] = {many_heads(), long_sequence(true)};
  std::vector<fbtest::Inputs> inputs;
  std::vector<Outputs> alone;
  for (const Case& c : cases) {
    inputs.push_back(inputs_for(c));
    alone.push_back(run(c, inputs.back()));
  }
  std::vector<Outputs> together(2 * std::size(cases));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < together.size(); ++i)
    threads.emplace_back([&, i] { together[i] = run(cases[i % 2], inputs[i % 2]); });
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < together.size(); ++i) {
    SCOPED_TRACE(cases[i % 2].describe() + "; " + fbtest::seed_note());
    expect_same_bits(alone[i % 2], together[i]);
  }
}

TEST_F(Api, CppApiGivesTheSameBitsAsTheCApi) {
  const Case c = many_heads();
  SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
  const fbtest::Inputs in = inputs_for(c);
  const Outputs expected = run(c, in);

  using flashback::TensorView;
  const Outputs got = fbtest::make_outputs(c);
  flashback::Params params;
  params.window_left = c.opt.window_left;
  params.window_right = c.opt.window_right;
  const TensorView q(in.q.raw()), k(in.k.raw()), v(in.v.raw()), dout(in.dout.raw()), o(got.o.raw()),
      lse(got.lse.raw());
  std::vector<char> ws(flashback::forward_workspace_size(q, k, v, o, lse, params));
  flashback::forward(q, k, v, o, lse, params, {ws.data(), ws.size()});
  flashback::Gradients grads;
  grads.dq = TensorView(got.dq.raw());
  grads.dk = TensorView(got.dk.raw());
  grads.dv = TensorView(got.dv.raw());
  grads.delta = TensorView(got.delta.raw());
  flashback::backward(dout, q, k, v, o, lse, grads, params);
  expect_same_bits(expected, got);
}

TEST_F(Api, ExplicitDefaultScaleGivesTheSameBits) {
  Case c = many_heads();
  SCOPED_TRACE(c.describe() + "; " + fbtest::seed_note());
  const fbtest::Inputs in = inputs_for(c);
  const Outputs implicit = run(c, in);
  c.opt.scale = 1.0 / std::sqrt(static_cast<double>(c.shape.head_dim));
  expect_same_bits(implicit, run(c, in));
}

// num_threads = 0 means FLASHBACK_NUM_THREADS, else OpenMP's default; the forward's workspace (one
// scratch per thread) shows which count a call plans for. ctest also runs this with the variable set.
TEST_F(Api, DefaultThreadCount) {
  const char* env = std::getenv("FLASHBACK_NUM_THREADS");
  const int expected = env && *env ? std::atoi(env) : omp_get_max_threads();
  Case c = many_heads(); // more work items than threads
  const fbtest::Inputs in = inputs_for(c);
  auto forward_bytes = [&](int threads) {
    c.threads = threads;
    size_t bytes = 0;
    EXPECT_EQ(fbtest::forward_workspace_bytes(c, in, fbtest::make_outputs(c), &bytes), FB_SUCCESS)
        << fb_last_error();
    return bytes;
  };
  EXPECT_EQ(forward_bytes(0), forward_bytes(expected)) << "expected " << expected << " threads by default";
  EXPECT_NE(forward_bytes(expected), forward_bytes(expected + 1)) << "the workspace does not depend on the threads";
}

// Decoding against a long cache prepares its keys and values per tile, in each thread's scratch: the
// forward's workspace holds no copy of the cache (math_f32.h, math_bf16.h: few_query_blocks), for
// every dtype. A bf16 copy of K and V packed for the bf16 products once was the whole cache again, written
// and read once more per decoding step (and allocated, when the library owns the workspace). The
// bound, half the cache, leaves room for the per-thread scratch (27% here with the bf16 tile math's
// padded rows) and none for a copy.
TEST_F(Api, DecodingWorkspaceHoldsNoCopyOfTheCache) {
  for (const fb_dtype dtype : {FB_F32, FB_BF16, FB_F16}) {
    Case c;
    c.dtype = dtype;
    c.shape = {1, 8, 2, 1, 16384, 64, 64};
    const fbtest::Inputs in = inputs_for(c);
    size_t bytes = 0;
    ASSERT_EQ(fbtest::forward_workspace_bytes(c, in, fbtest::make_outputs(c), &bytes), FB_SUCCESS)
        << fb_last_error();
    const size_t cache = static_cast<size_t>(2 * c.shape.heads_kv * c.shape.seqlen_k * c.shape.head_dim) *
                         (dtype == FB_F32 ? 4 : 2);
    EXPECT_LT(bytes, cache / 2) << c.describe() << ": " << bytes << " bytes of workspace for " << cache
                                << " bytes of K and V";
  }
}

// A level's name as fb_cpu_isa() gives it: the level, and whether it ends in "-emulated".
struct NamedLevel {
  flashback::cpu::Isa isa = flashback::cpu::Isa::scalar;
  bool emulated = false;
};
NamedLevel level_of(const char* name) {
  std::string s = name ? name : "(null)";
  const std::string suffix = "-emulated";
  NamedLevel l;
  l.emulated = s.size() > suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
  if (l.emulated) s.resize(s.size() - suffix.size());
  EXPECT_TRUE(flashback::cpu::parse_isa(s.c_str(), &l.isa)) << (name ? name : "(null)");
  return l;
}

TEST(Info, VersionAndIsa) {
  const std::string version = fb_version();
  EXPECT_EQ(version, std::to_string(FLASHBACK_VERSION_MAJOR) + "." + std::to_string(FLASHBACK_VERSION_MINOR) + "." +
                         std::to_string(FLASHBACK_VERSION_PATCH));
  EXPECT_EQ(flashback::version(), version);
  const std::string isa = fb_cpu_isa();
  EXPECT_EQ(flashback::cpu_isa(), isa);
  // "<level>-emulated" exactly when the level is above the machine's (FLASHBACK_EMULATION).
  const NamedLevel named = level_of(isa.c_str());
  const bool emulated = named.emulated;
  const flashback::cpu::Isa parsed = named.isa;
  EXPECT_EQ(parsed, flashback::cpu::active_isa());
  if (emulated)
    EXPECT_GT(parsed, flashback::cpu::machine_isa()) << isa << " on a machine that has it";
  else
    EXPECT_LE(parsed, flashback::cpu::machine_isa()) << "runs an instruction set the machine lacks";
}

// The level of each dtype's kernels: at or below the level that runs, f32's the f32 kernels', f16's the
// tiles' at the amx level (for head dims of kF16TilesMinHeadDim and more; the f32 kernels below them) and else the f32
// kernels', bf16's its own exactly where bf16 has kernels of its own (tiles or vdpbf16ps) and else the
// f32 kernels'; NULL for a value that is no dtype.
TEST(Info, KernelsIsa) {
  using flashback::cpu::Isa;
  const Isa f32 = level_of(fb_cpu_kernels_isa(FB_F32)).isa, bf16 = level_of(fb_cpu_kernels_isa(FB_BF16)).isa;
  const Isa f16 = level_of(fb_cpu_kernels_isa(FB_F16)).isa;
  EXPECT_EQ(f16, flashback::cpu::active_isa() == Isa::amx ? Isa::amx : f32);
  EXPECT_EQ(flashback::cpu::kernels_for(flashback::cpu::active_isa(), flashback::core::DType::f16,
                                         flashback::cpu::kF16TilesMinHeadDim - 1)
                .isa,
            f32);
  EXPECT_LE(f32, flashback::cpu::active_isa());
  EXPECT_LE(f32, Isa::avx512);
  EXPECT_LE(bf16, flashback::cpu::active_isa());
  const bool own_bf16 = fbtest::bf16_dot_kernels() || flashback::cpu::active_isa() == Isa::amx;
  if (own_bf16)
    EXPECT_EQ(bf16, fbtest::bf16_dot_kernels() ? Isa::avx512bf16 : Isa::amx);
  else
    EXPECT_EQ(bf16, f32);
  EXPECT_EQ(flashback::cpu_kernels_isa(flashback::DType::bf16), fb_cpu_kernels_isa(FB_BF16));
  EXPECT_EQ(fb_cpu_kernels_isa(static_cast<fb_dtype>(7)), nullptr);
}

TEST(Info, StatusNames) {
  EXPECT_STREQ(fb_status_name(FB_SUCCESS), "FB_SUCCESS");
  EXPECT_STREQ(fb_status_name(FB_ERROR_INVALID_ARGUMENT), "FB_ERROR_INVALID_ARGUMENT");
  EXPECT_STREQ(fb_status_name(FB_ERROR_UNSUPPORTED), "FB_ERROR_UNSUPPORTED");
  EXPECT_STREQ(fb_status_name(FB_ERROR_OUT_OF_MEMORY), "FB_ERROR_OUT_OF_MEMORY");
  EXPECT_STREQ(fb_status_name(FB_ERROR_INTERNAL), "FB_ERROR_INTERNAL");
  EXPECT_STRNE(fb_status_name(static_cast<fb_status>(99)), "");
}

TEST(Info, ParamsInitDefaults) {
  fb_params p;
  std::memset(&p, 0xFF, sizeof p);
  fb_params_init(&p);
  EXPECT_EQ(p.struct_size, sizeof(fb_params));
  EXPECT_EQ(p.causal, 0);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);
  EXPECT_EQ(p.has_scale, 0);
  EXPECT_EQ(p.num_threads, 0);
  EXPECT_EQ(p.softcap, 0.0f);
  EXPECT_EQ(p.dropout_p, 0.0f);
  EXPECT_EQ(p.dropout_seed, 0u);
  EXPECT_EQ(p.alibi_slopes, nullptr);
  EXPECT_EQ(p.bias, nullptr);
  EXPECT_EQ(p.bias_grad, nullptr);
  EXPECT_EQ(p.cu_seqlens_q, nullptr);
  EXPECT_EQ(p.cu_seqlens_k, nullptr);
  fb_params_init(nullptr); // documented as harmless
}

TEST(Info, TensorHelpers) {
  float x = 0;
  const fb_tensor t4 = fb_tensor_contiguous4(&x, FB_F32, 2, 3, 5, 7);
  EXPECT_EQ(t4.rank, 4);
  EXPECT_EQ(t4.device, FB_DEVICE_CPU);
  EXPECT_EQ(t4.device_index, 0);
  const int64_t shape4[] = {2, 3, 5, 7}, stride4[] = {105, 35, 7, 1};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(t4.shape[i], shape4[i]);
    EXPECT_EQ(t4.stride[i], stride4[i]);
  }
  const fb_tensor t3 = fb_tensor_contiguous3(&x, FB_F32, 2, 3, 5);
  EXPECT_EQ(t3.rank, 3);
  EXPECT_EQ(t3.stride[0], 15);
  EXPECT_EQ(t3.stride[1], 5);
  EXPECT_EQ(t3.stride[2], 1);
  // [B, S, H, D] viewed as [B, H, S, D]
  const flashback::TensorView bshd = flashback::TensorView::bshd(&x, flashback::DType::f32, 2, 5, 3, 7);
  const int64_t bshd_shape[] = {2, 3, 5, 7}, bshd_stride[] = {105, 7, 21, 1};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(bshd.t.shape[i], bshd_shape[i]);
    EXPECT_EQ(bshd.t.stride[i], bshd_stride[i]);
  }
}

} // namespace
