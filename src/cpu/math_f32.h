// Tile math in f32 over an ISA's microkernels (`Micro`: gemm, pack_t, load_rows, softmax_t, probs,
// dscores, dot; see scalar/kernels.cpp). Storage T is float, bf16 or f16. f32 operands are read in
// place when the rows of a head are consecutive; half-precision K, V (forward) and Q, dO (backward),
// and f32 ones whose rows lie apart (copies_kv, copies_qdo), are converted to f32 once per call, in
// the prepare phase, into the shared workspace (B Hk Sk (D + Dv) or B Hq Sq (D + Dv) floats, rows
// padded), since every block of them is used by many tiles; where the forward's key blocks are used by
// few (decoding: few_query_blocks), they are converted per tile instead, and each next key block is
// fetched into L2 during the work on the one before. Every output is rounded once from its f32 total.
//
// Forward: the scores are computed transposed, S^T = K Q^T [BN keys][BM rows], so Q is packed once per
// query block and K, V are read in place; the softmax then runs across rows in SIMD lanes. A block of
// a few rows (decoding) computes S = Q K^T instead, the keys in the lanes, and transposes it. Both passes
// compute the raw scores s = q.k the same way (one FMA chain over D from 0, in order: the same bits)
// and apply mul = scale * log2(e) in the exponent (forward exp2((s - max s) mul), backward
// exp2(s mul - lse2)), so the backward's P is the forward's but for the rounding of the LSE, also
// where logits are large; and the row's largest score gets P = 1 exactly.
// Backward: K^T and V^T are packed once per key block; S, dP, dS are [BM rows][BN keys].
#pragma once

#include "cpu/attention.h"
#include "cpu/blocks.h"

namespace flashback::cpu {
namespace {

// `rows` rows of `cols` elements as f32: f32 data in place when there is no `scratch`, else (half
// precision, or f32 copied) converted into `scratch`.
template <class Micro, class T>
const float* as_f32(const T* src, int64_t ld, int64_t rows, int64_t cols, float* scratch, int64_t scratch_ld,
                    int64_t* ld_out) {
  if constexpr (kIsF32<T>) {
    if (!scratch) {
      *ld_out = ld;
      return src;
    }
  }
  Micro::load_rows(src, ld, rows, cols, scratch, scratch_ld);
  *ld_out = scratch_ld;
  return scratch;
}

template <class Micro, class Storage>
struct MathF32 {
  using T = Storage;
  static constexpr Isa isa = Micro::isa;
  static constexpr bool kConvert = !kIsF32<T>; // half precision: operands converted once per call

  static Tiles tiles(const core::Problem& p, bool backward) { return Micro::tiles(p, backward); }
  static float dot(const T* a, const T* b, int64_t n) { return Micro::dot(a, b, n); }
  static void store_row(const float* src, int64_t n, float mul, T* dst) { Micro::store_row(src, n, mul, dst); }

  // One block of `rows` rows of the f32 copies in the shared workspace: [rows][Dp] then [rows][Dvp].
  static int64_t block_floats(const core::Problem& p, int64_t rows) {
    return rows * (round_up(p.head_dim, kLanes) + round_up(p.head_dim_v, kLanes));
  }
  // The f32 copy of block `index` (of `rows` rows): the first operand ([rows][Dp]) and the second.
  static float* converted(char* shared, const core::Problem& p, int64_t rows, int64_t index, float** second) {
    float* first = reinterpret_cast<float*>(shared) + index * block_floats(p, rows);
    *second = first + rows * round_up(p.head_dim, kLanes);
    return first;
  }
  static void convert(const T* a, int64_t lda, int64_t da, const T* b, int64_t ldb, int64_t db, int64_t rows,
                      float* fa, float* fb) {
    Micro::load_rows(a, lda, rows, da, fa, round_up(da, kLanes));
    Micro::load_rows(b, ldb, rows, db, fb, round_up(db, kLanes));
  }

