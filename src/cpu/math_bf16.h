// Tile math with bf16 products and f32 accumulation, for bf16 or f16 storage, over a bf16 GEMM microkernel
// (`BMicro`: AMX tiles, real or emulated, in amx/; or vdpbf16ps, dot_bf16_micro.h). Operands are packed
// into the two formats of avx512/pack_bf16.h; the softmax, the masks and every accumulation stay in f32.
//
// P and dS, computed in f32, enter their products as hi + lo, two bf16 each (hi truncated, lo = x - hi
// rounded: |x - hi - lo| <= 2^-15 |x|; pack_bf16.h): rounding them to one bf16, as FlashAttention
// does, fails the accuracy bar of a naive f32 implementation wherever sums cancel (measured: dQ =
// sum_j dS_ij K_j, whose dS rows sum to zero, at 3.6x the bar for D = 7, Sk = 300). Q, K, V, dO are
// bf16 already, so every product is then exact to about 2^-15 and nothing is rounded before the
// outputs (each once, from its f32 total).
//
// f16 inputs (kExact) enter as hi + lo, two bf16 whose sum is the f16 value exactly (an f16 has 11
// significant bits, a bf16 8), the two sides of each product concatenated along k:
//   S = Q K^T, dP = dO V^T: A = [Xh | Xh] with A_lo = [Xl | Xl], B = [Yh ; Yl] (k = 2 Dk): all four
//     products, so that S and dP are exact up to their f32 accumulation, as with bf16 inputs (rounding
//     f16 to one bf16 fails the accuracy bar 4x to 190x: tests/f16_route);
//   O += P V, dQ += dS K: A = [Ph | Pl | Ph], B = [Yh ; Yh ; Yl] (k = 3 BNk): three products; the
//     fourth, Pl Yl (|Pl Yl| <= 2^-15 |P| |Y|), is left out: the size of P's own split error;
//   dV^T += dO^T P, dK^T += Q^T dS: the same three with the sides swapped, A = [Yh^T | Yh^T | Yl^T],
//     B = [Ph ; Pl ; Ph] (k = 3 BMk; for bf16 inputs A = Y^T, B = Ph with B_lo = Pl).
// The backward takes dV and dK transposed so that P and dS enter as B operands, whose VNNI form pairs
// two rows word by word (Pack::split_pairs), rather than as the A operands P^T and dS^T, which took a
// 16 x 16 transpose per block of P and of dS; the transposed sums are added to dV and dK once per key
// block (Backward::finish).
// That is 2.3x the bf16 products of the forward (7 k-blocks of products for 3) and 2.1x of the backward
// (17 for 8): on AMX still faster than f16 converted to f32 (README, BENCHMARKS.md).
//
// Partially masked tiles (the diagonal band of a causal or windowed mask) take their products on tiles
// as the others do, with P and dS 0 where masked. A NaN or an infinity in an operand of those products
// would meet the masked zeros (0 * inf is NaN) and reach rows that do not see it, and in any tile it
// meets the zeros of P's and dS's lo parts (lo = 0 where P is a bf16 value, as P = 1 for a row's
// largest score; measured: o NaN instead of inf in 1 of 6 runs of
// Reliability.InfinitiesReachWhatDependsOnThem): such products take a copy of the operand with those
// values zeroed (finite_copy) and add them back, in f32, to the outputs of the rows and keys that see
// them, so that the other outputs get the same bits as without them and these the infinity
// (RELIABILITY.md: non-finite inputs). Before, masked tiles took their products in f32, each row over
// the keys it sees: the tiles took 0.95x / 0.94x the time of that (forward / backward) of causal bf16
// at S = 4096, D = 128, 0.81x / 0.77x at S = 512 and 0.74x / 0.66x with a window of 256; f16 0.99x /
// 0.96x at S = 4096, 0.83x / 0.92x at S = 512 (BENCHMARKS.md). The backward's query blocks of a few
// rows (BMicro::kF32Rows) still do, since their bf16 forms of P and dS would be mostly padding; with
// vdpbf16ps every query block does (kHiLoBackward: dot_bf16_micro.h says why).
//
// BMicro provides: isa, tiles(), kK (the k granule: operands are zero-padded to it), kF32Rows (the
// backward's query blocks of at most this many rows take their products with P and dS in f32),
// begin() and end() (a thread's tile state around its work items: thread_begin, thread_end below), and
//   gemm(m, n, k, a, a_lo, lda, b, ldb, c, ldc, acc, row_scale):
//     C[m][n] = (acc ? row_scale * C : 0) + (A + A_lo) B, a_lo may be null,
//   with A in the A format (rows up to round_up(m, 16) readable) and B in the VNNI format (columns
//   up to round_up(n, 16) readable), f32 C with any m, n.
//
// Packed once per call (the `shared` workspace):
//   forward:  per key block, K^T and V as B operands: ktb [Dkx/2][2 BNp], vb [BNkx/2][2 Dvn]; but
//             per tile, into the work item's scratch, where each key block serves few query blocks
//             (few_query_blocks: decoding, short chunks against a long cache)
//   backward: per query block, Q and dO as A operands and, where Dims::transposes, their transposes as
//             A operands of dK^T = Q^T dS and dV^T = dO^T P: qa [BMp][Dkx] (f16: and its lo), doa
//             [BMp][Dvkx] (f16: and its lo), qat [Dn][BMt], doat [Dvn][BMt]
// (Dk = D rounded up to kK, Dn = D rounded up to 16, likewise for Dv, BM, BN; the x forms are the k
// extents of the concatenated operands: Dkx = 2 Dk, BNkx = 3 BNk for f16, Dk and BNk for bf16; BMt =
// 3 BMk for f16, BMk for bf16. Every row here and in the scratch below is one cache line longer than
// shown: Dims, kPad.)
#pragma once

#include "cpu/attention.h"
#include "cpu/blocks.h"
#include "cpu/micro_f32.h"

namespace flashback::cpu {
namespace {

template <class U>
constexpr bool is_f16 = false;
template <>
constexpr bool is_f16<f16> = true;

template <class BMicro, class Storage = bf16>
struct MathBf16 {
  using T = Storage; // bf16 or f16
  // f16 inputs as hi + lo (above): k segments of the products of two inputs (S, dP) and of P or dS
  // with an input.
  static constexpr bool kExact = is_f16<T>;
  static constexpr int64_t kXSegs = kExact ? 2 : 1, kPSegs = kExact ? 3 : 1;
  // The backward's dV^T = dO^T P and dK^T = Q^T dS take P and dS as the B side: for bf16 inputs B =
  // Ph with B_lo = Pl (the microkernels' b_lo) and A = Y^T; for f16 the segments stacked along k, B =
  // [Ph ; Pl ; Ph] with A = [Yh^T | Yh^T | Yl^T]. kTSegs: k segments; kTParts: B's stored segments.
  static constexpr int64_t kTSegs = kExact ? 3 : 1, kTParts = kExact ? 3 : 2;
  // Whether the backward takes some query blocks' products with P and dS on the microkernel (AMX:
  // blocks of more than BMicro::kF32Rows rows); with vdpbf16ps it takes them all in f32, and neither
  // packs nor keeps their bf16 operands (Q^T, dO^T, K as dQ's B side, P and dS, dK^T and dV^T).
  static constexpr bool kHiLoBackward = BMicro::kF32Rows < INT64_MAX;
  using V = typename BMicro::V;       // 16-lane f32 vectors (V512, or its emulation)
  using Pack = typename BMicro::Pack; // the operand packing (avx512/pack_bf16.h, or its emulation)
  using F = MicroF32<V>;              // f32 helpers: probs, dscores, dot
  static_assert(V::lanes == 16);
  static constexpr Isa isa = BMicro::isa;
  static constexpr int64_t kK = BMicro::kK;
  // The forward's lazy rescaling (softmax_rows): log2 units, P <= 2^8 (FlashAttention 4's threshold).
  static constexpr float kLazyRescale = 8.0f;

  static Tiles tiles(const core::Problem& p, bool backward) { return BMicro::tiles(p, backward); }
  static float dot(const T* a, const T* b, int64_t n) { return F::dot(a, b, n); }
  static void store_row(const float* src, int64_t n, float mul, T* dst) { F::store_row(src, n, mul, dst); }
  static void thread_begin() { BMicro::begin(); }
  static void thread_end() { BMicro::end(); }

