// Portable microkernels: plain loops the compiler may vectorize for the baseline target. They define
// what every other instruction set's kernels must compute.
#include <cmath>
#include <limits>

#include "cpu/math_f32.h"
#include "cpu/tiles.h"

namespace flashback::cpu {
namespace {

struct ScalarMicro {
  static constexpr Isa isa = Isa::scalar;

  static Tiles tiles(const core::Problem& p, bool backward) {
    return tiles_of(isa, p, backward);
  }

  // C[M][N] = (acc ? row_scale[r] * C : 0) + A B, where A(r, k) = a[r * ars + k * aks] and
  // B(k, c) = b[k * ldb + c]. row_scale may be null (1). The product's sum runs from zero, in k order,
  // and C joins it at the end (micro_f32.h: tile).
  static void gemm(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                   int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale) {
    constexpr int64_t kCols = 64;
    for (int64_t r = 0; r < m; ++r) {
      float* crow = c + r * ldc;
      const float s = row_scale ? row_scale[r] : 1.0f;
      for (int64_t x0 = 0; x0 < n; x0 += kCols) {
        const int64_t w = n - x0 < kCols ? n - x0 : kCols;
        float sum[kCols] = {};
        for (int64_t k = 0; k < kk; ++k) {
          const float av = a[r * ars + k * aks];
          const float* brow = b + k * ldb + x0;
          for (int64_t x = 0; x < w; ++x) sum[x] += av * brow[x];
        }
        for (int64_t x = 0; x < w; ++x) crow[x0 + x] = acc ? crow[x0 + x] * s + sum[x] : sum[x];
      }
    }
  }

  // gemm without the paced steps of a fetch ahead: its lines all go after the products (math_f32.h).
  static int64_t k_steps(int64_t, int64_t, int64_t) { return 0; }
  static void gemm_fetching(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks,
                            const float* b, int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale,
                            Prefetch*) {
    gemm(m, n, kk, a, ars, aks, b, ldb, c, ldc, acc, row_scale);
  }
  // C = A B, and col_max[x] = max(col_max[x], max over r < m of C[r][x]) for x < n: the forward's row
  // maxima of S^T, for softmax_t's block_max.
  static void gemm_col_max(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                           int64_t ldb, float* c, int64_t ldc, float* col_max, Prefetch* pf) {
    gemm_fetching(m, n, kk, a, ars, aks, b, ldb, c, ldc, false, nullptr, pf);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t x = 0; x < n; ++x) col_max[x] = c[r * ldc + x] > col_max[x] ? c[r * ldc + x] : col_max[x];
  }

  // gemm where row i sums only over k in [i + lo, i + hi]: see blocks.h.
  static void gemm_banded(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t aks, const float* b,
                          int64_t ldb, float* c, int64_t ldc, bool acc, const float* row_scale, int64_t lo,
                          int64_t hi) {
    cpu::gemm_banded(&gemm, 1, m, n, kk, a, ars, aks, b, ldb, c, ldc, acc, row_scale, lo, hi);
  }

  // dst[c][r] = src[r][c] for r < rows, c < cols; zero for rows <= r < rows_pad.
  template <class T>
  static void pack_t(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd,
                     int64_t rows_pad) {
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t r = 0; r < rows; ++r) dst[c * ldd + r] = to_float(src[r * lds + c]);
      for (int64_t r = rows; r < rows_pad; ++r) dst[c * ldd + r] = 0.0f;
    }
  }

  // dst[r][c] = src[r][c] in f32, for r < rows, c < cols.
  template <class T>
  static void load_rows(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[r * ldd + c] = to_float(src[r * lds + c]);
  }

  static bool visible(const Mask* mask, int64_t r, int64_t c) {
    return !mask || (c - r >= mask->lo && c - r <= mask->hi);
  }

  // One online-softmax step on the raw scores S^T [cols][ld] (q.k, before the scale) for rows
  // [0, rows), with mul = scale * log2(e) > 0: updates the running max m of the raw scores and the sum
  // l, writes alpha = exp2((m_old - m_new) mul), and overwrites S^T with P^T = exp2((S^T - m_new) mul),
  // which is exactly 1 at the max. A row that has seen no visible key yet keeps m = -inf and gets P = 0.
  // block_max (only without a mask): the rows' maxima over this block's keys, max_c S^T[c][r], which
  // the product found (gemm_col_max); then they are not looked for again here.
  static void softmax_t(float* st, int64_t ld, int64_t rows, int64_t cols, float mul, const Mask* mask, float* m,
                        float* l, float* alpha, const float* block_max = nullptr) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      float mx = m[r];
      if (block_max) {
        mx = (block_max[r] > mx ? block_max[r] : mx);
      } else {
        for (int64_t c = 0; c < cols; ++c) {
          float& x = st[c * ld + r];
          if (!visible(mask, r, c)) x = kNegInf;
          mx = (x > mx ? x : mx);
        }
      }
      const float ref = mx == kNegInf ? 0.0f : mx;
      alpha[r] = std::exp2((m[r] - ref) * mul);
      float sum = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        float& x = st[c * ld + r];
        x = std::exp2((x - ref) * mul);
        sum += x;
      }
      l[r] = l[r] * alpha[r] + sum;
      m[r] = mx;
    }
  }

  // S [rows][ld] -> P = exp2(S * mul - lse2[r]), 0 where masked.
  static void probs(float* s, int64_t ld, int64_t rows, int64_t cols, float mul, const float* lse2,
                    const Mask* mask) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        float& x = s[r * ld + c];
        x = visible(mask, r, c) ? std::exp2(x * mul - lse2[r]) : 0.0f;
      }
  }

  // dP [rows][ld] -> dS = P (dP - delta[r]) * scale, 0 where masked (a masked dP may be NaN).
  static void dscores(const float* p, float* dp, int64_t ld, int64_t rows, int64_t cols, const float* delta,
                      float scale, const Mask* mask) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        float& x = dp[r * ld + c];
        x = visible(mask, r, c) ? p[r * ld + c] * (x - delta[r]) * scale : 0.0f;
      }
  }

  // dst[x] = src[x] * mul rounded to T, for x < n.
  template <class T>
  static void store_row(const float* src, int64_t n, float mul, T* dst) {
    for (int64_t x = 0; x < n; ++x) dst[x] = from_float<T>(src[x] * mul);
  }

  template <class T>
  static float dot(const T* a, const T* b, int64_t n) {
    float s = 0.0f;
    for (int64_t x = 0; x < n; ++x) s += to_float(a[x]) * to_float(b[x]);
    return s;
  }
};

} // namespace

const KernelSet& kernels_scalar(core::DType dtype) { return f32_kernel_set<ScalarMicro>(dtype); }

} // namespace flashback::cpu
