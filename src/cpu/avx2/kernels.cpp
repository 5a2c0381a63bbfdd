// AVX2 + FMA f32 kernels: MicroF32 over 8-lane ymm vectors.
// Compiled with -mavx2 -mfma -mf16c only; chosen at run time (cpu/isa.cpp).
#include "cpu/avx2/v256.h"
#include "cpu/math_f32.h"
#include "cpu/micro_f32.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

struct Avx2Micro : MicroF32<V256> {
  static constexpr Isa isa = Isa::avx2;
  static Tiles tiles(const core::Problem& p, bool backward) {
    return choose_tiles(isa, p.head_dim, p.head_dim_v, backward);
  }
};

} // namespace

const KernelSet& kernels_avx2(core::DType dtype) { return f32_kernel_set<Avx2Micro>(dtype); }

} // namespace flashback::cpu
