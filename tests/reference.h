// The float64 reference: naive attention over dense [B, H, S, D] arrays, written from the definitions
// and independent of the library's code (no blocks, no online softmax, its own mask test).
// It lives in tests/ and nowhere else.
#pragma once

#include <cstdint>
#include <vector>

namespace ref {

struct Shape {
  int64_t batch = 1, heads_q = 1, heads_kv = 1, seqlen_q = 1, seqlen_k = 1, head_dim = 1, head_dim_v = 1;
};

struct Options {
  bool causal = false;
  int64_t window_left = -1, window_right = -1; // -1: unbounded
  double scale = 0;                            // 0: 1/sqrt(head_dim)
};

// Query i sees key j (FlashAttention-2's bottom-right alignment; causal = window (left, 0)).
bool visible(const Shape& s, const Options& o, int64_t i, int64_t j);
double scale_of(const Shape& s, const Options& o);

// q [B,Hq,Sq,D], k [B,Hk,Sk,D], v [B,Hk,Sk,Dv] -> o [B,Hq,Sq,Dv], lse [B,Hq,Sq] (natural log;
// -inf and o = 0 for a row that sees no key).
void forward(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
             const std::vector<double>& v, std::vector<double>& out, std::vector<double>& lse);

// Gradients of sum(dout * o) with respect to q, k, v; delta = rowsum(dout * o). With o_given, the
// backward of an attention whose forward returned o_given (rounded, as a half-precision forward's o
// is): delta = rowsum(dout * o_given), as the library computes it from the o it is given.
void backward(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
              const std::vector<double>& v, const std::vector<double>& dout, std::vector<double>& dq,
              std::vector<double>& dk, std::vector<double>& dv, std::vector<double>& delta,
              const std::vector<double>* o_given = nullptr);

// Row-level pieces, for checking samples of large problems (flashback bench / check).
// All arrays are the same dense [B, H, S, D] layouts as above.

// One query row (b, h, i): writes o_row [Dv], returns its lse.
double forward_row(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v, int64_t b, int64_t h, int64_t i, double* o_row);
// dq of one query row (b, h, i) [D]; returns its delta.
double dq_row(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
              const std::vector<double>& v, const std::vector<double>& dout, int64_t b, int64_t h, int64_t i,
              double* dq_out);
// lse and delta of every query row of the heads that read kv head (b, hk): [group][Sq] each.
struct KvHeadStats {
  std::vector<double> lse, delta;
};
KvHeadStats kv_head_stats(const Shape& s, const Options& o, const std::vector<double>& q,
                          const std::vector<double>& k, const std::vector<double>& v,
                          const std::vector<double>& dout, int64_t b, int64_t hk);
// dk [D] and dv [Dv] of one key row (b, hk, j), given that head's stats.
void dkv_row(const Shape& s, const Options& o, const std::vector<double>& q, const std::vector<double>& k,
             const std::vector<double>& v, const std::vector<double>& dout, const KvHeadStats& stats, int64_t b,
             int64_t hk, int64_t j, double* dk_out, double* dv_out);

} // namespace ref
