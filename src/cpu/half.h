// bf16 and f16 storage types and their exact scalar conversions (round to nearest even, NaN kept
// quiet), for the CPU backend. Internal linkage, no std:: templates: included by ISA translation units.
#pragma once

#include <cstdint>
#include <cstring>

namespace flashback::cpu {
namespace {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return float_of(static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(f16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1Fu, man = x.bits & 0x3FFu;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (man << 13)); // inf, NaN
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (man << 13));
  // subnormal: man * 2^-24, exact in float
  const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

template <class T>
T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

template <>
inline bf16 from_float<bf16>(float x) {
  const uint32_t u = bits_of(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)}; // quiet NaN
  return {static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

template <>
inline f16 from_float<f16>(float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return {static_cast<uint16_t>(sign | 0x7E00u)}; // NaN
  if (a >= 0x477FF000u) return {static_cast<uint16_t>(sign | 0x7C00u)}; // rounds to >= 65520: inf
  if (a < 0x38800000u) { // below 2^-14: subnormal or zero; round(|x| * 2^24) to even
    const float scaled = float_of(a) * 16777216.0f; // exact: a power of two
    uint32_t m = static_cast<uint32_t>(scaled);
    const float frac = scaled - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return {static_cast<uint16_t>(sign | m)};
  }
  // normal: drop 13 mantissa bits with round to nearest even; a carry into the exponent is right.
  const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
  return {static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

} // namespace
} // namespace flashback::cpu
