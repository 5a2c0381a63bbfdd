// The CPU attention algorithm, written once and compiled by each instruction set's translation unit
// over that ISA's microkernels (a `Micro` type; see scalar/kernels.cpp for the reference set).
//
// Storage types T are float, bf16 and f16; all arithmetic is f32. Half-precision blocks are converted
// to f32 scratch as they are used, and every output is rounded once, from its f32 total.
//
// Forward (FlashAttention-2): per (batch, head, query block), stream the visible key blocks with an
// online softmax. The scores are computed transposed, S^T = K Q^T [BN keys][BM rows], so Q is packed
// once per query block and K, V are read in place; the softmax then runs across rows in SIMD lanes.
//
// Backward: per (batch, kv head, key block), accumulate dK and dV over every query head of the group
// and every visible query block; K^T and V^T are packed once per key block. dQ receives each key
// block's contribution in increasing key-block order (dq_next), so the sums are the same bits for any
// thread count and schedule.
//
// Internal linkage on purpose: every ISA translation unit gets its own copy, compiled with its flags.
// For the same reason this code uses no std:: function templates (std::fill, std::min, ...): an
// out-of-line instantiation would be a weak symbol compiled with AVX-512 flags that the linker may
// pick for generic code. tests/cpu/isa_symbols_test checks the ISA objects export nothing else.
#pragma once

#include <cmath>
#include <cstring>
#include <sched.h>

#include "cpu/half.h"
#include "cpu/kernels.h"

namespace flashback::cpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int64_t kAlign = 64;  // bytes: one cache line, one zmm
constexpr int64_t kLanes = 16;  // leading dimensions are padded to this many floats

