// AVX2 + FMA (+ F16C) 8-lane f32 vector operations, the `V` of MicroF32 on processors without
// AVX-512. Included only by translation units compiled with the avx2 flags; internal linkage.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/exp2_poly.h"
#include "cpu/half.h"

namespace flashback::cpu {
namespace {

struct V256 {
  using reg = __m256;
  using mask = __m256i; // all-ones lanes are selected
  static constexpr int lanes = 8;
  static constexpr int kRegisters = 16;
  // 6 x 2 ymm of C: 12 accumulators for 2 FMA ports x 4 cycles of latency, plus 2 of B and a
  // broadcast: 15 of the 16 registers.
  static constexpr int kMR = 6, kNV = 2;
  // Panels of up to 3 vectors where n leaves one vector over (n = 40, 72): 4 rows x 3 vectors, the same
  // 12 accumulators, 3 of B and a broadcast (micro_f32.h, for_each_panel).
  static constexpr int kNVWide = 3;

  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static mask first_lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // Masked-off lanes are neither read nor faulted on.
  static reg load_masked(const float* p, mask m) { return _mm256_maskload_ps(p, m); }
  static void store_masked(float* p, mask m, reg x) { _mm256_maskstore_ps(p, m, x); }
  // The first n (<= 8) elements at p in f32, the other lanes 0; nothing past them is read. A whole
  // vector is loaded without the mask: on Zen 3, vmaskmovps loads that miss the cache are slow (the
  // transposing pack of K, reading it from memory in decoding, took 0.7x the time with plain loads).
  static reg load(const float* p, int n) {
    if (n >= 8) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, first_lanes(n));
  }
  static reg load(const bf16* p, int n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load8x16(p, n)), 16));
  }
  static reg load(const f16* p, int n) { return _mm256_cvtph_ps(load8x16(p, n)); }
  // Eight 16-bit elements; a partial vector goes through a zeroed copy (AVX2 has no 16-bit masks).
  template <class T>
  static __m128i load8x16(const T* p, int n) {
    if (n >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    uint16_t tmp[8] = {};
    std::memcpy(tmp, p, static_cast<size_t>(n) * sizeof(T));
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
  }
  // The first n (<= 8) lanes stored at p, rounded to the storage type bit for bit as from_float
  // (half.h) rounds: to nearest even, NaN as its quiet NaN; nothing past them is written.
  // A whole vector is stored without the mask: Zen 3 runs vmaskmovps stores as microcode (perf: the
  // backward's code outside the products, P and dS, fell from about 12% of its samples to 5%).
  static void store(float* p, reg x, int n) {
    if (n >= 8) return _mm256_storeu_ps(p, x);
    _mm256_maskstore_ps(p, first_lanes(n), x);
  }
  static void store(bf16* p, reg x, int n) {
    const __m256i u = _mm256_castps_si256(x), high = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    store8x16(p, pack16(_mm256_blendv_epi8(rounded, quiet, nan)), n);
  }
  static void store(f16* p, reg x, int n) {
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(0x8000));
    const __m128i quiet = pack16(_mm256_or_si256(sign, _mm256_set1_epi32(0x7E00)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    store8x16(p, _mm_blendv_epi8(h, quiet, nan16), n);
  }
  // Eight 32-bit lanes holding values in [0, 0xFFFF] as eight 16-bit ones, in order.
  static __m128i pack16(__m256i v) {
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  }
  template <class T>
  static void store8x16(T* p, __m128i v, int n) {
    if (n >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
    uint16_t tmp[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), v);
    std::memcpy(p, tmp, static_cast<size_t>(n) * sizeof(T));
  }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fms(reg a, reg b, reg c) { return _mm256_fmsub_ps(a, b, c); } // a * b - c
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static mask equal(reg a, reg b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  static reg select(mask m, reg yes, reg no) { return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(m)); }
  static float reduce_add(reg x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(reg x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float first(reg x) { return _mm256_cvtss_f32(x); }

  // Lanes i with lo <= base + step * i <= hi.
  static mask in_band(int32_t base, int32_t step, int32_t lo, int32_t hi) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i v = _mm256_add_epi32(_mm256_set1_epi32(base), _mm256_mullo_epi32(iota, _mm256_set1_epi32(step)));
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), v),
                                        _mm256_cmpgt_epi32(v, _mm256_set1_epi32(hi)));
    return _mm256_xor_si256(out, _mm256_set1_epi32(-1));
  }

  // 2^x as in V512::exp2, with 2^n built in the exponent field: x is clamped to [-127, 128], so
  // n = -127 gives the bits of 0 (results below 2^-126 flush to 0) and n = 128 those of inf.
  // The operand order of max/min keeps NaN.
  static reg exp2(reg x) {
    x = _mm256_min_ps(_mm256_set1_ps(128.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), x));
    const reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = _mm256_sub_ps(x, n);
    reg p = _mm256_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 6
    for (int i = 1; i < kExp2Terms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }

  // In-register transpose of 8 rows of 8 floats.
  static void transpose(reg (&r)[8]) {
    reg t[8] = {};
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    reg u[8] = {};
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
      r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
  }
};

} // namespace
} // namespace flashback::cpu