  // f32 rows that lie apart (row stride != row length: BSHD with more than one head, packed QKV,
  // slices) are copied into f32 blocks as half precision is converted: read in place, the rows of a
  // block sit a stride apart that is often a multiple of 4 KiB (BSHD, Hq = 16, D = 128: 8 KiB), so that
  // they share a few cache sets, and attention ran 0.8x as fast as on BHSD (BENCHMARKS.md). A copy has
  // the same values: the same bits.
  static bool rows_apart(const core::Strided4& t, int64_t len) { return t.ss != len; }
  static bool copies_kv(const core::Problem& p) {
    return kConvert || rows_apart(p.k, p.head_dim) || rows_apart(p.v, p.head_dim_v);
  }
  static bool copies_qdo(const core::Problem& p) {
    return kConvert || rows_apart(p.q, p.head_dim) || rows_apart(p.dout, p.head_dim_v);
  }

  // Forward: K and V are converted once per call (the prepare phase) when each key block serves many
  // query blocks. Where it serves few (few_query_blocks: decoding, short chunks), a key block comes
  // from memory once: the work item fetches the rows of its next key block into L2 while it works on
  // one (Forward::upcoming), and converts them per tile, into its scratch (half precision reads half
  // the bytes that writing and reading an f32 copy moves), or reads f32 rows in place, copying only
  // those that lie apart (copies_kv). All give the same f32 values. attention.h also fetches the rows
  // of the next work item's Q, K and V during each item there (fetch_item_rows).
  static bool forward_per_tile(const core::Problem& p, Tiles t) { return few_query_blocks(p, t); }
  static bool forward_converts_per_tile(const core::Problem& p, Tiles t) {
    return copies_kv(p) && forward_per_tile(p, t);
  }
  static bool forward_copies_once(const core::Problem& p, Tiles t) {
    return copies_kv(p) && !few_query_blocks(p, t);
  }

  static size_t forward_shared_bytes(const core::Problem& p, Tiles t) {
    if (!forward_copies_once(p, t)) return 0;
    return static_cast<size_t>(p.batch * p.heads_kv * round_up(p.seqlen_k, t.bn) / t.bn * block_floats(p, t.bn)) *
           sizeof(float);
  }
  static int64_t forward_prepare_items(const ForwardJob& job) {
    if (!forward_copies_once(*job.p, job.tiles)) return 0;
    return job.p->batch * job.p->heads_kv * job.kv_blocks;
  }
  // Key block `item` = (b, hk, jb) of K and V in f32.
  static void forward_prepare(const ForwardJob& job, int64_t item) {
    const core::Problem& p = *job.p;
    const RowBlock k = row_block(item, p.heads_kv, job.kv_blocks, job.tiles.bn, p.seqlen_k);
    float* vf;
    float* kf = converted(job.shared, p, job.tiles.bn, item, &vf);
    convert(row_ptr<const T>(p.k, k.b, k.head, k.first), p.k.ss, p.head_dim,
            row_ptr<const T>(p.v, k.b, k.head, k.first), p.v.ss, p.head_dim_v, k.rows, kf, vf);
  }

  static size_t backward_shared_bytes(const core::Problem& p, Tiles t) {
    if (!copies_qdo(p)) return 0;
    return static_cast<size_t>(p.batch * p.heads_q * round_up(p.seqlen_q, t.bm) / t.bm * block_floats(p, t.bm)) *
           sizeof(float);
  }
  static int64_t backward_prepare_items(const BackwardJob& job) {
    return copies_qdo(*job.p) ? job.p->batch * job.p->heads_q * job.q_blocks : 0;
  }
  // Query block `item` = (b, h, ib) of Q and dO in f32.
  static void backward_prepare(const BackwardJob& job, int64_t item) {
    const core::Problem& p = *job.p;
    const RowBlock q = row_block(item, p.heads_q, job.q_blocks, job.tiles.bm, p.seqlen_q);
    float* dof;
    float* qf = converted(job.shared, p, job.tiles.bm, item, &dof);
    convert(row_ptr<const T>(p.q, q.b, q.head, q.first), p.q.ss, p.head_dim,
            row_ptr<const T>(p.dout, q.b, q.head, q.first), p.dout.ss, p.head_dim_v, q.rows, qf, dof);
  }

