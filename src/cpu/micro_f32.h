// f32 microkernels written once over a vector type V (AVX-512: 16 lanes, AVX2: 8 lanes). V supplies
// typed inline operations (see avx512/kernels.cpp); this file supplies what attention.h calls: a
// register-blocked GEMM with strided A, a transposing pack, the softmax steps and a dot product, as
// math_f32.h calls them.
// Compiled only inside the ISA's translation unit, with its flags; internal linkage, and no std::
// templates that could be emitted out of line (see attention.h).
#pragma once

#include <cstdint>
#include <utility>

#include "cpu/blocks.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

template <class V>
struct MicroF32 {
  using R = typename V::reg;
  using K = typename V::mask;
  static constexpr int L = V::lanes;
  // Register blocking: MR rows by NV vectors of C stay in registers across the whole k loop. Panels
  // of up to NVW vectors (for_each_panel) take mr_of(nv) rows.
  static constexpr int MR = V::kMR, NV = V::kNV, NVW = V::kNVWide;
  static constexpr int mr_of(int nv) { return nv <= NV ? MR : (V::kRegisters - nv - 1) / nv; }
  static_assert(MR * NV + NV + 1 <= V::kRegisters, "the C tile, a row of B and a broadcast must fit");
  static_assert((NVW == NV || NVW == NV + 1) && mr_of(NVW) * NVW + NVW + 1 <= V::kRegisters &&
                    mr_of(NVW) * NVW >= MR * NV,
                "a panel widens by one vector at most (for_each_panel); its tile must fit and hold as many "
                "accumulators");

