// Packing for bf16 products (math_bf16.h), with AVX-512 BW and AVX512_BF16. Two operand formats:
//   A: row-major bf16, the reduction index k contiguous: element (r, k) at a[r * lda + k].
//   B: "VNNI" pairs, element (k, n) at b[(k / 2) * ldb + 2 * n + k % 2]: each 32-bit word holds the
//      two k of one column n. AMX TDPBF16PS reads this layout.
// Every routine writes zeros into the padding it is given, so padded products add exact zeros.
// Internal linkage; included only by translation units compiled with those flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/avx512/v512.h"
#include "cpu/blocks.h"

namespace flashback::cpu {
namespace {

struct PackBf16 {
  static __mmask32 first32(int64_t n) {
    return n >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((uint64_t{1} << n) - 1u);
  }
  static __mmask16 first16(int64_t n) { return V512::first_lanes(static_cast<int>(n < 16 ? n : 16)); }
  // The first min(n, 16) of 16 bf16 to p; nothing past them is written.
  static void store16(bf16* p, int64_t n, __m256i x) { _mm256_mask_storeu_epi16(p, first16(n), x); }

  // dst [rows_pad][ldd] = src [rows][cols], zeros beyond.
  static void rows(const bf16* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldd,
                   int64_t rows_pad) {
    for (int64_t r = 0; r < rows_pad; ++r)
      for (int64_t c0 = 0; c0 < ldd; c0 += 32) {
        const __m512i x = r < rows && c0 < cols ? _mm512_maskz_loadu_epi16(first32(cols - c0), src + r * lds + c0)
                                                : _mm512_setzero_si512();
        _mm512_mask_storeu_epi16(dst + r * ldd + c0, first32(ldd - c0), x);
      }
  }

  // B(k, n) = src[n][k]: the VNNI form of src^T, for k < k_pad (even) and n < n_pad (a multiple of
  // 16). A 32-bit word of B is a 32-bit word of a src row, so this is a 16 x 16 transpose of words.
  static void vnni_t(const bf16* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb,
                     int64_t k_pad, int64_t n_pad) {
    const int64_t words = k_pad / 2;
    for (int64_t n0 = 0; n0 < n_pad; n0 += 16)
      for (int64_t w0 = 0; w0 < words; w0 += 16) {
        __m512 block[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t n = n0 + i, c0 = 2 * w0;
          block[i] = n < rows && c0 < cols
                         ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(first32(cols - c0), src + n * lds + c0))
                         : _mm512_setzero_ps();
        }
        V512::transpose(block);
        for (int j = 0; j < 16 && w0 + j < words; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (w0 + j) * ldb + 2 * n0), block[j]);
      }
  }

  // B(k, n) = src[k][n]: the VNNI form of src, for k < k_pad (even) and n < n_pad (a multiple of 16):
  // rows 2w and 2w + 1 interleaved element by element.
  static void vnni(const bf16* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb, int64_t k_pad,
                   int64_t n_pad) {
    // Indices for vpermt2w: element i of the result is even[i / 2] (i even) or odd[i / 2] (i odd).
    static const uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                             8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(kInterleave);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    auto row = [&](int64_t k, int64_t n0) {
      return k < rows && n0 < cols ? _mm512_maskz_loadu_epi16(first32(cols - n0), src + k * lds + n0)
                                   : _mm512_setzero_si512();
    };
    for (int64_t k = 0; k < k_pad; k += 2)
      for (int64_t n0 = 0; n0 < n_pad; n0 += 32) {
        const __m512i even = row(k, n0), odd = row(k + 1, n0);
        bf16* out = dst + (k / 2) * ldb + 2 * n0;
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(even, lo, odd));
        if (n0 + 16 < n_pad) _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(even, hi, odd));
      }
  }

  static __m256i to_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
  static __m512 to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

  // x as hi + lo, both bf16: hi = bf16(x), lo = bf16(x - hi); |x - hi - lo| <= 2^-16 |x|.
  static void split(__m512 x, bf16* hi, bf16* lo, int64_t n) {
    const __m256i h = to_bf16(x);
    store16(hi, n, h);
    store16(lo, n, to_bf16(_mm512_sub_ps(x, to_f32(h))));
  }

  // hi + lo [rows_pad][ldd] bf16 = src [rows][cols] f32, zeros beyond.
  static void split_f32(const float* src, int64_t lds, int64_t rows, int64_t cols, bf16* hi, bf16* lo, int64_t ldd,
                        int64_t rows_pad) {
    for (int64_t r = 0; r < rows_pad; ++r)
      for (int64_t c0 = 0; c0 < ldd; c0 += 16) {
        const __m512 x = r < rows && c0 < cols ? _mm512_maskz_loadu_ps(first16(cols - c0), src + r * lds + c0)
                                               : _mm512_setzero_ps();
        split(x, hi + r * ldd + c0, lo + r * ldd + c0, ldd - c0);
      }
  }

  // hi + lo [cols_pad][ldd] bf16 = (src [rows][cols] f32)^T, zeros beyond (cols_pad a multiple of 16).
  static void split_f32_t(const float* src, int64_t lds, int64_t rows, int64_t cols, bf16* hi, bf16* lo,
                          int64_t ldd, int64_t cols_pad) {
    for (int64_t c0 = 0; c0 < cols_pad; c0 += 16)
      for (int64_t r0 = 0; r0 < ldd; r0 += 16) {
        __m512 block[16];
        for (int i = 0; i < 16; ++i)
          block[i] = r0 + i < rows && c0 < cols ? _mm512_maskz_loadu_ps(first16(cols - c0), src + (r0 + i) * lds + c0)
                                                : _mm512_setzero_ps();
        V512::transpose(block);
        for (int j = 0; j < 16; ++j) split(block[j], hi + (c0 + j) * ldd + r0, lo + (c0 + j) * ldd + r0, ldd - r0);
      }
  }
};

} // namespace
} // namespace flashback::cpu
