// The "naive" of FlashAttention's accuracy rule for half precision (hopper/test_flash_attn.py):
//   max |out - ref64| <= 2 * max |naive - ref64| + 1e-5 * max |ref64|.
// A straightforward attention in f32 from the half-precision values: the whole score row at once,
// plain sequential sums, no blocks, no online softmax. Written from the definitions, independent of
// the library's code. The caller rounds o, dq, dk, dv to the storage type (fbtest::round_to); lse and
// delta stay f32, as in the library. The float64 reference (reference.h) remains the one truth; this
// only measures what f32 arithmetic on these inputs costs, to set the bar.
#pragma once

#include <vector>

#include "reference.h"

namespace naive {

// q [B,Hq,Sq,D], k [B,Hk,Sk,D], v [B,Hk,Sk,Dv] -> o [B,Hq,Sq,Dv], lse [B,Hq,Sq] (natural log; -inf and
// o = 0 for a row that sees no key).
void forward(const ref::Shape& s, const ref::Options& opt, const std::vector<float>& q, const std::vector<float>& k,
             const std::vector<float>& v, std::vector<float>& o, std::vector<float>& lse);

// The backward from the same inputs as the library's: dout, q, k, v and the forward's o and lse as
// given (P = exp(scale q.k - lse), delta = rowsum(dout * o)). dq, dk, dv like q, k, v; delta [B,Hq,Sq].
void backward(const ref::Shape& s, const ref::Options& opt, const std::vector<float>& dout,
              const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
              const std::vector<float>& o, const std::vector<float>& lse, std::vector<float>& dq,
              std::vector<float>& dk, std::vector<float>& dv, std::vector<float>& delta);

} // namespace naive