  // A query block of at most this many rows (decoding's one, the remainder of Sq) computes its
  // scores as S = Q K^T, the keys in the lanes, and transposes S into S^T: with its rows in the lanes,
  // a vector of 16 lanes would hold these few rows and zeros.
  static constexpr int64_t kFewRows = 8;
  static bool has_few_rows(const core::Problem& p, Tiles t) {
    const int64_t last = p.seqlen_q % t.bm;
    return last > 0 && last <= kFewRows;
  }

  // Per-thread scratch of the forward, in floats:
  //   qt    [D][BMp]    Q^T of the block
  //   st    [BN][BMp]   S^T (raw scores), then P^T, of one tile
  //   oacc  [BMp][Dvp]  unnormalized output rows
  //   m, l, alpha [BMp] running max (raw scores), running sum, rescale factor of this tile
  //   bmax  [BMp]       the rows' maxima over the tile's keys (raw scores), found by the product S^T
  // and only when the last query block has at most kFewRows rows (has_few_rows):
  //   kt    [D][BNp]    K^T of the key block
  //   s     [kFewRows][BNp] S of the block
  // and only when K and V are converted or copied per tile (forward_converts_per_tile):
  //   kf [BN][Dp], vf [BN][Dvp]   the key block's K and V in f32
  struct ForwardScratch {
    int64_t bmp, bnp, dp, dvp;
    float *qt, *st, *oacc, *m, *l, *alpha, *bmax, *kt, *s, *kf, *vf;

    ForwardScratch(const core::Problem& p, Tiles t, char* base, int64_t* bytes = nullptr) {
      bmp = round_up(t.bm, kLanes);
      bnp = round_up(t.bn, kLanes);
      dp = round_up(p.head_dim, kLanes);
      dvp = round_up(p.head_dim_v, kLanes);
      Carver c{base};
      qt = c.floats(p.head_dim * bmp);
      st = c.floats(t.bn * bmp);
      oacc = c.floats(bmp * dvp);
      m = c.floats(bmp);
      l = c.floats(bmp);
      alpha = c.floats(bmp);
      bmax = c.floats(bmp);
      const bool few = has_few_rows(p, t);
      kt = few ? c.floats(p.head_dim * bnp) : nullptr;
      s = few ? c.floats(kFewRows * bnp) : nullptr;
      const bool per_tile = forward_converts_per_tile(p, t);
      kf = per_tile ? c.floats(t.bn * dp) : nullptr;
      vf = per_tile ? c.floats(t.bn * dvp) : nullptr;
      if (bytes) *bytes = c.used;
    }
  };

  static size_t forward_scratch_bytes(const core::Problem& p, Tiles t) { return carved_bytes<ForwardScratch>(p, t); }

  class Forward {
   public:
    Forward(const ForwardJob& job, char* scratch)
        : job_(job), p_(*job.p), t_(job.tiles), s_(p_, t_, scratch), copied_(forward_copies_once(p_, t_)),
          per_tile_(forward_per_tile(p_, t_)), converts_(forward_converts_per_tile(p_, t_)) {}

    // A query block: qt [D][BMp] = (Q rows)^T; rows from `rows` up to rp_ (rows rounded up to a vector
    // of kLanes) are zero, and nothing works beyond rp_ (a short block, e.g. Sq = 1 in decoding, takes
    // a sixteenth of a full block's products, not all of them).
    void begin(int64_t b, int64_t h, int64_t i0, int64_t rows) {
      rows_ = rows;
      rp_ = round_up(rows, kLanes);
      Micro::pack_t(row_ptr<const T>(p_.q, b, h, i0), p_.q.ss, rows, p_.head_dim, s_.qt, s_.bmp, rp_);
      fill(s_.m, rp_, -kInf);
      fill(s_.l, rp_, 0.0f);
    }

