// choose_tiles: what the kernels and the test sweeps rely on.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/problem.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "cpu/tiles.h"

namespace {

using flashback::cpu::choose_tiles;
using flashback::cpu::Isa;
using flashback::cpu::Keys;
using flashback::cpu::Tiles;

constexpr Isa kIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512bf16, Isa::amx};
constexpr int64_t kHeadDims[] = {1, 7, 16, 32, 63, 64, 80, 96, 128, 200, 255, 256};

// A constant expression: usable where the kernels need compile-time tile sizes.
static_assert(choose_tiles(Isa::avx512, 128, 128, true, Keys::usual).bm > 0);

TEST(Tiles, PositiveForEveryIsaHeadDimAndPass) {
  for (Isa isa : kIsas)
    for (int64_t d : kHeadDims)
      for (int64_t dv : kHeadDims)
        for (bool backward : {false, true})
          for (Keys keys : {Keys::usual, Keys::wide, Keys::few}) {
            const Tiles t = choose_tiles(isa, d, dv, backward, keys);
            EXPECT_GT(t.bm, 0) << flashback::cpu::isa_name(isa) << " D=" << d << " Dv=" << dv << " bwd=" << backward;
            EXPECT_GT(t.bn, 0) << flashback::cpu::isa_name(isa) << " D=" << d << " Dv=" << dv << " bwd=" << backward;
          }
}

// The SIMD kernels work on 16-float (one zmm, two ymm) groups of rows and keys.
TEST(Tiles, SimdTilesAreMultiplesOf16) {
  for (Isa isa : {Isa::avx2, Isa::avx512, Isa::avx512bf16, Isa::amx})
    for (int64_t d : kHeadDims)
      for (bool backward : {false, true})
        for (Keys keys : {Keys::usual, Keys::wide, Keys::few}) {
          const Tiles t = choose_tiles(isa, d, d, backward, keys);
          EXPECT_EQ(t.bm % 16, 0) << flashback::cpu::isa_name(isa) << " D=" << d << " bwd=" << backward;
          EXPECT_EQ(t.bn % 16, 0) << flashback::cpu::isa_name(isa) << " D=" << d << " bwd=" << backward;
        }
}

// The sweeps in attention_test derive their sequence lengths from choose_tiles: each kernel set must
// run with exactly those tiles, and never with an instruction set above the one asked for.
TEST(Tiles, KernelSetsRunWithChooseTiles) {
  using flashback::core::DType;
  for (Isa isa : kIsas)
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (int64_t d : kHeadDims)
        for (bool backward : {false, true}) {
          const flashback::cpu::KernelSet& ks = flashback::cpu::kernels_for(isa, dtype, std::max(d, 257 - d));
          EXPECT_LE(ks.isa, isa);
          for (int shape = 0; shape < 3; ++shape) { // long, causal (bf16 and f32: wide), decoding
            flashback::core::Problem p;
            p.dtype = dtype;
            p.head_dim = d;
            p.head_dim_v = 257 - d;
            p.batch = 1;
            p.heads_q = 8;
            p.heads_kv = 2;
            p.seqlen_q = shape == 2 ? 1 : 4096;
            p.seqlen_k = 4096;
            if (shape == 1) p.window_right = 0;
            p.band = flashback::core::make_band(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
            const bool wide = shape == 0 || (shape == 1 && dtype != DType::f16);
            EXPECT_EQ(flashback::cpu::wide_keys(p), wide);
            const Keys keys = shape == 2 ? Keys::few : wide ? Keys::wide : Keys::usual;
            EXPECT_EQ(flashback::cpu::forward_keys(p), keys);
            Tiles want = choose_tiles(ks.isa, p.head_dim, p.head_dim_v, backward, keys);
            if (backward && shape == 2) want.bm = 16; // one query row: one block of 16 (backward_block_rows)
            const Tiles got = ks.tiles(p, backward);
            EXPECT_EQ(got.bm, want.bm) << flashback::cpu::isa_name(ks.isa) << " D=" << d << " bwd=" << backward;
            EXPECT_EQ(got.bn, want.bn) << flashback::cpu::isa_name(ks.isa) << " D=" << d << " bwd=" << backward;
          }
        }
    }
}

