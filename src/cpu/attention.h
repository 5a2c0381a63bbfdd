// The CPU attention algorithm, written once: work items, block ranges under the mask, the dQ ordering
// and the phases. The arithmetic on one tile is a `Math` policy's (math_f32.h: f32 GEMMs over an ISA's
// microkernels; math_bf16.h: bf16 products with f32 accumulation), so each instruction set compiles
// this file, in its own translation unit with its flags, over its own tile math.
//
// Forward (FlashAttention-2): per (batch, head, query block), stream the visible key blocks with an
// online softmax; a work item takes a few query blocks of one kv head's query heads (ForwardJob::q_group)
// and gives each key block to all of them in turn. When the query side is too small to keep the
// threads busy (decoding, short chunks against long caches), each query block's visible key blocks are
// cut into ForwardJob::splits consecutive parts (FlashDecoding's split-KV): an item takes one part, its
// blocks write f32 partial outputs and LSEs, and a last phase combines each row's parts in part order.
//
// Backward: per (batch, kv head, key block), accumulate dK and dV over every query head of the group
// and every visible query block; a work item takes a few key blocks (BackwardJob::k_group) and gives
// each query block to all of them in turn. When there are too few key blocks to keep the threads busy
// (one kv head against a short key side), each key block's (query head, query block) pairs are cut into
// BackwardJob::splits consecutive parts: an item takes one part of one key block and writes f32 partial
// dK and dV rows, and a last phase adds each key's parts in part order. dQ receives each key block's
// contribution in increasing key-block order (dq_next), so the sums are the same bits for any thread
// count and schedule. Items are claimed in increasing order and an item waits only for items of its kv
// head with lower key blocks, which have lower numbers; the lowest item in progress never waits (the
// key blocks before its own are done, or its own and already added), so this cannot deadlock.
//
// A Math policy provides: T (storage type), tiles(), *_scratch_bytes() (per thread), *_shared_bytes()
// and *_prepare() (operands packed once per call, e.g. bf16 tiles; may be empty), forward_per_tile()
// (whether the forward reads K and V as rows per tile, rather than copies made once), dot(), store_row()
// (an f32 row rounded to T), and the classes Forward {begin, add, finish (into T or f32 rows)} and
// Backward {begin, add, add_dq, finish}, where add may instead come in three phases (Forward
// {add_scores, add_softmax, add_values}, Backward {add_scores, add_probs, add_grads}: math_bf16.h),
// which run for all the blocks of an item in turn; optionally Forward::share_converted() (blocks of an item read
// one worker's per-tile operands), Backward::add_dq_sum() (several workers' add_dq in one product),
// thread_begin() and thread_end() (KernelSet).
//
// Internal linkage on purpose (see blocks.h).
#pragma once

#include <sched.h>

#include <type_traits>

#include "cpu/blocks.h"

