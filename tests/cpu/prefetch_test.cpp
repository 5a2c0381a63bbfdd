// The fetch ahead of the tile maths and of the work items (cpu/blocks.h: Prefetch; cpu/attention.h:
// fetch_item_rows, fetch_key_rows): which cache lines it fetches. A prefetch never faults and never
// changes a result, so a wrong address would only cost time unseen: these tests walk the lines instead
// of fetching them and check that the shares of the query blocks that see a key block fetch each line
// of its regions exactly once, in order, whatever the steps, and that a work item's fetch covers the
// rows it reads first and nothing outside its tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/attention.h"
#include "cpu/blocks.h"

namespace {

namespace core = flashback::core;
using flashback::cpu::Prefetch;
using flashback::cpu::Tiles;

// The lines of rows `rows` rows of `width` bytes, `ld` bytes apart, from `at`, in order.
void append_rows(std::vector<const char*>& out, const char* at, int64_t rows, int64_t width, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < width; b += 64) out.push_back(at + r * ld + b);
}

// Every share walked in steps of random sizes (and paced steps), the shares one after the other.
std::vector<const char*> walk_shares(Prefetch::Region first, Prefetch::Region second, int64_t shares,
                                     std::mt19937& rng, Prefetch::Region third = Prefetch::Region()) {
  std::vector<const char*> seen;
  for (int64_t share = 0; share < shares; ++share) {
    Prefetch pf;
    if (third.rows > 0)
      pf.share_of({first, second, third}, share, shares);
    else
      pf.share_of(first, second, share, shares);
    const int64_t steps = std::uniform_int_distribution<int64_t>(1, 9)(rng);
    pf.pace(steps);
    for (int64_t s = 0; s < steps / 2; ++s) pf.walk(pf.paced_lines, [&](const char* a) { seen.push_back(a); });
    while (pf.next < pf.end) {
      const int64_t before = pf.next;
      pf.walk(std::uniform_int_distribution<int64_t>(0, 5)(rng), [&](const char* a) { seen.push_back(a); });
      EXPECT_LE(pf.next - before, 5);
    }
    pf.walk(100, [&](const char* a) { seen.push_back(a); }); // nothing past the share
    EXPECT_EQ(pf.next, pf.end);
  }
  return seen;
}

TEST(Prefetch, SharesWalkEachLineOfTwoRowRegionsOnceInOrder) {
  static char k[64 * 1024], v[64 * 1024];
  std::mt19937 rng(7);
  // Rows of K of 3 lines (160 bytes: bf16 at D = 80) 512 bytes apart, then rows of V of 1 line; and
  // rows as long as their stride (BHSD), a packed block, an empty second region.
  struct Layout {
    int64_t k_rows, k_width, k_ld, v_rows, v_width, v_ld;
  };
  const Layout layouts[] = {{13, 160, 512, 13, 64, 64}, {64, 256, 256, 64, 256, 256}, {1, 4096, 0, 0, 0, 0},
                            {5, 64, 192, 7, 128, 128}};
  for (const Layout& l : layouts) {
    std::vector<const char*> expected;
    append_rows(expected, k, l.k_rows, l.k_width, l.k_ld);
    append_rows(expected, v, l.v_rows, l.v_width, l.v_ld);
    const Prefetch::Region first = Prefetch::rows_of(k, l.k_ld, l.k_rows, l.k_width);
    const Prefetch::Region second = Prefetch::rows_of(v, l.v_ld, l.v_rows, l.v_width);
    for (const int64_t shares : {1, 2, 3, 4}) {
      EXPECT_EQ(walk_shares(first, second, shares, rng), expected)
          << l.k_rows << " rows of " << l.k_width << " bytes, " << shares << " shares";
    }
  }
  // A packed block: its bytes as one row.
  std::vector<const char*> expected;
  append_rows(expected, k, 1, 40 * 64, 0);
  EXPECT_EQ(walk_shares(Prefetch::packed(k, 40 * 64), {}, 3, rng), expected);
}

TEST(Prefetch, SharesWalkEachLineOfThreeRegionsOnceInOrder) {
  static char q[16 * 1024], k[16 * 1024], v[16 * 1024];
  std::mt19937 rng(11);
  // Rows of Q, K and V (a work item's, attention.h), some regions empty.
  const int64_t rows[][3] = {{7, 13, 13}, {64, 64, 64}, {0, 5, 5}, {3, 0, 0}, {9, 0, 4}, {1, 1, 1}};
  for (const auto& r : rows) {
    std::vector<const char*> expected;
    append_rows(expected, q, r[0], 192, 256);
    append_rows(expected, k, r[1], 128, 128);
    append_rows(expected, v, r[2], 64, 192);
    for (const int64_t shares : {1, 2, 3, 4}) {
      EXPECT_EQ(walk_shares(Prefetch::rows_of(q, 256, r[0], 192), Prefetch::rows_of(k, 128, r[1], 128), shares, rng,
                            Prefetch::rows_of(v, 192, r[2], 64)),
                expected)
          << r[0] << ", " << r[1] << ", " << r[2] << " rows, " << shares << " shares";
    }
  }
}

