// AVX-512 (F, BW, DQ, VL) f32 kernels: MicroF32 over 16-lane zmm vectors.
// Compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vl only; chosen at run time (cpu/isa.cpp).
#include <immintrin.h>

#include "cpu/avx512/v512.h"
#include "cpu/math_f32.h"
#include "cpu/micro_f32.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

struct Avx512Micro : MicroF32<V512> {
  static constexpr Isa isa = Isa::avx512;
  static Tiles tiles(const core::Problem& p, bool backward) {
    return choose_tiles(isa, p.head_dim, p.head_dim_v, backward);
  }
};

} // namespace

const KernelSet& kernels_avx512(core::DType dtype) { return f32_kernel_set<Avx512Micro>(dtype); }

} // namespace flashback::cpu