  // Row strides of the packed operands and of the f32 blocks: their rows plus one cache line
  // (kPad bf16, kPadF floats), so that the 16 rows of a tile, a stride apart, fall in different sets
  // of L1 rather than the few that a stride of a power of two times 256 bytes maps them to. Measured
  // on the Xeon with AMX: the microkernel (one thread) on S's shape (64 x 256 x 128) 0.78x the time,
  // on P V's (64 x 128 x 256, hi + lo) 0.93x; bf16 attention (B = 1, Hq = 16, S = 4096, side by side,
  // sets of rounds at moments of different speed) forward 0.94 - 0.95x at D = 128 and 0.92 - 0.95x at
  // D = 64, backward 0.94 - 1.04x and 0.95 - 0.96x (BENCHMARKS.md).
  static constexpr int64_t kPad = 32, kPadF = 16;
  static int64_t a_ld(int64_t k) { return k + kPad; }

  // Padded sizes: k dims to kK, m and n dims to 16; the x forms: k extents of concatenated operands;
  // the _ld forms: row strides (above).
  struct Dims {
    int64_t dk, dn, dvk, dvn, bmp, bmk, bnp, bnk, dkx, dvkx, bnkx, bmt;
    int64_t kt_ld, dn_ld, dv_ld, pa_ld, t_ld, s_ld, o_ld, dk_ld;
    Dims(const core::Problem& p, Tiles t)
        : dk(round_up(p.head_dim, kK)), dn(round_up(p.head_dim, 16)), dvk(round_up(p.head_dim_v, kK)),
          dvn(round_up(p.head_dim_v, 16)), bmp(round_up(t.bm, 16)), bmk(round_up(t.bm, kK)),
          bnp(round_up(t.bn, 16)), bnk(round_up(t.bn, kK)), dkx(kXSegs * dk), dvkx(kXSegs * dvk),
          bnkx(kPSegs * bnk), bmt(kTSegs * bmk), kt_ld(2 * bnp + kPad), dn_ld(2 * dn + kPad),
          dv_ld(2 * dvn + kPad), pa_ld(a_ld(bnkx)), t_ld(a_ld(bmt)), s_ld(bnp + kPadF), o_ld(dvn + kPadF),
          dk_ld(dn + kPadF) {}
    // B operands (VNNI pairs of rows): K^T, V^T, and the backward's P, dS [k/2][kt_ld]; K [k/2][dn_ld];
    // V [k/2][dv_ld]. A operands: Q, dO [BMp][a_ld(kx)]; P, dS [BMp][pa_ld]; Q^T, dO^T [Dn or
    // Dvn][t_ld]. f32: S, P, dP, dS [BMp][s_ld]; dK^T, dV^T [Dn or Dvn][s_ld]; O, dV [][o_ld]; dK
    // [][dk_ld].
    // bf16 elements of one key block's packed K^T (V follows it), of K^T and V, of one query block's
    // packed Q and dO, and where transposes() Q^T and dO^T.
    int64_t kt_block() const { return dkx / 2 * kt_ld; }
    int64_t kv_block() const { return kt_block() + bnkx / 2 * dv_ld; }
    int64_t q_block() const { return x_block(dkx) + x_block(dvkx) + (transposes() ? (dn + dvn) * t_ld : 0); }
    // Whether the backward's query blocks pack Q^T and dO^T: where some take their products with P and
    // dS on the microkernel (more than kF32Rows rows; tiles.h: backward_block_rows gives 16 to short ones).
    bool transposes() const { return kHiLoBackward && bmp > BMicro::kF32Rows; }
    // A query block as the A side of S or dP (pack_x_a): hi [BMp][a_ld(kx)], and for f16 its lo.
    int64_t x_block(int64_t kx) const { return bmp * a_ld(kx) * kXSegs; }
  };

  // --- Operands ------------------------------------------------------------------------------------

  // X [rows][cols] as the A side of S = Q K^T or dP = dO V^T, k = kx = kXSegs * k1: hi
  // [rows_pad][a_ld(kx)] at dst, and for f16 lo likewise at x_lo(dst) (above: [Xh | Xh] and [Xl | Xl]).
  template <class B>
  static B* x_lo(B* hi, int64_t rows_pad, int64_t kx) {
    return kExact ? hi + rows_pad * a_ld(kx) : nullptr;
  }
  static void pack_x_a(const T* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t k1,
                       int64_t rows_pad) {
    const int64_t kx = kXSegs * k1, ld = a_ld(kx);
    Pack::rows(src, lds, rows, cols, dst, ld, k1, rows_pad);
    if (!kExact) return;
    bf16* lo = x_lo(dst, rows_pad, kx);
    Pack::rows(src, lds, rows, cols, lo, ld, k1, rows_pad, true);
    for (int64_t r = 0; r < rows_pad; ++r) { // the second segment: a copy of the first
      std::memcpy(dst + r * ld + k1, dst + r * ld, static_cast<size_t>(k1) * sizeof(bf16));
      std::memcpy(lo + r * ld + k1, lo + r * ld, static_cast<size_t>(k1) * sizeof(bf16));
    }
  }
  // Y [rows][cols] as the B side of S or dP (Y^T, k = cols): [Yh ; Yl] for f16, k = kXSegs * k1.
  static void pack_y_bt(const T* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb, int64_t k1,
                        int64_t n_pad) {
    Pack::vnni_t(src, lds, rows, cols, dst, ldb, k1, n_pad);
    if (kExact) Pack::vnni_t(src, lds, rows, cols, dst + k1 / 2 * ldb, ldb, k1, n_pad, true);
  }
  // Y [rows][cols] as the B side of a product with P or dS (k = rows): [Yh ; Yh ; Yl] for f16,
  // k = kPSegs * k1.
  static void pack_y_b(const T* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t ldb, int64_t k1,
                       int64_t n_pad) {
    Pack::vnni(src, lds, rows, cols, dst, ldb, k1, n_pad);
    if (!kExact) return;
    std::memcpy(dst + k1 / 2 * ldb, dst, static_cast<size_t>(k1 / 2 * ldb) * sizeof(bf16));
    Pack::vnni(src, lds, rows, cols, dst + k1 * ldb, ldb, k1, n_pad, true);
  }
  // Y [rows][cols] as the A side of a product with P or dS as B (k = rows, kTSegs segments of k1):
  // Y^T [cols_pad][a_ld(kTSegs k1)], for f16 [Yh^T | Yh^T | Yl^T].
  static void pack_yt_a(const T* src, int64_t lds, int64_t rows, int64_t cols, bf16* dst, int64_t k1,
                        int64_t cols_pad) {
    const int64_t ld = a_ld(kTSegs * k1);
    Pack::rows_t(src, lds, rows, cols, dst, ld, k1, cols_pad);
    if (!kExact) return;
    Pack::rows_t(src, lds, rows, cols, dst + 2 * k1, ld, k1, cols_pad, true);
    for (int64_t r = 0; r < cols_pad; ++r) // the second segment: a copy of the first
      std::memcpy(dst + r * ld + k1, dst + r * ld, static_cast<size_t>(k1) * sizeof(bf16));
  }
  // P or dS as the A side of its products: hi at hi, lo at lo, rows ld = kPSegs * k1 apart, and for
  // f16 hi again at hi + again_of(k1) ([Ph | Pl | Ph]: lo = hi + k1). The k of the product: for bf16,
  // n (the rows or columns present) rounded up to kK, with lo as A_lo; for f16 the three segments.
  static int64_t again_of(int64_t k1) { return kExact ? 2 * k1 : 0; }
  static int64_t p_k(int64_t n, int64_t k1) { return kExact ? kPSegs * k1 : round_up(n, kK); }
  static const bf16* p_lo(const bf16* lo) { return kExact ? nullptr : lo; }
  // The n packed bf16 at src, copied to dst with each NaN and infinity replaced by 0: the operand of a
  // masked tile's product that meets its zeros (0 * inf is NaN).
  static const bf16* finite_copy(const bf16* src, int64_t n, bf16* dst) {
    for (int64_t i = 0; i < n; ++i) dst[i].bits = (src[i].bits & 0x7F80u) == 0x7F80u ? uint16_t{0} : src[i].bits;
    return dst;
  }
  // out [r][c] (rows ldo apart) += w(r, j) x [j][c] for each non-finite x [j][c] of the `cols` keys at x
  // (Dv or D = width columns) and each of `rows` rows that sees key j under `mask`: what a product over
  // the keys (P V, dS K) on a finite_copy of x left out.
  template <class W>
  static void add_nonfinite_keys(const T* x, int64_t ldx, int64_t cols, int64_t width, int64_t rows, const Mask& mask,
                                 float* out, int64_t ldo, W&& w) {
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t c = 0; c < width; ++c) {
        const float v = to_float(x[j * ldx + c]);
        if (__builtin_isfinite(v)) continue;
        for (int64_t r = 0; r < rows; ++r)
          if (mask.shows(r, j)) out[r * ldo + c] += w(r, j) * v;
      }
  }
  // Floats of a scratch of the backward's f32 products that also holds a finite_copy of `packed` bf16
  // (for bf16 the f32 form is the larger with the tiles of choose_tiles; f16's parts can take more).
  static int64_t copy_room(int64_t floats, int64_t packed) {
    return 2 * floats >= packed ? floats : (packed + 1) / 2;
  }
  // p + n, where p may be null (a scratch layout only measured: carved_bytes).
  static bf16* past(bf16* p, int64_t n) { return p ? p + n : nullptr; }