    // A key block: S^T, an online-softmax step, O = alpha O + P V.
    void add(int64_t b, int64_t hk, int64_t j0, int64_t cols, const Mask* mask, bool first) {
      const int64_t d = p_.head_dim, dv = p_.head_dim_v;
      const float *k = nullptr, *v = nullptr;
      int64_t ldk = s_.dp, ldv = s_.dvp;
      if (copied_) { // converted once per call, in the prepare phase
        float* vf;
        k = converted(job_.shared, p_, t_.bn, (b * p_.heads_kv + hk) * job_.kv_blocks + j0 / t_.bn, &vf);
        v = vf;
      } else if (converts_) { // converted here (forward_converts_per_tile), once for the item's blocks
        Forward& owner = *kv_owner_;
        if (owner.kv_j0_ != j0) {
          convert(row_ptr<const T>(p_.k, b, hk, j0), p_.k.ss, d, row_ptr<const T>(p_.v, b, hk, j0), p_.v.ss, dv,
                  cols, owner.s_.kf, owner.s_.vf);
          owner.kv_j0_ = j0;
        }
        k = owner.s_.kf;
        v = owner.s_.vf;
      } else if constexpr (!kConvert) { // f32 in place
        k = row_ptr<const T>(p_.k, b, hk, j0);
        v = row_ptr<const T>(p_.v, b, hk, j0);
        ldk = p_.k.ss;
        ldv = p_.v.ss;
      }
      // Under a mask, only the tile's keys [kb, ke) that some row of the block sees are computed (a
      // causal diagonal tile, a window's edges: the others are masked for every row). The scores and
      // P V are the same bits as over the whole tile; the softmax's two partial sums may pair the
      // keys differently (rounding only).
      Mask trimmed;
      if (mask) {
        const VisibleSpan span = visible_span(*mask, rows_, cols);
        trimmed = VisibleSpan::at(*mask, 0, span.k0); // every row stays: the softmax runs over all of them
        mask = &trimmed;
        k += span.k0 * ldk;
        v += span.k0 * ldv;
        cols = span.k1 - span.k0;
      }
      // The next key block's rows (upcoming) are fetched one paced step per k of the products, the rest
      // after them (a masked tile's P V, gemm_banded, takes none).
      const bool few = s_.kt && rows_ <= kFewRows;
      Prefetch* pf = per_tile_ ? &prefetch_ : nullptr;
      if (pf)
        pf->pace((few ? Micro::k_steps(rows_, cols, d) : Micro::k_steps(cols, rp_, d)) +
                 (mask ? 0 : Micro::k_steps(rows_, dv, cols)));
      // st [cols][rp_] (ld BMp) = K Q^T, then P^T = exp2((S^T - m) * scale * log2(e)). A block of
      // few rows takes S = Q K^T (Q(r, x) = qt[x][r]) and transposes it: each score is the same FMA
      // chain over D either way, so the same bits. Without a mask, S^T's product also finds the rows'
      // maxima (bmax, its columns' maxima), which the softmax then need not look for in S^T.
      float* bmax = nullptr;
      if (few) {
        Micro::pack_t(k, ldk, cols, d, s_.kt, s_.bnp, round_up(cols, kLanes));
        Micro::gemm_fetching(rows_, cols, d, s_.qt, 1, s_.bmp, s_.kt, s_.bnp, s_.s, s_.bnp, false, nullptr, pf);
        Micro::pack_t(s_.s, s_.bnp, rows_, cols, s_.st, s_.bmp, rp_);
      } else {
        if (mask) {
          Micro::gemm_fetching(cols, rp_, d, k, ldk, 1, s_.qt, s_.bmp, s_.st, s_.bmp, false, nullptr, pf);
        } else {
          bmax = s_.bmax;
          fill(bmax, rp_, -kInf);
          Micro::gemm_col_max(cols, rp_, d, k, ldk, 1, s_.qt, s_.bmp, s_.st, s_.bmp, bmax, pf);
        }
      }
      Micro::softmax_t(s_.st, s_.bmp, rp_, cols, log2_scale(p_), mask, s_.m, s_.l, s_.alpha, bmax);
      // oacc [rows][Dv] = alpha * oacc + P V   (P(r, c) = st[c][r]); row r sums only the keys it sees
      if (mask)
        Micro::gemm_banded(rows_, dv, cols, s_.st, 1, s_.bmp, v, ldv, s_.oacc, s_.dvp, !first,
                           first ? nullptr : s_.alpha, mask->lo, mask->hi);
      else
        Micro::gemm_fetching(rows_, dv, cols, s_.st, 1, s_.bmp, v, ldv, s_.oacc, s_.dvp, !first,
                             first ? nullptr : s_.alpha, pf);
      prefetch_.step(prefetch_.quota(1));
    }

