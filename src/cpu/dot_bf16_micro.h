// The bf16 GEMM microkernel of math_bf16.h on vector dot products of bf16 pairs (AVX512_BF16's
// vdpbf16ps: 16 f32 lanes += the sum of two bf16 products each), register-blocked as MicroF32 blocks
// f32: MR rows by NV vectors of C in registers across the whole k loop, a row of B (NV vectors of 16
// column pairs, the VNNI format) loaded once per pair of k and each A pair broadcast to every lane.
// On CPUs that run vdpbf16ps near twice the f32 FMA rate in FLOP (AMD Zen 4: 2.0x, Zen 5: 1.8x; cpu/isa.h,
// bf16_dot_preferred) it multiplies bf16 faster than converting to f32; elsewhere the f32 kernels run.
//
// Written over V, the 16-lane f32 vector, extended with the word operations (`W`: 16 32-bit words,
// each a pair of bf16):
//   W::reg, W::load(p) (16 words), W::broadcast(p) (the word at p in every lane),
//   W::dot(acc, a, b): acc + a.even * b.even + a.odd * b.odd per lane, products exact in f32.
// avx512bf16/kernels.cpp instantiates it with vdpbf16ps, emulated/kernels.cpp with FMAs on AVX2
// (FLASHBACK_EMULATION). Internal linkage.
#pragma once

#include <cstdint>

#include "cpu/blocks.h"
#include "cpu/half.h"
#include "cpu/micro_f32.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

template <class Vec, class Words, class PackOps>
struct DotBf16Micro {
  using V = Vec;
  using W = Words;
  using Pack = PackOps;
  using F = MicroF32<V>; // the C tile's loads and stores, and the tiling of C
  using R = typename V::reg;
  using K = typename V::mask;
  static constexpr Isa isa = Isa::avx512bf16;
  static constexpr int64_t kK = 16; // operands zero-padded to 16 k (8 pairs)
  // Every query block takes the backward's products with P and dS in f32 (math_bf16.h: dV, dK, dQ on
  // MicroF32's FMA tiles; S and dP stay here): vdpbf16ps runs at about twice the FMA rate in FLOP, so
  // P and dS as hi + lo (two products each) cost what one f32 product does, and the passes that split
  // them and pair their rows cost more. Measured on Zen 4, side by side against hi + lo for blocks of
  // more than 64 rows (bf16, B = 1, Hq = 16, S = 4096): the backward in 0.94x the time at D = 128,
  // 0.92x at D = 64, 0.93x causal; 0.93x at B = 8, S = 512; 0.78x at B = 32, Hq = 12, S = 197, D = 64;
  // 0.74x with a window of 256 keys. On Zen 5 (Hq = 32, Hk = 8, Sk = 4096, D = 128) f32 products took
  // 0.47x the time of hi + lo at Sq = 1, 0.92x at 48 rows, 0.985x at 64, 1.01x at 128 and 0.99x for
  // the whole S = 4096 backward.
  static constexpr int64_t kF32Rows = INT64_MAX;
  static constexpr int L = 16, MR = F::MR, NV = F::NV;
  static_assert(V::lanes == 16);

  static Tiles tiles(const core::Problem& p, bool backward) {
    return tiles_of(isa, p, backward);
  }
  static void begin() {}
  static void end() {}

