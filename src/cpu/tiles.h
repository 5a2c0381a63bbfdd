// Tile sizes: a small constexpr function of (ISA, head dims, pass, wide_keys), unit-tested in tests/cpu/tiles_test.cpp.
// The tests derive their sequence-length sweeps (1, BM-1, BM, BM+1, ...) from it.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/kernels.h"

namespace flashback::cpu {

// keys: the forward's key blocks as the problem allows them (forward_keys below; kernels.h: Keys).
constexpr Tiles choose_tiles(Isa isa, int64_t head_dim, int64_t head_dim_v, bool backward, Keys keys) {
  (void)head_dim_v;
  const bool wide = keys == Keys::wide;
  if (isa == Isa::scalar) return {32, 32};
  // AVX2 and AVX-512 (measured on Zen 4, D = 64 and 128, one thread, min of 5; see BENCHMARKS.md):
  // forward 64 x 64 (AVX-512's wider key blocks below): the Q^T panel (D x 64 floats, 32 KiB at D =
  //   128) is reused by every key block; BM = 96 or 128 drops to 60-70% of peak.
  // backward 128 x 64: the dK/dV/dQ GEMMs run over k = 128 query rows, halving their C-tile
  //   traffic; 64 x 64 measured 76-79%, 128 x 64 81-88%, 192 x 64 80-91% (more scratch, no gain).
  // AVX2 forward at D >= 128 (measured on Zen 3, side by side; BENCHMARKS.md): 64 x 128, the P V
  //   product's output tile loaded, rescaled and stored once per 128 keys rather than 64, and the
  //   online softmax's per-block steps halved: 0.94-0.98x the time at D = 128 (causal 0.96-0.99);
  //   no clear change at D = 256 (0.97, 1.01), D = 96 (0.99, 1.01) or D = 64 (0.99, 1.01).
  if (isa == Isa::avx2 && !backward && head_dim >= 128) return Tiles{64, 128};
  // avx512bf16's vdpbf16ps kernels (bf16 only; measured on Zen 5, side by side, B = 1, Hq = 16,
  // S = 4096): forward 64 x 128, backward 128 x 128, the longer k of the P V, dV, dK and dQ products
  // amortizing each C tile's loads: 0.97x / 0.97x the time of 64 x 64 / 128 x 64 at D = 128 (forward /
  // backward), 0.93x / 0.96x at D = 64. With the backward's products with P and dS in f32 (Zen 4,
  // dot_bf16_micro.h: kF32Rows), 128 x 128 still: 128 x 64 took 1.02 - 1.07x its time and 64 x 128
  // 1.00 - 1.05x (B = 1, Hq = 16, S = 4096 and B = 8, S = 512 at D = 128; S = 512 and 197 at D = 64).
  if (isa == Isa::avx512bf16) return backward ? Tiles{128, 128} : Tiles{64, 128};
  // AMX forward 64 x 128 (measured on a Xeon with AMX, side by side, B = 1, Hq = 16, S = 4096): the
  // P V product's k doubles, so each accumulator tile of O is loaded and stored once per 128 keys:
  // 0.86x the time of 64 x 64 at D = 128, 0.92x at D = 64. Where wide_keys, 64 x 256 (once the
  // softmax took whole key blocks several rows at a time): 0.88x the time of 64 x 128 at D = 128, 0.91x
  // at D = 64, 0.86x at D = 256, 0.98x at S = 512 (Hq = 128); 128 x 128, 32 x 256 and 128 x 256 no
  // faster. The backward keeps 128 x 64 (64 x 64, 64 x 128 and 128 x 128 within the noise of those
  // rounds).
  if (isa == Isa::amx && !backward) return Tiles{64, wide ? 256 : 128};
  // AVX-512 f32 forward (measured on a Xeon without AMX, side by side, B = 1, Hq = 16, S = 2048 but where
  // said): 64 x 128, and 64 x 256 where wide_keys (below) at D >= 128, the P V product's k longer as above.
  // Against 64 x 64: 0.976x the time at D = 128 (S = 2048 and 4096), 0.979x at D = 256, 0.987x / 0.990x
  // at D = 64 (S = 2048 / 4096), 0.984x at D = 96 (B = 2, S = 1000), 0.980x / 0.988x at B = 8, S = 512 (D =
  // 128 / 64), bf16 converted 0.977x; causal 0.987x / 0.990x (S = 4096), 1.009x at B = 8, S = 512. 64 x 256
  // took 1.006x the time of 64 x 128 at D = 96 and 0.997x at D = 64. Where a kv head's query rows are few
  // (decoding) 64 x 64 still: 64 x 128 took 1.06x its time and 64 x 256 1.20x (Hq = 32, Hk = 8, Sq = 1, Sk
  // = 8192, D = 128), each key block packed per tile for a few rows (math_f32.h); at Sq = 16 (B = 4) 64 x 256
  // 1.03x, 64 x 128 0.98x.
  if (isa == Isa::avx512 && !backward && keys != Keys::few) return Tiles{64, wide && head_dim >= 128 ? 256 : 128};
  return backward ? Tiles{128, 64} : Tiles{64, 64};
}

static_assert(choose_tiles(Isa::scalar, 64, 64, false, Keys::usual).bm > 0);

namespace { // internal linkage, as blocks.h: compiled into every ISA's translation unit

// Whether the query side of a kv head is at most kMaxGroup query blocks (decoding, short chunks
// against a long cache): then each key block serves one forward work item or few, and the tile maths
// prepare K and V per tile, in the item's scratch, rather than once per call for the whole cache.
inline bool few_query_blocks(const core::Problem& p, Tiles t) {
  return p.group() * ((p.seqlen_q + t.bm - 1) / t.bm) <= kMaxGroup;
}

// Whether a kv head's query side, the rows of its group of query heads counted together, is at most
// kMaxGroup query blocks: what the forward's tiles depend on (forward_keys, wide_keys). A decoding
// problem counts the same whether or not its heads are swapped into rows (backend.cpp:
// swap_decoding_heads, which few_query_blocks does not: G blocks of one row, or one of G rows), so that
// both take the same tiles, and give the same bits.
inline bool few_query_rows(const core::Problem& p, Tiles t) {
  return (p.group() * p.seqlen_q + t.bm - 1) / t.bm <= kMaxGroup;
}

// sum over i in [a, b) of max(0, c + s i), for a slope s of -1, 0 or 1 (in double: the sums of huge
// problems pass int64).
inline double ramp_sum(int64_t a, int64_t b, int64_t c, int s) {
  if (s == 0) return c > 0 && b > a ? static_cast<double>(b - a) * static_cast<double>(c) : 0.0;
  if (s > 0 && a < 1 - c) a = 1 - c; // c + i >= 1
  if (s < 0 && b > c) b = c;         // c - i >= 1
  if (a >= b) return 0.0;
  return static_cast<double>(b - a) * (static_cast<double>(c + s * a) + static_cast<double>(c + s * (b - 1))) / 2;
}

// The query-key pairs a problem's mask shows, per query row (Sk without a mask), in closed form: row
// i sees keys [max(0, i + dlo), min(Sk - 1, i + dhi)], whose count is linear in i between the rows -dlo
// and Sk - dhi, where either end stops at an edge. (A loop over the rows took seconds for the sizes a
// workspace query may name: the fuzzer's timeout at ae78274.)
inline double visible_keys_per_row(const core::Problem& p) {
  const int64_t sq = p.seqlen_q, sk = p.seqlen_k, dlo = p.band.dlo, dhi = p.band.dhi;
  if (sq <= 0) return 0.0;
  auto clamp = [&](int64_t x) { return x < 0 ? int64_t{0} : x > sq ? sq : x; };
  int64_t cut1 = clamp(-dlo), cut2 = clamp(sk - dhi);
  if (cut1 > cut2) {
    const int64_t t = cut1;
    cut1 = cut2;
    cut2 = t;
  }
  const int64_t cuts[4] = {0, cut1, cut2, sq};
  double pairs = 0;
  for (int k = 0; k < 3; ++k) {
    const int64_t a = cuts[k], b = cuts[k + 1];
    if (a >= b) continue;
    const bool from_first = a < -dlo, to_row_end = a < sk - dhi; // lo = 0; hi = i + dhi
    if (from_first && to_row_end) pairs += ramp_sum(a, b, dhi + 1, 1);
    else if (from_first) pairs += ramp_sum(a, b, sk, 0);
    else if (to_row_end) pairs += ramp_sum(a, b, dhi - dlo + 1, 0);
    else pairs += ramp_sum(a, b, sk - dlo, -1);
  }
  return pairs / static_cast<double>(sq);
}

// Whether a problem's forward may take wide key blocks (choose_tiles: the amx and avx512 levels): where
// each key block serves more than one work item's query blocks (not few_query_rows, as in decoding or
// a short chunk against a long cache), and without a mask, or under one that shows each row at least
// kWideMaskedKeys keys on average, with bf16 or f32 inputs: partially masked tiles grow with the key
// block, and the wider ones lose where they are a larger share of the tiles. Measured on the Xeon with AMX,
// bf16 on tiles, B = 1 (but where said), Hq = 16, D = 128, side by side, 64 x 256 against 64 x 128:
// causal 0.955x the forward's time at S = 4096, 0.951x at S = 8192 (Hq = 8), 1.01x at S = 2048 (B = 2),
// 1.08x at S = 1024 (B = 4), 1.13x at S = 512 (B = 8), 1.19x with a window of 256 keys at S = 4096.
// f16's masked tiles take P V in f32 (math_bf16.h), which wider tiles only slow (when bf16's did too,
// causal took 0.99x the time at S = 4096 and 1.16x at S = 512). f32 (the avx512 kernels, on the Xeon
// without AMX, D = 128, side by side): causal 0.991x the time of 64 x 128 at S = 4096, 0.990x at S = 8192
// (Hq = 8).
//
// forward_keys: the forward's key blocks for a problem (choose_tiles), few, wide as above, or usual.
// Every SIMD level's forward takes query blocks of the same rows, so that `few` is the same whichever
// level asks.
inline constexpr double kWideMaskedKeys = 2048;
inline Keys forward_keys(const core::Problem& p) {
  constexpr Tiles narrow = choose_tiles(Isa::amx, 128, 128, false, Keys::usual);
  static_assert(narrow.bm == choose_tiles(Isa::avx512, 128, 128, false, Keys::few).bm);
  if (p.heads_kv <= 0) return Keys::usual;
  if (few_query_rows(p, narrow)) return Keys::few;
  const bool wide =
      !p.masked() || (p.dtype != core::DType::f16 && visible_keys_per_row(p) >= kWideMaskedKeys);
  return wide ? Keys::wide : Keys::usual;
}
inline bool wide_keys(const core::Problem& p) { return forward_keys(p) == Keys::wide; }

// The backward's query blocks hold at most the problem's query rows, rounded up to 16 (the row granule
// of every level's operands). Its packed or converted Q and dO are a block per query block of every
// head, and a block of 128 rows around one row made the workspace 2.8 GB for 0.5 MB of tensors (bf16 at
// amx, B Hq = 65535 heads of one row, D = 1: the fuzzer). A problem that short has one query block either way.
inline int64_t backward_block_rows(int64_t bm, int64_t seqlen_q) {
  const int64_t rows = seqlen_q < 1 ? 16 : (seqlen_q + 15) / 16 * 16;
  return rows < bm ? rows : bm;
}

// A level's tiles for a problem: what each kernel set's tiles() returns.
inline Tiles tiles_of(Isa isa, const core::Problem& p, bool backward) {
  Tiles t = choose_tiles(isa, p.head_dim, p.head_dim_v, backward, forward_keys(p));
  if (backward) t.bm = backward_block_rows(t.bm, p.seqlen_q);
  return t;
}

} // namespace

static_assert(choose_tiles(Isa::avx512, 128, 128, true, Keys::usual).bm % 16 == 0 &&
              choose_tiles(Isa::avx512, 128, 128, true, Keys::usual).bn % 16 == 0);

} // namespace flashback::cpu
