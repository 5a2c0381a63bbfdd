// bf16 products on AMX tiles (TDPBF16PS: C[16][16] f32 += A[16][32] bf16 x B[16 pairs][16] bf16) for bf16
// storage, and for f16 with each input as hi + lo, two bf16 that sum to it exactly (math_bf16.h; one
// bf16 would round f16 inputs to 8 bits of mantissa, which fails the accuracy bar; see README), where
// the head dims are large enough (kernels.h: kF16TilesMinHeadDim); f32 runs the AVX-512 kernels.
// Compiled with AVX-512 F/BW/DQ/VL/BF16 and AMX-TILE/AMX-BF16 flags only; chosen at run time
// (cpu/isa.cpp), which also asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
//
// The microkernel (amx/amx_micro.h) is written over a tile-operations policy: RealTiles
// (amx/real_tiles.h) issues the AMX instructions; EmulatedTiles does the same arithmetic on arrays,
// so that the AMX code path is tested on machines with AVX512_BF16 but no AMX (FLASHBACK_EMULATION=amx;
// slow: for tests only).
#include <immintrin.h>

#include "cpu/amx/amx_micro.h"
#include "cpu/amx/real_tiles.h"
#include "cpu/avx512/pack_bf16.h"
#include "cpu/avx512/v512.h"
#include "cpu/math_bf16.h"
#include "cpu/tiles.h"

namespace flashback::cpu {

const KernelSet& kernels_amx(core::DType dtype, bool emulated) {
  if (dtype == core::DType::bf16) {
    if (emulated) return kernel_set_of<MathBf16<AmxMicro<EmulatedTiles, V512, PackBf16>>>();
    return kernel_set_of<MathBf16<AmxMicro<RealTiles, V512, PackBf16>>>();
  }
  if (dtype == core::DType::f16) {
    if (emulated) return kernel_set_of<MathBf16<AmxMicro<EmulatedTiles, V512, PackBf16>, f16>>();
    return kernel_set_of<MathBf16<AmxMicro<RealTiles, V512, PackBf16>, f16>>();
  }
  return kernels_avx512(dtype);
}

} // namespace flashback::cpu
