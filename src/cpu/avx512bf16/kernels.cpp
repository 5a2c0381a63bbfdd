// bf16 products with AVX512_BF16's vdpbf16ps (dot_bf16_micro.h) for bf16 storage, on CPUs that run it
// faster than f32 FMA per FLOP (cpu/isa.h, bf16_dot_preferred); f32 and f16 run the AVX-512 f32
// kernels. Compiled with AVX-512 F/BW/DQ/VL/BF16 flags only; chosen at run time (cpu/isa.cpp).
#include <immintrin.h>

#include <cstring>

#include "cpu/avx512/pack_bf16.h"
#include "cpu/avx512/v512.h"
#include "cpu/dot_bf16_micro.h"
#include "cpu/math_bf16.h"

namespace flashback::cpu {
namespace {

// 16 words of two bf16 each; dot is vdpbf16ps (products exact in f32; it treats subnormal bf16 inputs
// as zero; of the CPUs where it was tested, Zen 4 flushes each partial sum below 2^-126 (the accumulator
// plus the odd product, then plus the even one) to zero, Zen 5 keeps them).
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

const KernelSet& kernels_avx512bf16(core::DType dtype) {
  if (dtype != core::DType::bf16) return kernels_avx512(dtype);
  return kernel_set_of<MathBf16<DotBf16Micro<V512, Bf16Words, PackBf16>>>();
}

} // namespace flashback::cpu