  // C[mr][nv*16] at c: (acc ? row_scale * C : 0) + (A + A_lo) B over kk (even) k; A rows a + r * lda,
  // B words b + w * ldb (ldb in bf16). The last vector of each row is masked by `last` when kTail. With
  // a fetch ahead (pf), one of its paced steps per pair of k (MicroF32::gemm_fetching).
  template <int mr, int nv, bool kTail, bool kLo>
  static void tile(int64_t kk, const bf16* a, const bf16* a_lo, int64_t lda, const bf16* b, int64_t ldb, float* c,
                   int64_t ldc, bool acc, const float* row_scale, K last, Prefetch* pf) {
    R cr[mr][nv];
    F::template load_c<mr, nv, kTail>(cr, c, ldc, acc, row_scale, last);
    for (int64_t k = 0; k < kk; k += 2) {
      if (pf) pf->paced();
      const bf16* brow = b + (k / 2) * ldb;
      typename W::reg bv[nv];
#pragma GCC unroll 4
      for (int v = 0; v < nv; ++v) bv[v] = W::load(brow + 2 * L * v); // B columns beyond n are readable zeros
#pragma GCC unroll 8
      for (int r = 0; r < mr; ++r) {
        const typename W::reg av = W::broadcast(a + r * lda + k);
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v) cr[r][v] = W::dot(cr[r][v], av, bv[v]);
        if constexpr (kLo) {
          const typename W::reg lv = W::broadcast(a_lo + r * lda + k);
#pragma GCC unroll 4
          for (int v = 0; v < nv; ++v) cr[r][v] = W::dot(cr[r][v], lv, bv[v]);
        }
      }
    }
    F::template store_c<mr, nv, kTail>(cr, c, ldc, last);
  }

  using TileFn = void (*)(int64_t, const bf16*, const bf16*, int64_t, const bf16*, int64_t, float*, int64_t, bool,
                          const float*, K, Prefetch*);
  template <int mr, int nv = 1>
  static TileFn pick_nv(int want_nv, bool tail, bool lo) {
    if constexpr (nv > NV) {
      return nullptr;
    } else {
      if (want_nv == nv) {
        if (lo) return tail ? &tile<mr, nv, true, true> : &tile<mr, nv, false, true>;
        return tail ? &tile<mr, nv, true, false> : &tile<mr, nv, false, false>;
      }
      return pick_nv<mr, nv + 1>(want_nv, tail, lo);
    }
  }
  template <int mr = 1>
  static TileFn pick_tile(int want_mr, int want_nv, bool tail, bool lo) {
    if constexpr (mr > MR) {
      return nullptr;
    } else {
      if (want_mr == mr) return pick_nv<mr>(want_nv, tail, lo);
      return pick_tile<mr + 1>(want_mr, want_nv, tail, lo);
    }
  }
  // C[m][n] = (acc ? row_scale * C : 0) + (A + A_lo) (B + B_lo); A, A_lo bf16 [m][kk] (lda), B, B_lo
  // VNNI [kk/2][ldb] with >= round_up(n, 16) columns, kk a multiple of kK; a_lo and b_lo may be null,
  // not both given; only C[m][n] is read or written. Tiled as MicroF32 tiles f32
  // (MicroF32::for_each_tile); B_lo in a second pass over C. With pf, one of its paced steps per pair
  // of k of each tile and pass (k_steps in all).
  static void gemm(int64_t m, int64_t n, int64_t kk, const bf16* a, const bf16* a_lo, int64_t lda, const bf16* b,
                   int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale, const bf16* b_lo = nullptr,
                   Prefetch* pf = nullptr) {
    if (b_lo) {
      gemm(m, n, kk, a, a_lo, lda, b, ldb, c, ldc, acc, row_scale, nullptr, pf);
      gemm(m, n, kk, a, a_lo, lda, b_lo, ldb, c, ldc, true, nullptr, nullptr, pf);
      return;
    }
    F::template for_each_tile<NV>(m, n, [&](int64_t r0, int64_t mr, int64_t c0, int nv, bool tail, K last) {
      pick_tile(static_cast<int>(mr), nv, tail, a_lo != nullptr)(
          kk, a + r0 * lda, a_lo ? a_lo + r0 * lda : nullptr, lda, b + 2 * c0, ldb, c + r0 * ldc + c0, ldc, acc,
          row_scale ? row_scale + r0 : nullptr, last, pf);
    });
  }
  // The paced steps of gemm(m, n, kk) with pf, without B_lo.
  static int64_t k_steps(int64_t m, int64_t n, int64_t kk) { return F::template k_steps<NV>(m, n, kk / 2); }
};

} // namespace
} // namespace flashback::cpu