  // --- GEMM ----------------------------------------------------------------------------------------
  // C[mr][nv*L] = (acc ? row_scale * C : 0) + A B over kk k: A(r, k) = a[r * ars + k * aks], B(k, x) =
  // b[k * ldb + x]. The product's sum runs in registers from zero, one FMA chain per element in k order,
  // and C joins it at the end (one FMA), so that an output summed over many blocks (O over the key
  // blocks, dK and dV over the query blocks, dQ over the key blocks) is a sum of the blocks' sums: its
  // rounding grows with the block's k plus the number of blocks, not with the whole sequence (one chain
  // through C from block to block had 3-4x the error of PyTorch's CPU kernel at Sk = 8192;
  // bench/torch_sdpa.py accuracy, BENCHMARKS.md). The last vector of each row is masked by `last` when
  // kTail (partial columns), so nothing outside the tile is read or written. kFetch (gemm_fetching): one
  // of pf's paced steps per k. A compile-time choice: a test of pf per k cost the f32 attention 3-5% of
  // its time (Zen 4, side by side). `sum` is the product in registers, which tile and tile_max share.
  template <int mr, int nv, bool kTail, bool kFetch>
  [[gnu::always_inline]] static inline void sum(R (&cr)[mr][nv], const float* a, int64_t ars, int64_t aks,
                                                const float* b, int64_t ldb, int64_t kk, K last, Prefetch* pf) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < nv; ++v) cr[r][v] = V::zero();
    const float* ar[mr];
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) ar[r] = a + r * ars;
    for (int64_t k = 0; k < kk; ++k) {
      if constexpr (kFetch) pf->paced();
      const float* brow = b + k * ldb;
      R bv[nv];
#pragma GCC unroll 8
      for (int v = 0; v < nv; ++v)
        bv[v] = kTail && v == nv - 1 ? V::load_masked(brow + v * L, last) : V::loadu(brow + v * L);
#pragma GCC unroll 8
      for (int r = 0; r < mr; ++r) {
        const R av = V::set1(ar[r][k * aks]);
#pragma GCC unroll 8
        for (int v = 0; v < nv; ++v) cr[r][v] = V::fma(av, bv[v], cr[r][v]);
      }
    }
  }
  template <int mr, int nv, bool kTail, bool kFetch>
  static void tile(const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, int64_t kk, float* c,
                   int64_t ldc, bool acc, const float* row_scale, K last, Prefetch* pf) {
    R cr[mr][nv];
    sum<mr, nv, kTail, kFetch>(cr, a, ars, aks, b, ldb, kk, last, pf);
    if (acc) add_c<mr, nv, kTail>(cr, c, ldc, row_scale, last);
    store_c<mr, nv, kTail>(cr, c, ldc, last);
  }

  // C[mr][nv*L] = A B, as tile() with acc false, and col_max[x] = max(col_max[x], max_r C[r][x]) for the
  // tile's columns, from the registers (col_maxima); whole vectors only. A function of its own rather
  // than a case of tile(), whose every call would then take a pointer more and test it: so the f32
  // forward took 0.981x and 0.983x the time of that form at D = 64 and 128 (150 rounds side by side).
  template <int mr, int nv, bool kFetch>
  static void tile_max(const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, int64_t kk, float* c,
                       int64_t ldc, float* col_max, Prefetch* pf) {
    R cr[mr][nv];
    const K all = V::first_lanes(L);
    sum<mr, nv, false, kFetch>(cr, a, ars, aks, b, ldb, kk, all, pf);
    store_c<mr, nv, false>(cr, c, ldc, all);
    col_maxima<mr, nv>(cr, col_max);
  }

  // col_max[v * L + i] = max(col_max[v * L + i], cr[r][v][i] over r): the forward's S^T = K Q^T has a
  // query row in each lane, so these are the rows' maxima over the tile's keys, which the online
  // softmax needs before its exponentials (softmax_t's block_max). Taken here, from the registers, they
  // take as many maxima as the softmax's pass did, but not its reads of S^T back from cache: f32
  // forward 0.95 - 0.96x the time at D = 64 and 0.97x at D = 128 (Xeon, avx512, B = 1, Hq = 16, S =
  // 2048 and 4096, side by side; BENCHMARKS.md). A maximum is exact, so the results are the pass's bits (a
  // row with a NaN score is NaN either way).
  template <int mr, int nv>
  [[gnu::always_inline]] static inline void col_maxima(R (&cr)[mr][nv], float* col_max) {
#pragma GCC unroll 8
    for (int v = 0; v < nv; ++v) {
      R mx = cr[0][v];
#pragma GCC unroll 8
      for (int r = 1; r < mr; ++r) mx = V::max(mx, cr[r][v]);
      V::storeu(col_max + v * L, V::max(V::loadu(col_max + v * L), mx));
    }
  }

  // The C tile's vector (r, v) from memory, the last vector of each row masked by `last` when kTail.
  template <int nv, bool kTail>
  [[gnu::always_inline]] static inline R c_vector(const float* c, int64_t ldc, int r, int v, K last) {
    const float* p = c + r * ldc + v * L;
    return kTail && v == nv - 1 ? V::load_masked(p, last) : V::loadu(p);
  }
  // A tile's C registers from memory, (acc ? row_scale[r] * C : 0): the vdpbf16ps microkernel's start
  // (dot_bf16_micro.h), whose chains run on from C. add_c: the f32 tile's end, cr + row_scale[r] * C in
  // one FMA. store_c: back to memory (both kernels). Always inlined, so that cr stays in registers.
  template <int mr, int nv, bool kTail>
  [[gnu::always_inline]] static inline void load_c(R (&cr)[mr][nv], const float* c, int64_t ldc, bool acc,
                                                   const float* row_scale, K last) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
      const R s = row_scale ? V::set1(row_scale[r]) : V::set1(1.0f);
#pragma GCC unroll 8
      for (int v = 0; v < nv; ++v) cr[r][v] = acc ? V::mul(c_vector<nv, kTail>(c, ldc, r, v, last), s) : V::zero();
    }
  }
  template <int mr, int nv, bool kTail>
  [[gnu::always_inline]] static inline void add_c(R (&cr)[mr][nv], const float* c, int64_t ldc,
                                                  const float* row_scale, K last) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
      const R s = row_scale ? V::set1(row_scale[r]) : V::set1(1.0f);