TEST(Prefetch, PacedStepsSpreadTheLinesEvenly) {
  static char k[32 * 1024];
  Prefetch pf;
  pf.share_of(Prefetch::rows_of(k, 256, 64, 256), {}, 0, 1); // 256 lines
  pf.pace(64);
  EXPECT_EQ(pf.paced_lines, 4);
  int64_t count = 0;
  for (int s = 0; s < 64; ++s) pf.walk(pf.paced_lines, [&](const char*) { ++count; });
  EXPECT_EQ(count, 256);
  EXPECT_EQ(pf.next, pf.end);
  pf.share_of(Prefetch::rows_of(k, 256, 64, 256), {}, 1, 2); // the second half, 128 lines
  pf.pace(0);                                                // no paced steps to come: the rest in one
  EXPECT_EQ(pf.paced_lines, 128);
  pf.pace(3);
  EXPECT_EQ(pf.paced_lines, 43);
}

TEST(Prefetch, RegionsLargerThanTheLimitAreNotFetched) {
  static char k[64];
  Prefetch pf;
  const int64_t rows = Prefetch::kMaxBytes / 64 / 2 + 1; // one line more than the limit, over both
  pf.share_of(Prefetch::rows_of(k, 0, rows, 64), Prefetch::rows_of(k, 0, rows - 1, 64), 0, 1);
  EXPECT_EQ(pf.next, pf.end);
  pf.share_of(Prefetch::rows_of(k, 0, rows - 1, 64), Prefetch::rows_of(k, 0, rows - 1, 64), 0, 1);
  EXPECT_EQ(pf.end - pf.next, 2 * (rows - 1));
  const int64_t third = Prefetch::kMaxBytes / 64 / 3; // over three regions
  pf.share_of({Prefetch::rows_of(k, 0, third, 64), Prefetch::rows_of(k, 0, third, 64),
               Prefetch::rows_of(k, 0, third + 1 + Prefetch::kMaxBytes / 64 % 3, 64)},
              0, 1);
  EXPECT_EQ(pf.next, pf.end);
  pf.share_of({Prefetch::rows_of(k, 0, third, 64), Prefetch::rows_of(k, 0, third, 64),
               Prefetch::rows_of(k, 0, third + Prefetch::kMaxBytes / 64 % 3, 64)},
              0, 1);
  EXPECT_EQ(pf.end - pf.next, Prefetch::kMaxBytes / 64);
}

// The next work item's fetch (attention.h). A tile math stand-in: f32 rows, key blocks read per tile
// (as where each key block serves few query blocks) or not.
template <bool kPerTile>
struct RowsMath {
  using T = float;
  static bool forward_per_tile(const core::Problem&, Tiles) { return kPerTile; }
};

// BHSD f32 tensors of a problem, the data never read (the tests only walk addresses).
struct Tensors {
  core::Problem p;
  std::vector<float> q, k, v;
  Tensors(int64_t b, int64_t hq, int64_t hk, int64_t sq, int64_t sk, int64_t d, int64_t dv, int64_t left,
          int64_t right)
      : q(b * hq * sq * d), k(b * hk * sk * d), v(b * hk * sk * dv) {
    p.batch = b;
    p.heads_q = hq;
    p.heads_kv = hk;
    p.seqlen_q = sq;
    p.seqlen_k = sk;
    p.head_dim = d;
    p.head_dim_v = dv;
    p.window_left = left;
    p.window_right = right;
    p.band = core::make_band(sq, sk, left, right);
    p.q = {q.data(), hq * sq * d, sq * d, d};
    p.k = {k.data(), hk * sk * d, sk * d, d};
    p.v = {v.data(), hk * sk * dv, sk * dv, dv};
  }
};

// The lines of `rows` rows from row r0 of head h of batch b of a BHSD tensor, as Prefetch::rows_of
// gives them.
void append_head_rows(std::vector<const char*>& out, const core::Strided4& t, int64_t b, int64_t h, int64_t r0,
                      int64_t rows, int64_t width) {
  const float* at = static_cast<const float*>(t.data) + b * t.sb + h * t.sh + r0 * t.ss;
  append_rows(out, reinterpret_cast<const char*>(at), rows, width * 4, t.ss * 4);
}

std::vector<const char*> walk_all(Prefetch& pf) {
  std::vector<const char*> seen;
  pf.walk(int64_t{1} << 40, [&](const char* a) { seen.push_back(a); });
  return seen;
}