  // --- Forward -------------------------------------------------------------------------------------

  // K^T and V are packed once per call when each key block serves many query blocks. Where it serves
  // few (decoding: one block of the G rows of a kv head's query heads), that packed copy of the whole
  // cache (as large as K and V) would be written and read once more for a product or two: decoding
  // (Hq = 32, Hk = 8, Sk = 8192, D = 128) took 1.3x the time of the f32 kernels on converted K and V,
  // and 5x when the library allocated the workspace in the call. There each work item packs its key
  // blocks itself, into its first block's scratch, which the item's query blocks share
  // (share_converted): the same packed values, the same bits. attention.h then fetches the rows of the
  // next work item's Q, K and V during each item (fetch_item_rows).
  static bool forward_per_tile(const core::Problem& p, Tiles t) { return few_query_blocks(p, t); }

  static size_t forward_shared_bytes(const core::Problem& p, Tiles t) {
    if (forward_per_tile(p, t)) return 0;
    return static_cast<size_t>(p.batch * p.heads_kv * round_up(p.seqlen_k, t.bn) / t.bn * Dims(p, t).kv_block()) *
           sizeof(bf16);
  }
  static int64_t forward_prepare_items(const ForwardJob& job) {
    return forward_per_tile(*job.p, job.tiles) ? 0 : job.p->batch * job.p->heads_kv * job.kv_blocks;
  }
  static bf16* kv_block(const ForwardJob& job, const Dims& z, int64_t b, int64_t hk, int64_t jb) {
    return reinterpret_cast<bf16*>(job.shared) + ((b * job.p->heads_kv + hk) * job.kv_blocks + jb) * z.kv_block();
  }
  // ktb = K^T (k = d) and then vb = V (k = key) of the `rows` keys from j0: kv_block() elements.
  static void pack_kv(const core::Problem& p, const Dims& z, int64_t b, int64_t hk, int64_t j0, int64_t rows,
                      bf16* ktb) {
    bf16* vb = ktb + z.kt_block();
    pack_y_bt(row_ptr<const T>(p.k, b, hk, j0), p.k.ss, rows, p.head_dim, ktb, z.kt_ld, z.dk, z.bnp);
    pack_y_b(row_ptr<const T>(p.v, b, hk, j0), p.v.ss, rows, p.head_dim_v, vb, z.dv_ld, z.bnk, z.dvn);
  }
  // Packs key block `item` = (b, hk, jb) into the shared workspace.
  static void forward_prepare(const ForwardJob& job, int64_t item) {
    const core::Problem& p = *job.p;
    const Dims z(p, job.tiles);
    const RowBlock k = row_block(item, p.heads_kv, job.kv_blocks, job.tiles.bn, p.seqlen_k);
    pack_kv(p, z, k.b, k.head, k.first, k.rows, kv_block(job, z, k.b, k.head, k.block));
  }

  // Per-thread scratch of the forward: qa x_block(Dkx) bf16, s [BMp][BNp] f32, pa [BMp][BNkx] and for
  // bf16 pa_lo [BMp][BNk] (P as hi + lo; for f16 pa_lo = pa + BNk), oacc [BMp][Dvn] f32, m, l, alpha
  // [BMp] f32, vz: a packed V block (V without its NaNs and infinities for a masked tile, finite_copy),
  // and only where K and V are packed per tile (forward_per_tile), kv: kv_block() bf16.
  struct ForwardScratch {
    Dims z;
    bf16 *qa, *pa, *pa_lo, *vz, *kv;
    float *s, *oacc, *m, *l, *alpha;
    ForwardScratch(const core::Problem& p, Tiles t, char* base, int64_t* bytes = nullptr) : z(p, t) {
      Carver c{base};
      qa = c.take<bf16>(z.x_block(z.dkx));
      pa = c.take<bf16>(z.bmp * z.pa_ld);
      pa_lo = kExact ? past(pa, z.bnk) : c.take<bf16>(z.bmp * z.pa_ld);
      s = c.floats(z.bmp * z.s_ld);
      oacc = c.floats(z.bmp * z.o_ld);
      m = c.floats(z.bmp);
      l = c.floats(z.bmp);
      alpha = c.floats(z.bmp);
      vz = c.take<bf16>(z.bnkx / 2 * z.dv_ld);
      kv = forward_per_tile(p, t) ? c.take<bf16>(z.kv_block()) : nullptr;
      if (bytes) *bytes = c.used;
    }
  };
  static size_t forward_scratch_bytes(const core::Problem& p, Tiles t) { return carved_bytes<ForwardScratch>(p, t); }

  class Forward {
   public:
    Forward(const ForwardJob& job, char* scratch) : job_(job), p_(*job.p), s_(p_, job.tiles, scratch) {}

    void begin(int64_t b, int64_t h, int64_t i0, int64_t rows) {
      pack_x_a(row_ptr<const T>(p_.q, b, h, i0), p_.q.ss, rows, p_.head_dim, s_.qa, s_.z.dk, s_.z.bmp);
      fill(s_.m, s_.z.bmp, -kInf);
      fill(s_.l, s_.z.bmp, 0.0f);
      rows_ = rows;
    }

    // One key block: S, the online softmax, O, in three phases, which attention.h runs for all the
    // query blocks that see a key block in turn (add_scores of each, then add_softmax of each, then
    // add_values of each), so that the products on tiles run together between the vector passes:
    // each return to the tiles after vector work costs a ramp of the tile unit (BENCHMARKS.md).
    // s [rows][cols] = Q K^T (unscaled).
    void add_scores(int64_t b, int64_t hk, int64_t j0, int64_t cols) {
      const Dims& z = s_.z;
      const bf16* kt = key_block(b, hk, j0);
      if constexpr (kPacedFetch) { // the fetch ahead's steps: one per pair of k of this block's products
        if (paced())
          prefetch_.pace(BMicro::k_steps(rows_, cols, z.dkx) +
                         BMicro::k_steps(rows_, p_.head_dim_v, p_k(cols, z.bnk)));
      }
      product(rows_, cols, z.dkx, s_.qa, x_lo(s_.qa, z.bmp, z.dkx), a_ld(z.dkx), kt, z.kt_ld, s_.s, z.s_ld, false,
              nullptr);
    }

    // A partially masked tile's P goes to the tiles as an unmasked one's does, 0 where masked.
    void add_softmax(int64_t cols, const Mask* mask) { softmax_rows(cols, mask); }

    // oacc [rows][Dv] = alpha oacc + P V. A masked tile's zeros, and the zeros of P's lo part in any
    // tile, meet every value of V, and 0 * inf is NaN, which would reach rows that do not see the key
    // and turn the infinity of those that do into NaN (RELIABILITY.md: non-finite inputs): where V
    // holds a NaN or an infinity the product takes a copy of it with those values zeroed, and
    // add_nonfinite_keys() adds them to the rows that see them. The other rows get the same bits as
    // without them.
    void add_values(int64_t b, int64_t hk, int64_t j0, int64_t cols, const Mask* mask, bool first) {
      const Dims& z = s_.z;
      const bf16* vb = key_block(b, hk, j0) + z.kt_block();
      const bool zeroed = !values_finite(b, hk, j0);
      if (zeroed) vb = finite_copy(vb, z.bnkx / 2 * z.dv_ld, s_.vz);
      product(rows_, p_.head_dim_v, p_k(cols, z.bnk), s_.pa, p_lo(s_.pa_lo), z.pa_ld, vb, z.dv_ld, s_.oacc, z.o_ld,
              !first, first || !rescaled_ ? nullptr : s_.alpha);
      prefetch_.step(prefetch_.quota(1)); // what the products' paced steps left (upcoming)
      if (!zeroed) return;
      auto prob = [&](int64_t r, int64_t j) {
        return to_float(s_.pa[r * z.pa_ld + j]) + to_float(s_.pa_lo[r * z.pa_ld + j]);
      };
      add_nonfinite_keys(row_ptr<const T>(p_.v, b, hk, j0), p_.v.ss, cols, p_.head_dim_v, rows_,
                         mask ? *mask : kShowAll, s_.oacc, z.o_ld, prob);
    }

