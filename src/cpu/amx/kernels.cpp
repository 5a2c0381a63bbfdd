// bf16 products on AMX tiles (TDPBF16PS: C[16][16] f32 += A[16][32] bf16 x B[16 pairs][16] bf16) for bf16
// storage; f32 and f16 run the AVX-512 f32 kernels (f16 through bf16 would round its inputs to 8 bits
// of mantissa, which fails the accuracy bar; see README). Compiled with AVX-512 F/BW/DQ/VL/BF16 and
// AMX-TILE/AMX-BF16 flags only; chosen at run time (cpu/isa.cpp), which also asks Linux for the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM).
//
// The microkernel is written over a tile-operations policy: RealTiles issues the AMX instructions;
// EmulatedTiles does the same arithmetic on arrays, so that the AMX code path (blocking, padding,
// edges, configuration) is exercised and tested on machines without AMX (FLASHBACK_AMX_EMULATION=1;
// slow: for tests only).
#include <immintrin.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

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

// TDPBF16PS in software, per the Intel SDM: for each element, the two products of a pair are added
// to the f32 accumulator in order (bf16 products are exact in f32). Like the hardware, which raises
// #UD for a tile instruction without a loaded configuration, it stops the program when a tile is used
// outside begin() / end(): the tests then show that every GEMM runs inside a thread's configuration.
struct EmulatedTiles {
  struct Regs {
    alignas(64) uint8_t t[8][16][64];
    bool configured = false;
  };
  static Regs& regs() {
    static thread_local Regs r;
    return r;
  }
  static Regs& configured_regs() {
    Regs& g = regs();
    if (!g.configured) {
      std::fputs("flashback: AMX tile used without a tile configuration on this thread\n", stderr);
      std::abort();
    }
    return g;
  }
  static void begin() {
    std::memset(regs().t, 0, sizeof regs().t); // LDTILECFG zeroes every tile
    regs().configured = true;
  }
  static void end() { regs().configured = false; }
  template <int t>
  static void load(const void* p, int64_t stride) {
    Regs& g = configured_regs();
    for (int r = 0; r < 16; ++r) std::memcpy(g.t[t][r], static_cast<const char*>(p) + r * stride, 64);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    Regs& g = configured_regs();
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(p) + r * stride, g.t[t][r], 64);
  }
  template <int t>
  static void zero() {
    Regs& g = configured_regs();
    std::memset(g.t[t], 0, sizeof g.t[t]);
  }
  template <int c, int a, int b>
  static void dot() {
    Regs& g = configured_regs();
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float acc;
        std::memcpy(&acc, &g.t[c][m][4 * n], 4);
        for (int w = 0; w < 16; ++w) {
          bf16 a0, a1, b0, b1;
          std::memcpy(&a0, &g.t[a][m][4 * w], 2);
          std::memcpy(&a1, &g.t[a][m][4 * w + 2], 2);
          std::memcpy(&b0, &g.t[b][w][4 * n], 2);
          std::memcpy(&b1, &g.t[b][w][4 * n + 2], 2);
          acc += to_float(a0) * to_float(b0);
          acc += to_float(a1) * to_float(b1);
        }
        std::memcpy(&g.t[c][m][4 * n], &acc, 4);
      }
  }
};

template <class TileOps>
struct AmxMicro {
  static constexpr Isa isa = Isa::amx;
  static constexpr int64_t kK = 32; // one tile of A holds 32 k

  static Tiles tiles(const core::Problem& p, bool backward) {
    return choose_tiles(isa, p.head_dim, p.head_dim_v, backward);
  }
  // The tile configuration of a thread's work items: gemm runs only between the two.
  static void begin() { TileOps::begin(); }
  static void end() { TileOps::end(); }

  // A 16 x 16 block of C at (r0, c0): in place when it lies inside [m][n], else through `edge`.
  struct Block {
    float* ptr;
    int64_t stride;
    int rows, cols;
  };
  static Block block(float* c, int64_t ldc, int64_t m, int64_t n, int64_t r0, int64_t c0, float* edge) {
    const int rows = static_cast<int>(min64(16, m - r0)), cols = static_cast<int>(min64(16, n - c0));
    if (rows == 16 && cols == 16) return {c + r0 * ldc + c0, ldc * 4, 16, 16};
    return {edge, 64, rows, cols};
  }

