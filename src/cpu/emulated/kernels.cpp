// FLASHBACK_EMULATION (cpu/isa.h): the avx512 level's f32 kernels (MicroF32 at 16 lanes, avx512's
// tiles) over V512Pairs on a machine without AVX-512; the avx512bf16 level's bf16 kernels (MathBf16
// over DotBf16Micro) over V512Pairs, vdpbf16ps in software and the portable packing below on a machine
// without AVX512_BF16; and the amx level's bf16 kernels (MathBf16 over AmxMicro) over V512Pairs,
// emulated tiles and the same packing. The same code as on real hardware above the vector operations, the tile instructions
// and the packing, which only real hardware runs. For tests; slow. Compiled with the avx2 flags only.
#include <cstring>

#include "cpu/amx/amx_micro.h"
#include "cpu/dot_bf16_micro.h"
#include "cpu/emulated/v512_pairs.h"
#include "cpu/math_bf16.h"
#include "cpu/math_f32.h"
#include "cpu/micro_f32.h"

namespace flashback::cpu {
namespace {

// avx512/pack_bf16.h's operations element by element: the same operand formats, padding and rounding
// to nearest even (from_float; VCVTNEPS2BF16 also flushes subnormals, which this does not).
struct PackBf16Portable {
  // A value of storage as bf16: bf16 as it is, f16 as its hi or lo part (pack_bf16.h).
  static bf16 part(bf16 x, bool /*lo*/) { return x; }
  static bf16 part(f16 x, bool lo) {
    bf16 hi, low;
    split(to_float(x), &hi, &low);
    return lo ? low : hi;
  }
  // dst [rows_pad][width] (row stride ldd) = src [rows][cols], zeros beyond.
  template <class S>
  static void rows(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldd, int64_t width,
                   int64_t rows_pad, bool lo = false) {
    for (int64_t r = 0; r < rows_pad; ++r)
      for (int64_t c = 0; c < width; ++c)
        dst[r * ldd + c] = r < rows && c < cols ? part(src[r * lds + c], lo) : bf16{};
  }
  // dst [cols_pad][width] (row stride ldd) = (src [rows][cols])^T, zeros beyond.
  template <class S>
  static void rows_t(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldd, int64_t width,
                     int64_t cols_pad, bool lo = false) {
    for (int64_t c = 0; c < cols_pad; ++c)
      for (int64_t r = 0; r < width; ++r)
        dst[c * ldd + r] = r < rows && c < cols ? part(src[r * lds + c], lo) : bf16{};
  }
  // B(k, n) = src[n][k] in the VNNI format, for k < k_pad and n < n_pad.
  template <class S>
  static void vnni_t(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb,
                     int64_t k_pad, int64_t n_pad, bool lo = false) {
    for (int64_t k = 0; k < k_pad; ++k)
      for (int64_t n = 0; n < n_pad; ++n)
        dst[(k / 2) * ldb + 2 * n + k % 2] = n < rows && k < cols ? part(src[n * lds + k], lo) : bf16{};
  }
  // B(k, n) = src[k][n] in the VNNI format, for k < k_pad and n < n_pad.
  template <class S>
  static void vnni(const S* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb, int64_t k_pad,
                   int64_t n_pad, bool lo = false) {
    for (int64_t k = 0; k < k_pad; ++k)
      for (int64_t n = 0; n < n_pad; ++n)
        dst[(k / 2) * ldb + 2 * n + k % 2] = k < rows && n < cols ? part(src[k * lds + n], lo) : bf16{};
  }
  // An f16 value as hi + lo, both rounded to nearest (exact: pack_bf16.h).
  static void split(float x, bf16* hi, bf16* lo) {
    *hi = from_float<bf16>(x);
    *lo = from_float<bf16>(x - to_float(*hi));
  }
  // P or dS's hi part as pack_bf16.h takes it, x truncated to bf16, at hi (and at hi + again when
  // again is not 0); returns x - hi, exact.
  static float truncate(float x, bf16* hi, int64_t again) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint16_t top = static_cast<uint16_t>(u >> 16);
    std::memcpy(hi, &top, sizeof top);
    if (again) hi[again] = *hi;
    u &= 0xFFFF0000u;
    float h;
    std::memcpy(&h, &u, sizeof h);
    return x - h;
  }
  // P or dS as hi + lo as split32 splits them: lo = x - hi rounded to nearest (even).
  static void split(float x, bf16* hi, bf16* lo, int64_t again) { *lo = from_float<bf16>(truncate(x, hi, again)); }
  // The first min(n, 32) of x0's lanes and then x1's as hi + lo; hi also at hi + again when again is
  // not 0.
  static void split32(V512Pairs::reg x0, V512Pairs::reg x1, bf16* hi, bf16* lo, int64_t n, int64_t again = 0) {
    float v[32];
    V512Pairs::storeu(v, x0);
    V512Pairs::storeu(v + 16, x1);
    for (int64_t i = 0; i < n && i < 32; ++i) split(v[i], hi + i, lo + i, again);
  }
  // P or dS as hi + lo as pack_bf16.h's split_pairs splits them: lo = x - hi rounded to nearest with
  // ties away from zero (half an ulp added to the bits).
  static void split_pair(float x, bf16* hi, bf16* lo, int64_t again) {
    const float l = truncate(x, hi, again);
    uint32_t u;
    std::memcpy(&u, &l, sizeof u);
    const uint16_t rounded = static_cast<uint16_t>((u + 0x8000u) >> 16);
    std::memcpy(lo, &rounded, sizeof rounded);
  }
  // Rows k and k + 1 (x, y) as one row of B's VNNI words, split pair by pair.
  static void split_pairs(V512Pairs::reg x, V512Pairs::reg y, bf16* hi, bf16* lo, int64_t again = 0) {
    float a[16], b[16];
    V512Pairs::storeu(a, x);
    V512Pairs::storeu(b, y);
    for (int i = 0; i < 16; ++i) {
      split_pair(a[i], hi + 2 * i, lo + 2 * i, again);
      split_pair(b[i], hi + 2 * i + 1, lo + 2 * i + 1, again);
    }
  }
};

// vdpbf16ps in software for DotBf16Micro: per lane, acc + the odd pair's product, then + the even one's,
// in the order the Intel SDM gives; each bf16 widened to f32 exactly (a shift), each product exact, so
// each FMA rounds only its sum as the instruction does; like it, inputs below 2^-126 (subnormal)
// count as zero (sums below it are kept, as Zen 5 keeps them; Zen 4 flushes them to zero).
struct PairWords {
  struct reg {
    __m256i lo, hi; // words 0-7, 8-15
  };
  static reg load(const bf16* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
  }
  static reg broadcast(const bf16* p) {
    int32_t w;
    std::memcpy(&w, p, sizeof w);
    return {_mm256_set1_epi32(w), _mm256_set1_epi32(w)};
  }
  // x, or 0 where x is subnormal (exponent field 0).
  static __m256 flush(__m256 x) {
    const __m256i exponent = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7F800000));
    const __m256i zero_exponent = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
    return _mm256_andnot_ps(_mm256_castsi256_ps(zero_exponent), x);
  }
  static __m256 even(__m256i w) { return flush(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))); }
  static __m256 odd(__m256i w) { return flush(_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)))); }
  static __m256 dot8(__m256 acc, __m256i a, __m256i b) {
    return _mm256_fmadd_ps(even(a), even(b), _mm256_fmadd_ps(odd(a), odd(b), acc));
  }
  static V512Pairs::reg dot(V512Pairs::reg acc, reg a, reg b) { return {dot8(acc.lo, a.lo, b.lo), dot8(acc.hi, a.hi, b.hi)}; }
};

} // namespace

const KernelSet& kernels_emulated(Isa isa, core::DType dtype) {
  if (isa >= Isa::avx512bf16 && dtype == core::DType::bf16 && bf16_dot_preferred())
    return kernel_set_of<MathBf16<DotBf16Micro<V512Pairs, PairWords, PackBf16Portable>>>();
  if (isa >= Isa::amx && dtype == core::DType::bf16)
    return kernel_set_of<MathBf16<AmxMicro<EmulatedTiles, V512Pairs, PackBf16Portable>>>();
  if (isa >= Isa::amx && dtype == core::DType::f16)
    return kernel_set_of<MathBf16<AmxMicro<EmulatedTiles, V512Pairs, PackBf16Portable>, f16>>();
  return f32_kernel_set<IsaMicroF32<V512Pairs, Isa::avx512>>(dtype);
}

} // namespace flashback::cpu