    // Share `share` of `shares` of the packed K^T and V of a key block that comes next (attention.h),
    // fetched into L2 during this worker's next softmax, but where they are large (Prefetch::kMaxBytes).
    // The first query block of an item to use a key block otherwise waits on memory for it. Where each
    // work item packs its key blocks (forward_per_tile: decoding), the rows of K and V it packs them from,
    // as the f32 tile math fetches them, in paced steps through the products where the microkernel
    // takes them (math_f32.h: Forward::upcoming; product() below).
    void upcoming(int64_t b, int64_t hk, int64_t j0, int64_t share, int64_t shares) {
      const Dims& z = s_.z;
      if (s_.kv) {
        const int64_t keys = block_keys(j0);
        prefetch_.share_of(Prefetch::head_rows<T>(p_.k, b, hk, j0, keys, p_.head_dim),
                           Prefetch::head_rows<T>(p_.v, b, hk, j0, keys, p_.head_dim_v), share, shares);
        return;
      }
      const int64_t bytes = z.kv_block() * static_cast<int64_t>(sizeof(bf16));
      prefetch_.share_of(Prefetch::packed(kv_block(job_, z, b, hk, j0 / job_.tiles.bn), bytes), {}, share, shares);
    }

    // The query blocks of a work item share one kv head: K and V packed per tile (forward_per_tile) are
    // packed once per key block, into `owner`'s scratch, and read there by every block of the item.
    void share_converted(Forward& owner) { kv_owner_ = &owner; }

    // The block's rows of O (bf16, or f32 partial rows when the keys are split) and of the LSE.
    template <class U>
    void finish(U* o, int64_t ldo, float* lse, int64_t rows) {
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = s_.l[r] != 0.0f ? 1.0f / s_.l[r] : 0.0f; // l = 0: no key, O = 0
        F::store_row(s_.oacc + r * s_.z.o_ld, p_.head_dim_v, inv, o + r * ldo);
        lse[r] = lse_of(s_.m[r], s_.l[r]);
      }
    }

   private:
    // The keys of key block j0 (a tile may take fewer: attention.h trims masked ones).
    int64_t block_keys(int64_t j0) const { return min64(p_.seqlen_k, j0 + job_.tiles.bn) - j0; }

    // Where each work item packs its key blocks (s_.kv), the microkernels take the fetch ahead of the next
    // one in paced steps through this block's products, one per pair of k (DotBf16Micro; AMX's tiles
    // run their k in a few large steps, and take it during the softmax as a packed block's).
    static constexpr bool kPacedFetch = requires { BMicro::k_steps(1, 1, 1); };
    bool paced() const { return kPacedFetch && s_.kv; }
    void product(int64_t m, int64_t n, int64_t kk, const bf16* a, const bf16* a_lo, int64_t lda, const bf16* b,
                 int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale) {
      if constexpr (kPacedFetch) {
        if (paced()) return BMicro::gemm(m, n, kk, a, a_lo, lda, b, ldb, c, ldc, acc, row_scale, nullptr, &prefetch_);
      }
      BMicro::gemm(m, n, kk, a, a_lo, lda, b, ldb, c, ldc, acc, row_scale);
    }

    // The packed K^T of key block j0 (V follows it): packed here where each work item packs its key
    // blocks (forward_per_tile), once for the item's query blocks, else the call's shared copy.
    const bf16* key_block(int64_t b, int64_t hk, int64_t j0) {
      if (!s_.kv) return kv_block(job_, s_.z, b, hk, j0 / job_.tiles.bn);
      Forward& owner = *kv_owner_;
      if (owner.kv_j0_ != j0) {
        pack_kv(p_, s_.z, b, hk, j0, block_keys(j0), owner.s_.kv);
        owner.kv_j0_ = j0;
      }
      return owner.s_.kv;
    }

    // Whether V of key block j0 (all its keys, which a product may read past a tile's) is finite,
    // found once per key block for the work item's query blocks.
    bool values_finite(int64_t b, int64_t hk, int64_t j0) {
      Forward& owner = *kv_owner_;
      if (owner.finite_j0_ != j0) {
        owner.finite_ = F::all_finite(row_ptr<const T>(p_.v, b, hk, j0), p_.v.ss, block_keys(j0), p_.head_dim_v);
        owner.finite_j0_ = j0;
      }
      return owner.finite_;
    }

    // One online-softmax step on the rows of s (log2 units after scaling): m, l, alpha updated, and
    // P = exp2(S * scale * log2(e) - m) written to pa + pa_lo (zero beyond cols up to BNk and where
    // masked; for f16 hi again at pa + 2 BNk). A row that has seen no visible key yet keeps m = -inf
    // and gets P = 0. The rows of a whole key block (the most of them) go through softmax_whole several
    // at a time (four of 128 keys, two of 256); the others (the last key block, masked tiles) one at a
    // time.
    void softmax_rows(int64_t cols, const Mask* mask) {
      rescaled_ = false;
      int64_t r = 0;
      // per row, from upcoming(); none where the products take paced steps of it (add_scores)
      const int64_t lines = paced() ? 0 : prefetch_.quota(rows_);
      if (!mask && cols == s_.z.bnk) {
        if (cols == 128) softmax_wholes<8, 4>(r, lines);
        else if (cols == 64) softmax_wholes<4, 4>(r, lines);
        else if (cols == 256) softmax_wholes<16, 2>(r, lines);
      }
      for (; r < rows_; ++r) {
        prefetch_.step(lines);
        softmax_row(r, cols, mask);
      }
    }

    // softmax_whole on the rows from r, R at a time while R are left (r then the first row left), each
    // group with its `lines` per row of the prefetch.
    template <int NV, int R>
    void softmax_wholes(int64_t& r, int64_t lines) {
      for (; r + R <= rows_; r += R) {
        prefetch_.step(R * lines);
        softmax_whole<NV, R>(r);
      }
    }

    // The reference of a row whose raw scores reach `raw_max` (log2 units after scaling by scale2).
    // Lazy rescaling: the reference moves only when the row's maximum passes it by more than
    // kLazyRescale (P then stays below 2^kLazyRescale), so after a row's first blocks O is rarely
    // rescaled and the P V product accumulates onto it without the pass over O. The logits are S *
    // scale * log2(e): the scale is positive, so the row's largest logit is its largest S times it (the
    // same bits), and each P one FMA and exp2 from S.
    float new_max(int64_t r, float raw_max, float scale2) const {
      const float row_max = raw_max * scale2;
      return row_max > s_.m[r] + kLazyRescale ? row_max : s_.m[r];
    }
    static float ref_of(float m) { return m == -kInf ? 0.0f : m; }
    // The row's m, l and alpha after a step with reference m_new and sum of P `sum`.
    void end_row(int64_t r, float m_new, float sum) {
      const float m_old = s_.m[r], ref = ref_of(m_new);
      const float alpha = m_old == ref ? 1.0f : V::first(V::exp2(V::set1(m_old - ref))); // exp2(0) = 1
      s_.alpha[r] = alpha;
      rescaled_ = rescaled_ || alpha != 1.0f;
      s_.l[r] = s_.l[r] * alpha + sum;
      s_.m[r] = m_new;
    }

