// The AMX microkernel of math_bf16.h, written over a tile-operations policy (TileOps) and the
// 16-lane vector and packing it runs with: amx/kernels.cpp instantiates it with the real tile
// instructions (RealTiles, there) and with EmulatedTiles over real AVX-512, emulated/kernels.cpp with
// EmulatedTiles over AVX-512 emulated on AVX2 (FLASHBACK_EMULATION, cpu/isa.h). No AMX instruction
// here: EmulatedTiles does the tile arithmetic on arrays, so that the AMX code path (blocking,
// padding, edges, per-thread configuration) is exercised and tested on machines without AMX (slow:
// for tests only). Internal linkage.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/blocks.h"
#include "cpu/half.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

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
  // Element (m, n) adds A(m, 2w) B(w, 2n), then A(m, 2w + 1) B(w, 2n + 1), for w = 0, 1, ..., 15 in
  // turn; the loops run n innermost, over B's even and odd elements apart (every element still in that
  // order: the same bits), which the compiler vectorizes. Only the tile registers are read and written
  // here, at indices the loops fix, so the sanitizers are left out of it: under AddressSanitizer this
  // loop took 82% of the time of the tests on emulated tiles, which took a third of the sanitized
  // suite (scripts/test.sh). load() and store(), which touch the caller's memory, stay checked.
  // It calls no function: GCC inlines no instrumented function (half.h's to_float, say) into one built
  // without the sanitizers, and each such call, with its instrumented local, took more of the sanitized
  // time on emulated tiles than these loops (measured: 57% of amx_emulated's f16 non-finite test).
  // A bf16 becomes an f32 exactly as the bits of its upper half.
  template <int c, int a, int b>
  __attribute__((no_sanitize("address", "undefined"))) static void dot() {
    Regs& g = configured_regs();
    uint32_t abits[16][32], even_bits[16][16], odd_bits[16][16];
    for (int r = 0; r < 16; ++r)
      for (int x = 0; x < 32; ++x) {
        uint16_t ha, hb;
        std::memcpy(&ha, &g.t[a][r][2 * x], 2);
        std::memcpy(&hb, &g.t[b][r][2 * x], 2);
        abits[r][x] = static_cast<uint32_t>(ha) << 16;
        (x % 2 ? odd_bits : even_bits)[r][x / 2] = static_cast<uint32_t>(hb) << 16;
      }
    float af[16][32], even[16][16], odd[16][16], cf[16][16]; // A (m, k), B (pair w, n) by k % 2, C
    std::memcpy(af, abits, sizeof af);
    std::memcpy(even, even_bits, sizeof even);
    std::memcpy(odd, odd_bits, sizeof odd);
    std::memcpy(cf, g.t[c], sizeof cf);
    for (int m = 0; m < 16; ++m)
      for (int w = 0; w < 16; ++w) {
        const float a0 = af[m][2 * w], a1 = af[m][2 * w + 1];
        for (int n = 0; n < 16; ++n) {
          cf[m][n] += a0 * even[w][n];
          cf[m][n] += a1 * odd[w][n];
        }
      }
    std::memcpy(g.t[c], cf, sizeof cf);
  }
};

template <class TileOps, class Vec, class PackOps>
struct AmxMicro {
  using V = Vec;
  using Pack = PackOps;
  static constexpr Isa isa = Isa::amx;
  static constexpr int64_t kK = 32; // one tile of A holds 32 k
  // Query blocks of up to 24 rows take the backward's products with P and dS in f32 (math_bf16.h),
  // where hi + lo tiles pad their k to 32 and double it. Measured on a Xeon with AMX (Hq = 32, Hk = 8,
  // Sk = 8192, D = 128, side by side, 8 rounds), f32 products took 0.80x the time of the tiles at 16
  // rows, 0.91x at 24, 1.14x at 32.
  static constexpr int64_t kF32Rows = 24;

