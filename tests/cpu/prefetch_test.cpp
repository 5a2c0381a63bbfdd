// The fetch ahead of the tile maths (cpu/blocks.h: Prefetch): which cache lines it fetches. A prefetch
// never faults and never changes a result, so a wrong address would only cost time unseen: these
// tests walk the lines instead of fetching them and check that the shares of the query blocks that
// see a key block fetch each line of its two regions exactly once, in order, whatever the steps.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cpu/blocks.h"

namespace {

using flashback::cpu::Prefetch;

// The lines of rows `rows` rows of `width` bytes, `ld` bytes apart, from `at`, in order.
void append_rows(std::vector<const char*>& out, const char* at, int64_t rows, int64_t width, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < width; b += 64) out.push_back(at + r * ld + b);
}

// Every share walked in steps of random sizes (and paced steps), the shares one after the other.
std::vector<const char*> walk_shares(Prefetch::Region first, Prefetch::Region second, int64_t shares,
                                     std::mt19937& rng) {
  std::vector<const char*> seen;
  for (int64_t share = 0; share < shares; ++share) {
    Prefetch pf;
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
}

} // namespace