constexpr float kInf = __builtin_inff();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }
inline void fill(float* p, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

// The element mask of one tile: local row r, column c is visible iff lo <= c - r <= hi.
struct Mask {
  int32_t lo, hi;
};

inline Mask tile_mask(const core::Band& band, int64_t i0, int64_t j0) {
  // dlo - (j0 - i0) etc.; clamped to what can matter inside a tile (|c - r| < 2^20).
  constexpr int64_t kFar = int64_t{1} << 30;
  const int64_t lo = clamp64(band.dlo - (j0 - i0), -kFar, kFar);
  const int64_t hi = clamp64(band.dhi - (j0 - i0), -kFar, kFar);
  return {static_cast<int32_t>(lo), static_cast<int32_t>(hi)};
}

// Carves 64-byte-aligned float arrays out of a scratch block; with a null base it only measures.
struct Carver {
  char* base;
  int64_t used = 0;
  float* floats(int64_t n) {
    float* p = base ? reinterpret_cast<float*>(base + used) : nullptr;
    used += round_up(n * static_cast<int64_t>(sizeof(float)), kAlign);
    return p;
  }
};

template <class T>
T* row_ptr(const core::Strided4& t, int64_t b, int64_t h, int64_t s) {
  return static_cast<T*>(t.data) + b * t.sb + h * t.sh + s * t.ss;
}

template <class T>
constexpr bool kIsF32 = false;
template <>
constexpr bool kIsF32<float> = true;

// `rows` rows of `cols` elements as f32: f32 data in place, half precision converted into `scratch`.
template <class Micro, class T>
const float* as_f32(const T* src, int64_t ld, int64_t rows, int64_t cols, float* scratch, int64_t scratch_ld,
                    int64_t* ld_out) {
  if constexpr (kIsF32<T>) {
    *ld_out = ld;
    return src;
  } else {
    Micro::load_rows(src, ld, rows, cols, scratch, scratch_ld);
    *ld_out = scratch_ld;
    return scratch;
  }
}

template <class T>
void store_row(const float* src, int64_t n, float mul, T* dst) {
  for (int64_t x = 0; x < n; ++x) dst[x] = from_float<T>(src[x] * mul);
}

// ---------------------------------------------------------------------------------------------------
// Forward

// Per-thread scratch of the forward, in floats:
//   qt    [D][BMp]    Q^T of the block, scaled by scale * log2(e)
//   st    [BN][BMp]   S^T, then P^T, of one tile
//   oacc  [BMp][Dvp]  unnormalized output rows
//   m, l, alpha [BMp] running max (log2 units), running sum, rescale factor of this tile
//   kf [BN][Dp], vf [BN][Dvp]  the key block in f32 (half precision only)
struct ForwardScratch {
  int64_t bmp, dp, dvp;
  float *qt, *st, *oacc, *m, *l, *alpha, *kf, *vf;
};

// Carves the layout above out of `base` (or only measures it, when base is null).
template <class T>
ForwardScratch forward_layout(const core::Problem& p, Tiles t, char* base, int64_t* bytes = nullptr) {
  ForwardScratch s;
  s.bmp = round_up(t.bm, kLanes);
  s.dp = round_up(p.head_dim, kLanes);
  s.dvp = round_up(p.head_dim_v, kLanes);
  Carver c{base};
  s.qt = c.floats(p.head_dim * s.bmp);
  s.st = c.floats(t.bn * s.bmp);
  s.oacc = c.floats(s.bmp * s.dvp);
  s.m = c.floats(s.bmp);
  s.l = c.floats(s.bmp);
  s.alpha = c.floats(s.bmp);
  if constexpr (!kIsF32<T>) {
    s.kf = c.floats(t.bn * s.dp);
    s.vf = c.floats(t.bn * s.dvp);
  }
  if (bytes) *bytes = c.used;
  return s;
}

template <class T>
size_t forward_scratch_bytes(const core::Problem& p, Tiles t) {
  int64_t bytes = 0;
  forward_layout<T>(p, t, nullptr, &bytes);
  return static_cast<size_t>(bytes);
}

template <class Micro, class T>
void forward_item(const ForwardJob& job, int64_t item, char* scratch) {
  const core::Problem& p = *job.p;
  const Tiles t = job.tiles;
  // Items run from the last query block down: under a causal mask those see the most keys, so the
  // dynamic schedule starts with the longest ones.
  const int64_t bh = item / job.q_blocks, ib = job.q_blocks - 1 - item % job.q_blocks;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group();
  const int64_t i0 = ib * t.bm, i1 = min64(p.seqlen_q, i0 + t.bm), rows = i1 - i0;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  ForwardScratch s = forward_layout<T>(p, t, scratch);

  T* o = row_ptr<T>(p.o, b, h, i0);
  float* lse = p.lse.data + b * p.lse.sb + h * p.lse.sh + i0;
  int64_t kfirst, klast;
  p.band.keys_of_rows(i0, i1, p.seqlen_k, &kfirst, &klast);
  if (kfirst > klast) { // no row of the block sees a key
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t x = 0; x < dv; ++x) o[r * p.o.ss + x] = from_float<T>(0.0f);
      lse[r] = -kInf;
    }
    return;
  }

  // qt [D][BMp] = (Q rows)^T * scale * log2(e); rows >= `rows` are zero.
  Micro::pack_t(row_ptr<const T>(p.q, b, h, i0), p.q.ss, rows, d, p.scale * kLog2e, s.qt, s.bmp, s.bmp);
  fill(s.m, s.bmp, -kInf);
  fill(s.l, s.bmp, 0.0f);

  bool first = true;
  for (int64_t jb = kfirst / t.bn; jb <= klast / t.bn; ++jb) {
    const int64_t j0 = jb * t.bn, cols = min64(p.seqlen_k, j0 + t.bn) - j0;
    int64_t ldk, ldv;
    const float* k = as_f32<Micro>(row_ptr<const T>(p.k, b, hk, j0), p.k.ss, cols, d, s.kf, s.dp, &ldk);
    const float* v = as_f32<Micro>(row_ptr<const T>(p.v, b, hk, j0), p.v.ss, cols, dv, s.vf, s.dvp, &ldv);
    // st [cols][BMp] = K Q^T, in log2 units
    Micro::gemm(cols, s.bmp, d, k, ldk, 1, s.qt, s.bmp, s.st, s.bmp, false, nullptr);
    const Mask mask = tile_mask(p.band, i0, j0);
    const bool full = p.band.covers(i0, i1, j0, j0 + cols);
    Micro::softmax_t(s.st, s.bmp, s.bmp, cols, full ? nullptr : &mask, s.m, s.l, s.alpha);
    // oacc [rows][Dv] = alpha * oacc + P V   (P(r, c) = st[c][r])
    Micro::gemm(rows, dv, cols, s.st, 1, s.bmp, v, ldv, s.oacc, s.dvp, !first, first ? nullptr : s.alpha);
    first = false;
  }

  for (int64_t r = 0; r < rows; ++r) {
    // l = 0: this row sees no key; its zero accumulator gives O = 0.
    const float inv = s.l[r] > 0 ? 1.0f / s.l[r] : 0.0f;
    store_row(s.oacc + r * s.dvp, dv, inv, o + r * p.o.ss);
    lse[r] = s.l[r] > 0 ? (s.m[r] + __builtin_log2f(s.l[r])) * kLn2 : -kInf;
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward

// Per-thread scratch of the backward, in floats:
//   kt [D][BNp], vt [Dv][BNp]   K^T and V^T of the key block
//   s  [BM][BNp]                S, then P
//   dp [BM][BNp]                dP, then dS (scale folded in)
//   dk [BN][Dp], dv [BN][Dvp]   the key block's gradient accumulators
//   kf [BN][Dp], qf [BM][Dp], dof [BM][Dvp]   K, Q and dO blocks in f32 (half precision only)
struct BackwardScratch {
  int64_t bnp, dp, dvp;
  float *kt, *vt, *s, *ds, *dk, *dv, *kf, *qf, *dof;
};

template <class T>
BackwardScratch backward_layout(const core::Problem& p, Tiles t, char* base, int64_t* bytes = nullptr) {
  BackwardScratch s;
  s.bnp = round_up(t.bn, kLanes);
  s.dp = round_up(p.head_dim, kLanes);
  s.dvp = round_up(p.head_dim_v, kLanes);
  Carver c{base};
  s.kt = c.floats(p.head_dim * s.bnp);
  s.vt = c.floats(p.head_dim_v * s.bnp);
  s.s = c.floats(t.bm * s.bnp);
  s.ds = c.floats(t.bm * s.bnp);
  s.dk = c.floats(t.bn * s.dp);
  s.dv = c.floats(t.bn * s.dvp);
  if constexpr (!kIsF32<T>) {
    s.kf = c.floats(t.bn * s.dp);
    s.qf = c.floats(t.bm * s.dp);
    s.dof = c.floats(t.bm * s.dvp);
  }
  if (bytes) *bytes = c.used;
  return s;
}

template <class T>
size_t backward_scratch_bytes(const core::Problem& p, Tiles t) {
  int64_t bytes = 0;
  backward_layout<T>(p, t, nullptr, &bytes);
  return static_cast<size_t>(bytes);
}

template <class Micro, class T>
void backward_rows(const BackwardJob& job, int64_t begin, int64_t end) {
  const core::Problem& p = *job.p;
  const int64_t dv = p.head_dim_v, d = p.head_dim;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bh = row / p.seqlen_q, i = row % p.seqlen_q;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const float dl = Micro::dot(row_ptr<const T>(p.dout, b, h, i), row_ptr<const T>(p.o, b, h, i), dv);
    job.delta[row] = dl;
    if (p.delta) p.delta.data[b * p.delta.sb + h * p.delta.sh + i] = dl;
    job.lse2[row] = p.lse.data[b * p.lse.sb + h * p.lse.sh + i] * kLog2e;
    if (job.need_dq) {
      float* acc = job.dq_acc + b * job.dq_sb + h * job.dq_sh + i * job.dq_ss;
      fill(acc, d, 0.0f);
      if (i % job.tiles.bm == 0) { // the first key block that adds to this query block
        const int64_t ib = i / job.tiles.bm;
        int64_t kfirst, klast;
        p.band.keys_of_rows(i, min64(p.seqlen_q, i + job.tiles.bm), p.seqlen_k, &kfirst, &klast);
        job.dq_next[bh * job.q_blocks + ib] = kfirst <= klast ? kfirst / job.tiles.bn : 0;
      }
    }
  }
}