  static Tiles tiles(const core::Problem& p, bool backward) {
    return tiles_of(isa, p, backward);
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

  // C tile t from memory (acc), or zero.
  template <int t>
  static void init_c(const float* c, int64_t stride, bool acc) {
    if (acc) TileOps::template load<t>(c, stride);
    else TileOps::template zero<t>();
  }

  // One k segment of gemm_sum: A, A_lo, B, B_lo as in gemm.
  struct Segment {
    const bf16 *a, *a_lo, *b, *b_lo;
  };

  // The whole 32 x 32 blocks of C (four tiles each, in place) of the first mf rows and nf columns
  // (multiples of 32), in rows or columns of blocks (below), each over the k steps of every segment in
  // turn, straight-line. The tiles are not renamed: a load into a tile waits for the instructions that
  // read it. So each k step's loads are issued right after the
  // last product that reads the tile they overwrite, while the other products run (1.02 - 1.07x the
  // rate of loading at the top of each step), and the blocks are pipelined: in a block's last k step
  // each C tile is stored right after its last product and the next block's C tile (zeroed or
  // loaded), A and B tiles follow as their tiles come free, so that the stores and the next block's
  // loads overlap the last products rather than follow them. Measured on the Xeon with AMX, operands
  // in L1, against the register-only TDPBF16PS rate: C loaded, k = 64 / 128 / 256: 0.35 / 0.52 / 0.67
  // of it block by block, 0.51 / 0.67 / 0.79 pipelined; C zeroed, k = 128: 0.77 and 0.81.
  template <bool kLo, bool kLoB>
  static void full_blocks(int64_t mf, int64_t nf, int64_t kk, const Segment* seg, int64_t nseg, int64_t lda,
                          int64_t ldb, float* c, int64_t ldc, bool acc) {
    const int64_t sa = lda * 2, sb = ldb * 2, sc = ldc * 4, cols = nf / 32, blocks = mf / 32 * cols;
    if (blocks == 0) return;
    // Blocks in rows of blocks, or in columns of blocks where B's panel is the larger operand (the
    // forward's S = Q K^T: 64 query rows, 128 or 256 keys): then each B tile is loaded from L2 once
    // per pair of block rows rather than once per block row.
    const int64_t rows = mf / 32;
    const bool by_cols = nf * (kLoB ? 2 : 1) > mf * (kLo ? 2 : 1);
    struct At {
      int64_t a, b; // offsets of the block's rows of A and columns of B
      float* c;
    };
    auto at = [&](int64_t i) {
      const int64_t r0 = (by_cols ? i % rows : i / cols) * 32, c0 = (by_cols ? i / rows : i % cols) * 32;
      return At{r0 * lda, 2 * c0, c + r0 * ldc + c0};
    };
    // The operands of a block's k step (32 k) at k0 of segment g.
    const int64_t steps = nseg * (kk / 32);
    struct Step {
      const bf16 *a, *a_lo, *b, *b_lo;
    };
    auto step = [&](const At& x, int64_t g, int64_t k0) {
      const Segment& sg = seg[g];
      return Step{sg.a + x.a + k0, kLo ? sg.a_lo + x.a + k0 : nullptr, sg.b + x.b + k0 / 2 * ldb,
                  kLoB ? sg.b_lo + x.b + k0 / 2 * ldb : nullptr};
    };
    At x = at(0);
    init_c<0>(x.c, sc, acc);
    init_c<1>(x.c + 16, sc, acc);
    init_c<2>(x.c + 16 * ldc, sc, acc);
    init_c<3>(x.c + 16 * ldc + 16, sc, acc);
    Step f = step(x, 0, 0);
    TileOps::template load<4>(f.a, sa);
    TileOps::template load<6>(f.b, sb);
    TileOps::template load<7>(f.b + 32, sb);
    TileOps::template load<5>(f.a + 16 * lda, sa);
    for (int64_t i = 0; i < blocks; ++i) {
      const bool next = i + 1 < blocks;
      const At y = next ? at(i + 1) : x;
      for (int64_t s = 0, g = 0, k0 = 0; s < steps; ++s) {
        const Step k = step(x, g, k0);
        k0 += 32;
        if (k0 == kk) { // the next step's segment
          k0 = 0;
          ++g;
        }
        if constexpr (kLo) { // A's hi rows first, then its lo rows, with the same B tiles
          TileOps::template dot<0, 4, 6>();
          TileOps::template dot<1, 4, 7>();
          TileOps::template load<4>(k.a_lo, sa);
          TileOps::template dot<2, 5, 6>();
          TileOps::template dot<3, 5, 7>();
          TileOps::template load<5>(k.a_lo + 16 * lda, sa);
        }
        if constexpr (kLoB) { // B's hi columns first, then its lo columns, with the same A tiles
          TileOps::template dot<0, 4, 6>();
          TileOps::template dot<2, 5, 6>();
          TileOps::template load<6>(k.b_lo, sb);
          TileOps::template dot<1, 4, 7>();
          TileOps::template dot<3, 5, 7>();
          TileOps::template load<7>(k.b_lo + 32, sb);
        }
        if (s + 1 < steps) {
          const Step n = step(x, g, k0);
          TileOps::template dot<0, 4, 6>();
          TileOps::template dot<1, 4, 7>();
          TileOps::template load<4>(n.a, sa);
          TileOps::template dot<2, 5, 6>();
          TileOps::template load<6>(n.b, sb);
          TileOps::template dot<3, 5, 7>();
          TileOps::template load<7>(n.b + 32, sb);
          TileOps::template load<5>(n.a + 16 * lda, sa);
          continue;
        }
        // The last k step: this block's stores, the next block's first tiles.
        if (next) f = step(y, 0, 0);
        TileOps::template dot<0, 4, 6>();
        TileOps::template store<0>(x.c, sc);
        TileOps::template dot<1, 4, 7>();
        if (next) TileOps::template load<4>(f.a, sa);
        TileOps::template store<1>(x.c + 16, sc);
        if (next) init_c<0>(y.c, sc, acc);
        TileOps::template dot<2, 5, 6>();
        if (next) TileOps::template load<6>(f.b, sb);
        TileOps::template store<2>(x.c + 16 * ldc, sc);
        if (next) init_c<1>(y.c + 16, sc, acc);
        TileOps::template dot<3, 5, 7>();
        if (next) {
          TileOps::template load<7>(f.b + 32, sb);
          TileOps::template load<5>(f.a + 16 * lda, sa);
        }
        TileOps::template store<3>(x.c + 16 * ldc + 16, sc);
        if (next) {
          init_c<2>(y.c + 16 * ldc, sc, acc);
          init_c<3>(y.c + 16 * ldc + 16, sc, acc);
        }
      }
      x = y;
    }
  }

  // C[m][n] = (acc ? row_scale * C : 0) + (A + A_lo) (B + B_lo); A, A_lo bf16 [>= round_up(m, 16)][kk]
  // (lda), B, B_lo VNNI [kk/2][ldb] with >= round_up(n, 16) columns, kk a multiple of 32; a_lo and
  // b_lo may be null, not both given. Between begin() and end() of the calling thread.
  static void gemm(int64_t m, int64_t n, int64_t kk, const bf16* a, const bf16* a_lo, int64_t lda, const bf16* b,
                   int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale, const bf16* b_lo = nullptr) {
    const Segment seg{a, a_lo, b, b_lo};
    gemm_sum(m, n, kk, &seg, 1, lda, ldb, c, ldc, acc, row_scale);
  }

  // C[m][n] = (acc ? row_scale * C : 0) + the sum over the nseg segments, in order, of (A + A_lo) (B +
  // B_lo), each over kk; every segment with the same of a_lo and b_lo given (at most one of the two).
  // The same bits as gemm on each segment in turn (the tiles accumulate in the same order; C only
  // stays in its tiles across them).
  // Blocks of 32 x 32 of C in four tiles (0-3), A in tiles 4-5, B in tiles 6-7; the whole blocks run
  // full_blocks, an edge block (the last row or column of blocks, when m or n is not a multiple of 32)
  // the general code below, its partial tiles through 16 x 16 buffers so that nothing outside [m][n]
  // is read or written.
  static void gemm_sum(int64_t m, int64_t n, int64_t kk, const Segment* seg, int64_t nseg, int64_t lda, int64_t ldb,
                       float* c, int64_t ldc, bool acc, const float* row_scale) {
    if (acc && row_scale)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t x = 0; x < n; x += 16) {
          const int lanes = static_cast<int>(min64(16, n - x));
          float* p = c + r * ldc + x;
          V::store(p, V::mul(V::load(p, lanes), V::set1(row_scale[r])), lanes);
        }
    const int64_t mf = kk > 0 && nseg > 0 ? m / 32 * 32 : 0, nf = n / 32 * 32; // no k: all in the general code
    if (mf > 0 && seg[0].a_lo) full_blocks<true, false>(mf, nf, kk, seg, nseg, lda, ldb, c, ldc, acc);
    else if (mf > 0 && seg[0].b_lo) full_blocks<false, true>(mf, nf, kk, seg, nseg, lda, ldb, c, ldc, acc);
    else full_blocks<false, false>(mf, nf, kk, seg, nseg, lda, ldb, c, ldc, acc);
    alignas(64) float edge[4][16 * 16];
    for (int64_t r0 = 0; r0 < m; r0 += 32)
      for (int64_t c0 = r0 < mf ? nf : 0; c0 < n; c0 += 32) { // the blocks full_blocks left
        const bool two_rows = r0 + 16 < m, two_cols = c0 + 16 < n;
        const Block c00 = block(c, ldc, m, n, r0, c0, edge[0]);
        const Block c01 = block(c, ldc, m, n, r0, c0 + 16, edge[1]);
        const Block c10 = block(c, ldc, m, n, r0 + 16, c0, edge[2]);
        const Block c11 = block(c, ldc, m, n, r0 + 16, c0 + 16, edge[3]);
        load_c<0>(c00, c + r0 * ldc + c0, ldc, acc);
        if (two_cols) load_c<1>(c01, c + r0 * ldc + c0 + 16, ldc, acc);
        if (two_rows) load_c<2>(c10, c + (r0 + 16) * ldc + c0, ldc, acc);
        if (two_rows && two_cols) load_c<3>(c11, c + (r0 + 16) * ldc + c0 + 16, ldc, acc);
        for (int64_t g = 0; g < nseg; ++g)
          for (int64_t k0 = 0; k0 < kk; k0 += 32)
            for (const bf16* bsrc : {seg[g].b, seg[g].b_lo}) {
              if (!bsrc) continue;
              TileOps::template load<6>(bsrc + (k0 / 2) * ldb + 2 * c0, ldb * 2);
              if (two_cols) TileOps::template load<7>(bsrc + (k0 / 2) * ldb + 2 * (c0 + 16), ldb * 2);
              for (const bf16* src : {seg[g].a, seg[g].a_lo}) {
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
} // namespace flashback::cpu
