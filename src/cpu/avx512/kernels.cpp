// AVX-512 (F, BW, DQ, VL) f32 kernels: MicroF32 over 16-lane zmm vectors.
// Compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl only; chosen at run time (cpu/isa.cpp).
#include <immintrin.h>

#include "cpu/avx512/v512.h"
#include "cpu/math_f32.h"
#include "cpu/micro_f32.h"

namespace flashback::cpu {

const KernelSet& kernels_avx512(core::DType dtype) {
  return f32_kernel_set<IsaMicroF32<V512, Isa::avx512>>(dtype);
}

} // namespace flashback::cpu
