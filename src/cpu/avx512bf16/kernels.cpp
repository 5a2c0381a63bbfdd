// bf16 products with AVX512_BF16's vdpbf16ps (dot_bf16_micro.h) for bf16 storage, on CPUs that run it
// faster than f32 FMA per FLOP (cpu/isa.h, bf16_dot_preferred); f32 and f16 run the AVX-512 f32
// kernels. Compiled with AVX-512 F/BW/DQ/VL/BF16 flags only; chosen at run time (cpu/isa.cpp).
#include "cpu/avx512/pack_bf16.h"
#include "cpu/avx512/v512.h"
#include "cpu/avx512bf16/bf16_words.h"
#include "cpu/dot_bf16_micro.h"
#include "cpu/math_bf16.h"

namespace flashback::cpu {

const KernelSet& kernels_avx512bf16(core::DType dtype) {
  if (dtype != core::DType::bf16) return kernels_avx512(dtype);
  return kernel_set_of<MathBf16<DotBf16Micro<V512, Bf16Words, PackBf16>>>();
}

} // namespace flashback::cpu