namespace flashback::cpu {
namespace {

// ---------------------------------------------------------------------------------------------------
// Work items of several blocks

// The tile workers (Math::Forward or Math::Backward) of an item of `blocks` blocks, each on its own
// job.block_scratch bytes of the thread's scratch; those past `blocks` share the first one's and are
// never begun.
template <class W>
struct Workers {
  W at[kMaxGroup];
};
template <class W, class Job>
Workers<W> workers(const Job& job, char* scratch, int64_t blocks) {
  auto of = [&](int64_t g) { return scratch + (g < blocks ? g : 0) * job.block_scratch; };
  static_assert(kMaxGroup == 4);
  return {{{job, of(0)}, {job, of(1)}, {job, of(2)}, {job, of(3)}}};
}

// The blocks of `size` that hold elements [first, last]; an empty range (first > last) gives
// *block_last = *block_first - 1.
inline void block_range(int64_t first, int64_t last, int64_t size, int64_t* block_first, int64_t* block_last) {
  *block_first = first / size;
  *block_last = first <= last ? last / size : *block_first - 1;
}

// ---------------------------------------------------------------------------------------------------
// Forward

// A forward work item: the query blocks [first_x, first_x + blocks) of kv head (b, hk)'s run of query
// blocks, x = (h - first head) * q_blocks + ib, and the part of their keys (splits = 1: all of them).
// The query blocks of a kv head's group of query heads, in a row: an item takes q_group of them in a
// row, so that it shares the keys and values between query blocks of a head (long sequences) or
// between the heads of a group (short ones, as in decoding). Items take the runs from the last down:
// under a causal mask the last query blocks of a head see the most keys, so the dynamic schedule
// starts with the longest ones.
struct ForwardItem {
  int64_t b, hk, first_x, blocks, part;
};
inline int64_t forward_runs(const ForwardJob& job) {
  return (job.p->group() * job.q_blocks + job.q_group - 1) / job.q_group;
}
inline ForwardItem forward_item_at(const ForwardJob& job, int64_t item) {
  const core::Problem& p = *job.p;
  const int64_t runs = forward_runs(job), run = item / job.splits;
  const int64_t bhk = run / runs, first_x = (runs - 1 - run % runs) * job.q_group;
  return {bhk / p.heads_kv, bhk % p.heads_kv, first_x, min64(job.q_group, p.group() * job.q_blocks - first_x),
          item % job.splits};
}
// Query block g of an item: its head, first row and rows, and the key blocks of its part that its rows
// see, [jfirst, jlast] (none: jfirst > jlast).
struct ForwardBlock {
  int64_t h, i0, rows, jfirst, jlast;
};
inline ForwardBlock forward_block(const ForwardJob& job, const ForwardItem& it, int64_t g) {
  const core::Problem& p = *job.p;
  const Tiles t = job.tiles;
  const int64_t x = it.first_x + g;
  ForwardBlock k;
  k.h = it.hk * p.group() + x / job.q_blocks;
  k.i0 = x % job.q_blocks * t.bm;
  k.rows = min64(p.seqlen_q, k.i0 + t.bm) - k.i0;
  int64_t kfirst, klast;
  p.band.keys_of_rows(k.i0, k.i0 + k.rows, p.seqlen_k, &kfirst, &klast);
  block_range(kfirst, klast, t.bn, &k.jfirst, &k.jlast);
  if (job.splits > 1) { // this part's share of the key blocks: [first + part n / s, first + (part + 1) n / s)
    const int64_t n = k.jlast - k.jfirst + 1;
    if (n > 0) {
      k.jlast = k.jfirst + (it.part + 1) * n / job.splits - 1;
      k.jfirst += it.part * n / job.splits;
    }
  }
  return k;
}

// The rows of Q, K and V that forward item `item` reads first, in the lines of `ahead` (all or none:
// Prefetch::kMaxBytes): its query blocks' rows of the first block's head, and the rows of the keys its
// blocks see, which the tile math reads per tile where each key block serves few query blocks
// (Math::forward_per_tile: short sequences, decoding). Else nothing: the tile math reads packed or
// converted copies there, and each key block serves many items.
template <class Math>
void fetch_item_rows(const ForwardJob& job, int64_t item, Prefetch& ahead) {
  using T = typename Math::T;
  const core::Problem& p = *job.p;
  if (!Math::forward_per_tile(p, job.tiles)) return;
  const ForwardItem it = forward_item_at(job, item);
  const ForwardBlock first = forward_block(job, it, 0);
  int64_t rows = 0, jmin = job.kv_blocks, jmax = -1;
  for (int64_t g = 0; g < it.blocks; ++g) {
    const ForwardBlock k = forward_block(job, it, g);
    if (k.h == first.h) rows = k.i0 + k.rows - first.i0;
    if (k.jfirst > k.jlast) continue;
    jmin = min64(jmin, k.jfirst);
    jmax = jmax > k.jlast ? jmax : k.jlast;
  }
  const int64_t j0 = jmin * job.tiles.bn, keys = jmax < jmin ? 0 : min64(p.seqlen_k, (jmax + 1) * job.tiles.bn) - j0;
  ahead.share_of({Prefetch::head_rows<T>(p.q, it.b, first.h, first.i0, rows, p.head_dim),
                  Prefetch::head_rows<T>(p.k, it.b, it.hk, j0, keys, p.head_dim),
                  Prefetch::head_rows<T>(p.v, it.b, it.hk, j0, keys, p.head_dim_v)},
                 0, 1);
}

template <class Math>
void forward_item(const ForwardJob& job, int64_t item, char* scratch) {
  using T = typename Math::T;
  using Forward = typename Math::Forward;
  const core::Problem& p = *job.p;
  const Tiles t = job.tiles;
  const ForwardItem it = forward_item_at(job, item);
  const int64_t b = it.b, hk = it.hk, blocks = it.blocks, part = it.part;

  // Each query block g has its scratch, its head h[g], its first row i0[g] and its key blocks
  // [jfirst[g], jlast[g]]; key block jb is added to every query block that sees it, one after the
  // other, while its keys and values are in cache. Each query block still receives its key blocks in
  // increasing order, as alone.
  Workers<Forward> group = workers<Forward>(job, scratch, blocks);
  Forward* f = group.at;
  if constexpr (requires { f[0].share_converted(f[0]); }) // operands the tile math converts per key block
    for (int64_t g = 1; g < blocks; ++g) f[g].share_converted(f[0]);
  int64_t h[kMaxGroup], i0[kMaxGroup], jfirst[kMaxGroup], jlast[kMaxGroup];
  int64_t jmin = job.kv_blocks, jmax = -1;
  // Block g's output rows: the caller's O and LSE, or (split) its part's f32 partial rows.
  auto finish = [&](int64_t g, auto&& store) {
    if (job.splits > 1) {
      float* o = job.partial_of(b, h[g], i0[g], part);
      store(o, job.partial_ld, o + job.partial_rows * job.partial_ld);
    } else {
      store(row_ptr<T>(p.o, b, h[g], i0[g]), p.o.ss, p.lse.data + b * p.lse.sb + h[g] * p.lse.sh + i0[g]);
    }
  };
  for (int64_t g = 0; g < blocks; ++g) {
    const ForwardBlock k = forward_block(job, it, g);
    h[g] = k.h;
    i0[g] = k.i0;
    jfirst[g] = k.jfirst;
    jlast[g] = k.jlast;
    const int64_t rows = k.rows;
    if (jfirst[g] > jlast[g]) { // no row of the block sees a key (of this part)
      finish(g, [&](auto* o, int64_t ldo, float* lse) {
        using U = std::remove_pointer_t<decltype(o)>;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < p.head_dim_v; ++c) o[r * ldo + c] = from_float<U>(0.0f);
          lse[r] = -kInf;
        }
      });
      continue;
    }
    f[g].begin(b, h[g], i0[g], rows);
    jmin = min64(jmin, jfirst[g]);
    jmax = jmax > jlast[g] ? jmax : jlast[g];
  }
  // The item this thread likely takes next (items are claimed in increasing order, and where they are
  // short they take about the same time: item + threads) is fetched into L2 during this one, a share
  // before each tile's last products (add, or add_values where the tile math has phases): its first
  // reads otherwise wait on memory. Measured on Zen 4 (bench/ab.cpp, Hq = 16, D = 64, inputs larger
  // than the caches): f32 0.88x the forward's time at S = 64, 0.97x at 128 and 197, 0.99x at 256;
  // bf16 0.92x, 0.97x, 0.98x, 0.99x (BENCHMARKS.md).
  Prefetch ahead;
  if (item + job.threads < job.items) fetch_item_rows<Math>(job, item + job.threads, ahead);
  int64_t tiles_left = 0;
  for (int64_t g = 0; g < blocks; ++g) tiles_left += jfirst[g] <= jlast[g] ? jlast[g] - jfirst[g] + 1 : 0;
  auto step_ahead = [&] {
    ahead.step(ahead.quota(tiles_left));
    if (tiles_left > 1) --tiles_left;
  };
  for (int64_t jb = jmin; jb <= jmax; ++jb) {
    const int64_t j0 = jb * t.bn, cols = min64(p.seqlen_k, j0 + t.bn) - j0;
    // The next key block is brought into cache while this one's tiles run: each query block that sees
    // this one fetches a share of it (Math::Forward::upcoming, where the tile math has it).
    if constexpr (requires { f[0].upcoming(b, hk, j0, jb, jb); }) {
      if (jb < jmax) {
        int64_t seen = 0, share = 0;
        for (int64_t g = 0; g < blocks; ++g) seen += jb >= jfirst[g] && jb <= jlast[g];
        for (int64_t g = 0; g < blocks; ++g)
          if (jb >= jfirst[g] && jb <= jlast[g]) f[g].upcoming(b, hk, j0 + t.bn, share++, seen);
      }
    }
    // Where the tile math has add() in phases (math_bf16.h), each phase runs for all the query blocks
    // in turn, so that their products on tiles run together, between the vector passes; each block's
    // own operations keep their order, so the results are the same bits.
    // A partially masked tile's width ends at the last key one of its rows sees (a causal diagonal):
    // the keys after it take no part in the phases.
    Mask masks[kMaxGroup];
    const Mask* mask[kMaxGroup] = {}; // &masks[g] where the tile is partially masked
    bool sees[kMaxGroup];
    int64_t width[kMaxGroup];
    for (int64_t g = 0; g < blocks; ++g) {
      sees[g] = jb >= jfirst[g] && jb <= jlast[g];
      if (!sees[g]) continue;
      const int64_t rows = min64(p.seqlen_q, i0[g] + t.bm) - i0[g];
      masks[g] = tile_mask(p.band, i0[g], j0);
      if (!p.band.covers(i0[g], i0[g] + rows, j0, j0 + cols)) mask[g] = &masks[g];
      width[g] = mask[g] ? visible_span(masks[g], rows, cols).k1 : cols;
    }
    if constexpr (requires { f[0].add_scores(b, hk, j0, cols); }) {
      for (int64_t g = 0; g < blocks; ++g)
        if (sees[g]) f[g].add_scores(b, hk, j0, width[g]);
      for (int64_t g = 0; g < blocks; ++g)
        if (sees[g]) f[g].add_softmax(width[g], mask[g]);
      for (int64_t g = 0; g < blocks; ++g) {
        if (!sees[g]) continue;
        step_ahead();
        f[g].add_values(b, hk, j0, width[g], mask[g], jb == jfirst[g]);
      }
    } else {
      for (int64_t g = 0; g < blocks; ++g) {
        if (!sees[g]) continue;
        step_ahead();
        f[g].add(b, hk, j0, cols, mask[g], jb == jfirst[g]);
      }
    }
  }
  for (int64_t g = 0; g < blocks; ++g) {
    if (jfirst[g] > jlast[g]) continue;
    const int64_t rows = min64(p.seqlen_q, i0[g] + t.bm) - i0[g];
    finish(g, [&](auto* o, int64_t ldo, float* lse) { f[g].finish(o, ldo, lse, rows); });
  }
}

