// Packing for bf16 products (math_bf16.h), with AVX-512 BW and AVX512_BF16. Two operand formats:
//   A: row-major bf16, the reduction index k contiguous: element (r, k) at a[r * lda + k].
//   B: "VNNI" pairs, element (k, n) at b[(k / 2) * ldb + 2 * n + k % 2]: each 32-bit word holds the
//      two k of one column n. AMX TDPBF16PS reads this layout.
// Every routine writes zeros into the padding it is given, so padded products add exact zeros.
// The routines that read storage take bf16, or f16 as one of its two parts (`lo` false: hi, true: lo;
// part16): hi + lo, two bf16, is the f16 value exactly (an f16 has 11 significant bits; hi takes 8,
// the remainder x - hi is exact in f32 and has at most 3).
// Internal linkage; included only by translation units compiled with those flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/avx512/v512.h"
#include "cpu/blocks.h"

namespace flashback::cpu {
namespace {

struct PackBf16 {
  // vnni_t and vnni fetch the source rows kAheadRows ahead of those they read (within the rows given):
  // where K and V come from memory as they are packed (decoding packs each key block as it reaches it,
  // math_bf16.h: packs_per_tile) the loads waited on memory. Measured on an AMD Zen 4 guest (bf16 on
  // vdpbf16ps, side by side, 8 rounds; BENCHMARKS.md): a decoding step (Hq = 32, Hk = 8, Sk = 8192,
  // D = 128) 0.88x the time (0.75 - 0.99), its backward 0.93x; S = 4096 within 1%.
  static constexpr int64_t kAheadRows = 16;

  static __mmask32 first32(int64_t n) {
    return n >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((uint64_t{1} << n) - 1u);
  }

  static __m256i to_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
  static __m512 to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

  // 16 f32 as their hi (bf16(x)) or lo (bf16(x - hi)) parts.
  static __m256i part16(__m512 x, bool lo) {
    const __m256i h = to_bf16(x);
    return lo ? to_bf16(_mm512_sub_ps(x, to_f32(h))) : h;
  }
  // The first lanes (mask m) of 32 values at p as bf16: bf16 as they are, f16 as their part.
  static __m512i load32(const bf16* p, __mmask32 m, bool /*lo: bf16 has no lo part*/) {
    return _mm512_maskz_loadu_epi16(m, p);
  }
  static __m512i load32(const f16* p, __mmask32 m, bool lo) {
    const __m512i x = _mm512_maskz_loadu_epi16(m, p);
    const __m256i a = part16(_mm512_cvtph_ps(_mm512_castsi512_si256(x)), lo);
    const __m256i b = part16(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1)), lo);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }

  // dst [rows_pad][width] (row stride ldd) = src [rows][cols], zeros beyond.
  template <class S>
  static void rows(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldd, int64_t width,
                   int64_t rows_pad, bool lo = false) {
    for (int64_t r = 0; r < rows_pad; ++r)
      for (int64_t c0 = 0; c0 < width; c0 += 32) {
        const __m512i x = r < rows && c0 < cols ? load32(src + r * lds + c0, first32(cols - c0), lo)
                                                : _mm512_setzero_si512();
        _mm512_mask_storeu_epi16(dst + r * ldd + c0, first32(width - c0), x);
      }
  }

