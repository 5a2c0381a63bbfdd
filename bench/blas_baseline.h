// The baseline a user would otherwise write: materialized attention on a BLAS (OpenBLAS sgemm), one
// head at a time, with the full Sq x Sk score matrix in memory. Same inputs and outputs as flashback
// (contiguous BHSD, f32, no mask or causal), same five matrix products in the backward.
#pragma once

#include <cstdint>
#include <vector>

struct BlasShape {
  int64_t batch, heads, seqlen_q, seqlen_k, head_dim;
  bool causal;
};

class BlasAttention {
 public:
  explicit BlasAttention(const BlasShape& s);
  // o, lse from q, k, v.
  void forward(const float* q, const float* k, const float* v, float* o, float* lse);
  // dq, dk, dv from dout, q, k, v, o, lse: S = QK^T, P = exp(scale S - lse) recomputed, then
  // dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO o)), dQ = scale dS K, dK = scale dS^T Q.
  void backward(const float* dout, const float* q, const float* k, const float* v, const float* o,
                const float* lse, float* dq, float* dk, float* dv);

 private:
  BlasShape s_;
  float scale_;
  std::vector<float> scores_, dscores_; // [Sq, Sk] each: the O(N^2) memory flashback avoids
};

// Sets OpenBLAS's thread count (no-op for other BLAS libraries).
void blas_set_threads(int threads);