  template <int t>
  static void load_c(const Block& blk, const float* c, int64_t ldc, bool acc) {
    if (!acc) {
      TileOps::template zero<t>();
      return;
    }
    if (blk.rows < 16 || blk.cols < 16) {
      std::memset(blk.ptr, 0, 16 * 64);
      for (int r = 0; r < blk.rows; ++r) std::memcpy(blk.ptr + r * 16, c + r * ldc, blk.cols * sizeof(float));
    }
    TileOps::template load<t>(blk.ptr, blk.stride);
  }

  template <int t>
  static void store_c(const Block& blk, float* c, int64_t ldc) {
    TileOps::template store<t>(blk.ptr, blk.stride);
    if (blk.rows < 16 || blk.cols < 16)
      for (int r = 0; r < blk.rows; ++r) std::memcpy(c + r * ldc, blk.ptr + r * 16, blk.cols * sizeof(float));
  }

  // C[m][n] = (acc ? row_scale * C : 0) + (A + A_lo) B; A, A_lo bf16 [>= round_up(m, 16)][kk] (lda),
  // B VNNI [kk/2][ldb] with >= round_up(n, 16) columns, kk a multiple of 32.
  // Blocks of 32 x 32 of C in four tiles (0-3), A in tiles 4-5, B in tiles 6-7; an edge block of C
  // goes through a 16 x 16 buffer so nothing outside [m][n] is read or written. Between begin() and
  // end() of the calling thread.
  static void gemm(int64_t m, int64_t n, int64_t kk, const bf16* a, const bf16* a_lo, int64_t lda, const bf16* b,
                   int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale) {
    if (acc && row_scale)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t x = 0; x < n; x += 16) {
          const __mmask16 in = V512::first_lanes(static_cast<int>(min64(16, n - x)));
          float* p = c + r * ldc + x;
          _mm512_mask_storeu_ps(p, in, _mm512_mul_ps(_mm512_maskz_loadu_ps(in, p), _mm512_set1_ps(row_scale[r])));
        }
    alignas(64) float edge[4][16 * 16];
    for (int64_t r0 = 0; r0 < m; r0 += 32)
      for (int64_t c0 = 0; c0 < n; c0 += 32) {
        const bool two_rows = r0 + 16 < m, two_cols = c0 + 16 < n;
        const Block c00 = block(c, ldc, m, n, r0, c0, edge[0]);
        const Block c01 = block(c, ldc, m, n, r0, c0 + 16, edge[1]);
        const Block c10 = block(c, ldc, m, n, r0 + 16, c0, edge[2]);
        const Block c11 = block(c, ldc, m, n, r0 + 16, c0 + 16, edge[3]);
        load_c<0>(c00, c + r0 * ldc + c0, ldc, acc);
        if (two_cols) load_c<1>(c01, c + r0 * ldc + c0 + 16, ldc, acc);
        if (two_rows) load_c<2>(c10, c + (r0 + 16) * ldc + c0, ldc, acc);
        if (two_rows && two_cols) load_c<3>(c11, c + (r0 + 16) * ldc + c0 + 16, ldc, acc);
        for (int64_t k0 = 0; k0 < kk; k0 += 32) {
          TileOps::template load<6>(b + (k0 / 2) * ldb + 2 * c0, ldb * 2);
          if (two_cols) TileOps::template load<7>(b + (k0 / 2) * ldb + 2 * (c0 + 16), ldb * 2);
          const bf16* const parts[2] = {a, a_lo};
          for (const bf16* src : parts) {
            if (!src) continue;
            TileOps::template load<4>(src + r0 * lda + k0, lda * 2);
            if (two_rows) TileOps::template load<5>(src + (r0 + 16) * lda + k0, lda * 2);
            TileOps::template dot<0, 4, 6>();
            if (two_cols) TileOps::template dot<1, 4, 7>();
            if (two_rows) TileOps::template dot<2, 5, 6>();
            if (two_rows && two_cols) TileOps::template dot<3, 5, 7>();
          }
        }
        store_c<0>(c00, c + r0 * ldc + c0, ldc);
        if (two_cols) store_c<1>(c01, c + r0 * ldc + c0 + 16, ldc);
        if (two_rows) store_c<2>(c10, c + (r0 + 16) * ldc + c0, ldc);
        if (two_rows && two_cols) store_c<3>(c11, c + (r0 + 16) * ldc + c0 + 16, ldc);
      }
  }
};

} // namespace

const KernelSet& kernels_amx(core::DType dtype, bool emulated) {
  if (dtype != core::DType::bf16) return kernels_avx512(dtype);
  if (emulated) return kernel_set_of<MathBf16<AmxMicro<EmulatedTiles>>>();
  return kernel_set_of<MathBf16<AmxMicro<RealTiles>>>();
}

} // namespace flashback::cpu
