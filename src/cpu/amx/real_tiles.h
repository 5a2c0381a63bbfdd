// The real AMX tile instructions, as the tile-operations policy of amx_micro.h (RealTiles) and the
// tile configuration they run under. Internal linkage; included only by translation units compiled
// with the amx level's flags (AMX-TILE, AMX-BF16): amx/kernels.cpp and the benchmark's kernel probe.
#pragma once

#include <immintrin.h>

#include <cstdint>

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
} // namespace flashback::cpu