// The backward's query blocks hold the problem's rows rounded up to 16 where those are fewer than the
// level's block, so that a short problem's packed Q and dO are not a full block per head.
TEST(Tiles, BackwardBlocksFitShortQuerySides) {
  using flashback::cpu::backward_block_rows;
  const std::pair<int64_t, int64_t> at128[] = {{0, 16},    {1, 16},     {15, 16},  {16, 16},  {17, 32},
                                               {100, 112}, {127, 128},  {128, 128}, {129, 128}, {1000000, 128}};
  for (auto [sq, bm] : at128) EXPECT_EQ(backward_block_rows(128, sq), bm) << "Sq=" << sq;
  EXPECT_EQ(backward_block_rows(32, 1), 16);  // the scalar level's 32 x 32
  EXPECT_EQ(backward_block_rows(32, 20), 32);
  EXPECT_EQ(backward_block_rows(32, 33), 32);
  // Through the kernel sets: Sq = 20 against choose_tiles' 128 rows at every level that runs here.
  for (Isa isa : kIsas) {
    const flashback::cpu::KernelSet& ks = flashback::cpu::kernels_for(isa, flashback::core::DType::bf16, 64);
    flashback::core::Problem p;
    p.dtype = flashback::core::DType::bf16;
    p.head_dim = p.head_dim_v = 64;
    p.batch = p.heads_q = p.heads_kv = 1;
    p.seqlen_q = 20;
    p.seqlen_k = 300;
    p.band = flashback::core::make_band(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
    const int64_t full = choose_tiles(ks.isa, 64, 64, true, flashback::cpu::forward_keys(p)).bm;
    EXPECT_EQ(ks.tiles(p, true).bm, std::min<int64_t>(full, 32)) << flashback::cpu::isa_name(ks.isa);
    EXPECT_EQ(ks.tiles(p, false).bm, choose_tiles(ks.isa, 64, 64, false, flashback::cpu::forward_keys(p)).bm);
  }
}

// visible_keys_per_row's closed form against counting each row's keys, over windows that cut either
// side, both, none, rows that see nothing (Sq > Sk under causal), Sq or Sk of 0 and 1, and a size no
// loop could count (the fuzzer's: a workspace query with 2^28 rows).
TEST(Tiles, VisibleKeysPerRowCountsTheMask) {
  const int64_t lens[] = {0, 1, 2, 7, 64, 65, 300};
  const int64_t sides[] = {-1, 0, 1, 3, 50, 299, 1000};
  int64_t checked = 0;
  for (int64_t sq : lens)
    for (int64_t sk : lens)
      for (int64_t left : sides)
        for (int64_t right : sides) {
          flashback::core::Problem p;
          p.seqlen_q = sq;
          p.seqlen_k = sk;
          p.band = flashback::core::make_band(sq, sk, left, right);
          int64_t pairs = 0;
          for (int64_t i = 0; i < sq; ++i)
            for (int64_t j = 0; j < sk; ++j) pairs += p.band.visible(i, j);
          const double want = sq > 0 ? static_cast<double>(pairs) / static_cast<double>(sq) : 0.0;
          ASSERT_DOUBLE_EQ(flashback::cpu::visible_keys_per_row(p), want)
              << "Sq=" << sq << " Sk=" << sk << " window (" << left << ", " << right << ")";
          ++checked;
        }
  EXPECT_EQ(checked, 7 * 7 * 7 * 7);
  flashback::core::Problem huge;
  huge.seqlen_q = huge.seqlen_k = int64_t{1} << 28;
  huge.band = flashback::core::make_band(huge.seqlen_q, huge.seqlen_k, -1, 0); // causal
  EXPECT_DOUBLE_EQ(flashback::cpu::visible_keys_per_row(huge), (static_cast<double>(int64_t{1} << 28) + 1) / 2);
}

} // namespace
