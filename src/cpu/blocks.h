// Small pieces shared by the CPU algorithm (attention.h) and the tile math it runs (math_*.h).
// Internal linkage and no std:: function templates: these headers are compiled into every ISA's
// translation unit with that ISA's flags, and an out-of-line instantiation would be a weak symbol
// the linker may pick for generic code (tests/cpu/isa_symbols_test checks the ISA objects).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/problem.h"
#include "cpu/half.h"
#include "cpu/kernels.h"
#include "cpu/tiles.h" // few_query_blocks

namespace flashback::cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = __builtin_inff();
constexpr int64_t kAlign = 64; // bytes: one cache line, one zmm
constexpr int64_t kLanes = 16; // f32 leading dimensions are padded to this many floats

// The natural-log LSE of a row from its running max m2 (log2 units, exact in double) and sum l (of
// exp2(logit - m2)), and back to log2 units for the backward: each rounded once, from double, so that
// the backward's exp2(logit - lse2) drifts from the forward's P by about 2 ulp of |lse2| at most.
inline float lse_of(double m2, float l) {
  return l != 0.0f ? static_cast<float>((m2 + __builtin_log2(static_cast<double>(l))) * 0.6931471805599453)
                   : -kInf; // l = 0: the row sees no key
}
// The factor of the raw scores q.k in the exponent of exp2: scale * log2(e), as every kernel rounds it.
inline float log2_scale(const core::Problem& p) { return p.scale * kLog2e; }
inline float lse2_of(float lse) { return static_cast<float>(static_cast<double>(lse) * 1.4426950408889634); }

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }
inline void fill(float* p, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

// The element mask of one tile: local row r, column c is visible iff lo <= c - r <= hi.
struct Mask {
  int32_t lo, hi;
  bool shows(int64_t r, int64_t c) const { return lo <= c - r && c - r <= hi; }
};
// The mask of an unmasked tile: every row sees every key (|c - r| < 2^20 inside a tile).
inline constexpr Mask kShowAll{-(1 << 30), 1 << 30};

inline Mask tile_mask(const core::Band& band, int64_t i0, int64_t j0) {
  // dlo - (j0 - i0) etc.; clamped to what can matter inside a tile (|c - r| < 2^20).
  constexpr int64_t kFar = int64_t{1} << 30;
  const int64_t lo = clamp64(band.dlo - (j0 - i0), -kFar, kFar);
  const int64_t hi = clamp64(band.dhi - (j0 - i0), -kFar, kFar);
  return {static_cast<int32_t>(lo), static_cast<int32_t>(hi)};
}

// The part of a [rows][cols] tile under mask m where rows and keys meet: rows [r0, r1) see some key of
// the tile, keys [k0, k1) are seen by some row (a causal diagonal tile, a window's edges leave the
// rest masked for every row or key). at(r, k): the mask of the sub-tile that starts at row r, key k.
struct VisibleSpan {
  int64_t r0, r1, k0, k1;
  static Mask at(const Mask& m, int64_t r, int64_t k) {
    return {static_cast<int32_t>(m.lo + r - k), static_cast<int32_t>(m.hi + r - k)};
  }
};
inline VisibleSpan visible_span(const Mask& m, int64_t rows, int64_t cols) {
  // row r sees key c iff lo <= c - r <= hi: rows [-hi, cols - lo), then keys [r0 + lo, r1 - 1 + hi]
  const int64_t r0 = clamp64(-int64_t{m.hi}, 0, rows), r1 = clamp64(cols - int64_t{m.lo}, r0, rows);
  const int64_t k0 = clamp64(r0 + m.lo, 0, cols), k1 = clamp64(r1 + int64_t{m.hi}, k0, cols);
  return {r0, r1, k0, k1};
}

// Carves 64-byte-aligned arrays out of a scratch block; with a null base it only measures.
struct Carver {
  char* base;
  int64_t used = 0;
  template <class E = float>
  E* take(int64_t n) {
    E* p = base ? reinterpret_cast<E*>(base + used) : nullptr;
    used += round_up(n * static_cast<int64_t>(sizeof(E)), kAlign);
    return p;
  }
  float* floats(int64_t n) { return take<float>(n); }
};

// The bytes of a scratch layout: Scratch(p, t, nullptr, &bytes) carves nothing and only measures.
template <class Scratch>
size_t carved_bytes(const core::Problem& p, Tiles t) {
  int64_t bytes = 0;
  Scratch(p, t, nullptr, &bytes);
  return static_cast<size_t>(bytes);
}

// Prepare item `item` = (b, head, block) over `heads` heads of `blocks` blocks of `size` rows each,
// with the block's first row and its number of rows (of `seqlen`).
struct RowBlock {
  int64_t b, head, block, first, rows;
};
inline RowBlock row_block(int64_t item, int64_t heads, int64_t blocks, int64_t size, int64_t seqlen) {
  const int64_t bh = item / blocks, block = item % blocks, first = block * size;
  return {bh / heads, bh % heads, block, first, min64(seqlen, first + size) - first};
}

template <class T>
T* row_ptr(const core::Strided4& t, int64_t b, int64_t h, int64_t s) {
  return static_cast<T*>(t.data) + b * t.sb + h * t.sh + s * t.ss;
}

// Cache lines fetched into L2 a few at a time during other work: the operands of a block that comes
// next (the tile maths' upcoming()), or of the work item that likely comes next (attention.h:
// fetch_item_rows, fetch_key_rows), so that their first use does not wait on memory. The lines [next,
// end) of up to three regions, each one's before the next's, each `rows` rows of `row_lines` lines
// `ld` bytes apart (a packed block: one row of all its lines; an empty region: no rows).
struct Prefetch {
  struct Region {
    const char* at = nullptr;
    int64_t rows = 0, row_lines = 1, ld = 0;
    int64_t lines() const { return rows * row_lines; }
  };
  // `rows` rows of `cols` elements from `at`, `ld` elements apart. The stride of one row is never used,
  // and may be anything: a dim of size 1 may have any stride (a Sk = 1 key block with a stride of 2^61
  // elements overflowed here: found by fuzz_c_api, UBSan's signed overflow). Over more rows it is
  // bounded by the tensor's byte extent (core/problem.cpp).
  template <class E>
  static Region rows_of(const E* at, int64_t ld, int64_t rows, int64_t cols) {
    const auto size = static_cast<int64_t>(sizeof(E));
    return {reinterpret_cast<const char*>(at), rows, (cols * size + 63) / 64, rows > 1 ? ld * size : 0};
  }
  // `bytes` bytes from `at`.
  static Region packed(const void* at, int64_t bytes) { return {static_cast<const char*>(at), 1, bytes / 64, 0}; }
  // Rows [r0, r0 + rows) of head h of batch b of t, `width` elements each; none without rows, where t
  // may have no elements and no address to compute rows from (Sk = 0, and an address near the top of
  // the address space: found by fuzz_c_api, UBSan's pointer overflow).
  template <class T>
  static Region head_rows(const core::Strided4& t, int64_t b, int64_t h, int64_t r0, int64_t rows, int64_t width) {
    if (rows <= 0) return Region();
    return rows_of(row_ptr<const T>(t, b, h, r0), t.ss, rows, width);
  }

  static constexpr int kRegions = 3;
  Region region[kRegions];
  int64_t bound[kRegions] = {}; // the line after the last of each region: region[g] holds [bound[g - 1], bound[g])
  int64_t next = 0, end = 0;
  int64_t paced_lines = 0; // per paced() step (pace)

  // The next `lines` lines (prefetcht1: into L2).
  void step(int64_t lines) {
    walk(lines, [](const char* line) { __builtin_prefetch(line, 0, 2); });
  }
  // fetch(address) for each of the next `lines` lines, in order: one division per region reached
  // rather than per line (bf16 decoding at D = 64 took 1.13 - 1.25x the time with one per line).
  template <class Fetch>
  void walk(int64_t lines, Fetch&& fetch) {
    const int64_t stop = min64(end, next + lines);
    while (next < stop) {
      int g = 0; // the region that holds line `next`, from its first line
      while (next >= bound[g]) ++g;
      const Region& r = region[g];
      const int64_t first = g > 0 ? bound[g - 1] : 0, last = min64(stop, bound[g]);
      int64_t row = (next - first) / r.row_lines, line = (next - first) % r.row_lines;
      for (; next < last; ++next) {
        fetch(r.at + row * r.ld + line * 64);
        if (++line == r.row_lines) {
          line = 0;
          ++row;
        }
      }
    }
  }
  // The lines left, `parts` steps to go.
  int64_t quota(int64_t parts) const { return (end - next + parts - 1) / parts; }
  // The lines left spread over `steps` calls of paced(): the microkernels take one step per k of a
  // product (gemm_fetching), so that the fetches go out at about the pace the memory serves them
  // rather than in bursts that stall the core on its outstanding misses while the memory then idles.
  void pace(int64_t steps) { paced_lines = quota(steps > 0 ? steps : 1); }
  void paced() { step(paced_lines); }
  // Share `share` of `shares` of the lines of `first` and `second`; none where they are larger than
  // kMaxBytes. Measured on the Xeon with AMX (side by side, B = 1, S = 4096): fetching ahead gained
  // where a block's operands were 64 - 192 KiB (bf16 at D = 64 and 128: forward 0.98 - 1.00x the time,
  // backward 0.94 - 0.98x) and lost where they were larger (bf16 at D = 256: 1.035x forward and
  // backward; f16 at D = 128, whose operands are split in two and three: 1.06x and 1.07x).
  static constexpr int64_t kMaxBytes = int64_t{192} << 10;
  void share_of(Region first, Region second, int64_t share, int64_t shares) {
    share_of({first, second, Region()}, share, shares);
  }
  void share_of(const Region (&regions)[kRegions], int64_t share, int64_t shares) {
    int64_t total = 0;
    for (int g = 0; g < kRegions; ++g) {
      region[g] = regions[g];
      bound[g] = total += regions[g].lines();
    }
    const bool fits = total * 64 <= kMaxBytes;
    next = fits ? share * total / shares : 0;
    end = fits ? (share + 1) * total / shares : 0;
  }
};

template <class T>
constexpr bool kIsF32 = false;
template <>
constexpr bool kIsF32<float> = true;

// The exact product of a partially masked tile: C = (acc ? row_scale * C : 0) + A B, where row i sums
// only over k in [i + lo, i + hi] (and [0, kk)). A masked element of A is 0, but 0 times a NaN or Inf in
// B is NaN: summing only what a row sees keeps a non-finite input out of the rows that do not see it.
// Runs `gemm` (unbanded, the same arguments) on the k that every row of a group of `group` rows sees,
// and on each row's few remaining k one row at a time.
template <class Gemm>
void gemm_banded(Gemm&& gemm, int64_t group, int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars,
                 int64_t aks, const float* b, int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale,
                 int64_t lo, int64_t hi) {
  auto first = [&](int64_t i) { return clamp64(i + lo, 0, kk); };
  auto end = [&](int64_t i) { return clamp64(i + hi + 1, 0, kk); };
  auto run = [&](int64_t i, int64_t rows, int64_t k0, int64_t k1, bool init) {
    const bool keep = !init || acc;
    gemm(rows, n, k1 > k0 ? k1 - k0 : 0, a + i * ars + k0 * aks, ars, aks, b + k0 * ldb, ldb, c + i * ldc, ldc, keep,
         init && row_scale ? row_scale + i : nullptr);
  };
  for (int64_t r0 = 0; r0 < m; r0 += group) {
    const int64_t rows = min64(group, m - r0);
    const int64_t k0 = first(r0 + rows - 1), k1 = end(r0); // seen by every row of the group
    if (k0 < k1) {
      run(r0, rows, k0, k1, true);
      for (int64_t i = r0; i < r0 + rows; ++i) {
        if (first(i) < k0) run(i, 1, first(i), k0, false);
        if (end(i) > k1) run(i, 1, k1, end(i), false);
      }
    } else {
      for (int64_t i = r0; i < r0 + rows; ++i) run(i, 1, first(i), end(i), true);
    }
  }
}

// C += A B over a backward tile (Micro: gemm and gemm_banded), A row-major [rows or keys][k]; under a
// mask (null: none) each output row sums only what it sees: k - row in [lo, hi] for dQ (rows =
// queries, k = keys), [-hi, -lo] for dV, dK (rows = keys, k = queries).
template <class Micro>
void tile_product(const Mask* mask, bool keys_are_k, int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars,
                  int64_t aks, const float* b, int64_t ldb, float* c, int64_t ldc) {
  if (!mask) return Micro::gemm(m, n, kk, a, ars, aks, b, ldb, c, ldc, true, nullptr);
  const int64_t lo = keys_are_k ? mask->lo : -mask->hi, hi = keys_are_k ? mask->hi : -mask->lo;
  Micro::gemm_banded(m, n, kk, a, ars, aks, b, ldb, c, ldc, true, nullptr, lo, hi);
}

} // namespace
} // namespace flashback::cpu
