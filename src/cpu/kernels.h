// The boundary between the generic CPU driver (threads, workspace, phases) and the per-ISA code.
// Each instruction set compiles the algorithm of attention.h over its microkernels, in its own
// translation unit with its own flags, and exports one KernelSet.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.h"
#include "cpu/isa.h"

namespace flashback::cpu {

// Block sizes: BM query rows by BN keys per tile.
struct Tiles {
  int64_t bm = 0, bn = 0;
  friend constexpr bool operator==(const Tiles&, const Tiles&) = default;
};

// The forward's key blocks as a problem allows them (tiles.h: forward_keys, choose_tiles): `few` where
// a kv head's query side is a few blocks of rows (decoding: few_query_rows), `wide` where wide blocks pay
// (wide_keys), else `usual` (masked problems). The backward's tiles do not depend on it.
enum class Keys { usual, wide, few };

// The most blocks a work item runs side by side: query blocks in the forward (ForwardJob::q_group),
// key blocks in the backward (BackwardJob::k_group).
constexpr int64_t kMaxGroup = 4;

// The most parts a forward cuts each query block's keys into (ForwardJob::splits), and a backward each
// key block's query blocks (BackwardJob::splits).
constexpr int64_t kMaxSplits = 16;

// Everything a forward work item needs; items are (batch, kv head, group of q_group query blocks of
// its query heads: blocks of one head, or of consecutive heads when a head has fewer, part of the keys).
struct ForwardJob {
  const core::Problem* p = nullptr;
  Tiles tiles;
  int64_t q_blocks = 0, kv_blocks = 0; // per (batch, head)
  // Query blocks per item: each key block is used by all of them while it is in cache. The item's
  // scratch is q_group blocks of block_scratch bytes, one per query block.
  int64_t q_group = 1;
  size_t block_scratch = 0;
  int64_t items = 0, threads = 1;      // the work items (claimed in increasing order) and the threads
  char* shared = nullptr;              // forward_shared_bytes, 64-byte aligned: operands packed once
  // Split keys: each query block's visible key blocks in `splits` parts (1: not split). Part k of a
  // block writes its normalized f32 rows [partial_rows][partial_ld] and their LSEs [partial_rows]
  // at partial_of(b, h, i0, k); forward_combine adds them up.
  int64_t splits = 1;
  float* partial = nullptr;
  int64_t partial_rows = 0, partial_ld = 0;
  // Floats of one part of one query block (a multiple of 16: 64-byte aligned).
  static int64_t partial_floats(int64_t rows, int64_t ld) { return (rows * (ld + 1) + 15) / 16 * 16; }
  float* partial_of(int64_t b, int64_t h, int64_t i0, int64_t part) const {
    const int64_t block = ((b * p->heads_q + h) * q_blocks + i0 / tiles.bm) * splits + part;
    return partial + block * partial_floats(partial_rows, partial_ld);
  }
};

// Everything a backward work item needs; items are (batch, kv head, group of k_group key blocks, part
// of the query blocks), claimed in increasing order (the dQ ordering relies on it).
struct BackwardJob {
  const core::Problem* p = nullptr;
  Tiles tiles;
  int64_t q_blocks = 0, kv_blocks = 0;
  // Key blocks per item: each query block is used by all of them while it is in cache. The item's
  // scratch is k_group blocks of block_scratch bytes, one per key block.
  int64_t k_group = 1;
  size_t block_scratch = 0;
  int64_t items = 0, threads = 1; // the work items (claimed in increasing order) and the threads
  bool need_dq = false, need_dk = false, need_dv = false;
  float* delta = nullptr;    // [B * Hq * Sq] rowsum(dout * o), contiguous
  float* lse2 = nullptr;     // [B * Hq * Sq] lse * log2(e), contiguous
  int64_t* dq_next = nullptr; // [B * Hq * q_blocks]: the key block whose dQ contribution goes next
  float* dq_acc = nullptr;   // f32 dQ accumulator: the caller's dq when it is f32, else workspace
  int64_t dq_sb = 0, dq_sh = 0, dq_ss = 0;
  char* shared = nullptr;    // backward_shared_bytes, 64-byte aligned: operands packed once
  // Split queries: the (query head, query block) pairs each key block sees, in `splits` parts (1: not
  // split; then k_group = 1). Part k of a key block writes its f32 dK rows [partial_rows][partial_ldk]
  // and then its dV rows [partial_rows][partial_ldv] at partial_of(b, hk, jb, k); backward_combine
  // adds them up.
  int64_t splits = 1;
  float* partial = nullptr;
  int64_t partial_rows = 0, partial_ldk = 0, partial_ldv = 0;
  // Floats of one part of one key block (a multiple of 16: 64-byte aligned).
  static int64_t partial_floats(int64_t rows, int64_t ldk, int64_t ldv) { return (rows * (ldk + ldv) + 15) / 16 * 16; }
  float* partial_of(int64_t b, int64_t hk, int64_t jb, int64_t part) const {
    const int64_t block = ((b * p->heads_kv + hk) * kv_blocks + jb) * splits + part;
    return partial + block * partial_floats(partial_rows, partial_ldk, partial_ldv);
  }
};

// Each pass runs in phases separated by barriers: prepare items (operands packed once per call, when
// the tile math packs any), then the work items; the backward also has per-row work first and, for
// half-precision dq, a store phase last.
struct KernelSet {
  Isa isa;
  Tiles (*tiles)(const core::Problem& p, bool backward);

