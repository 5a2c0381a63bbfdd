#include "cpu/backend.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "cpu/kernels.h"

namespace flashback::cpu {
namespace {

constexpr size_t kAlign = 64;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

char* align_ptr(void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<char*>((u + kAlign - 1) / kAlign * kAlign);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

const KernelSet& active_kernels(const core::Problem& p) {
  return kernels_for(active_isa(), p.dtype, std::max(p.head_dim, p.head_dim_v));
}

// Forward items are groups of `group` query blocks of the query heads of one kv head; backward items,
// groups of `group` key blocks of one kv head.
int64_t forward_items(const core::Problem& p, Tiles t, int64_t group) {
  return p.batch * p.heads_kv * ceil_div(p.group() * ceil_div(p.seqlen_q, t.bm), group);
}
int64_t backward_items(const core::Problem& p, Tiles t, int64_t group) {
  return p.batch * p.heads_kv * ceil_div(ceil_div(p.seqlen_k, t.bn), group);
}

// Threads that can have work: never more than the items.
int threads_for(const core::Problem& p, int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(resolve_threads(p), items)));
}

// Claims items [0, n) in increasing order, one at a time, across the team.
template <class Fn>
void claim_items(std::atomic<int64_t>& next, int64_t n, Fn&& fn) {
  for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(item);
}

// Runs the work items a thread claims, inside the kernel set's per-thread state (AMX tiles).
template <class Fn>
void claim_work_items(const KernelSet& ks, std::atomic<int64_t>& next, int64_t n, Fn&& fn) {
  if (ks.thread_begin) ks.thread_begin();
  claim_items(next, n, fn);
  if (ks.thread_end) ks.thread_end();
}

// The forward's workspace: per-thread scratch (one block per query block of an item), the operands
// the tile math packs once per call, then (split keys only) the parts' f32 rows.
struct ForwardLayout {
  Tiles tiles;
  int threads = 1;
  int64_t group = 1, splits = 1, partial_rows = 0, partial_ld = 0;
  size_t block = 0, shared = 0, partial = 0;
  size_t scratch() const { return group * block; } // per thread
  size_t total() const { return kAlign + threads * scratch() + shared + partial; }
};

// Split keys (FlashDecoding): when the query side has fewer than kSplitPieces query blocks (decoding,
// a short chunk against a long cache), each block's visible key blocks are cut into parts of at least
// kSplitMinBlocks blocks, enough parts to make about kSplitPieces pieces of work. A function of the
// problem only, never of the thread count, so the results are the same bits for any thread count; and
// of quantities that swapping the decoding heads (below) leaves alone, so swapped or not, the same bits.
// The query side counts the rows of a kv head's group together (B Hk ceil(G Sq / BM) blocks, as a
// swapped decoding problem has them); the keys, those a row sees (Sk, or a window's width).
constexpr int64_t kSplitPieces = kMaxSplits, kSplitMinBlocks = 8;
int64_t splits_for(const core::Problem& p, Tiles t) {
  const int64_t query_blocks = p.batch * p.heads_kv * ceil_div(p.group() * p.seqlen_q, t.bm);
  if (query_blocks == 0 || query_blocks >= kSplitPieces) return 1;
  const int64_t width = std::min<int64_t>(p.seqlen_k, p.band.dhi - p.band.dlo + 1);
  const int64_t parts = std::min(ceil_div(kSplitPieces, query_blocks), ceil_div(width, t.bn) / kSplitMinBlocks);
  return std::max<int64_t>(1, parts);
}

// Split queries, the backward's counterpart: when there are fewer than kSplitPieces key blocks (one kv
// head against a short key side, however long the query side), each key block's (query head, query
// block) pairs are cut into parts of at least kSplitMinPairs pairs, enough parts to make about
// kSplitPieces pieces of work. A function of the problem only, never of the thread count. The query
// side counts the pairs of the key block that sees the most query blocks (G of them per query block).
constexpr int64_t kSplitMinPairs = 4;
int64_t backward_splits_for(const core::Problem& p, Tiles t) {
  const int64_t kv_blocks = ceil_div(p.seqlen_k, t.bn), key_blocks = p.batch * p.heads_kv * kv_blocks;
  if (key_blocks == 0 || key_blocks >= kSplitPieces) return 1;
  int64_t most = 0; // fewer than kSplitPieces key blocks to look at
  for (int64_t jb = 0; jb < kv_blocks; ++jb) {
    int64_t first, last;
    p.band.rows_of_keys(jb * t.bn, std::min(p.seqlen_k, (jb + 1) * t.bn), p.seqlen_q, &first, &last);
    if (first <= last) most = std::max(most, last / t.bm - first / t.bm + 1);
  }
  return std::max<int64_t>(1, std::min(ceil_div(kSplitPieces, key_blocks), p.group() * most / kSplitMinPairs));
}

// Blocks per work item: up to kMaxGroup, so that the operands the blocks share (the keys and values of
// a kv head in the forward; the queries, dO and dQ rows in the backward) are read from memory once per
// group rather than once per block, while every thread still has at least 4 items to balance. A
// function of the problem and the thread count only; the results do not depend on it.
template <class Items>
int64_t group_for(const core::Problem& p, Tiles t, Items&& items) {
  const int64_t want = 4 * static_cast<int64_t>(resolve_threads(p));
  int64_t group = kMaxGroup;
  while (group > 1 && items(p, t, group) < want) group /= 2;
  return group;
}

ForwardLayout forward_layout(const core::Problem& p, const KernelSet& ks) {
  ForwardLayout l;
  l.tiles = ks.tiles(p, false);
  l.splits = splits_for(p, l.tiles);
  auto items = [&](const core::Problem& q, Tiles t, int64_t group) { return forward_items(q, t, group) * l.splits; };
  l.group = group_for(p, l.tiles, items);
  l.threads = threads_for(p, items(p, l.tiles, l.group));
  l.block = align_up(ks.forward_scratch_bytes(p, l.tiles));
  l.shared = align_up(ks.forward_shared_bytes(p, l.tiles));
  if (l.splits > 1) {
    l.partial_rows = std::min(p.seqlen_q, l.tiles.bm);
    l.partial_ld = ceil_div(p.head_dim_v, 16) * 16;
    const int64_t parts = p.batch * p.heads_q * ceil_div(p.seqlen_q, l.tiles.bm) * l.splits;
    l.partial = static_cast<size_t>(parts * ForwardJob::partial_floats(l.partial_rows, l.partial_ld)) * sizeof(float);
  }
  return l;
}

// The backward's workspace, in order: per-thread scratch, delta and lse2 rows, the dQ turn counters,
// (for half-precision dq only) an f32 dQ accumulator, the operands packed once per call, then (split
// queries only) the parts' f32 dK and dV rows.
struct BackwardLayout {
  Tiles tiles;
  int threads = 1;
  int64_t group = 1, splits = 1, partial_rows = 0, partial_ldk = 0, partial_ldv = 0;
  size_t block = 0, rows = 0, counters = 0, dq_acc = 0, shared = 0, partial = 0;
  size_t scratch() const { return group * block; } // per thread
  size_t total() const { return kAlign + threads * scratch() + 2 * rows + counters + dq_acc + shared + partial; }
};

BackwardLayout backward_layout(const core::Problem& p, const KernelSet& ks) {
  BackwardLayout l;
  l.tiles = ks.tiles(p, true);
  l.splits = backward_splits_for(p, l.tiles);
  auto items = [&](const core::Problem& q, Tiles t, int64_t group) { return backward_items(q, t, group) * l.splits; };
  l.group = l.splits > 1 ? 1 : group_for(p, l.tiles, items); // a part's pairs take one key block
  l.threads = threads_for(p, items(p, l.tiles, l.group));
  l.block = align_up(ks.backward_scratch_bytes(p, l.tiles));
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  l.rows = align_up(static_cast<size_t>(rows) * sizeof(float));
  if (p.dq) {
    l.counters = align_up(static_cast<size_t>(p.batch * p.heads_q * ceil_div(p.seqlen_q, l.tiles.bm)) * sizeof(int64_t));
    if (p.dtype != core::DType::f32) l.dq_acc = align_up(static_cast<size_t>(rows * p.head_dim) * sizeof(float));
  }
  l.shared = align_up(ks.backward_shared_bytes(p, l.tiles));
  if (l.splits > 1 && (p.dk || p.dv)) {
    l.partial_rows = std::min(p.seqlen_k, l.tiles.bn);
    l.partial_ldk = ceil_div(p.head_dim, 16) * 16;
    l.partial_ldv = ceil_div(p.head_dim_v, 16) * 16;
    const int64_t parts = p.batch * p.heads_kv * ceil_div(p.seqlen_k, l.tiles.bn) * l.splits;
    const int64_t floats = parts * BackwardJob::partial_floats(l.partial_rows, l.partial_ldk, l.partial_ldv);
    l.partial = static_cast<size_t>(floats) * sizeof(float);
  }
  return l;
}

// Runs body(thread, threads) on a team of `threads`. One thread runs on the caller's thread without
// entering OpenMP at all: no fork/join cost for small calls, and nothing a race detector cannot see
// (RELIABILITY.md: ThreadSanitizer runs with num_threads = 1 per caller).
template <class Body>
void run_team(int threads, Body&& body) {
  if (threads == 1) {
    body(0, 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  body(omp_get_thread_num(), omp_get_num_threads());
}

// Thread tid's share [begin, end) of n rows split evenly over nt threads (the static row phases).
struct RowShare {
  int64_t begin, end;
};
RowShare row_share(int64_t n, int tid, int nt) {
  const int64_t per = ceil_div(n, nt);
  return {std::min(n, tid * per), std::min(n, (tid + 1) * per)};
}

void team_barrier(int threads) {
  if (threads > 1) {
#pragma omp barrier
  }
}

} // namespace

const KernelSet& kernels_for(Isa isa, core::DType dtype, int64_t head_dim) {
  const Isa machine = machine_isa();
  // f16 with small head dims: the f32 kernels (the avx512bf16 level runs them for f16) rather than tiles.
  if (dtype == core::DType::f16 && isa >= Isa::amx && head_dim < kF16TilesMinHeadDim) isa = Isa::avx512bf16;
  const bool bf16_dot = dtype == core::DType::bf16 && isa >= Isa::avx512bf16 && bf16_dot_preferred();
#if defined(FLASHBACK_HAVE_AVX512BF16_KERNELS)
  // bf16 products with vdpbf16ps, where they are faster than f32 FMA or asked for (cpu/isa.h).
  if (bf16_dot && machine >= Isa::avx512bf16) return kernels_avx512bf16(dtype);
#endif
#if defined(FLASHBACK_HAVE_AMX_KERNELS)
  // Real tiles, or emulated tiles over real AVX-512 (FLASHBACK_EMULATION=amx with AVX512_BF16).
  if (isa >= Isa::amx && machine >= Isa::avx512bf16) return kernels_amx(dtype, machine < Isa::amx);
#endif
#if defined(FLASHBACK_HAVE_EMULATED_KERNELS)
  // A level above the machine's (FLASHBACK_EMULATION): AVX-512 on pairs of AVX2 vectors, and for bf16
  // vdpbf16ps (the avx512bf16 level) or the tiles (the amx level, bf16 and f16) in software.
  if (isa > machine && isa >= Isa::avx512 && machine >= Isa::avx2 &&
      (machine < Isa::avx512 || bf16_dot || (isa >= Isa::amx && dtype != core::DType::f32)))
    return kernels_emulated(isa, dtype);
#endif
#if defined(FLASHBACK_HAVE_AVX512_KERNELS)
  if (isa >= Isa::avx512 && machine >= Isa::avx512) return kernels_avx512(dtype);
#endif
#if defined(FLASHBACK_HAVE_AVX2_KERNELS)
  if (isa >= Isa::avx2) return kernels_avx2(dtype);
#endif
  (void)isa, (void)machine, (void)bf16_dot; // used only where this build has x86 kernels
  return kernels_scalar(dtype);
}

int default_threads() {
  static const int from_env = [] {
    const char* env = std::getenv("FLASHBACK_NUM_THREADS");
    const int n = env ? std::atoi(env) : 0;
    return n > 0 && n <= 1024 ? n : 0;
  }();
  return from_env > 0 ? from_env : std::max(1, omp_get_max_threads());
}

int resolve_threads(const core::Problem& p) { return p.num_threads > 0 ? p.num_threads : default_threads(); }

// Decoding with grouped heads (Sq = 1, Hq > Hk): the query heads of a kv head, one row each, become
// the rows of one query block (Sq' = Hq/Hk rows a head's stride apart, Hq' = Hk), as FlashAttention's
// forward swaps them (seqlenq_ngroups_swapped): each key block then enters one product of G rows rather
// than G products of one row, and is packed once rather than G times. Only where the row sees every
// key (no window cuts it), so that each row meets the same key blocks, unmasked, with the same FMA
// chains: the same bits as unswapped. Not when it would leave a thread idle for little gain (G < 4
// with fewer kv heads than threads), nor when the lse rows of a kv head's query heads are not adjacent
// (Rows3 has no row stride).
core::Problem swap_decoding_heads(const core::Problem& p) {
  const int64_t g = p.group();
  if (p.seqlen_q != 1 || g == 1 || p.seqlen_k == 0 || p.lse.sh != 1) return p;
  if (p.band.dlo > 0 || p.band.dhi < p.seqlen_k - 1) return p; // a window cuts the row's keys
  if (g < 4 && p.batch * p.heads_kv < resolve_threads(p)) return p;
  core::Problem s = p;
  s.heads_q = p.heads_kv;
  s.seqlen_q = g;
  s.q.sh = g * p.q.sh;
  s.q.ss = p.q.sh;
  s.o.sh = g * p.o.sh;
  s.o.ss = p.o.sh;
  s.lse.sh = g * p.lse.sh;
  s.window_left = s.window_right = -1;
  s.band.dlo = -s.seqlen_q; // unbounded on both sides, as core::make_band clamps them
  s.band.dhi = s.seqlen_k;
  return s;
}

int64_t forward_splits(const core::Problem& p) {
  const core::Problem s = swap_decoding_heads(p); // as forward() runs it: the tiles may differ (tiles.h)
  return splits_for(s, active_kernels(s).tiles(s, false));
}
int64_t backward_splits(const core::Problem& p) { return backward_splits_for(p, active_kernels(p).tiles(p, true)); }

size_t forward_workspace_bytes(const core::Problem& p) {
  const core::Problem s = swap_decoding_heads(p);
  return forward_layout(s, active_kernels(s)).total();
}

void forward(const core::Problem& problem, void* workspace) {
  const core::Problem p = swap_decoding_heads(problem);
  const KernelSet& ks = active_kernels(p);
  const ForwardLayout l = forward_layout(p, ks);
  ForwardJob job;
  job.p = &p;
  job.tiles = l.tiles;
  job.q_blocks = ceil_div(p.seqlen_q, l.tiles.bm);
  job.kv_blocks = ceil_div(p.seqlen_k, l.tiles.bn);
  job.q_group = l.group;
  job.block_scratch = l.block;
  job.splits = l.splits;
  job.partial_rows = l.partial_rows;
  job.partial_ld = l.partial_ld;
  const int64_t items = forward_items(p, l.tiles, l.group) * l.splits;
  if (items == 0) return;
  job.items = items;
  job.threads = l.threads;
  char* scratch = align_ptr(workspace);
  job.shared = scratch + l.threads * l.scratch();
  job.partial = reinterpret_cast<float*>(job.shared + l.shared);
  const int64_t prepare_items = ks.forward_prepare_items(job);
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  std::atomic<int64_t> next_prepare{0}, next{0};
  run_team(l.threads, [&](int tid, int nt) {
    if (prepare_items > 0) {
      claim_items(next_prepare, prepare_items, [&](int64_t item) { ks.forward_prepare(job, item); });
      team_barrier(nt);
    }
    char* mine = scratch + tid * l.scratch();
    claim_work_items(ks, next, items, [&](int64_t item) { ks.forward_item(job, item, mine); });
    if (job.splits > 1) { // the parts of each row combined (static row ranges)
      team_barrier(nt);
      const RowShare mine = row_share(rows, tid, nt);
      ks.forward_combine(job, mine.begin, mine.end);
    }
  });
}

size_t backward_workspace_bytes(const core::Problem& p) { return backward_layout(p, active_kernels(p)).total(); }

void backward(const core::Problem& p, void* workspace) {
  const KernelSet& ks = active_kernels(p);
  const BackwardLayout l = backward_layout(p, ks);
  BackwardJob job;
  job.p = &p;
  job.tiles = l.tiles;
  job.q_blocks = ceil_div(p.seqlen_q, l.tiles.bm);
  job.kv_blocks = ceil_div(p.seqlen_k, l.tiles.bn);
  job.need_dq = static_cast<bool>(p.dq);
  job.need_dk = static_cast<bool>(p.dk);
  job.need_dv = static_cast<bool>(p.dv);
  char* at = align_ptr(workspace);
  char* scratch = at;
  at += l.threads * l.scratch();
  job.delta = reinterpret_cast<float*>(at);
  at += l.rows;
  job.lse2 = reinterpret_cast<float*>(at);
  at += l.rows;
  job.dq_next = reinterpret_cast<int64_t*>(at);
  at += l.counters;
  if (l.dq_acc) {
    job.dq_acc = reinterpret_cast<float*>(at);
    job.dq_ss = p.head_dim;
    job.dq_sh = p.seqlen_q * job.dq_ss;
    job.dq_sb = p.heads_q * job.dq_sh;
  } else if (p.dq) {
    job.dq_acc = static_cast<float*>(p.dq.data);
    job.dq_sb = p.dq.sb;
    job.dq_sh = p.dq.sh;
    job.dq_ss = p.dq.ss;
  }
  at += l.dq_acc;
  job.shared = at;
  at += l.shared;
  job.splits = l.splits;
  job.partial = reinterpret_cast<float*>(at);
  job.partial_rows = l.partial_rows;
  job.partial_ldk = l.partial_ldk;
  job.partial_ldv = l.partial_ldv;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  job.k_group = l.group;
  job.block_scratch = l.block;
  // Without dq, dk and dv (delta only, or nothing) phase 1 is all there is to do.
  const bool gradients = job.need_dq || job.need_dk || job.need_dv;
  const int64_t items = gradients ? backward_items(p, l.tiles, l.group) * l.splits : 0;
  job.items = items;
  job.threads = l.threads;
  const int64_t prepare_items = gradients ? ks.backward_prepare_items(job) : 0;
  std::atomic<int64_t> next_prepare{0}, next{0};
  run_team(l.threads, [&](int tid, int nt) {
    // Phase 1: delta = rowsum(dO * O), lse2, zeroed dQ accumulator (static row ranges); operands the
    // tile math packs once.
    const RowShare mine_rows = row_share(rows, tid, nt);
    ks.backward_rows(job, mine_rows.begin, mine_rows.end);
    claim_items(next_prepare, prepare_items, [&](int64_t item) { ks.backward_prepare(job, item); });
    team_barrier(nt);
    // Phase 2: key blocks, claimed in increasing order.
    char* mine = scratch + tid * l.scratch();
    claim_work_items(ks, next, items, [&](int64_t item) { ks.backward_item(job, item, mine); });
    // Phase 3: half-precision dq, rounded once from its f32 total; split queries' dK and dV, each key's
    // parts added up (static row ranges).
    const bool combine = job.splits > 1 && (job.need_dk || job.need_dv);
    if (l.dq_acc || combine) team_barrier(nt);
    if (l.dq_acc) ks.backward_store_dq(job, mine_rows.begin, mine_rows.end);
    if (combine) {
      const RowShare mine_keys = row_share(p.batch * p.heads_kv * p.seqlen_k, tid, nt);
      ks.backward_combine(job, mine_keys.begin, mine_keys.end);
    }
  });
}

} // namespace flashback::cpu