    // Share `share` of `shares` of the rows of K and V of the key block from j0, which comes next
    // (attention.h), fetched into L2 during this worker's add(), a paced step per k of its products
    // (gemm_fetching), where each work item reads its key blocks per tile (forward_per_tile: decoding).
    // Without it a key block's first reads wait on memory while the products of the one before leave
    // the memory idle; fetched in a few bursts between the products, the bursts stall the core on its
    // outstanding misses. Measured on Zen 4, side by side (Hq = 32, Hk = 8, Sq = 1, Sk = 8192, f32 rows
    // read in place rather than copied): f32 0.60 - 0.73x the time of neither at D = 128 and 0.52x at
    // D = 64 (in bursts: 0.78x and 0.61x), f16 0.80x; at the avx2 level 0.83x (BENCHMARKS.md).
    void upcoming(int64_t b, int64_t hk, int64_t j0, int64_t share, int64_t shares) {
      if (!per_tile_) return;
      const int64_t keys = min64(p_.seqlen_k, j0 + t_.bn) - j0;
      prefetch_.share_of(Prefetch::head_rows<T>(p_.k, b, hk, j0, keys, p_.head_dim),
                         Prefetch::head_rows<T>(p_.v, b, hk, j0, keys, p_.head_dim_v), share, shares);
    }

    // The query blocks of a work item share one kv head: K and V converted per tile (half precision,
    // forward_converts_per_tile) are converted once per key block, into `owner`'s scratch, and read
    // there by every block of the item.
    void share_converted(Forward& owner) { kv_owner_ = &owner; }

    // The block's rows of O (T, or f32 partial rows when the keys are split) and of the LSE.
    template <class U>
    void finish(U* o, int64_t ldo, float* lse, int64_t rows) {
      for (int64_t r = 0; r < rows; ++r) {
        // l = 0: this row sees no key; its zero accumulator gives O = 0.
        const float inv = s_.l[r] != 0.0f ? 1.0f / s_.l[r] : 0.0f;
        Micro::store_row(s_.oacc + r * s_.dvp, p_.head_dim_v, inv, o + r * ldo);
        lse[r] = lse_of(static_cast<double>(s_.m[r]) * log2_scale(p_), s_.l[r]);
      }
    }

   private:
    const ForwardJob& job_;
    const core::Problem& p_;
    Tiles t_;
    ForwardScratch s_;
    bool copied_; // K and V were converted once per call (forward_copies_once)
    bool per_tile_; // K and V are read per tile, each next key block fetched ahead (forward_per_tile)
    bool converts_; // K and V are converted or copied per tile (forward_converts_per_tile)
    Prefetch prefetch_;
    int64_t rows_ = 0, rp_ = 0;
    Forward* kv_owner_ = this; // whose kf, vf hold the converted key block (share_converted)
    int64_t kv_j0_ = -1;       // the first key of the block converted into this one's kf, vf
  };

  // Per-thread scratch of the backward, in floats:
  //   kt [D][BNp], vt [Dv][BNp]   K^T and V^T of the key block
  //   s  [BM][BNp]                S, then P
  //   ds [BM][BNp]                dP, then dS (scale folded in)
  //   dk [BN][Dp], dv [BN][Dvp]   the key block's gradient accumulators
  //   kf [BN][Dp]                 K in f32 for dQ (half precision, and f32 K whose rows lie apart)
  struct BackwardScratch {
    int64_t bnp, dp, dvp;
    float *kt, *vt, *s, *ds, *dk, *dv, *kf;