    // The step on R rows from r that see all of their NV * 16 keys (NV a power of two, 16 NV = BNk):
    // the rows held in registers, their maxima and sums as trees, R NV independent exponentials. Row
    // by row, a step's latency (the maximum's chain and reduction, then the exponentials, then the
    // sum's) left the vector units idle: measured on the Xeon with AMX, side by side, 0.74x the bf16
    // forward's time (BENCHMARKS.md).
    template <int NV, int R>
    void softmax_whole(int64_t r) {
      const Dims& z = s_.z;
      const float scale2 = log2_scale(p_);
      const typename V::reg mul = V::set1(scale2);
      typename V::reg x[R][NV], t[R][NV];
      float m_new[R];
      for (int q = 0; q < R; ++q) {
        for (int i = 0; i < NV; ++i) t[q][i] = x[q][i] = V::loadu(s_.s + (r + q) * z.s_ld + 16 * i);
        for (int w = NV / 2; w >= 1; w /= 2)
          for (int i = 0; i < w; ++i) t[q][i] = V::max(t[q][i], t[q][i + w]);
        m_new[q] = new_max(r + q, V::reduce_max(t[q][0]), scale2);
      }
      for (int q = 0; q < R; ++q) {
        const typename V::reg vref = V::set1(ref_of(m_new[q]));
        for (int i = 0; i < NV; ++i) t[q][i] = x[q][i] = V::exp2(V::fms(x[q][i], mul, vref));
      }
      for (int q = 0; q < R; ++q) {
        for (int w = NV / 2; w >= 1; w /= 2)
          for (int i = 0; i < w; ++i) t[q][i] = V::add(t[q][i], t[q][i + w]);
        bf16* hi = s_.pa + (r + q) * z.pa_ld;
        for (int i = 0; i < NV; i += 2)
          Pack::split32(x[q][i], x[q][i + 1], hi + 16 * i, s_.pa_lo + (r + q) * z.pa_ld + 16 * i, 32, again_of(z.bnk));
        end_row(r + q, m_new[q], V::reduce_add(t[q][0]));
      }
    }

    // The step on row r, any cols, under a mask or not.
    void softmax_row(int64_t r, int64_t cols, const Mask* mask) {
      const Dims& z = s_.z;
      const float scale2 = log2_scale(p_);
      const typename V::reg mul = V::set1(scale2), neg_inf = V::set1(-kInf);
      const float* srow = s_.s + r * z.s_ld;
      // The row's S from c0, -inf in lanes c0 + i >= cols and, under a mask, in those it hides.
      const int32_t lo = mask ? mask->lo : INT32_MIN;
      const int32_t hi = static_cast<int32_t>(mask ? min64(mask->hi, cols - 1 - r) : cols - 1 - r);
      auto raw = [&](int64_t c0) {
        if (!mask && c0 + 16 <= cols) return V::loadu(srow + c0); // every lane visible
        const typename V::reg x = V::load(srow + c0, static_cast<int>(min64(16, cols - c0)));
        return V::select(V::in_band(static_cast<int32_t>(c0 - r), 1, lo, hi), x, neg_inf);
      };
      typename V::reg mx = neg_inf;
      for (int64_t c0 = 0; c0 < cols; c0 += 16) mx = V::max(mx, raw(c0));
      const float m_new = new_max(r, V::reduce_max(mx), scale2);
      const typename V::reg vref = V::set1(ref_of(m_new));
      // P: exp2 of S as it is, then 0 in the lanes the row does not see, as the backward's P, rather
      // than exp2(-inf), which underflowed and took a microcode assist per vector on Intel before
      // V512::exp2 flushed such results itself (a causal forward took 0.60 - 0.64x the non-causal
      // time, 0.53 - 0.56 after).
      auto prob = [&](int64_t c0) {
        if (c0 >= cols) return V::zero();
        if (!mask && c0 + 16 <= cols) return V::exp2(V::fms(V::loadu(srow + c0), mul, vref));
        const typename V::reg x = V::load(srow + c0, static_cast<int>(min64(16, cols - c0)));
        return V::select(V::in_band(static_cast<int32_t>(c0 - r), 1, lo, hi), V::exp2(V::fms(x, mul, vref)),
                         V::zero());
      };
      // The row's sum of P as softmax_whole sums it, a tree over its vectors of 16 keys (zeros beyond
      // cols, which add nothing exactly): a row gives the same bits whichever of the two steps it takes,
      // as in a decoding problem whose heads are swapped into one block's rows, or not (backend.cpp:
      // swap_decoding_heads; Api.DecodingHeadsSwappedGiveTheSameBits).
      static_assert(kMaxKeyVectors * 16 >= choose_tiles(Isa::amx, 128, 128, false, Keys::wide).bn, "the widest block");
      typename V::reg part[kMaxKeyVectors];
      const int n = static_cast<int>((z.bnk + 31) / 32 * 2);
      for (int64_t c0 = 0; c0 < z.bnk; c0 += 32) { // P as hi + lo, 32 keys at a time
        const typename V::reg p0 = prob(c0), p1 = prob(c0 + 16);
        part[c0 / 16] = p0;
        part[c0 / 16 + 1] = p1;
        Pack::split32(p0, p1, s_.pa + r * z.pa_ld + c0, s_.pa_lo + r * z.pa_ld + c0, z.bnk - c0, again_of(z.bnk));
      }
      for (int w = n; w > 1;) { // halves, as softmax_whole's for a power of two
        const int h = (w + 1) / 2;
        for (int i = 0; i + h < w; ++i) part[i] = V::add(part[i], part[i + h]);
        w = h;
      }
      end_row(r, m_new, V::reduce_add(part[0]));
    }
    static constexpr int kMaxKeyVectors = 16;

    const ForwardJob& job_;
    const core::Problem& p_;
    ForwardScratch s_;
    int64_t rows_ = 0;
    bool rescaled_ = false; // the last softmax_rows moved some row's reference (alpha != 1)
    Prefetch prefetch_;
    Forward* kv_owner_ = this; // whose kv holds the packed key block (share_converted)
    int64_t kv_j0_ = -1;       // the first key of the block packed into this one's kv
    int64_t finite_j0_ = -1;   // the first key of the block whose V values_finite() looked at last
    bool finite_ = false;      // and what it found
  };

  // --- Backward ------------------------------------------------------------------------------------

  static size_t backward_shared_bytes(const core::Problem& p, Tiles t) {
    return static_cast<size_t>(p.batch * p.heads_q * round_up(p.seqlen_q, t.bm) / t.bm * Dims(p, t).q_block()) *
           sizeof(bf16);
  }
  static int64_t backward_prepare_items(const BackwardJob& job) {
    return job.p->batch * job.p->heads_q * job.q_blocks;
  }
  struct QBlock {
    const bf16 *qa, *qat, *doa, *doat;
  };
  static QBlock q_block(const BackwardJob& job, const Dims& z, int64_t bh, int64_t ib) {
    const bf16* base = reinterpret_cast<const bf16*>(job.shared) + (bh * job.q_blocks + ib) * z.q_block();
    QBlock q;
    q.qa = base;
    q.doa = q.qa + z.x_block(z.dkx);
    q.qat = z.transposes() ? q.doa + z.x_block(z.dvkx) : nullptr;
    q.doat = z.transposes() ? q.qat + z.dn * z.t_ld : nullptr;
    return q;
  }
  // Packs query block `item` = (b, h, ib): Q and dO as A operands (k = d), and their transposes as A
  // operands (k = row) for dK^T and dV^T; a block of at most BMicro::kF32Rows rows takes those
  // products in f32 (Backward::add_scores: f32_products_), so it does not pack the transposes.
  static void backward_prepare(const BackwardJob& job, int64_t item) {
    const core::Problem& p = *job.p;
    const Dims z(p, job.tiles);
    const RowBlock r = row_block(item, p.heads_q, job.q_blocks, job.tiles.bm, p.seqlen_q);
    const QBlock q = q_block(job, z, r.b * p.heads_q + r.head, r.block);
    const T* qsrc = row_ptr<const T>(p.q, r.b, r.head, r.first);
    const T* dsrc = row_ptr<const T>(p.dout, r.b, r.head, r.first);
    pack_x_a(qsrc, p.q.ss, r.rows, p.head_dim, const_cast<bf16*>(q.qa), z.dk, z.bmp);
    pack_x_a(dsrc, p.dout.ss, r.rows, p.head_dim_v, const_cast<bf16*>(q.doa), z.dvk, z.bmp);
    if (!z.transposes() || r.rows <= BMicro::kF32Rows) return;
    pack_yt_a(qsrc, p.q.ss, r.rows, p.head_dim, const_cast<bf16*>(q.qat), z.bmk, z.dn);
    pack_yt_a(dsrc, p.dout.ss, r.rows, p.head_dim_v, const_cast<bf16*>(q.doat), z.bmk, z.dvn);
  }