// Rows [begin, end) of the flattened (batch, head, query) index, when the keys were split: each row's
// parts combined in part order, O = sum_k w_k O_k and LSE = log sum_k exp(LSE_k), w_k = exp(LSE_k - LSE)
// (in double, rounded once), O rounded to T once. A row that saw no key in any part: O = 0, LSE = -inf;
// a NaN in a part's LSE (a non-finite input the row sees) makes the row's outputs NaN.
template <class Math>
void forward_combine(const ForwardJob& job, int64_t begin, int64_t end) {
  using T = typename Math::T;
  const core::Problem& p = *job.p;
  const int64_t s = job.splits, dv = p.head_dim_v;
  float acc[core::kMaxHeadDim];
  const float* part_o[kMaxSplits];
  double w[kMaxSplits];
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bh = row / p.seqlen_q, i = row % p.seqlen_q;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const int64_t i0 = i / job.tiles.bm * job.tiles.bm;
    double mx = -kInf;
    bool nan = false;
    for (int64_t k = 0; k < s; ++k) {
      const float* o = job.partial_of(b, h, i0, k);
      part_o[k] = o + (i - i0) * job.partial_ld;
      w[k] = o[job.partial_rows * job.partial_ld + (i - i0)]; // the part's LSE
      nan = nan || w[k] != w[k];
      mx = w[k] > mx ? w[k] : mx;
    }
    float* lse = p.lse.data + b * p.lse.sb + h * p.lse.sh + i;
    if (nan || mx == -kInf) { // NaN, or no key in any part
      const float fill_value = nan ? __builtin_nanf("") : 0.0f;
      for (int64_t c = 0; c < dv; ++c) acc[c] = fill_value;
      *lse = nan ? fill_value : -kInf;
    } else {
      double sum = 0;
      for (int64_t k = 0; k < s; ++k) sum += (w[k] = __builtin_exp(w[k] - mx));
      *lse = static_cast<float>(mx + __builtin_log(sum));
      for (int64_t c = 0; c < dv; ++c) acc[c] = 0.0f;
      for (int64_t k = 0; k < s; ++k) {
        const float wk = static_cast<float>(w[k] / sum);
        for (int64_t c = 0; c < dv; ++c) acc[c] += wk * part_o[k][c];
      }
    }
    Math::store_row(acc, dv, 1.0f, row_ptr<T>(p.o, b, h, i));
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward

template <class Math>
void backward_rows(const BackwardJob& job, int64_t begin, int64_t end) {
  using T = typename Math::T;
  const core::Problem& p = *job.p;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bh = row / p.seqlen_q, i = row % p.seqlen_q;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const float dl = Math::dot(row_ptr<const T>(p.dout, b, h, i), row_ptr<const T>(p.o, b, h, i), p.head_dim_v);
    job.delta[row] = dl;
    if (p.delta) p.delta.data[b * p.delta.sb + h * p.delta.sh + i] = dl;
    job.lse2[row] = lse2_of(p.lse.data[b * p.lse.sb + h * p.lse.sh + i]);
    if (job.need_dq) {
      fill(job.dq_acc + b * job.dq_sb + h * job.dq_sh + i * job.dq_ss, p.head_dim, 0.0f);
      if (i % job.tiles.bm == 0) { // the first key block that adds to this query block
        int64_t kfirst, klast;
        p.band.keys_of_rows(i, min64(p.seqlen_q, i + job.tiles.bm), p.seqlen_k, &kfirst, &klast);
        job.dq_next[bh * job.q_blocks + i / job.tiles.bm] = kfirst <= klast ? kfirst / job.tiles.bn : 0;
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

inline void pass_turn(int64_t* next, int64_t jb) { __atomic_store_n(next, jb + 1, __ATOMIC_RELEASE); }

// dq += the dS K of n workers (consecutive key blocks, unmasked tiles), in order: the tile math's
// add_dq_sum where it has one, else each worker's add_dq.
template <class Backward>
void add_dq_sum(Backward* w, int64_t n, float* dq, int64_t ld) {
  if constexpr (requires { Backward::add_dq_sum(w, n, dq, ld); }) {
    Backward::add_dq_sum(w, n, dq, ld);
  } else {
    for (int64_t g = 0; g < n; ++g) w[g].add_dq(dq, ld);
  }
}

// A backward work item: the key blocks [first_jb, first_jb + blocks) of kv head (b, hk), and the part
// of their (query head, query block) pairs (splits = 1: all of them). Items = (group of key blocks, kv
// head), the kv heads of a group in a row: the items of one kv head, which wait for each other's dQ
// turns, are B Hk apart, so the threads run different heads at once rather than the next item of a
// head, which would wait for the one before it to reach its query blocks each time it starts (up to a
// tenth of a causal backward, whose items get shorter). The first groups (under a causal mask the
// longest) still come first. With split queries, the parts of a key block are consecutive items: an
// item still waits only for lower key blocks.
struct BackwardItem {
  int64_t b, hk, first_jb, blocks, part;
};
inline BackwardItem backward_item_at(const BackwardJob& job, int64_t item) {
  const core::Problem& p = *job.p;
  const int64_t heads = p.batch * p.heads_kv, group = item / job.splits;
  const int64_t bhk = group % heads, first_jb = group / heads * job.k_group;
  return {bhk / p.heads_kv, bhk % p.heads_kv, first_jb, min64(job.k_group, job.kv_blocks - first_jb),
          item % job.splits};
}

// The rows of K and V of backward item `item`'s key blocks, in the lines of `ahead` (all or none:
// Prefetch::kMaxBytes): every tile math reads them first, as it packs its key blocks (Backward::begin).
template <class Math>
void fetch_key_rows(const BackwardJob& job, int64_t item, Prefetch& ahead) {
  using T = typename Math::T;
  const core::Problem& p = *job.p;
  const BackwardItem it = backward_item_at(job, item);
  const int64_t j0 = it.first_jb * job.tiles.bn, keys = min64(p.seqlen_k, j0 + it.blocks * job.tiles.bn) - j0;
  ahead.share_of({Prefetch::head_rows<T>(p.k, it.b, it.hk, j0, keys, p.head_dim),
                  Prefetch::head_rows<T>(p.v, it.b, it.hk, j0, keys, p.head_dim_v), Prefetch::Region()},
                 0, 1);
}

template <class Math>
void backward_item(const BackwardJob& job, int64_t item, char* scratch) {
  using T = typename Math::T;
  using Backward = typename Math::Backward;
  const core::Problem& p = *job.p;
  const Tiles t = job.tiles;
  const BackwardItem it = backward_item_at(job, item);
  const int64_t b = it.b, hk = it.hk, first_jb = it.first_jb, blocks = it.blocks, part = it.part;

  // Each key block g has its scratch and its query blocks [ifirst[g], ilast[g]]; query block ib is
  // given to every key block that it sees, in increasing key-block order, while its rows are in cache.
  Workers<Backward> group = workers<Backward>(job, scratch, blocks);
  Backward* w = group.at;
  int64_t ifirst[kMaxGroup], ilast[kMaxGroup];
  int64_t imin = job.q_blocks, imax = -1;
  for (int64_t g = 0; g < blocks; ++g) {
    const int64_t j0 = (first_jb + g) * t.bn, cols = min64(p.seqlen_k, j0 + t.bn) - j0;
    w[g].begin(b, hk, j0, cols);
    int64_t rfirst, rlast;
    p.band.rows_of_keys(j0, j0 + cols, p.seqlen_q, &rfirst, &rlast);
    block_range(rfirst, rlast, t.bm, &ifirst[g], &ilast[g]);
    if (ifirst[g] <= ilast[g]) {
      imin = min64(imin, ifirst[g]);
      imax = imax > ilast[g] ? imax : ilast[g];
    }
  }
  // The item this thread likely takes next (item + threads, as in the forward) is fetched into L2
  // during this one, a share after each query block: its K and V rows, which it reads first (its Q and
  // dO are the tile math's copies or rows). Measured on Zen 4 as the forward: f32 0.95x the backward's
  // time at S = 64, 0.96x at 128, 0.97x at 197 and 256; bf16 0.98 - 1.02x (BENCHMARKS.md).
  Prefetch ahead;
  if (item + job.threads < job.items) fetch_key_rows<Math>(job, item + job.threads, ahead);
  // The pairs (query head, query block) in order, x = (h - first head) * span + (ib - imin); this
  // part's share: [part n / s, (part + 1) n / s) (split queries have one key block per item).
  const int64_t span = imax - imin + 1, pairs = imin <= imax ? p.group() * span : 0;
  const int64_t x_end = (part + 1) * pairs / job.splits;
  for (int64_t x = part * pairs / job.splits; x < x_end; ++x) {
    const int64_t h = hk * p.group() + x / span, ib = imin + x % span;
    const int64_t i0 = ib * t.bm, rows = min64(p.seqlen_q, i0 + t.bm) - i0;
    // The item's next query block is brought into cache while this one's tiles run: each key block
    // that sees this one fetches a share of its operands (Math::Backward::upcoming, where the tile
    // math has it), whose first use otherwise waited on memory.
    if constexpr (requires(Backward& bw) { bw.upcoming(b, h, i0, rows, x, x); }) {
      if (x + 1 < x_end) {
        const int64_t h1 = hk * p.group() + (x + 1) / span, i1 = (imin + (x + 1) % span) * t.bm;
        const int64_t rows1 = min64(p.seqlen_q, i1 + t.bm) - i1;
        int64_t seen = 0, share = 0;
        for (int64_t g = 0; g < blocks; ++g) seen += ib >= ifirst[g] && ib <= ilast[g];
        for (int64_t g = 0; g < blocks; ++g)
          if (ib >= ifirst[g] && ib <= ilast[g]) w[g].upcoming(b, h1, i1, rows1, share++, seen);
      }
    }
    // The key blocks that see this query block: gs .. gs + n - 1 (consecutive: the band's). Where the
    // tile math has add() in phases (math_bf16.h), each phase runs for all of them in turn, so that
    // their products on tiles run together, between the vector passes; each block's own operations
    // keep their order, so the results are the same bits.
    int64_t gs = -1, n = 0;
    bool masked[kMaxGroup] = {};
    constexpr bool phased = requires(Backward& bw) { bw.add_scores(b, h, i0, rows, nullptr); };
    for (int64_t g = 0; g < blocks; ++g) {
      if (ib < ifirst[g] || ib > ilast[g]) continue;
      const int64_t jb = first_jb + g, j0 = jb * t.bn, cols = min64(p.seqlen_k, j0 + t.bn) - j0;
      const Mask mask = tile_mask(p.band, i0, j0);
      masked[g] = !p.band.covers(i0, i0 + rows, j0, j0 + cols);
      if constexpr (phased) w[g].add_scores(b, h, i0, rows, masked[g] ? &mask : nullptr);
      else w[g].add(b, h, i0, rows, masked[g] ? &mask : nullptr);
      if (gs < 0) gs = g;
      ++n;
    }
    if constexpr (phased) {
      for (int64_t g = gs; g < gs + n; ++g) w[g].add_probs(b, h, i0);
      for (int64_t g = gs; g < gs + n; ++g) w[g].add_grads(b, h, i0);
    }
    if (job.need_dq && n > 0) { // dq [rows][D] += dS K, in key-block order
      int64_t* next = job.dq_next + (b * p.heads_q + h) * job.q_blocks + ib;
      float* dq = job.dq_acc + b * job.dq_sb + h * job.dq_sh + i0 * job.dq_ss;
      wait_turn(next, first_jb + gs);
      for (int64_t g = gs, end = gs + n; g < end;) {
        int64_t run = 1; // unmasked key blocks in a row go in one product where the tile math has one
        while (!masked[g] && g + run < end && !masked[g + run]) ++run;
        if (run > 1) {
          add_dq_sum<Backward>(w + g, run, dq, job.dq_ss);
        } else {
          w[g].add_dq(dq, job.dq_ss);
        }
        g += run;
      }
      pass_turn(next, first_jb + gs + n - 1);
    }
    ahead.step(ahead.quota(x_end - x));
  }
  // The key blocks' dK and dV rows: the caller's, or (split) this part's f32 partial rows.
  for (int64_t g = 0; g < blocks; ++g) {
    const int64_t jb = first_jb + g, j0 = jb * t.bn, cols = min64(p.seqlen_k, j0 + t.bn) - j0;
    if (job.splits > 1) {
      float* dk = job.partial_of(b, hk, jb, part);
      float* dv = dk + job.partial_rows * job.partial_ldk;
      w[g].finish(job.need_dk ? dk : nullptr, job.partial_ldk, job.need_dv ? dv : nullptr, job.partial_ldv, cols);
    } else {
      w[g].finish(job.need_dk ? row_ptr<T>(p.dk, b, hk, j0) : nullptr, p.dk.ss,
                  job.need_dv ? row_ptr<T>(p.dv, b, hk, j0) : nullptr, p.dv.ss, cols);
    }
  }
}

// Rows [begin, end) of the flattened (batch, kv head, key) index, when the queries were split: dK and
// dV of each key, the sum of its parts' f32 rows in part order, rounded to T once.
template <class Math>
void backward_combine(const BackwardJob& job, int64_t begin, int64_t end) {
  using T = typename Math::T;
  const core::Problem& p = *job.p;
  float acc[core::kMaxHeadDim];
  auto combine = [&](int64_t b, int64_t hk, int64_t j, int64_t offset, int64_t ld, int64_t n,
                     const core::Strided4& out) {
    const int64_t jb = j / job.tiles.bn, c = j % job.tiles.bn;
    for (int64_t k = 0; k < job.splits; ++k) {
      const float* src = job.partial_of(b, hk, jb, k) + offset + c * ld;
      for (int64_t x = 0; x < n; ++x) acc[x] = k == 0 ? src[x] : acc[x] + src[x];
    }
    Math::store_row(acc, n, 1.0f, row_ptr<T>(out, b, hk, j));
  };
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bh = row / p.seqlen_k, j = row % p.seqlen_k;
    const int64_t b = bh / p.heads_kv, hk = bh % p.heads_kv;
    if (job.need_dk) combine(b, hk, j, 0, job.partial_ldk, p.head_dim, p.dk);
    if (job.need_dv) combine(b, hk, j, job.partial_rows * job.partial_ldk, job.partial_ldv, p.head_dim_v, p.dv);
  }
}

// Rows [begin, end) of dq from the f32 accumulator (half precision: rounded once, at the end).
template <class Math>
void backward_store_dq(const BackwardJob& job, int64_t begin, int64_t end) {
  using T = typename Math::T;
  const core::Problem& p = *job.p;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bh = row / p.seqlen_q, i = row % p.seqlen_q;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    Math::store_row(job.dq_acc + b * job.dq_sb + h * job.dq_sh + i * job.dq_ss, p.head_dim, 1.0f,
              row_ptr<T>(p.dq, b, h, i));
  }
}

template <class Math>
constexpr void (*thread_begin_of())() {
  if constexpr (requires { Math::thread_begin(); }) return &Math::thread_begin;
  return nullptr;
}
template <class Math>
constexpr void (*thread_end_of())() {
  if constexpr (requires { Math::thread_end(); }) return &Math::thread_end;
  return nullptr;
}

template <class Math>
const KernelSet& kernel_set_of() {
  static const KernelSet set{
      Math::isa,
      &Math::tiles,
      &Math::forward_scratch_bytes,
      &Math::forward_shared_bytes,
      &Math::forward_prepare_items,
      &Math::forward_prepare,
      &forward_item<Math>,
      &forward_combine<Math>,
      &Math::backward_scratch_bytes,
      &Math::backward_shared_bytes,
      &Math::backward_prepare_items,
      &Math::backward_prepare,
      &backward_rows<Math>,
      &backward_item<Math>,
      &backward_combine<Math>,
      &backward_store_dq<Math>,
      thread_begin_of<Math>(),
      thread_end_of<Math>(),
  };
  return set;
}

} // namespace
} // namespace flashback::cpu