    BackwardScratch(const core::Problem& p, Tiles t, char* base, int64_t* bytes = nullptr) {
      bnp = round_up(t.bn, kLanes);
      dp = round_up(p.head_dim, kLanes);
      dvp = round_up(p.head_dim_v, kLanes);
      Carver c{base};
      kt = c.floats(p.head_dim * bnp);
      vt = c.floats(p.head_dim_v * bnp);
      s = c.floats(t.bm * bnp);
      ds = c.floats(t.bm * bnp);
      dk = c.floats(t.bn * dp);
      dv = c.floats(t.bn * dvp);
      kf = kConvert || rows_apart(p.k, p.head_dim) ? c.floats(t.bn * dp) : nullptr;
      if (bytes) *bytes = c.used;
    }
  };

  static size_t backward_scratch_bytes(const core::Problem& p, Tiles t) { return carved_bytes<BackwardScratch>(p, t); }

  class Backward {
   public:
    Backward(const BackwardJob& job, char* scratch)
        : job_(job), p_(*job.p), t_(job.tiles), s_(p_, t_, scratch), copied_(copies_qdo(p_)) {}

    // A key block: K^T, V^T (and K in f32 for dQ) packed; the accumulators zeroed.
    void begin(int64_t b, int64_t hk, int64_t j0, int64_t cols) {
      const T* k = row_ptr<const T>(p_.k, b, hk, j0);
      const T* v = row_ptr<const T>(p_.v, b, hk, j0);
      need_ds_ = job_.need_dk || job_.need_dq;
      cols_ = cols;
      Micro::pack_t(k, p_.k.ss, cols, p_.head_dim, s_.kt, s_.bnp, s_.bnp);
      if (need_ds_) Micro::pack_t(v, p_.v.ss, cols, p_.head_dim_v, s_.vt, s_.bnp, s_.bnp);
      if (job_.need_dq) kf_ = as_f32<Micro>(k, p_.k.ss, cols, p_.head_dim, s_.kf, s_.dp, &ldk_);
      if (job_.need_dk) fill(s_.dk, cols * s_.dp, 0.0f);
      if (job_.need_dv) fill(s_.dv, cols * s_.dvp, 0.0f);
    }

    // C += A B over the tile, under its mask (blocks.h: tile_product).
    void product(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool keys_are_k) {
      tile_product<Micro>(mask_, keys_are_k, m, n, kk, a, ars, aks, b, ldb, c, ldc);
    }