  // Per-thread scratch of the backward:
  //   ktb [Dkx/2][2 BNp], vtb [Dvkx/2][2 BNp], kb [BNkx/2][2 Dn]  the key block as B operands
  //   s, dp [BMp][BNp] f32                                         S then P; dP then dS
  //   pb, dsb [kTParts BMk/2][2 BNp] bf16                          P, dS as B operands (hi, lo, f16: hi)
  //   dsa [BMp][BNkx], and for bf16 dsa_lo [BMp][BNk] bf16         dS as A operand (hi; lo, for f16 at
  //                                                                dsa + BNk)
  //   dk [BNp][Dn], dv [BNp][Dvn] f32                              the key block's accumulators of the
  //   dkt [Dn][BNp], dvt [Dvn][BNp] f32                            f32 products and, transposed, of the
  //                                                                bf16 ones (added up in finish())
  //   kf [BN][Dn], qf [BM][Dn], dof [BM][Dvn] f32                  K, Q, dO of tiles with f32 products
  // kb, pb, dsb, dsa, dsa_lo, dkt and dvt only where kHiLoBackward (null else).
  struct BackwardScratch {
    Dims z;
    bf16 *ktb, *vtb, *kb, *pb, *dsb, *dsa, *dsa_lo;
    float *s, *dp, *dk, *dv, *dkt, *dvt, *kf, *qf, *dof;
    BackwardScratch(const core::Problem& p, Tiles t, char* base, int64_t* bytes = nullptr) : z(p, t) {
      Carver c{base};
      // the buffers of the products with P and dS on the microkernel: only where kHiLoBackward
      auto hilo = [&](int64_t n) { return kHiLoBackward ? c.take<bf16>(n) : nullptr; };
      auto hilo_floats = [&](int64_t n) { return kHiLoBackward ? c.floats(n) : nullptr; };
      ktb = c.take<bf16>(z.dkx / 2 * z.kt_ld);
      vtb = c.take<bf16>(z.dvkx / 2 * z.kt_ld);
      kb = hilo(z.bnkx / 2 * z.dn_ld);
      pb = hilo(kTParts * z.bmk / 2 * z.kt_ld);
      dsb = hilo(kTParts * z.bmk / 2 * z.kt_ld);
      dsa = hilo(z.bmp * z.pa_ld);
      dsa_lo = kExact ? past(dsa, z.bnk) : hilo(z.bmp * z.pa_ld);
      s = c.floats(z.bmp * z.s_ld);
      dp = c.floats(z.bmp * z.s_ld);
      dk = c.floats(z.bnp * z.dk_ld);
      dv = c.floats(z.bnp * z.o_ld);
      dkt = hilo_floats(z.dn * z.s_ld);
      dvt = hilo_floats(z.dvn * z.s_ld);
      kf = c.floats(copy_room(t.bn * z.dn, z.bnkx / 2 * z.dn_ld));
      qf = c.floats(z.transposes() ? copy_room(t.bm * z.dn, z.dn * z.t_ld) : t.bm * z.dn);
      dof = c.floats(z.transposes() ? copy_room(t.bm * z.dvn, z.dvn * z.t_ld) : t.bm * z.dvn);
      if (bytes) *bytes = c.used;
    }
  };
  static size_t backward_scratch_bytes(const core::Problem& p, Tiles t) { return carved_bytes<BackwardScratch>(p, t); }

  class Backward {
   public:
    Backward(const BackwardJob& job, char* scratch) : job_(job), p_(*job.p), s_(p_, job.tiles, scratch) {}

    void begin(int64_t b, int64_t hk, int64_t j0, int64_t cols) {
      const Dims& z = s_.z;
      const T* k = row_ptr<const T>(p_.k, b, hk, j0);
      const T* v = row_ptr<const T>(p_.v, b, hk, j0);
      cols_ = cols;
      k_ = k;
      kf_ready_ = false;
      keys_finite_ = -1;
      need_ds_ = job_.need_dk || job_.need_dq;
      pack_y_bt(k, p_.k.ss, cols, p_.head_dim, s_.ktb, z.kt_ld, z.dk, z.bnp);
      if (need_ds_) pack_y_bt(v, p_.v.ss, cols, p_.head_dim_v, s_.vtb, z.kt_ld, z.dvk, z.bnp);
      if (kHiLoBackward && job_.need_dq) pack_y_b(k, p_.k.ss, cols, p_.head_dim, s_.kb, z.dn_ld, z.bnk, z.dn);
      if (job_.need_dk) fill(s_.dk, cols * z.dk_ld, 0.0f);
      if (job_.need_dv) fill(s_.dv, cols * z.o_ld, 0.0f);
      transposed_ = false;
    }

    // C += A B in f32 for a tile whose products are in f32 (f32_products_), under its mask
    // (blocks.h: tile_product).
    void product_f32(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                     int64_t ldb, float* c, int64_t ldc, bool keys_are_k) {
      tile_product<F>(masked_ ? &tile_mask_ : nullptr, keys_are_k, m, n, kk, a, ars, aks, b, ldb, c, ldc);
    }

    // A query block of head h: S, P, dV, dP, dS, dK. A block of at most BMicro::kF32Rows rows takes
    // its products with P and dS in f32 (a few rows' bf16 forms would be mostly the padding of kK), each
    // output row over what it sees; partially masked tiles go to the tiles as unmasked ones do, P and
    // dS 0 where masked, their products with operands that hold a NaN or an infinity on copies without
    // them (zeroed_, add_grads, add_dq). In three phases, which attention.h runs for all the key blocks that see a
    // query block in turn (add_scores of each, then add_probs of each, then add_grads of each): the
    // products on tiles in two runs, the vector passes between them, since each return to the tiles
    // after vector work costs a ramp of the tile unit (about 0.3 us here: BENCHMARKS.md).
    // s [rows][cols] = Q K^T; dp [rows][cols] = dO V^T.
    void add_scores(int64_t b, int64_t h, int64_t i0, int64_t rows, const Mask* mask) {
      const Dims& z = s_.z;
      const int64_t bh = b * p_.heads_q + h, cols = cols_;
      const QBlock q = q_block(job_, z, bh, i0 / job_.tiles.bm);
      rows_ = rows;
      tile_mask_ = mask ? *mask : kShowAll;
      masked_ = mask != nullptr;
      f32_products_ = rows <= BMicro::kF32Rows;
      BMicro::gemm(rows, cols, z.dkx, q.qa, x_lo(q.qa, z.bmp, z.dkx), a_ld(z.dkx), s_.ktb, z.kt_ld, s_.s, z.s_ld, false,
                   nullptr);
      if (need_ds_)
        BMicro::gemm(rows, cols, z.dvkx, q.doa, x_lo(q.doa, z.bmp, z.dvkx), a_ld(z.dvkx), s_.vtb, z.kt_ld, s_.dp,
                     z.s_ld, false, nullptr);
    }

    // P = exp2(S * scale * log2(e) - lse2), 0 where masked, with P's split for dV^T in the same pass
    // where the tile takes its products on tiles; dS = P (dP - delta) * scale, with its splits for dQ
    // and dK^T likewise.
    void add_probs(int64_t b, int64_t h, int64_t i0) {
      const Dims& z = s_.z;
      const int64_t row0 = (b * p_.heads_q + h) * p_.seqlen_q + i0, rows = rows_, cols = cols_;
      const Mask* mask = masked_ ? &tile_mask_ : nullptr;
      delta_ = job_.delta + row0;
      zeroed_ = !f32_products_ ? zeroed(b, h, i0) : Zeroed{}; // before P overwrites S
      if (job_.need_dv && !f32_products_)
        probs_split(rows, cols, job_.lse2 + row0);
      else
        F::probs(s_.s, z.s_ld, rows, cols, log2_scale(p_), job_.lse2 + row0, mask);
      if (need_ds_) {
        if (!f32_products_)
          dscores_split(rows, cols, job_.delta + row0);
        else
          F::dscores(s_.s, s_.dp, z.s_ld, rows, cols, job_.delta + row0, p_.scale, mask);
      }
    }