  size_t (*forward_scratch_bytes)(const core::Problem& p, Tiles t); // per thread
  size_t (*forward_shared_bytes)(const core::Problem& p, Tiles t);
  int64_t (*forward_prepare_items)(const ForwardJob& job);
  void (*forward_prepare)(const ForwardJob& job, int64_t item);
  void (*forward_item)(const ForwardJob& job, int64_t item, char* scratch);
  // Rows [begin, end) of the flattened (batch, head, query) index: the parts of split keys combined.
  void (*forward_combine)(const ForwardJob& job, int64_t begin, int64_t end);

  size_t (*backward_scratch_bytes)(const core::Problem& p, Tiles t); // per thread
  size_t (*backward_shared_bytes)(const core::Problem& p, Tiles t);
  int64_t (*backward_prepare_items)(const BackwardJob& job);
  void (*backward_prepare)(const BackwardJob& job, int64_t item);
  // Rows [begin, end) of the flattened (batch, head, query) index: delta, lse2, zeroed dQ accumulator.
  void (*backward_rows)(const BackwardJob& job, int64_t begin, int64_t end);
  void (*backward_item)(const BackwardJob& job, int64_t item, char* scratch);
  // Rows [begin, end) of the flattened (batch, kv head, key) index: the parts of split queries combined.
  void (*backward_combine)(const BackwardJob& job, int64_t begin, int64_t end);
  // Rows [begin, end): dq = dq_acc (converted) when the accumulator is not the caller's dq.
  void (*backward_store_dq)(const BackwardJob& job, int64_t begin, int64_t end);

  // Per-thread state of the work items (AMX: the tile configuration), set up by each thread before its
  // first forward_item or backward_item of a call and torn down after its last; null when the tile
  // math has none.
  void (*thread_begin)();
  void (*thread_end)();
};

// Each ISA's kernel set for a storage type (f32, bf16 or f16).
const KernelSet& kernels_scalar(core::DType dtype);
const KernelSet& kernels_avx2(core::DType dtype);
const KernelSet& kernels_avx512(core::DType dtype);
// bf16 products with vdpbf16ps for bf16, else avx512's.
const KernelSet& kernels_avx512bf16(core::DType dtype);
// AMX tiles (real, or emulated over real AVX-512) for bf16, else avx512's.
const KernelSet& kernels_amx(core::DType dtype, bool emulated);
// The avx512 (isa avx512 or avx512bf16) or amx level on pairs of AVX2 vectors, the tiles in software
// (FLASHBACK_EMULATION, cpu/isa.h).
const KernelSet& kernels_emulated(Isa isa, core::DType dtype);

// f16 at the amx level runs the AMX tiles (its inputs as exact hi + lo bf16, math_bf16.h) where the
// larger head dim max(D, Dv) is at least this, and the avx512 f32 kernels (inputs converted) below.
// Measured on a Xeon with AMX (B = 1, Hq = 16, S = 4096, 2 threads, side by side, 8 - 10 rounds, since
// the forward's softmax takes its rows several at a time), the tiles' time over the f32 kernels': D = 64
// forward 0.65, backward 0.90; D = 32 forward 0.79, backward 1.03; D = 16 (S = 2048) forward 1.06,
// backward 1.20. Before that change: D = 128 forward 0.65, backward 0.83; D = 96 0.75, 0.88; D = 64
// 0.90, 1.17 (Hq = 8).
constexpr int64_t kF16TilesMinHeadDim = 64;

// The kernel set for an instruction set this build has (falls back to the best one at or below it),
// for problems whose larger head dim is head_dim (it decides f16's at the amx level; the default, the
// largest allowed, gives the level f16 runs at for large head dims).
const KernelSet& kernels_for(Isa isa, core::DType dtype, int64_t head_dim = 256);

} // namespace flashback::cpu
