// AVX2 + FMA f32 kernels: MicroF32 over 8-lane ymm vectors.
// Compiled with -mavx2 -mfma -mf16c only; chosen at run time (cpu/isa.cpp).
#include "cpu/avx2/v256.h"
#include "cpu/math_f32.h"
#include "cpu/micro_f32.h"

namespace flashback::cpu {

const KernelSet& kernels_avx2(core::DType dtype) { return f32_kernel_set<IsaMicroF32<V256, Isa::avx2>>(dtype); }

} // namespace flashback::cpu
