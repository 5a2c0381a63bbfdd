// The polynomial of every vector exp2 (avx2/v256.h, avx512/v512.h): 2^f for |f| <= 1/2 by the degree-5
// polynomial of least maximum relative error (Remez exchange, 7.5e-8 in exact arithmetic) with its
// constant term rounded to 1, so that 2^0 = 1 exactly. In f32 Horner steps (FMA), every f32 f in
// [-1/2, 1/2] compared with exp2 in double: relative error at most 2.21e-7, against 2.25e-7 for the
// degree-6 Taylor polynomial used before (one FMA more per vector). Coefficients from the highest
// degree down, for Horner's rule; each level then multiplies by 2^n in its own way.
#pragma once

namespace flashback::cpu {

inline constexpr float kExp2Poly[6] = {1.3276472167819943e-3f, 9.6755413310213911e-3f, 5.5507132728753912e-2f,
                                       2.4022119723969178e-1f, 6.9314696706526493e-1f, 1.0f};
inline constexpr int kExp2Terms = static_cast<int>(sizeof kExp2Poly / sizeof kExp2Poly[0]);

} // namespace flashback::cpu
