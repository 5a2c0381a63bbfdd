#include "naive.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace naive {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0;
  for (int64_t x = 0; x < n; ++x) sum += a[x] * b[x];
  return sum;
}

} // namespace

void forward(const ref::Shape& s, const ref::Options& opt, const std::vector<float>& q, const std::vector<float>& k,
             const std::vector<float>& v, std::vector<float>& o, std::vector<float>& lse) {
  const int64_t group = s.heads_q / s.heads_kv, d = s.head_dim, dv = s.head_dim_v;
  const float scale = static_cast<float>(ref::scale_of(s, opt));
  o.assign(s.batch * s.heads_q * s.seqlen_q * dv, 0.0f);
  lse.assign(s.batch * s.heads_q * s.seqlen_q, kNegInf);
  std::vector<float> p(s.seqlen_k); // one row of scores, then of exp(score - max)
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t kv = (b * s.heads_kv + h / group) * s.seqlen_k; // first key row of this head
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const int64_t row = (b * s.heads_q + h) * s.seqlen_q + i;
        float mx = kNegInf;
        for (int64_t j = 0; j < s.seqlen_k; ++j) {
          p[j] = ref::visible(s, opt, i, j) ? dot(&q[row * d], &k[(kv + j) * d], d) * scale : kNegInf;
          mx = std::max(mx, p[j]);
        }
        if (mx == kNegInf) continue; // sees no key: o = 0, lse = -inf
        float sum = 0;
        for (int64_t j = 0; j < s.seqlen_k; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        float* orow = &o[row * dv];
        for (int64_t j = 0; j < s.seqlen_k; ++j)
          for (int64_t x = 0; x < dv; ++x) orow[x] += p[j] * v[(kv + j) * dv + x];
        for (int64_t x = 0; x < dv; ++x) orow[x] /= sum;
        lse[row] = mx + std::log(sum);
      }
    }
}

void backward(const ref::Shape& s, const ref::Options& opt, const std::vector<float>& dout,
              const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
              const std::vector<float>& o, const std::vector<float>& lse, std::vector<float>& dq,
              std::vector<float>& dk, std::vector<float>& dv, std::vector<float>& delta) {
  const int64_t group = s.heads_q / s.heads_kv, d = s.head_dim, dvd = s.head_dim_v;
  const float scale = static_cast<float>(ref::scale_of(s, opt));
  dq.assign(q.size(), 0.0f);
  dk.assign(k.size(), 0.0f);
  dv.assign(v.size(), 0.0f);
  delta.assign(s.batch * s.heads_q * s.seqlen_q, 0.0f);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t kv = (b * s.heads_kv + h / group) * s.seqlen_k;
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const int64_t row = (b * s.heads_q + h) * s.seqlen_q + i;
        const float* g = &dout[row * dvd];
        delta[row] = dot(g, &o[row * dvd], dvd);
        if (lse[row] == kNegInf) continue; // sees no key: no gradient
        for (int64_t j = 0; j < s.seqlen_k; ++j) {
          if (!ref::visible(s, opt, i, j)) continue;
          const float* kj = &k[(kv + j) * d];
          const float p = std::exp(dot(&q[row * d], kj, d) * scale - lse[row]);
          const float ds = p * (dot(g, &v[(kv + j) * dvd], dvd) - delta[row]) * scale;
          for (int64_t x = 0; x < d; ++x) {
            dq[row * d + x] += ds * kj[x];
            dk[(kv + j) * d + x] += ds * q[row * d + x];
          }
          for (int64_t x = 0; x < dvd; ++x) dv[(kv + j) * dvd + x] += p * g[x];
        }
      }
    }
}

} // namespace naive