    // dv [cols][Dv] += P^T dO and dk [cols][D] += dS^T Q (the bf16 products as dv^T and dk^T).
    void add_grads(int64_t b, int64_t h, int64_t i0) {
      const Dims& z = s_.z;
      const int64_t bh = b * p_.heads_q + h, rows = rows_, cols = cols_;
      const QBlock q = q_block(job_, z, bh, i0 / job_.tiles.bm);
      if (!f32_products_ && !transposed_) { // the key block's first tile with bf16 products
        if (job_.need_dv) fill(s_.dvt, z.dvn * z.s_ld, 0.0f);
        if (job_.need_dk) fill(s_.dkt, z.dn * z.s_ld, 0.0f);
        transposed_ = true;
      }
      if (job_.need_dv) {
        if (f32_products_) {
          F::load_rows(row_ptr<const T>(p_.dout, b, h, i0), p_.dout.ss, rows, p_.head_dim_v, s_.dof, z.dvn);
          product_f32(cols, p_.head_dim_v, rows, s_.s, 1, z.s_ld, s_.dof, z.dvn, s_.dv, z.o_ld, false);
        } else { // dv^T [Dv][cols] += dO^T P, P split by probs_split
          const bf16* a = zeroed_.dout ? finite_copy(q.doat, z.dvn * z.t_ld, as_bf16(s_.dof)) : q.doat;
          BMicro::gemm(p_.head_dim_v, cols, z.bmt, a, nullptr, z.t_ld, s_.pb, z.kt_ld, s_.dvt, z.s_ld, true, nullptr,
                       b_lo(s_.pb));
          if (zeroed_.dout)
            add_nonfinite_t(row_ptr<const T>(p_.dout, b, h, i0), p_.dout.ss, p_.head_dim_v, s_.dvt,
                            [&](int64_t r, int64_t j) { return s_.s[r * z.s_ld + j]; });
        }
      }
      if (job_.need_dk) {
        if (f32_products_) {
          F::load_rows(row_ptr<const T>(p_.q, b, h, i0), p_.q.ss, rows, p_.head_dim, s_.qf, z.dn);
          product_f32(cols, p_.head_dim, rows, s_.dp, 1, z.s_ld, s_.qf, z.dn, s_.dk, z.dk_ld, false);
        } else { // dk^T [D][cols] += Q^T dS
          const bf16* a = zeroed_.q ? finite_copy(q.qat, z.dn * z.t_ld, as_bf16(s_.qf)) : q.qat;
          BMicro::gemm(p_.head_dim, cols, z.bmt, a, nullptr, z.t_ld, s_.dsb, z.kt_ld, s_.dkt, z.s_ld, true, nullptr,
                       b_lo(s_.dsb));
          if (zeroed_.q)
            add_nonfinite_t(row_ptr<const T>(p_.q, b, h, i0), p_.q.ss, p_.head_dim, s_.dkt,
                            [&](int64_t r, int64_t j) { return dscore(r, j); });
        }
      }
    }

    // Share `share` of `shares` of the operands of a query block that comes next (attention.h): its
    // packed Q and dO and its rows of the dQ accumulator, fetched into the cache during the vector
    // passes of this worker's next add_probs(), where they are not large (Prefetch::kMaxBytes). Measured on
    // the Xeon with AMX (B = 1, Hq = 16, S = 4096): the products of a query block's first key block ran
    // at half the rate of the others before.
    void upcoming(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t share, int64_t shares) {
      const Dims& z = s_.z;
      const int64_t bh = b * p_.heads_q + h;
      const int64_t bytes = z.q_block() * static_cast<int64_t>(sizeof(bf16));
      const Prefetch::Region packed = Prefetch::packed(q_block(job_, z, bh, i0 / job_.tiles.bm).qa, bytes);
      Prefetch::Region dq;
      if (job_.need_dq)
        dq = Prefetch::rows_of(job_.dq_acc + b * job_.dq_sb + h * job_.dq_sh + i0 * job_.dq_ss, job_.dq_ss, rows,
                               p_.head_dim);
      prefetch_.share_of(packed, dq, share, shares);
    }

    // P = exp2(S * scale * log2(e) - lse2) of a tile (as F::probs, 0 where masked) into s, and P as the B
    // side of dV^T = dO^T P, hi + lo (as Pack::split_pairs: VNNI words of rows k and k + 1, zeros
    // beyond rows and cols), in the same pass: s is read once.
    void probs_split(int64_t rows, int64_t cols, const float* lse2) {
      const Dims& z = s_.z;
      const typename V::reg mul = V::set1(log2_scale(p_));
      const int64_t seg = z.bmk / 2 * z.kt_ld, lines = prefetch_.quota(z.bmk); // half of them here
      auto prob = [&](int64_t r, int64_t c0) {
        if (r >= rows || c0 >= cols) return V::zero();
        const int n = static_cast<int>(min64(16, cols - c0));
        float* at = s_.s + r * z.s_ld + c0;
        typename V::reg pr = F::prob(V::load(at, n), mul, V::set1(lse2[r]));
        if (n < 16 || masked_) pr = V::select(shown(r, c0), pr, V::zero()); // no keys past cols or masked
        V::store(at, pr, n);
        return pr;
      };
      for (int64_t r = 0; r < z.bmk; r += 2) {
        prefetch_.step(lines);
        bf16* hi = s_.pb + r / 2 * z.kt_ld;
        for (int64_t c0 = 0; c0 < z.bnp; c0 += 16)
          Pack::split_pairs(prob(r, c0), prob(r + 1, c0), hi + 2 * c0, hi + seg + 2 * c0, kExact ? 2 * seg : 0);
      }
    }

    // dS = P (dP - delta) * scale of a tile (as F::dscores, 0 where masked), in one pass over P and dP: as
    // dQ's A operand, hi + lo [BMp][BNk] (zeros beyond rows and cols), and as the B side of dK^T = Q^T
    // dS, as probs_split splits P.
    void dscores_split(int64_t rows, int64_t cols, const float* delta) {
      const Dims& z = s_.z;
      const typename V::reg vs = V::set1(p_.scale);
      const int64_t seg = z.bmk / 2 * z.kt_ld, lines = prefetch_.quota(z.bmk / 2);
      const bool for_dq = job_.need_dq, for_dk = job_.need_dk;
      for (int64_t r = 0; r < z.bmk; r += 2) {
        prefetch_.step(lines);
        const typename V::reg dl0 = V::set1(r < rows ? delta[r] : 0.0f);
        const typename V::reg dl1 = V::set1(r + 1 < rows ? delta[r + 1] : 0.0f);
        auto ds = [&](int64_t row, typename V::reg dl, int64_t c0) {
          if (row >= rows || c0 >= cols) return V::zero();
          const int n = static_cast<int>(min64(16, cols - c0));
          const typename V::reg d =
              F::dscore(V::load(s_.s + row * z.s_ld + c0, n), V::load(s_.dp + row * z.s_ld + c0, n), dl, vs);
          return masked_ ? V::select(shown(row, c0), d, V::zero()) : d; // dP may be NaN where masked
        };
        bf16* hi = s_.dsb + r / 2 * z.kt_ld;
        for (int64_t c0 = 0; c0 < z.bnk; c0 += 32) {
          const typename V::reg x0 = ds(r, dl0, c0), x1 = ds(r, dl0, c0 + 16);
          const typename V::reg y0 = ds(r + 1, dl1, c0), y1 = ds(r + 1, dl1, c0 + 16);
          if (for_dq && r < z.bmp) { // bmp and bmk are even: r + 1 < bmp too
            bf16 *a = s_.dsa + r * z.pa_ld + c0, *a_lo = s_.dsa_lo + r * z.pa_ld + c0;
            Pack::split32(x0, x1, a, a_lo, z.bnk - c0, again_of(z.bnk));
            Pack::split32(y0, y1, a + z.pa_ld, a_lo + z.pa_ld, z.bnk - c0, again_of(z.bnk));
          }
          if (!for_dk) continue;
          if (c0 < z.bnp) Pack::split_pairs(x0, y0, hi + 2 * c0, hi + seg + 2 * c0, kExact ? 2 * seg : 0);
          if (c0 + 16 < z.bnp)
            Pack::split_pairs(x1, y1, hi + 2 * c0 + 32, hi + seg + 2 * c0 + 32, kExact ? 2 * seg : 0);
        }
      }
    }

    // dq [rows][D] += dS K for the last query block added (in f32 where its other products were).
    void add_dq(float* dq, int64_t ld) {
      const Dims& z = s_.z;
      if (f32_products_) {
        if (!kf_ready_) F::load_rows(k_, p_.k.ss, cols_, p_.head_dim, s_.kf, z.dn);
        kf_ready_ = true;
        product_f32(rows_, p_.head_dim, cols_, s_.dp, z.s_ld, 1, s_.kf, z.dn, dq, ld, true);
        return;
      }
      const bf16* kb = s_.kb;
      if (zeroed_.k) {
        kb = finite_copy(s_.kb, z.bnkx / 2 * z.dn_ld, as_bf16(s_.kf));
        kf_ready_ = false;
      }
      BMicro::gemm(rows_, p_.head_dim, p_k(cols_, z.bnk), s_.dsa, p_lo(s_.dsa_lo), z.pa_ld, kb, z.dn_ld, dq, ld, true,
                   nullptr);
      if (zeroed_.k)
        add_nonfinite_keys(k_, p_.k.ss, cols_, p_.head_dim, rows_, tile_mask_, dq, ld,
                           [&](int64_t r, int64_t j) { return dscore(r, j); });
    }

