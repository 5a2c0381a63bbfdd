// A 16-lane f32 vector as two AVX2 vectors: V512's operations (avx512/v512.h) with the same lanes and
// register blocking (V512Shape), so that MicroF32, MathF32 and MathBf16 instantiated over it run the
// avx512 kernels' code (their tiles, edges, masks and remainders at 16 lanes) on a machine without
// AVX-512 (FLASHBACK_EMULATION, cpu/isa.h). For tests: the 24 accumulators of a 6 x 4 tile do not
// fit in 16 ymm registers. Each lane computes what V512 computes, except that exp2 flushes results
// below 2^-126 to zero (V256::exp2) where V512 keeps them, and sums reduce in another order.
// Included only by translation units compiled with the avx2 flags; internal linkage.
#pragma once

#include "cpu/avx2/v256.h"
#include "cpu/avx512/shape.h"

namespace flashback::cpu {
namespace {

struct V512Pairs : V512Shape {
  struct reg {
    __m256 lo, hi; // lanes 0-7, 8-15
  };
  struct mask {
    V256::mask lo, hi;
  };
  using H = V256;

  static reg zero() { return {H::zero(), H::zero()}; }
  static reg set1(float x) { return {H::set1(x), H::set1(x)}; }
  static reg loadu(const float* p) { return {H::loadu(p), H::loadu(p + 8)}; }
  static void storeu(float* p, reg x) {
    H::storeu(p, x.lo);
    H::storeu(p + 8, x.hi);
  }
  static mask first_lanes(int n) { return {H::first_lanes(n), H::first_lanes(n - 8)}; }
  // Masked-off lanes are neither read nor faulted on.
  static reg load_masked(const float* p, mask m) { return {H::load_masked(p, m.lo), H::load_masked(p + 8, m.hi)}; }
  static void store_masked(float* p, mask m, reg x) {
    H::store_masked(p, m.lo, x.lo);
    H::store_masked(p + 8, m.hi, x.hi);
  }
  // The first n (<= 16) elements at p, the other lanes 0; nothing past them is read.
  template <class T>
  static reg load(const T* p, int n) {
    return {H::load(p, n < 8 ? n : 8), n > 8 ? H::load(p + 8, n - 8) : H::zero()};
  }
  // The first n (<= 16) lanes stored at p, rounded as V512::store rounds; nothing past them is written.
  template <class T>
  static void store(T* p, reg x, int n) {
    H::store(p, x.lo, n < 8 ? n : 8);
    if (n > 8) H::store(p + 8, x.hi, n - 8);
  }
  static reg add(reg a, reg b) { return {H::add(a.lo, b.lo), H::add(a.hi, b.hi)}; }
  static reg sub(reg a, reg b) { return {H::sub(a.lo, b.lo), H::sub(a.hi, b.hi)}; }
  static reg mul(reg a, reg b) { return {H::mul(a.lo, b.lo), H::mul(a.hi, b.hi)}; }
  static reg fma(reg a, reg b, reg c) { return {H::fma(a.lo, b.lo, c.lo), H::fma(a.hi, b.hi, c.hi)}; }
  static reg fms(reg a, reg b, reg c) { return {H::fms(a.lo, b.lo, c.lo), H::fms(a.hi, b.hi, c.hi)}; }
  static reg max(reg a, reg b) { return {H::max(a.lo, b.lo), H::max(a.hi, b.hi)}; }
  static mask equal(reg a, reg b) { return {H::equal(a.lo, b.lo), H::equal(a.hi, b.hi)}; }
  static reg select(mask m, reg yes, reg no) {
    return {H::select(m.lo, yes.lo, no.lo), H::select(m.hi, yes.hi, no.hi)};
  }
  static float reduce_add(reg x) { return H::reduce_add(H::add(x.lo, x.hi)); }
  static float reduce_max(reg x) { return H::reduce_max(H::max(x.lo, x.hi)); }
  static float first(reg x) { return H::first(x.lo); }

  // Lanes i with lo <= base + step * i <= hi.
  static mask in_band(int32_t base, int32_t step, int32_t lo, int32_t hi) {
    return {H::in_band(base, step, lo, hi), H::in_band(base + 8 * step, step, lo, hi)};
  }

  static reg exp2(reg x) { return {H::exp2(x.lo), H::exp2(x.hi)}; }

  // In-register transpose of 16 rows of 16 floats: the four 8 x 8 quarters transposed, the two
  // off-diagonal ones swapped.
  static void transpose(reg (&r)[16]) {
    __m256 q[4][8]; // [row half * 2 + column half][row within the half]
    for (int i = 0; i < 8; ++i) {
      q[0][i] = r[i].lo;
      q[1][i] = r[i].hi;
      q[2][i] = r[i + 8].lo;
      q[3][i] = r[i + 8].hi;
    }
    for (auto& quarter : q) H::transpose(quarter);
    for (int i = 0; i < 8; ++i) {
      r[i] = {q[0][i], q[2][i]};
      r[i + 8] = {q[1][i], q[3][i]};
    }
  }
};

} // namespace
} // namespace flashback::cpu
