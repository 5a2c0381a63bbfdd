#include "reference.h"

#include <cmath>
#include <limits>

namespace ref {

bool visible(const Shape& s, const Options& o, int64_t i, int64_t j) {
  const int64_t right = o.causal ? 0 : o.window_right;
  // j relative to the key query i is aligned with (i + Sk - Sq); compared with the window sides, which
  // may be as large as INT64_MAX, without adding to them
  const int64_t offset = j - (i + s.seqlen_k - s.seqlen_q);
  if (o.window_left >= 0 && -offset > o.window_left) return false;
  if (right >= 0 && offset > right) return false;
  return true;
}

double scale_of(const Shape& s, const Options& o) {
  return o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
}

namespace {

// The probabilities of one query row over all keys (0 where masked) and its logsumexp.
double row_probs(const Shape& s, const Options& o, const double* qrow, const double* kh, int64_t i,
                 std::vector<double>& p) {
  const double scale = scale_of(s, o);
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < s.seqlen_k; ++j) {
    p[j] = -std::numeric_limits<double>::infinity();
    if (!visible(s, o, i, j)) continue;
    double dot = 0;
    for (int64_t x = 0; x < s.head_dim; ++x) dot += qrow[x] * kh[j * s.head_dim + x];
    p[j] = dot * scale;
    mx = std::max(mx, p[j]);
  }
  if (mx == -std::numeric_limits<double>::infinity()) {
    for (int64_t j = 0; j < s.seqlen_k; ++j) p[j] = 0;
    return mx;
  }
  // p = exp(score - mx) / sum: one exp per key (the exponentials took a fifth of some sanitized tests)
  double sum = 0;
  for (int64_t j = 0; j < s.seqlen_k; ++j) sum += (p[j] = std::exp(p[j] - mx));
  for (int64_t j = 0; j < s.seqlen_k; ++j) p[j] /= sum;
  return mx + std::log(sum);
}

} // namespace

void forward(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
             const std::vector<double>& v, std::vector<double>& out, std::vector<double>& lse) {
  const int64_t group = s.heads_q / s.heads_kv;
  out.assign(s.batch * s.heads_q * s.seqlen_q * s.head_dim_v, 0.0);
  lse.assign(s.batch * s.heads_q * s.seqlen_q, 0.0);
  std::vector<double> p(s.seqlen_k);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t hk = h / group;
      const double* kh = k.data() + (b * s.heads_kv + hk) * s.seqlen_k * s.head_dim;
      const double* vh = v.data() + (b * s.heads_kv + hk) * s.seqlen_k * s.head_dim_v;
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const int64_t row = (b * s.heads_q + h) * s.seqlen_q + i;
        lse[row] = row_probs(s, o, q.data() + row * s.head_dim, kh, i, p);
        for (int64_t j = 0; j < s.seqlen_k; ++j)
          for (int64_t x = 0; x < s.head_dim_v; ++x) out[row * s.head_dim_v + x] += p[j] * vh[j * s.head_dim_v + x];
      }
    }
}

void backward(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
              const std::vector<double>& v, const std::vector<double>& dout, std::vector<double>& dq,
              std::vector<double>& dk, std::vector<double>& dv, std::vector<double>& delta,
              const std::vector<double>* o_given) {
  const int64_t group = s.heads_q / s.heads_kv;
  const double scale = scale_of(s, o);
  dq.assign(q.size(), 0.0);
  dk.assign(k.size(), 0.0);
  dv.assign(v.size(), 0.0);
  delta.assign(s.batch * s.heads_q * s.seqlen_q, 0.0);
  std::vector<double> p(s.seqlen_k), dp(s.seqlen_k);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t hk = h / group;
      const int64_t kbase = (b * s.heads_kv + hk) * s.seqlen_k;
      const double* kh = k.data() + kbase * s.head_dim;
      const double* vh = v.data() + kbase * s.head_dim_v;
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const int64_t row = (b * s.heads_q + h) * s.seqlen_q + i;
        const double* g = dout.data() + row * s.head_dim_v;
        row_probs(s, o, q.data() + row * s.head_dim, kh, i, p);
        // delta = sum_j p_j (dout . v_j) = dout . o
        double dl = 0;
        for (int64_t j = 0; j < s.seqlen_k; ++j) {
          dp[j] = 0;
          for (int64_t x = 0; x < s.head_dim_v; ++x) dp[j] += g[x] * vh[j * s.head_dim_v + x];
          dl += p[j] * dp[j];
        }
        if (o_given) {
          dl = 0;
          for (int64_t x = 0; x < s.head_dim_v; ++x) dl += g[x] * (*o_given)[row * s.head_dim_v + x];
        }
        delta[row] = dl;
        for (int64_t j = 0; j < s.seqlen_k; ++j) {
          if (p[j] == 0) continue;
          const double ds = p[j] * (dp[j] - dl) * scale;
          for (int64_t x = 0; x < s.head_dim; ++x) {
            dq[row * s.head_dim + x] += ds * kh[j * s.head_dim + x];
            dk[(kbase + j) * s.head_dim + x] += ds * q[row * s.head_dim + x];
          }
          for (int64_t x = 0; x < s.head_dim_v; ++x) dv[(kbase + j) * s.head_dim_v + x] += p[j] * g[x];
        }
      }
    }
}