// Wait until the dQ accumulator of a query block expects this key block's contribution.
inline void wait_turn(int64_t* next, int64_t jb) {
  for (int spins = 0; __atomic_load_n(next, __ATOMIC_ACQUIRE) != jb;) {
    if (spins < 2000) {
      ++spins;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      sched_yield(); // more threads than cores: let the one we wait for run
    }
  }
}

inline void pass_turn(int64_t* next, int64_t jb) {
  __atomic_store_n(next, jb + 1, __ATOMIC_RELEASE);
}

template <class Micro, class T>
void backward_item(const BackwardJob& job, int64_t item, char* scratch) {
  const core::Problem& p = *job.p;
  const Tiles t = job.tiles;
  const int64_t bhk = item / job.kv_blocks, jb = item % job.kv_blocks;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
  const int64_t j0 = jb * t.bn, cols = min64(p.seqlen_k, j0 + t.bn) - j0;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  BackwardScratch s = backward_layout<T>(p, t, scratch);

  const T* k = row_ptr<const T>(p.k, b, hk, j0);
  const T* v = row_ptr<const T>(p.v, b, hk, j0);
  const bool need_ds = job.need_dk || job.need_dq;
  Micro::pack_t(k, p.k.ss, cols, d, 1.0f, s.kt, s.bnp, s.bnp);
  if (need_ds) Micro::pack_t(v, p.v.ss, cols, dv, 1.0f, s.vt, s.bnp, s.bnp);
  int64_t ldk = 0;
  const float* kf = job.need_dq ? as_f32<Micro>(k, p.k.ss, cols, d, s.kf, s.dp, &ldk) : nullptr;
  if (job.need_dk) fill(s.dk, cols * s.dp, 0.0f);
  if (job.need_dv) fill(s.dv, cols * s.dvp, 0.0f);

  int64_t ifirst, ilast;
  p.band.rows_of_keys(j0, j0 + cols, p.seqlen_q, &ifirst, &ilast);
  const float mul = p.scale * kLog2e;
  for (int64_t h = hk * p.group(); h < (hk + 1) * p.group() && ifirst <= ilast; ++h) {
    for (int64_t ib = ifirst / t.bm; ib <= ilast / t.bm; ++ib) {
      const int64_t i0 = ib * t.bm, rows = min64(p.seqlen_q, i0 + t.bm) - i0;
      const int64_t row0 = (b * p.heads_q + h) * p.seqlen_q + i0;
      int64_t ldq, lddo;
      const float* q = as_f32<Micro>(row_ptr<const T>(p.q, b, h, i0), p.q.ss, rows, d, s.qf, s.dp, &ldq);
      const float* dout = as_f32<Micro>(row_ptr<const T>(p.dout, b, h, i0), p.dout.ss, rows, dv, s.dof, s.dvp, &lddo);
      const Mask mask = tile_mask(p.band, i0, j0);
      const bool full = p.band.covers(i0, i0 + rows, j0, j0 + cols);
      // s [rows][cols] = Q K^T, then P = exp2(S * scale * log2(e) - lse2), 0 where masked
      Micro::gemm(rows, cols, d, q, ldq, 1, s.kt, s.bnp, s.s, s.bnp, false, nullptr);
      Micro::probs(s.s, s.bnp, rows, cols, mul, job.lse2 + row0, full ? nullptr : &mask);
      // dv [cols][Dv] += P^T dO
      if (job.need_dv) Micro::gemm(cols, dv, rows, s.s, 1, s.bnp, dout, lddo, s.dv, s.dvp, true, nullptr);
      if (!need_ds) continue;
      // ds [rows][cols] = dO V^T, then dS = P (dP - delta) * scale
      Micro::gemm(rows, cols, dv, dout, lddo, 1, s.vt, s.bnp, s.ds, s.bnp, false, nullptr);
      Micro::dscores(s.s, s.ds, s.bnp, rows, cols, job.delta + row0, p.scale);
      // dk [cols][D] += dS^T Q
      if (job.need_dk) Micro::gemm(cols, d, rows, s.ds, 1, s.bnp, q, ldq, s.dk, s.dp, true, nullptr);
      // dq [rows][D] += dS K, in key-block order
      if (job.need_dq) {
        int64_t* next = job.dq_next + (b * p.heads_q + h) * job.q_blocks + ib;
        float* dq = job.dq_acc + b * job.dq_sb + h * job.dq_sh + i0 * job.dq_ss;
        wait_turn(next, jb);
        Micro::gemm(rows, d, cols, s.ds, s.bnp, 1, kf, ldk, dq, job.dq_ss, true, nullptr);
        pass_turn(next, jb);
      }
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    if (job.need_dk) store_row(s.dk + c * s.dp, d, 1.0f, row_ptr<T>(p.dk, b, hk, j0 + c));
    if (job.need_dv) store_row(s.dv + c * s.dvp, dv, 1.0f, row_ptr<T>(p.dv, b, hk, j0 + c));
  }
}

// Rows [begin, end) of dq from the f32 accumulator (half precision: rounded once, at the end).
template <class T>
void backward_store_dq(const BackwardJob& job, int64_t begin, int64_t end) {
  const core::Problem& p = *job.p;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bh = row / p.seqlen_q, i = row % p.seqlen_q;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    store_row(job.dq_acc + b * job.dq_sb + h * job.dq_sh + i * job.dq_ss, p.head_dim, 1.0f,
              row_ptr<T>(p.dq, b, h, i));
  }
}

template <class Micro, class T>
const KernelSet& kernel_set_of() {
  static const KernelSet set{
      Micro::isa,
      &Micro::tiles,
      &forward_scratch_bytes<T>,
      &backward_scratch_bytes<T>,
      &forward_item<Micro, T>,
      &backward_rows<Micro, T>,
      &backward_item<Micro, T>,
      &backward_store_dq<T>,
  };
  return set;
}

// The ISA's kernel set for each storage type.
template <class Micro>
const KernelSet& make_kernel_set(core::DType dtype) {
  switch (dtype) {
    case core::DType::bf16: return kernel_set_of<Micro, bf16>();
    case core::DType::f16: return kernel_set_of<Micro, f16>();
    case core::DType::f32: break;
  }
  return kernel_set_of<Micro, float>();
}

} // namespace
} // namespace flashback::cpu
