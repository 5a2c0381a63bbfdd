// bf16 products with AVX512_BF16 (vdpbf16ps: 32 bf16 multiply-adds into 16 f32 lanes per
// instruction, twice the f32 FMA rate) for bf16 storage; f32 and f16 run the AVX-512 f32 kernels.
// Compiled with AVX-512 F/BW/DQ/VL + BF16 flags only; chosen at run time (cpu/isa.cpp).
#include <immintrin.h>

#include "cpu/avx512/v512.h"
#include "cpu/math_bf16.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

struct Dpbf16Micro {
  static constexpr Isa isa = Isa::avx512bf16;
  static constexpr int64_t kK = 2; // operands are padded to an even k
  // 6 rows x 4 zmm of C as in the f32 kernel: per pair of k, 4 loads of B and 6 broadcasts of A pairs
  // feed 24 vdpbf16ps.
  static constexpr int kMR = 6, kNV = 4;

  static Tiles tiles(const core::Problem& p, bool backward) {
    return choose_tiles(isa, p.head_dim, p.head_dim_v, backward);
  }

  static __m512bh pair_of(const bf16* p) {
    int32_t pair;
    __builtin_memcpy(&pair, p, sizeof pair);
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
  }

  // With kSplit, A is hi + lo: both rows go into the same accumulators, sharing the loads of B.
  template <int mr, int nv, bool kTail, bool kSplit>
  static void tile(int64_t kk, const bf16* a, const bf16* a_lo, int64_t lda, const bf16* b, int64_t ldb, float* c,
                   int64_t ldc, bool acc, const float* row_scale, __mmask16 last) {
    __m512 cr[mr][nv];
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
      const __m512 s = _mm512_set1_ps(row_scale ? row_scale[r] : 1.0f);
#pragma GCC unroll 4
      for (int v = 0; v < nv; ++v) {
        const float* p = c + r * ldc + 16 * v;
        cr[r][v] = !acc ? _mm512_setzero_ps()
                        : _mm512_mul_ps(kTail && v == nv - 1 ? _mm512_maskz_loadu_ps(last, p) : _mm512_loadu_ps(p), s);
      }
    }
    for (int64_t kp = 0; kp < kk / 2; ++kp) {
      const bf16* brow = b + kp * ldb;
      __m512bh bv[nv];
#pragma GCC unroll 4
      for (int v = 0; v < nv; ++v)
        bv[v] = reinterpret_cast<__m512bh>(kTail && v == nv - 1 ? _mm512_maskz_loadu_epi32(last, brow + 32 * v)
                                                                 : _mm512_loadu_si512(brow + 32 * v));
#pragma GCC unroll 8
      for (int r = 0; r < mr; ++r) {
        const __m512bh av = pair_of(a + r * lda + 2 * kp);
#pragma GCC unroll 4
        for (int v = 0; v < nv; ++v) cr[r][v] = _mm512_dpbf16_ps(cr[r][v], av, bv[v]);
        if constexpr (kSplit) {
          const __m512bh lo = pair_of(a_lo + r * lda + 2 * kp);
#pragma GCC unroll 4
          for (int v = 0; v < nv; ++v) cr[r][v] = _mm512_dpbf16_ps(cr[r][v], lo, bv[v]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < nv; ++v) {
        float* p = c + r * ldc + 16 * v;
        if (kTail && v == nv - 1)
          _mm512_mask_storeu_ps(p, last, cr[r][v]);
        else
          _mm512_storeu_ps(p, cr[r][v]);
      }
  }

  using TileFn = void (*)(int64_t, const bf16*, const bf16*, int64_t, const bf16*, int64_t, float*, int64_t, bool,
                          const float*, __mmask16);
  template <int mr, int nv>
  static TileFn variant(bool tail, bool split) {
    return tail ? (split ? &tile<mr, nv, true, true> : &tile<mr, nv, true, false>)
                : (split ? &tile<mr, nv, false, true> : &tile<mr, nv, false, false>);
  }
  template <int mr, int nv = 1>
  static TileFn pick_nv(int want_nv, bool tail, bool split) {
    if constexpr (nv > kNV) {
      return nullptr;
    } else {
      if (want_nv == nv) return variant<mr, nv>(tail, split);
      return pick_nv<mr, nv + 1>(want_nv, tail, split);
    }
  }
  template <int mr = 1>
  static TileFn pick_tile(int want_mr, int want_nv, bool tail, bool split) {
    if constexpr (mr > kMR) {
      return nullptr;
    } else {
      if (want_mr == mr) return pick_nv<mr>(want_nv, tail, split);
      return pick_tile<mr + 1>(want_mr, want_nv, tail, split);
    }
  }

  // C[m][n] = (acc ? row_scale * C : 0) + (A + A_lo) B; A, A_lo bf16 [m][kk] (lda; A_lo may be null),
  // B VNNI [kk/2][ldb], kk even.
  static void gemm(int64_t m, int64_t n, int64_t kk, const bf16* a, const bf16* a_lo, int64_t lda, const bf16* b,
                   int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale) {
    for (int64_t c0 = 0; c0 < n; c0 += 16 * kNV) {
      const int64_t width = min64(16 * kNV, n - c0);
      const int nv = static_cast<int>((width + 15) / 16);
      const int rem = static_cast<int>(width - (nv - 1) * 16);
      for (int64_t r0 = 0; r0 < m; r0 += kMR) {
        const int mr = static_cast<int>(min64(kMR, m - r0));
        pick_tile(mr, nv, rem != 16, a_lo != nullptr)(kk, a + r0 * lda, a_lo ? a_lo + r0 * lda : nullptr, lda,
                                                      b + 2 * c0, ldb, c + r0 * ldc + c0, ldc, acc,
                                                      row_scale ? row_scale + r0 : nullptr, V512::first_lanes(rem));
      }
    }
  }
};

} // namespace

const KernelSet& kernels_avx512bf16(core::DType dtype) {
  if (dtype == core::DType::bf16) return kernel_set_of<MathBf16<Dpbf16Micro>>();
  return kernels_avx512(dtype);
}

} // namespace flashback::cpu