    // dq [rows][D] += dS K of n workers' last query block against consecutive key blocks whose tiles
    // are unmasked, in worker order: the sums of their add_dq() one after the other, but
    // in one product over the n key blocks (BMicro::gemm_sum), so that dq is loaded and stored once
    // rather than n times (each key block's k padded to BNk). Measured on the Xeon with AMX (one
    // thread, 128 rows, 4 key blocks of 64): 0.80x the time of four products at D = 128, 0.64x at D =
    // 64. Only over microkernels with gemm_sum; attention.h calls add_dq() in turn otherwise.
    static void add_dq_sum(Backward* w, int64_t n, float* dq, int64_t ld)
      requires requires { typename BMicro::Segment; }
    {
      if (w[0].f32_products_) { // a block of few rows: each in f32 (the same for all: the same rows)
        for (int64_t g = 0; g < n; ++g) w[g].add_dq(dq, ld);
        return;
      }
      typename BMicro::Segment seg[kMaxGroup];
      for (int64_t g = 0; g < n; ++g) seg[g] = {w[g].s_.dsa, p_lo(w[g].s_.dsa_lo), w[g].s_.kb, nullptr};
      const Dims& z = w[0].s_.z;
      BMicro::gemm_sum(w[0].rows_, w[0].p_.head_dim, p_k(z.bnk, z.bnk), seg, n, z.pa_ld, z.dn_ld, dq, ld, true,
                       nullptr);
    }

    // The key block's dK and dV rows (T, or f32 partial rows when the queries are split); null: not needed.
    template <class U>
    void finish(U* dk, int64_t lddk, U* dv, int64_t lddv, int64_t cols) {
      const Dims& z = s_.z;
      if (transposed_) { // the bf16 products' sums, after the f32 products' (a fixed order)
        if (dk) add_transposed(s_.dkt, z.dn, cols, s_.dk, z.dk_ld);
        if (dv) add_transposed(s_.dvt, z.dvn, cols, s_.dv, z.o_ld);
      }
      for (int64_t c = 0; c < cols; ++c) {
        if (dk) F::store_row(s_.dk + c * s_.z.dk_ld, p_.head_dim, 1.0f, dk + c * lddk);
        if (dv) F::store_row(s_.dv + c * s_.z.o_ld, p_.head_dim_v, 1.0f, dv + c * lddv);
      }
    }

   private:
    // The operands of a tile's products with P and dS (whose masked entries are 0, and their lo parts
    // 0 where they are bf16 values) that hold a NaN or an infinity: 0 * inf is NaN, which would reach
    // outputs that do not depend on it and turn infinities into NaN (RELIABILITY.md: non-finite
    // inputs). Those products take copies with such values zeroed (finite_copy, into the scratch of
    // the f32 products), and what they left out is added to the
    // outputs whose rows and keys the mask shows; the others get the same bits as without them: Q and
    // dO of query block i0 of head h (dK^T = Q^T dS, dV^T = dO^T P), K of the key block (dQ = dS K).
    // S = Q K^T and dP = dO V^T meet them too (their masked lanes are dropped), and each of their
    // entries is NaN or infinite where a row of Q or dO or a row of K is not finite: a finite tile of S
    // clears Q and K, a finite dP clears dO, for a pass over the tile rather than over the inputs.
    // An unmasked tile needs no copies of Q and K: every row sees every key there, so each output
    // their products reach with a NaN or an infinity depends on it (through that row or column of S,
    // P and dS) and may hold NaN; only dO's infinities, which dV receives as they are, are copied.
    struct Zeroed {
      bool q = false, dout = false, k = false;
    };
    Zeroed zeroed(int64_t b, int64_t h, int64_t i0) {
      const Dims& z = s_.z;
      const bool s_finite = !need_ds_ || !masked_ || F::all_finite(s_.s, z.s_ld, rows_, cols_); // dK or dQ
      const bool dp_finite = need_ds_ && job_.need_dv && F::all_finite(s_.dp, z.s_ld, rows_, cols_);
      if (job_.need_dq && !s_finite && keys_finite_ < 0) keys_finite_ = F::all_finite(k_, p_.k.ss, cols_, p_.head_dim);
      Zeroed zr;
      zr.k = job_.need_dq && !s_finite && keys_finite_ == 0;
      zr.q = job_.need_dk && !s_finite &&
             !F::all_finite(row_ptr<const T>(p_.q, b, h, i0), p_.q.ss, rows_, p_.head_dim);
      zr.dout = job_.need_dv && !dp_finite &&
                !F::all_finite(row_ptr<const T>(p_.dout, b, h, i0), p_.dout.ss, rows_, p_.head_dim_v);
      return zr;
    }
    static bf16* as_bf16(float* scratch) { return reinterpret_cast<bf16*>(scratch); }
    // dS [r][j] of the tile, as F::dscore computes it (from P in s and dP in dp).
    float dscore(int64_t r, int64_t j) const {
      const int64_t at = r * s_.z.s_ld + j;
      return s_.s[at] * (s_.dp[at] - delta_[r]) * p_.scale;
    }
    // acc [c][j] (transposed, rows s_ld apart) += w(r, j) x [r][c] for each non-finite x [r][c] (the
    // tile's rows of x at src) and each key j that row r sees: what a product on a zeroed copy left out.
    template <class W>
    void add_nonfinite_t(const T* x, int64_t ldx, int64_t width, float* acc, W&& w) const {
      for (int64_t r = 0; r < rows_; ++r)
        for (int64_t c = 0; c < width; ++c) {
          const float v = to_float(x[r * ldx + c]);
          if (__builtin_isfinite(v)) continue;
          for (int64_t j = 0; j < cols_; ++j)
            if (tile_mask_.shows(r, j)) acc[c * s_.z.s_ld + j] += w(r, j) * v;
        }
    }

    // The lanes of row r from column c0 that lie before cols_ and that the tile's mask (if any) shows.
    typename V::mask shown(int64_t r, int64_t c0) const {
      const int32_t lo = masked_ ? tile_mask_.lo : INT32_MIN;
      const int32_t hi = static_cast<int32_t>(masked_ ? min64(tile_mask_.hi, cols_ - 1 - r) : cols_ - 1 - r);
      return V::in_band(static_cast<int32_t>(c0 - r), 1, lo, hi);
    }

    // For bf16 the lo segment of P or dS as B (pb, dsb) as the products' B_lo; for f16 none (its
    // segments are stacked along k).
    const bf16* b_lo(const bf16* hi) const { return kExact ? nullptr : hi + s_.z.bmk / 2 * s_.z.kt_ld; }

    // dst [cols][ldd] += src^T, src [width][s_ld] (width a multiple of 16, columns up to BNp readable).
    void add_transposed(const float* src, int64_t width, int64_t cols, float* dst, int64_t ldd) const {
      for (int64_t d0 = 0; d0 < width; d0 += 16)
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
          typename V::reg block[16];
          for (int i = 0; i < 16; ++i) block[i] = V::loadu(src + (d0 + i) * s_.z.s_ld + c0);
          V::transpose(block);
          for (int j = 0; j < 16 && c0 + j < cols; ++j) {
            float* row = dst + (c0 + j) * ldd + d0;
            V::storeu(row, V::add(V::loadu(row), block[j]));
          }
        }
    }

    const BackwardJob& job_;
    const core::Problem& p_;
    BackwardScratch s_;
    bool need_ds_ = false, masked_ = false, f32_products_ = false, kf_ready_ = false;
    bool transposed_ = false; // dkt and dvt hold sums (zeroed at the key block's first bf16 tile)
    int64_t cols_ = 0, rows_ = 0;
    int keys_finite_ = -1; // whether K of the key block is finite: -1 not looked at yet (zeroed)
    Zeroed zeroed_;        // of the last tile (add_probs)
    const float* delta_ = nullptr; // delta of the last tile's rows (add_probs)
    const T* k_ = nullptr;
    Mask tile_mask_{};
    Prefetch prefetch_;
  };
};

} // namespace
} // namespace flashback::cpu
