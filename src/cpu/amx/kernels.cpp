// bf16 products on AMX tiles (TDPBF16PS: C[16][16] f32 += A[16][32] bf16 x B[16 pairs][16] bf16) for bf16
// storage; f32 and f16 run the AVX-512 f32 kernels (f16 through bf16 would round its inputs to 8 bits
// of mantissa, which fails the accuracy bar; see README). Compiled with AVX-512 F/BW/DQ/VL/BF16 and
// AMX-TILE/AMX-BF16 flags only; chosen at run time (cpu/isa.cpp), which also asks Linux for the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM).
//
// The microkernel (amx/amx_micro.h) is written over a tile-operations policy: RealTiles, here, issues
// the AMX instructions; EmulatedTiles does the same arithmetic on arrays, so that the AMX code path is
// tested on machines with AVX512_BF16 but no AMX (FLASHBACK_EMULATION=amx; slow: for tests only).
#include <immintrin.h>

#include "cpu/amx/amx_micro.h"
#include "cpu/avx512/pack_bf16.h"
#include "cpu/avx512/v512.h"
#include "cpu/math_bf16.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

// Palette 1, all eight tiles 16 rows x 64 bytes. Loaded once per thread per call, before the thread's
// first work item, and released after its last (KernelSet::thread_begin / thread_end, the way oneDNN
// configures once per kernel call), so no tile state outlives a call on any thread; every GEMM in
// between keeps it and loads its C, A and B tiles from memory.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// GCC's tile intrinsics paste their tile number into the instruction text, so each number is spelled.
struct RealTiles {
  static void begin() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  static void end() { _tile_release(); }
  template <int t>
  static void load(const void* p, int64_t stride) {
    static_assert(t >= 0 && t <= 7);
    if constexpr (t == 0) _tile_loadd(0, p, stride);
    else if constexpr (t == 1) _tile_loadd(1, p, stride);
    else if constexpr (t == 2) _tile_loadd(2, p, stride);
    else if constexpr (t == 3) _tile_loadd(3, p, stride);
    else if constexpr (t == 4) _tile_loadd(4, p, stride);
    else if constexpr (t == 5) _tile_loadd(5, p, stride);
    else if constexpr (t == 6) _tile_loadd(6, p, stride);
    else _tile_loadd(7, p, stride);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    static_assert(t >= 0 && t <= 3, "only C tiles are stored");
    if constexpr (t == 0) _tile_stored(0, p, stride);
    else if constexpr (t == 1) _tile_stored(1, p, stride);
    else if constexpr (t == 2) _tile_stored(2, p, stride);
    else _tile_stored(3, p, stride);
  }
  template <int t>
  static void zero() {
    static_assert(t >= 0 && t <= 3, "only C tiles are zeroed");
    if constexpr (t == 0) _tile_zero(0);
    else if constexpr (t == 1) _tile_zero(1);
    else if constexpr (t == 2) _tile_zero(2);
    else _tile_zero(3);
  }
  // The four products of a 2 x 2 block: C0 += A4 B6, C1 += A4 B7, C2 += A5 B6, C3 += A5 B7.
  template <int c, int a, int b>
  static void dot() {
    static_assert((c == 0 && a == 4 && b == 6) || (c == 1 && a == 4 && b == 7) || (c == 2 && a == 5 && b == 6) ||
                  (c == 3 && a == 5 && b == 7));
    if constexpr (c == 0) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (c == 1) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (c == 2) _tile_dpbf16ps(2, 5, 6);
    else _tile_dpbf16ps(3, 5, 7);
  }
};

} // namespace

const KernelSet& kernels_amx(core::DType dtype, bool emulated) {
  if (dtype != core::DType::bf16) return kernels_avx512(dtype);
  if (emulated) return kernel_set_of<MathBf16<AmxMicro<EmulatedTiles, V512, PackBf16>>>();
  return kernel_set_of<MathBf16<AmxMicro<RealTiles, V512, PackBf16>>>();
}

} // namespace flashback::cpu