TEST(Prefetch, AForwardItemFetchesItsQueryRowsAndTheKeysTheySee) {
  std::mt19937 rng(5);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int64_t fetched = 0, items_checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t hk = pick(1, 2), hq = hk * pick(1, 3), sq = pick(1, 300), sk = pick(1, 300);
    const int64_t d = pick(1, 64), dv = pick(1, 64);
    const int kind = static_cast<int>(pick(0, 2)); // no mask, causal, a window
    const int64_t left = kind == 2 ? pick(0, 100) : -1, right = kind == 0 ? -1 : kind == 1 ? 0 : pick(0, 50);
    Tensors x(pick(1, 2), hq, hk, sq, sk, d, dv, left, right);
    const core::Problem& p = x.p;
    flashback::cpu::ForwardJob job;
    job.p = &p;
    job.tiles = {64, 64};
    job.q_blocks = (sq + 63) / 64;
    job.kv_blocks = (sk + 63) / 64;
    job.q_group = int64_t{1} << pick(0, 2);
    job.items = p.batch * p.heads_kv * flashback::cpu::forward_runs(job);
    for (int64_t item = 0; item < job.items; ++item) {
      // What the item reads first: the rows of its blocks of the first block's head, and the rows of
      // the key blocks that some row of its blocks sees (the band, brute force).
      const auto it = flashback::cpu::forward_item_at(job, item);
      const auto first = flashback::cpu::forward_block(job, it, 0);
      std::vector<const char*> expected;
      int64_t rows = 0, kmin = sk, kmax = -1;
      for (int64_t g = 0; g < it.blocks; ++g) {
        const auto blk = flashback::cpu::forward_block(job, it, g);
        if (blk.h == first.h) rows = blk.i0 + blk.rows - first.i0;
        for (int64_t i = blk.i0; i < blk.i0 + blk.rows; ++i)
          for (int64_t j = 0; j < sk; ++j)
            if (p.band.visible(i, j)) {
              kmin = std::min(kmin, j);
              kmax = std::max(kmax, j);
            }
      }
      const int64_t j0 = kmax < 0 ? 0 : kmin / 64 * 64, keys = kmax < 0 ? 0 : std::min(sk, (kmax / 64 + 1) * 64) - j0;
      append_head_rows(expected, p.q, it.b, first.h, first.i0, rows, d);
      append_head_rows(expected, p.k, it.b, it.hk, j0, keys, d);
      append_head_rows(expected, p.v, it.b, it.hk, j0, keys, dv);
      const bool fits = static_cast<int64_t>(expected.size()) * 64 <= Prefetch::kMaxBytes;
      Prefetch pf;
      flashback::cpu::fetch_item_rows<RowsMath<true>>(job, item, pf);
      EXPECT_EQ(walk_all(pf), fits ? expected : std::vector<const char*>())
          << "item " << item << " of B = " << p.batch << ", Hq = " << hq << ", Hk = " << hk << ", Sq = " << sq
          << ", Sk = " << sk << ", window (" << left << ", " << right << "), q_group " << job.q_group;
      Prefetch none;
      flashback::cpu::fetch_item_rows<RowsMath<false>>(job, item, none);
      EXPECT_EQ(none.end, 0); // the tile math reads copies: nothing
      fetched += fits && !expected.empty();
      ++items_checked;
    }
  }
  EXPECT_GT(fetched, items_checked / 2); // most of these small items fit the limit
}

TEST(Prefetch, ABackwardItemFetchesTheRowsOfItsKeyBlocks) {
  std::mt19937 rng(6);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t hk = pick(1, 3), sk = pick(1, 700), d = pick(1, 64), dv = pick(1, 64);
    Tensors x(pick(1, 2), hk * pick(1, 2), hk, pick(1, 300), sk, d, dv, -1, -1);
    const core::Problem& p = x.p;
    flashback::cpu::BackwardJob job;
    job.p = &p;
    job.tiles = {128, 64};
    job.q_blocks = (p.seqlen_q + 127) / 128;
    job.kv_blocks = (sk + 63) / 64;
    job.k_group = int64_t{1} << pick(0, 2);
    job.splits = job.k_group == 1 ? pick(1, 3) : 1;
    job.items = p.batch * hk * ((job.kv_blocks + job.k_group - 1) / job.k_group) * job.splits;
    // Item order: (key block group, batch and kv head), each group's parts in a row.
    int64_t item = 0;
    for (int64_t jg = 0; jg < job.kv_blocks; jg += job.k_group)
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t h = 0; h < hk; ++h)
          for (int64_t part = 0; part < job.splits; ++part, ++item) {
            const int64_t j0 = jg * 64, keys = std::min(sk, (jg + job.k_group) * 64) - j0;
            std::vector<const char*> expected;
            append_head_rows(expected, p.k, b, h, j0, keys, d);
            append_head_rows(expected, p.v, b, h, j0, keys, dv);
            const bool fits = static_cast<int64_t>(expected.size()) * 64 <= Prefetch::kMaxBytes;
            Prefetch pf;
            flashback::cpu::fetch_key_rows<RowsMath<true>>(job, item, pf);
            EXPECT_EQ(walk_all(pf), fits ? expected : std::vector<const char*>())
                << "item " << item << " (key block " << jg << ", b " << b << ", kv head " << h << ", part " << part
                << ") of Sk = " << sk << ", k_group " << job.k_group << ", splits " << job.splits;
          }
    EXPECT_EQ(item, job.items);
  }
}

} // namespace
