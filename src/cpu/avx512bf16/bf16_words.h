// The word operations of DotBf16Micro (dot_bf16_micro.h) on AVX512_BF16: 16 words of two bf16 each;
// dot is vdpbf16ps (products exact in f32; it treats subnormal bf16 inputs as zero; of the CPUs where
// it was tested, Zen 4 flushes each partial sum below 2^-126 (the accumulator plus the odd product,
// then plus the even one) to zero, Zen 5 keeps them). Compiled only with the avx512bf16 level's flags
// (avx512bf16/kernels.cpp, and bench/kernel_avx512bf16.cpp). Internal linkage.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/half.h"

namespace flashback::cpu {
namespace {

struct Bf16Words {
  using reg = __m512i;
  static reg load(const bf16* p) { return _mm512_loadu_si512(p); }
  static reg broadcast(const bf16* p) {
    int32_t w;
    std::memcpy(&w, p, sizeof w);
    return _mm512_set1_epi32(w);
  }
  static __m512 dot(__m512 acc, reg a, reg b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
};

} // namespace
} // namespace flashback::cpu