#pragma GCC unroll 8
      for (int v = 0; v < nv; ++v) cr[r][v] = V::fma(c_vector<nv, kTail>(c, ldc, r, v, last), s, cr[r][v]);
    }
  }
  template <int mr, int nv, bool kTail>
  [[gnu::always_inline]] static inline void store_c(R (&cr)[mr][nv], float* c, int64_t ldc, K last) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < nv; ++v) {
        float* p = c + r * ldc + v * L;
        if (kTail && v == nv - 1)
          V::store_masked(p, last, cr[r][v]);
        else
          V::storeu(p, cr[r][v]);
      }
  }

  using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool,
                          const float*, K, Prefetch*);

  using TileMaxFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, float*,
                             Prefetch*);

  // The instantiation for (want_mr, want_nv) that make.template operator()<mr, nv>() returns (tile's or
  // tile_max's, the other template arguments chosen there); a chain of compares, once per tile of
  // thousands of FMAs. Only mr <= mr_of(nv) is instantiated (for_each_tile asks for no other).
  template <class Make>
  using Picked = decltype(std::declval<const Make&>().template operator()<1, 1>());
  template <int mr, int nv = 1, class Make>
  static Picked<Make> pick_nv(int want_nv, const Make& make) {
    if constexpr (nv > NVW) {
      return nullptr;
    } else {
      if constexpr (mr <= mr_of(nv)) {
        if (want_nv == nv) return make.template operator()<mr, nv>();
      }
      return pick_nv<mr, nv + 1>(want_nv, make);
    }
  }
  template <int mr = 1, class Make>
  static Picked<Make> pick_tile(int want_mr, int want_nv, const Make& make) {
    if constexpr (mr > MR) {
      return nullptr;
    } else {
      if (want_mr == mr) return pick_nv<mr>(want_nv, make);
      return pick_tile<mr + 1>(want_mr, want_nv, make);
    }
  }

  // The rows of the next row tile of at most `most` rows when `rest` rows are left: `most`, but the
  // last most + 1 to 2 most - 1 rows go in two tiles of about equal height, since a tile of one or
  // two rows has too few accumulators to cover the FMA latency (128 rows of 6: 20 x 6, then 4 + 4
  // rather than 6 + 2). Each element is the same FMA chain over k whatever the tiling: the same bits.
  static int64_t row_tile(int64_t rest, int64_t most) {
    return rest > most && rest < 2 * most ? (rest + 1) / 2 : min64(most, rest);
  }

  // The widths of the column panels of `vectors` vectors of C, at most `widest` (NVW for the f32
  // tiles, NV for the bf16 ones, dot_bf16_micro.h): panels of NV vectors, the last with the rest; but
  // a rest of one vector joins the first panel where `widest` lets it widen to NV + 1. With NV = 4
  // (avx512): 5 vectors (n = 80, D = 80) take one panel of 5 x 5 tiles rather than 6 x 4 and 6 x 1 (6
  // accumulators, three quarters of the 8 that cover the FMA latency), 9 take 5 + 4; with NV = 2
  // (avx2), 5 vectors (n = 40) take 3 + 2. Measured side by side (bench/ab.cpp; Xeon,
  // S = 2048, Hq = 16): avx512 at D = 80 (B = 1), the forward and the backward in 0.96x the time;
  // avx2 at D = 40 and 72 (B = 2), 0.96 - 0.98x. A rest of two (6 x 2 tiles, 12 accumulators) widened
  // to 4 x 6 tiles took 0.99x and 1.00x the time at D = 96, 1.00x at D = 160: not done. fn(nv) for each
  // panel, in order.
  template <class Fn>
  static void for_each_panel(int64_t vectors, int widest, const Fn& fn) {
    const int64_t count = (vectors + NV - 1) / NV, rest = vectors % NV;
    if (widest > NV && count > 1 && rest == 1) {
      fn(NV + 1);
      for (int64_t i = 2; i < count; ++i) fn(NV);
      return;
    }
    for (int64_t i = 0; i < count; ++i) fn(static_cast<int>(i < count - 1 || rest == 0 ? NV : rest));
  }

  // C[m][n] = (acc ? row_scale[r] * C : 0) + A B with A(r, k) = a[r * ars + k * aks],
  // B(k, x) = b[k * ldb + x], each tile as tile() sums it. Column panels (for_each_panel) outside (the
  // panel of B stays in cache), row tiles of mr_of(nv) inside. With pf, one of its paced steps per k of each tile.
  static void gemm_fetching(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks,
                            const float* b, int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale,
                            Prefetch* pf) {
    const bool fetch = pf != nullptr;
    for_each_tile<NVW>(m, n, [&](int64_t r0, int64_t mr, int64_t c0, int nv, bool tail, K last) {
      const TileFn fn = pick_tile(static_cast<int>(mr), nv, [&]<int r, int v>() -> TileFn {
        if (fetch) return tail ? &tile<r, v, true, true> : &tile<r, v, false, true>;
        return tail ? &tile<r, v, true, false> : &tile<r, v, false, false>;
      });
      fn(a + r0 * ars, ars, aks, b + c0, ldb, kk, c + r0 * ldc + c0, ldc, acc, row_scale ? row_scale + r0 : nullptr,
         last, pf);
    });
  }
  // C[m][n] = A B (gemm_fetching with acc false), and col_max[x] = max(col_max[x], max over r < m of
  // C[r][x]) for x < n, taken by each tile from its registers (tile_max). n must be a multiple of L: the
  // forward's n, its rows rounded up to 16, always is.
  static void gemm_col_max(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                           int64_t ldb, float* c, int64_t ldc, float* col_max, Prefetch* pf) {
    const bool fetch = pf != nullptr;
    for_each_tile<NVW>(m, n, [&](int64_t r0, int64_t mr, int64_t c0, int nv, bool, K) {
      const TileMaxFn fn = pick_tile(static_cast<int>(mr), nv, [&]<int r, int v>() -> TileMaxFn {
        return fetch ? &tile_max<r, v, true> : &tile_max<r, v, false>;
      });
      fn(a + r0 * ars, ars, aks, b + c0, ldb, kk, c + r0 * ldc + c0, ldc, col_max + c0, pf);
    });
  }
  static void gemm(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                   int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale) {
    gemm_fetching(m, n, kk, a, ars, aks, b, ldb, c, ldc, acc, row_scale, nullptr);
  }
  // The k steps of a gemm(m, n, kk) tiled with panels of at most `widest` vectors: one per k of each tile.
  template <int widest = NVW>
  static int64_t k_steps(int64_t m, int64_t n, int64_t kk) {
    int64_t tiles = 0;
    for_each_tile<widest>(m, n, [&](int64_t, int64_t, int64_t, int, bool, K) { ++tiles; });
    return tiles * kk;
  }

  // The tiles of C[m][n], fn(r0, mr, c0, nv, tail, last) for each: column panels (for_each_panel, at
  // most `widest` vectors) outside, row tiles of row_tile(, mr_of(nv)) rows inside; the last panel's last
  // vector holds `last` of its lanes when tail. Shared with the bf16 microkernel (dot_bf16_micro.h,
  // widest = NV).
  template <int widest, class Fn>
  static void for_each_tile(int64_t m, int64_t n, const Fn& fn) {
    int64_t c0 = 0;
    for_each_panel((n + L - 1) / L, widest, [&](int nv) {
      const int64_t width = min64(nv * L, n - c0);
      const int rem = static_cast<int>(width - (nv - 1) * L);
      const K last = V::first_lanes(rem);
      const bool tail = rem != L;
      for (int64_t r0 = 0, mr = 0; r0 < m; r0 += mr) {
        mr = row_tile(m - r0, mr_of(nv));
        fn(r0, mr, c0, nv, tail, last);
      }
      c0 += width;
    });
  }

  // gemm where row i sums only over k in [i + lo, i + hi]: see blocks.h.
  static void gemm_banded(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                          int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale, int64_t lo,
                          int64_t hi) {
    cpu::gemm_banded(&gemm, MR, m, n, kk, a, ars, aks, b, ldb, c, ldc, acc, row_scale, lo, hi);
  }

  // --- Packing -------------------------------------------------------------------------------------
  // dst[c][r] = src[r][c] for r < rows, c < cols; zero for rows <= r < rows_pad (a multiple of L).
  // L x L blocks transposed in registers. Never inlined: inlined into the forward's work item (which
  // GCC chose once the GEMM tile changed, 2026-12-06), the decoding forward, which packs each key block,
  // kept the rows' pointers on the stack and took 1.2x the time (Zen 4, one thread, Hq = 32, Hk = 8,
  // Sk = 8192, D = 128; 1.00x out of line).
  template <class T>
  [[gnu::noinline]] static void pack_t(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                                       int64_t ldd, int64_t rows_pad) {
    for (int64_t r0 = 0; r0 < rows_pad; r0 += L) {
      for (int64_t c0 = 0; c0 < cols; c0 += L) {
        const int nc = static_cast<int>(min64(L, cols - c0));
        R block[L];
        for (int i = 0; i < L; ++i)
          block[i] = r0 + i < rows ? V::load(src + (r0 + i) * lds + c0, nc) : V::zero();
        V::transpose(block);
        for (int j = 0; j < nc; ++j) V::storeu(dst + (c0 + j) * ldd + r0, block[j]);
      }
    }
  }

  // dst[r][c] = src[r][c] in f32 for r < rows, c < cols; dst rows are padded with zeros to a multiple
  // of L (ldd is).
  template <class T>
  static void load_rows(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c0 = 0; c0 < cols; c0 += L)
        V::storeu(dst + r * ldd + c0, V::load(src + r * lds + c0, static_cast<int>(min64(L, cols - c0))));
  }

  // Whether src[r][c] is finite for every r < rows, c < cols: a sum of x * 0, which stays 0 unless some
  // x is NaN or infinite (x * 0 is NaN then). Four sums, four vectors of a row at a time: one chain of
  // FMAs waited on each FMA's latency (bf16 decoding on Zen 4, a block of V: 14% of the time).
  template <class T>
  static bool all_finite(const T* src, int64_t lds, int64_t rows, int64_t cols) {
    R acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
    const R zero = V::zero();
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = src + r * lds;
      int64_t c0 = 0;
      for (; c0 + 4 * L <= cols; c0 += 4 * L)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[i] = V::fma(V::load(row + c0 + i * L, L), zero, acc[i]);
      for (; c0 < cols; c0 += L)
        acc[0] = V::fma(V::load(row + c0, static_cast<int>(min64(L, cols - c0))), zero, acc[0]);
    }
    return V::reduce_add(V::add(V::add(acc[0], acc[1]), V::add(acc[2], acc[3]))) == 0.0f;
  }

  // --- Softmax pieces ------------------------------------------------------------------------------
  // One online-softmax step on S^T [cols][ld], rows in lanes; see ScalarMicro::softmax_t.
  static void softmax_t(float* st, int64_t ld, int64_t rows, int64_t cols, float mul, const Mask* mask, float* m,
                        float* l, float* alpha, const float* block_max = nullptr) {
    const R neg_inf = V::set1(-kInf), vmul = V::set1(mul);
    for (int64_t r0 = 0; r0 < rows; r0 += L) {
      // Two running maxima and sums: the dependency chains are 4 cycles long.
      R mx0 = V::loadu(m + r0), mx1 = mx0;
      int64_t c = 0;
      if (block_max) {
        mx0 = V::max(mx0, V::loadu(block_max + r0));
      } else if (mask) {
        for (; c < cols; ++c) {
          // lane i is row r0 + i: visible iff lo <= c - r0 - i <= hi
          const K vis = V::in_band(static_cast<int32_t>(c - r0), -1, mask->lo, mask->hi);
          const R x = V::select(vis, V::loadu(st + c * ld + r0), neg_inf);
          V::storeu(st + c * ld + r0, x);
          mx0 = V::max(mx0, x);
        }
      } else {
        for (; c + 1 < cols; c += 2) {
          mx0 = V::max(mx0, V::loadu(st + c * ld + r0));
          mx1 = V::max(mx1, V::loadu(st + (c + 1) * ld + r0));
        }
        if (c < cols) mx0 = V::max(mx0, V::loadu(st + c * ld + r0));
      }
      const R mx = V::max(mx0, mx1);
      const R ref = V::select(V::equal(mx, neg_inf), V::zero(), mx); // a row with no key yet: P = 0
      const R a = V::exp2(V::mul(V::sub(V::loadu(m + r0), ref), vmul));
      R s0 = V::zero(), s1 = V::zero();
      for (c = 0; c + 1 < cols; c += 2) {
        const R p0 = V::exp2(V::mul(V::sub(V::loadu(st + c * ld + r0), ref), vmul));
        const R p1 = V::exp2(V::mul(V::sub(V::loadu(st + (c + 1) * ld + r0), ref), vmul));
        V::storeu(st + c * ld + r0, p0);
        V::storeu(st + (c + 1) * ld + r0, p1);
        s0 = V::add(s0, p0);
        s1 = V::add(s1, p1);
      }
      if (c < cols) {
        const R p0 = V::exp2(V::mul(V::sub(V::loadu(st + c * ld + r0), ref), vmul));
        V::storeu(st + c * ld + r0, p0);
        s0 = V::add(s0, p0);
      }
      V::storeu(alpha + r0, a);
      V::storeu(l + r0, V::fma(V::loadu(l + r0), a, V::add(s0, s1)));
      V::storeu(m + r0, mx);
    }
  }

  // One vector of P = exp2(S * mul - lse2) and of dS = P (dP - delta) * scale: the formulas of probs and
  // dscores, and of the tile maths' passes that fuse them with other work (the same bits).
  static R prob(R s, R mul, R lse2) { return V::exp2(V::fms(s, mul, lse2)); }
  static R dscore(R p, R dp, R delta, R scale) { return V::mul(V::mul(p, V::sub(dp, delta)), scale); }

  // S [rows][ld] -> P = exp2(S * mul - lse2[r]), 0 where masked.
  static void probs(float* s, int64_t ld, int64_t rows, int64_t cols, float mul, const float* lse2, const Mask* mask) {
    const R vmul = V::set1(mul);
    for (int64_t r = 0; r < rows; ++r) {
      const R sub = V::set1(lse2[r]);
      float* row = s + r * ld;
      for (int64_t c0 = 0; c0 < cols; c0 += L) {
        const int n = static_cast<int>(min64(L, cols - c0));
        R p = prob(V::load(row + c0, n), vmul, sub);
        if (mask) p = V::select(V::in_band(static_cast<int32_t>(c0 - r), 1, mask->lo, mask->hi), p, V::zero());
        V::store(row + c0, p, n);
      }
    }
  }

  // dP [rows][ld] -> dS = P (dP - delta[r]) * scale, 0 where masked (a masked dP may be NaN).
  static void dscores(const float* p, float* dp, int64_t ld, int64_t rows, int64_t cols, const float* delta,
                      float scale, const Mask* mask) {
    const R vs = V::set1(scale);
    for (int64_t r = 0; r < rows; ++r) {
      const R dl = V::set1(delta[r]);
      for (int64_t c0 = 0; c0 < cols; c0 += L) {
        const int n = static_cast<int>(min64(L, cols - c0));
        const R x = V::load(dp + r * ld + c0, n), pr = V::load(p + r * ld + c0, n);
        R ds = dscore(pr, x, dl, vs);
        if (mask) ds = V::select(V::in_band(static_cast<int32_t>(c0 - r), 1, mask->lo, mask->hi), ds, V::zero());
        V::store(dp + r * ld + c0, ds, n);
      }
    }
  }

  // dst[x] = src[x] * mul rounded to T (as from_float, half.h), for x < n.
  template <class T>
  static void store_row(const float* src, int64_t n, float mul, T* dst) {
    const R m = V::set1(mul);
    for (int64_t x = 0; x < n; x += L) {
      const int k = static_cast<int>(min64(L, n - x));
      V::store(dst + x, V::mul(V::load(src + x, k), m), k);
    }
  }

  template <class T>
  static float dot(const T* a, const T* b, int64_t n) {
    R s = V::zero();
    for (int64_t x = 0; x < n; x += L) {
      const int in = static_cast<int>(min64(L, n - x));
      s = V::fma(V::load(a + x, in), V::load(b + x, in), s);
    }
    return V::reduce_add(s);
  }
};

// An instruction set's f32 microkernels, as MathF32 takes them: MicroF32 over V with the ISA's tiles.
template <class V, Isa I>
struct IsaMicroF32 : MicroF32<V> {
  static constexpr Isa isa = I;
  static Tiles tiles(const core::Problem& p, bool backward) {
    return tiles_of(isa, p, backward);
  }
};

} // namespace
} // namespace flashback::cpu
