#include "blas_baseline.h"

#include <cblas.h>
#include <omp.h>

#include <cmath>
#include <limits>

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

void blas_set_threads(int threads) {
  if (openblas_set_num_threads) openblas_set_num_threads(threads);
}

BlasAttention::BlasAttention(const BlasShape& s)
    : s_(s), scale_(1.0f / std::sqrt(static_cast<float>(s.head_dim))),
      scores_(s.seqlen_q * s.seqlen_k), dscores_(s.seqlen_q * s.seqlen_k) {}

namespace {

// Causal (bottom-right) entries above the diagonal get -inf before the softmax.
bool masked(const BlasShape& s, int64_t i, int64_t j) { return s.causal && j > i + s.seqlen_k - s.seqlen_q; }

} // namespace

void BlasAttention::forward(const float* q, const float* k, const float* v, float* o, float* lse) {
  const int64_t sq = s_.seqlen_q, sk = s_.seqlen_k, d = s_.head_dim;
  for (int64_t bh = 0; bh < s_.batch * s_.heads; ++bh) {
    const float* qh = q + bh * sq * d;
    const float* kh = k + bh * sk * d;
    const float* vh = v + bh * sk * d;
    float* S = scores_.data();
    // S [Sq, Sk] = scale Q K^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, sq, sk, d, scale_, qh, d, kh, d, 0.0f, S, sk);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < sq; ++i) {
      float* row = S + i * sk;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < sk; ++j) {
        if (masked(s_, i, j)) row[j] = -std::numeric_limits<float>::infinity();
        mx = std::max(mx, row[j]);
      }
      float sum = 0;
      for (int64_t j = 0; j < sk; ++j) sum += (row[j] = std::exp(row[j] - mx));
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < sk; ++j) row[j] *= inv;
      lse[bh * sq + i] = mx + std::log(sum);
    }
    // O [Sq, D] = P V
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sq, d, sk, 1.0f, S, sk, vh, d, 0.0f, o + bh * sq * d, d);
  }
}

void BlasAttention::backward(const float* dout, const float* q, const float* k, const float* v, const float* o,
                             const float* lse, float* dq, float* dk, float* dv) {
  const int64_t sq = s_.seqlen_q, sk = s_.seqlen_k, d = s_.head_dim;
  for (int64_t bh = 0; bh < s_.batch * s_.heads; ++bh) {
    const float* qh = q + bh * sq * d;
    const float* kh = k + bh * sk * d;
    const float* vh = v + bh * sk * d;
    const float* gh = dout + bh * sq * d;
    const float* oh = o + bh * sq * d;
    float* P = scores_.data();
    float* dS = dscores_.data();
    // P [Sq, Sk] = exp(scale Q K^T - lse)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, sq, sk, d, scale_, qh, d, kh, d, 0.0f, P, sk);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t j = 0; j < sk; ++j)
        P[i * sk + j] = masked(s_, i, j) ? 0.0f : std::exp(P[i * sk + j] - lse[bh * sq + i]);
    // dV [Sk, D] = P^T dO;  dP [Sq, Sk] = dO V^T
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, sk, d, sq, 1.0f, P, sk, gh, d, 0.0f, dv + bh * sk * d, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, sq, sk, d, 1.0f, gh, d, vh, d, 0.0f, dS, sk);
    // dS = P (dP - rowsum(dO o))
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < sq; ++i) {
      float delta = 0;
      for (int64_t x = 0; x < d; ++x) delta += gh[i * d + x] * oh[i * d + x];
      for (int64_t j = 0; j < sk; ++j) dS[i * sk + j] = P[i * sk + j] * (dS[i * sk + j] - delta);
    }
    // dQ [Sq, D] = scale dS K;  dK [Sk, D] = scale dS^T Q
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sq, d, sk, scale_, dS, sk, kh, d, 0.0f, dq + bh * sq * d, d);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, sk, d, sq, scale_, dS, sk, qh, d, 0.0f, dk + bh * sk * d, d);
  }
}
