// AVX-512 (F, BW, DQ, VL) 16-lane f32 vector operations, the `V` of MicroF32 and the helpers of the
// bf16 tile math. Included only by translation units compiled with AVX-512 flags; internal linkage.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/avx512/shape.h"
#include "cpu/exp2_poly.h"
#include "cpu/half.h"

namespace flashback::cpu {
namespace {

struct V512 : V512Shape {
  using reg = __m512;
  using mask = __mmask16;

  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static mask first_lanes(int n) { return static_cast<mask>(n >= 16 ? 0xFFFF : (1u << n) - 1u); }
  // Masked-off lanes are neither read nor faulted on.
  static reg load_masked(const float* p, mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_masked(float* p, mask m, reg x) { _mm512_mask_storeu_ps(p, m, x); }
  // The first n (<= 16) elements at p in f32, the other lanes 0; nothing past them is read.
  static reg load(const float* p, int n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
  static reg load(const bf16* p, int n) {
    const __m256i h = _mm256_maskz_loadu_epi16(first_lanes(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg load(const f16* p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(n), p)); }
  // The first n (<= 16) lanes stored at p, rounded to the storage type bit for bit as from_float
  // (half.h) rounds: to nearest even, NaN as its quiet NaN; nothing past them is written.
  static void store(float* p, reg x, int n) { _mm512_mask_storeu_ps(p, first_lanes(n), x); }
  static void store(bf16* p, reg x, int n) {
    const __m512i u = _mm512_castps_si512(x), high = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
  }
  static void store(f16* p, reg x, int n) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(0x8000));
    const __m256i quiet = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7E00)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    _mm256_mask_storeu_epi16(p, first_lanes(n), _mm256_mask_blend_epi16(nan, h, quiet));
  }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg fms(reg a, reg b, reg c) { return _mm512_fmsub_ps(a, b, c); } // a * b - c
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static mask equal(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static reg select(mask m, reg yes, reg no) { return _mm512_mask_blend_ps(m, no, yes); }
  static float reduce_add(reg x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(reg x) { return _mm512_reduce_max_ps(x); }
  static float first(reg x) { return _mm512_cvtss_f32(x); }

  // Lanes i with lo <= base + step * i <= hi.
  static mask in_band(int32_t base, int32_t step, int32_t lo, int32_t hi) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_add_epi32(_mm512_set1_epi32(base), _mm512_mullo_epi32(iota, _mm512_set1_epi32(step)));
    return _mm512_cmp_epi32_mask(v, _mm512_set1_epi32(lo), _MM_CMPINT_NLT) &
           _mm512_cmp_epi32_mask(v, _mm512_set1_epi32(hi), _MM_CMPINT_LE);
  }

  // 2^x: x = n + f with n = round(x), |f| <= 1/2; 2^f by a degree-5 polynomial (relative error at
  // most 2.21e-7: exp2_poly.h), then scalef multiplies by 2^n, giving inf above 128. Below -125 the result is
  // 0 (as AVX2's exp2 gives 0 below -126.5): a subnormal or underflowing result takes a microcode
  // assist on Intel, about 40x the time of the vector (measured on a Xeon with AMX: 190 - 320 TSC
  // cycles against 5), and values below 2^-125 vanish beside the softmax's largest term (>= 1).
  // f = x - round(x) in one vreduceps, exact, and n = x - f, exact: the same bits as rounding x first
  // and clamping it to [-200, 128] (every one of the 2^32 inputs compared), in 0.72x the time (1.9
  // against 2.6 ns per vector, measured on the Xeon with AMX). +-inf gives f = 0: inf and (masked) 0;
  // NaN stays NaN (the unordered comparison).
  static reg exp2(reg x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
    const reg f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    reg p = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 6
    for (int i = 1; i < kExp2Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
    return _mm512_maskz_scalef_ps(normal, p, _mm512_sub_ps(x, f));
  }

  // In-register transpose of 16 rows of 16 floats: 4x4 blocks within 128-bit lanes, then two rounds
  // of 128-bit lane shuffles.
  static void transpose(reg (&r)[16]) {
    __m512 t[16] = {};
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    // r[4g + j]: rows 4g..4g+3 of columns j, j+4, j+8, j+12 (one per 128-bit lane).
    for (int i = 0; i < 8; ++i) {
      const int a = (i / 4) * 8 + (i % 4);
      t[a] = _mm512_shuffle_f32x4(r[a], r[a + 4], _MM_SHUFFLE(2, 0, 2, 0));
      t[a + 4] = _mm512_shuffle_f32x4(r[a], r[a + 4], _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], _MM_SHUFFLE(2, 0, 2, 0));
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], _MM_SHUFFLE(3, 1, 3, 1));
      r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
      r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
};

} // namespace
} // namespace flashback::cpu
