// The polynomial of every vector exp2 (avx2/v256.h, avx512/v512.h): 2^f for |f| <= 1/2 by its degree-6
// Taylor polynomial (relative error below 1.2e-7), coefficients from the highest degree down, for
// Horner's rule; each level then multiplies by 2^n in its own way.
#pragma once

namespace flashback::cpu {

inline constexpr float kExp2Poly[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                       5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f,
                                       1.0f};

} // namespace flashback::cpu