double forward_row(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v, int64_t b, int64_t h, int64_t i, double* o_row) {
  const int64_t hk = h / (s.heads_q / s.heads_kv);
  const double* kh = k.data() + (b * s.heads_kv + hk) * s.seqlen_k * s.head_dim;
  const double* vh = v.data() + (b * s.heads_kv + hk) * s.seqlen_k * s.head_dim_v;
  const int64_t row = (b * s.heads_q + h) * s.seqlen_q + i;
  std::vector<double> p(s.seqlen_k);
  const double lse = row_probs(s, o, q.data() + row * s.head_dim, kh, i, p);
  for (int64_t x = 0; x < s.head_dim_v; ++x) o_row[x] = 0;
  for (int64_t j = 0; j < s.seqlen_k; ++j)
    for (int64_t x = 0; x < s.head_dim_v; ++x) o_row[x] += p[j] * vh[j * s.head_dim_v + x];
  return lse;
}

double dq_row(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
              const std::vector<double>& v, const std::vector<double>& dout, int64_t b, int64_t h, int64_t i,
              double* dq_out) {
  const int64_t hk = h / (s.heads_q / s.heads_kv);
  const double* kh = k.data() + (b * s.heads_kv + hk) * s.seqlen_k * s.head_dim;
  const double* vh = v.data() + (b * s.heads_kv + hk) * s.seqlen_k * s.head_dim_v;
  const int64_t row = (b * s.heads_q + h) * s.seqlen_q + i;
  const double* g = dout.data() + row * s.head_dim_v;
  std::vector<double> p(s.seqlen_k), dp(s.seqlen_k);
  row_probs(s, o, q.data() + row * s.head_dim, kh, i, p);
  double dl = 0;
  for (int64_t j = 0; j < s.seqlen_k; ++j) {
    dp[j] = 0;
    for (int64_t x = 0; x < s.head_dim_v; ++x) dp[j] += g[x] * vh[j * s.head_dim_v + x];
    dl += p[j] * dp[j];
  }
  const double scale = scale_of(s, o);
  for (int64_t x = 0; x < s.head_dim; ++x) dq_out[x] = 0;
  for (int64_t j = 0; j < s.seqlen_k; ++j) {
    const double ds = p[j] * (dp[j] - dl) * scale;
    for (int64_t x = 0; x < s.head_dim; ++x) dq_out[x] += ds * kh[j * s.head_dim + x];
  }
  return dl;
}

KvHeadStats kv_head_stats(const Shape& s, const Options& o, const std::vector<double>& q,
                          const std::vector<double>& k, const std::vector<double>& v,
                          const std::vector<double>& dout, int64_t b, int64_t hk) {
  const int64_t group = s.heads_q / s.heads_kv;
  KvHeadStats st;
  st.lse.resize(group * s.seqlen_q);
  st.delta.resize(group * s.seqlen_q);
  std::vector<double> orow(s.head_dim_v);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < s.seqlen_q; ++i) {
      const int64_t h = hk * group + g;
      st.lse[g * s.seqlen_q + i] = forward_row(s, o, q, k, v, b, h, i, orow.data());
      const double* gr = dout.data() + ((b * s.heads_q + h) * s.seqlen_q + i) * s.head_dim_v;
      double dl = 0;
      for (int64_t x = 0; x < s.head_dim_v; ++x) dl += gr[x] * orow[x];
      st.delta[g * s.seqlen_q + i] = dl;
    }
  return st;
}

void dkv_row(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
             const std::vector<double>& v, const std::vector<double>& dout, const KvHeadStats& stats, int64_t b,
             int64_t hk, int64_t j, double* dk_out, double* dv_out) {
  const int64_t group = s.heads_q / s.heads_kv;
  const double scale = scale_of(s, o);
  const int64_t krow = (b * s.heads_kv + hk) * s.seqlen_k + j;
  const double* kj = k.data() + krow * s.head_dim;
  const double* vj = v.data() + krow * s.head_dim_v;
  for (int64_t x = 0; x < s.head_dim; ++x) dk_out[x] = 0;
  for (int64_t x = 0; x < s.head_dim_v; ++x) dv_out[x] = 0;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < s.seqlen_q; ++i) {
      if (!visible(s, o, i, j)) continue;
      const int64_t h = hk * group + g;
      const int64_t row = (b * s.heads_q + h) * s.seqlen_q + i;
      const double* qi = q.data() + row * s.head_dim;
      const double* gi = dout.data() + row * s.head_dim_v;
      double dot = 0, dp = 0;
      for (int64_t x = 0; x < s.head_dim; ++x) dot += qi[x] * kj[x];
      for (int64_t x = 0; x < s.head_dim_v; ++x) dp += gi[x] * vj[x];
      const double p = std::exp(dot * scale - stats.lse[g * s.seqlen_q + i]);
      const double ds = p * (dp - stats.delta[g * s.seqlen_q + i]) * scale;
      for (int64_t x = 0; x < s.head_dim; ++x) dk_out[x] += ds * qi[x];
      for (int64_t x = 0; x < s.head_dim_v; ++x) dv_out[x] += p * gi[x];
    }
}

} // namespace ref