    // A query block of head h: S, P, dV, dP, dS, dK.
    void add(int64_t b, int64_t h, int64_t i0, int64_t rows, const Mask* mask) {
      const int64_t d = p_.head_dim, dv = p_.head_dim_v, cols = cols_;
      const int64_t row0 = (b * p_.heads_q + h) * p_.seqlen_q + i0;
      const float *q = nullptr, *dout = nullptr;
      int64_t ldq = s_.dp, lddo = s_.dvp;
      if (copied_) { // converted once per call, in the prepare phase
        float* dof;
        q = converted(job_.shared, p_, t_.bm, (b * p_.heads_q + h) * job_.q_blocks + i0 / t_.bm, &dof);
        dout = dof;
      } else if constexpr (!kConvert) { // f32 in place
        q = row_ptr<const T>(p_.q, b, h, i0);
        dout = row_ptr<const T>(p_.dout, b, h, i0);
        ldq = p_.q.ss;
        lddo = p_.dout.ss;
      }
      // Under a mask, only the rows [rb, rb + rows) that see some key of the tile and the keys
      // [kb, kb + kn) that they see (a causal diagonal tile, a window's edges: up to half of such a
      // tile is masked for every row or key). Each product still sums exactly what each row or key
      // sees; the banded products group rows from rb, so their order of terms, and the rounding, may
      // differ from the whole tile's (a function of the problem: still deterministic).
      rb_ = kb_ = 0;
      kn_ = cols;
      if (mask) {
        const VisibleSpan span = visible_span(*mask, rows, cols);
        rb_ = span.r0;
        kb_ = span.k0;
        kn_ = span.k1 - span.k0;
        rows = span.r1 - span.r0;
        tile_mask_ = VisibleSpan::at(*mask, rb_, kb_);
        q += rb_ * ldq;
        dout += rb_ * lddo;
      }
      rows_ = rows;
      mask_ = mask ? &tile_mask_ : nullptr;
      const int64_t kn = kn_, r0 = row0 + rb_;
      // s [rows][kn] = Q K^T, then P = exp2(S * scale * log2(e) - lse2), 0 where masked
      Micro::gemm(rows, kn, d, q, ldq, 1, s_.kt + kb_, s_.bnp, s_.s, s_.bnp, false, nullptr);
      Micro::probs(s_.s, s_.bnp, rows, kn, log2_scale(p_), job_.lse2 + r0, mask_);
      // dv [kn][Dv] += P^T dO
      if (job_.need_dv) product(kn, dv, rows, s_.s, 1, s_.bnp, dout, lddo, s_.dv + kb_ * s_.dvp, s_.dvp, false);
      if (!need_ds_) return;
      // ds [rows][kn] = dO V^T, then dS = P (dP - delta) * scale
      Micro::gemm(rows, kn, dv, dout, lddo, 1, s_.vt + kb_, s_.bnp, s_.ds, s_.bnp, false, nullptr);
      Micro::dscores(s_.s, s_.ds, s_.bnp, rows, kn, job_.delta + r0, p_.scale, mask_);
      // dk [kn][D] += dS^T Q
      if (job_.need_dk) product(kn, d, rows, s_.ds, 1, s_.bnp, q, ldq, s_.dk + kb_ * s_.dp, s_.dp, false);
    }

    // dq [rows][D] += dS K for the last add().
    void add_dq(float* dq, int64_t ld) {
      product(rows_, p_.head_dim, kn_, s_.ds, s_.bnp, 1, kf_ + kb_ * ldk_, ldk_, dq + rb_ * ld, ld, true);
    }

    // The key block's dK and dV rows (T, or f32 partial rows when the queries are split); null: not needed.
    template <class U>
    void finish(U* dk, int64_t lddk, U* dv, int64_t lddv, int64_t cols) {
      for (int64_t c = 0; c < cols; ++c) {
        if (dk) Micro::store_row(s_.dk + c * s_.dp, p_.head_dim, 1.0f, dk + c * lddk);
        if (dv) Micro::store_row(s_.dv + c * s_.dvp, p_.head_dim_v, 1.0f, dv + c * lddv);
      }
    }

   private:
    const BackwardJob& job_;
    const core::Problem& p_;
    Tiles t_;
    BackwardScratch s_;
    bool copied_; // Q and dO were converted once per call (copies_qdo)
    bool need_ds_ = false;
    int64_t cols_ = 0, ldk_ = 0;
    int64_t rb_ = 0, rows_ = 0, kb_ = 0, kn_ = 0; // the last add()'s rows and keys (trimmed under a mask)
    const float* kf_ = nullptr;
    Mask tile_mask_{};
    const Mask* mask_ = nullptr; // &tile_mask_ when the last add()'s tile is partially masked
  };
};

// The kernel set of an ISA for each storage type, over its f32 microkernels.
template <class Micro>
const KernelSet& f32_kernel_set(core::DType dtype) {
  switch (dtype) {
    case core::DType::bf16: return kernel_set_of<MathF32<Micro, bf16>>();
    case core::DType::f16: return kernel_set_of<MathF32<Micro, f16>>();
    case core::DType::f32: break;
  }
  return kernel_set_of<MathF32<Micro, float>>();
}

} // namespace
} // namespace flashback::cpu
