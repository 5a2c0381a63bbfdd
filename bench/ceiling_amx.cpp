// Compiled with -mamx-tile -mamx-bf16; called only when the CPU and the OS allow AMX (the library's
// probe has already asked Linux for the tile state).
#include <immintrin.h>
#include <omp.h>

#include <cstdint>

// TDPBF16PS on registers only: 4 accumulator tiles, 2 A and 2 B tiles loaded once (16 x 16 x 32
// multiply-adds per instruction).
double amx_probe(int threads, long iters) {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  };
  alignas(64) static const uint16_t ones[16 * 32] = {};
  double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    static const Config config;
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    for (long it = 0; it < iters; ++it) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
  }
  const double t = omp_get_wtime() - t0;
  return 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(iters) * threads / t;
}