  // B(k, n) = src[n][k]: the VNNI form of src^T, for k < k_pad (even) and n < n_pad (a multiple of
  // 16). A 32-bit word of B is a 32-bit word of a src row, so this is a 16 x 16 transpose of words.
  template <class S>
  static void vnni_t(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb,
                     int64_t k_pad, int64_t n_pad, bool lo = false) {
    const int64_t words = k_pad / 2;
    for (int64_t n0 = 0; n0 < n_pad; n0 += 16)
      for (int64_t w0 = 0; w0 < words; w0 += 16) {
        __m512 block[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t n = n0 + i, c0 = 2 * w0;
          block[i] = n < rows && c0 < cols
                         ? _mm512_castsi512_ps(load32(src + n * lds + c0, first32(cols - c0), lo))
                         : _mm512_setzero_ps();
          if (n + kAheadRows < rows && c0 < cols) __builtin_prefetch(src + (n + kAheadRows) * lds + c0, 0, 3);
        }
        V512::transpose(block);
        for (int j = 0; j < 16 && w0 + j < words; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (w0 + j) * ldb + 2 * n0), block[j]);
      }
  }

  // B(k, n) = src[k][n]: the VNNI form of src, for k < k_pad (even) and n < n_pad (a multiple of 16):
  // rows 2w and 2w + 1 interleaved element by element.
  template <class S>
  static void vnni(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb, int64_t k_pad,
                   int64_t n_pad, bool lo = false) {
    // Indices for vpermt2w: element i of the result is even[i / 2] (i even) or odd[i / 2] (i odd).
    static const uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                             8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i first = _mm512_loadu_si512(kInterleave);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    auto row = [&](int64_t k, int64_t n0) {
      return k < rows && n0 < cols ? load32(src + k * lds + n0, first32(cols - n0), lo) : _mm512_setzero_si512();
    };
    for (int64_t k = 0; k < k_pad; k += 2)
      for (int64_t n0 = 0; n0 < n_pad; n0 += 32) {
        const __m512i even = row(k, n0), odd = row(k + 1, n0);
        if (k + 1 + kAheadRows < rows && n0 < cols) {
          __builtin_prefetch(src + (k + kAheadRows) * lds + n0, 0, 3);
          __builtin_prefetch(src + (k + 1 + kAheadRows) * lds + n0, 0, 3);
        }
        bf16* out = dst + (k / 2) * ldb + 2 * n0;
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(even, first, odd));
        if (n0 + 16 < n_pad) _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(even, second, odd));
      }
  }

  // dst [cols_pad][width] (row stride ldd) = (src [rows][cols])^T, zeros beyond (cols_pad and width
  // multiples of 16): the A form of an input's transpose. 16 x 16 blocks, widened to 32-bit words,
  // transposed and narrowed.
  template <class S>
  static void rows_t(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldd, int64_t width,
                     int64_t cols_pad, bool lo = false) {
    for (int64_t c0 = 0; c0 < cols_pad; c0 += 16)
      for (int64_t r0 = 0; r0 < width; r0 += 16) {
        __m512 block[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t r = r0 + i;
          block[i] = r < rows && c0 < cols
                         ? _mm512_castsi512_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(
                               load32(src + r * lds + c0, first32(cols - c0 < 16 ? cols - c0 : 16), lo))))
                         : _mm512_setzero_ps();
        }
        V512::transpose(block);
        for (int j = 0; j < 16; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (c0 + j) * ldd + r0),
                              _mm512_cvtepi32_epi16(_mm512_castps_si512(block[j])));
      }
  }

  // P and dS (f32) as hi + lo, both bf16: hi = x truncated to bf16, lo = bf16(x - hi), rounded to
  // nearest; |x - hi - lo| <= 2^-15 |x| (|x - hi| < 2^-7 |x|, and lo's rounding 2^-8 of that). x - hi
  // is exact; x = +-inf gives lo = NaN, as rounding both parts did. Truncation makes hi an AND and
  // its packing a shift or a permutation.
  static __m512 low_part(__m512 x) {
    return _mm512_sub_ps(x, _mm512_and_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
  }
  // 32 lanes, x0 then x1, the first min(n, 32) of them, hi also at hi + again when again is not 0:
  // one permutation packs hi and one cvtne2ps rounds lo, half the instructions of splitting 16 lanes
  // at a time (the forward's P: 0.91x its time).
  static void split32(__m512 x0, __m512 x1, bf16* hi, bf16* lo, int64_t n, int64_t again = 0) {
    static const uint16_t kHigh[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                       33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    const __m512i h = _mm512_permutex2var_epi16(_mm512_castps_si512(x0), _mm512_loadu_si512(kHigh),
                                                _mm512_castps_si512(x1));
    const __m512i l = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(low_part(x1), low_part(x0)));
    const __mmask32 m = first32(n);
    _mm512_mask_storeu_epi16(hi, m, h);
    if (again) _mm512_mask_storeu_epi16(hi + again, m, h);
    _mm512_mask_storeu_epi16(lo, m, l);
  }

  // Rows k and k + 1 of P or dS (x and y, 16 columns each) as one row of B's VNNI words (word n holds
  // x[n] and y[n]), split as split32 splits but for ties: 16 words of hi at hi (and at hi + again when
  // again is not 0), 16 of lo at lo. Each word's two halves taken by a shift and a bitwise select,
  // hi from x and y, lo from their low parts rounded to nearest with ties away from zero (half an
  // ulp added to the bits; the same bound, |x - hi - lo| <= 2^-15 |x|). Rounding by cvtne2ps and
  // interleaving by a permutation of words instead: the bf16 backward took 1.02x the time at D = 64
  // (measured on the Xeon with AMX, side by side, 8 rounds: 0.99 - 1.03x), 1.00x at D = 128.
  static void split_pairs(__m512 x, __m512 y, bf16* hi, bf16* lo, int64_t again = 0) {
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), half = _mm512_set1_epi32(0x8000);
    auto words = [&](__m512i a, __m512i b) { // a's high half in the low half, beside b's high half
      return _mm512_ternarylogic_epi32(_mm512_srli_epi32(a, 16), b, top, 0xF8); // a | (b & c)
    };
    const __m512i h = words(_mm512_castps_si512(x), _mm512_castps_si512(y));
    const __m512i l = words(_mm512_add_epi32(_mm512_castps_si512(low_part(x)), half),
                            _mm512_add_epi32(_mm512_castps_si512(low_part(y)), half));
    _mm512_storeu_si512(hi, h);
    if (again) _mm512_storeu_si512(hi + again, h);
    _mm512_storeu_si512(lo, l);
  }
};

} // namespace
} // namespace flashback::cpu
