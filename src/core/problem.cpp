#include "core/problem.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace flashback::core {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "?";
}

namespace {

template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

template <class... Args>
[[noreturn]] void invalid(const Args&... args) {
  throw Error(FB_ERROR_INVALID_ARGUMENT, cat(args...));
}

template <class... Args>
[[noreturn]] void unsupported(const Args&... args) {
  throw Error(FB_ERROR_UNSUPPORTED, cat(args...));
}

const char* const kDimNames4[] = {"batch", "heads", "seqlen", "head_dim"};
const char* const kDimNames3[] = {"batch", "heads", "seqlen"};

bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }
bool add_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_add_overflow(a, b, out); }

// "[a, b, ...]": a tensor's shape or strides (its first `rank` values).
std::string dims_str(const fb_tensor& t, const int64_t* dims) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < t.rank && i < FB_MAX_RANK; ++i) s << (i ? ", " : "") << dims[i];
  s << "]";
  return s.str();
}
std::string shape_str(const fb_tensor& t) { return dims_str(t, t.shape); }
std::string stride_str(const fb_tensor& t) { return dims_str(t, t.stride); }

// What validation learned about one tensor: its dtype and the bytes it may touch.
struct Checked {
  const fb_tensor* t = nullptr;
  const char* name = "";
  DType dtype = DType::f32;
  int64_t numel = 0;
  int64_t extent_bytes = 0; // (max offset - min offset + 1) * element size; 0 when empty
  int64_t low_bytes = 0;    // min offset * element size (<= 0: negative strides reach below data)
};

// Everything that can be said about one tensor on its own.
Checked check_tensor(const fb_tensor* t, const char* name, int rank) {
  Checked c;
  c.t = t;
  c.name = name;
  if (t == nullptr) invalid(name, ": expected a tensor, got a null pointer");
  if (t->rank != rank) invalid(name, ".rank: expected ", rank, ", got ", t->rank);
  if (t->dtype != FB_F32 && t->dtype != FB_BF16 && t->dtype != FB_F16)
    invalid(name, ".dtype: expected one of FB_F32 (0), FB_BF16 (1), FB_F16 (2), got ", t->dtype);
  c.dtype = static_cast<DType>(t->dtype);
  if (t->device == FB_DEVICE_CUDA) unsupported(name, ".device: CUDA tensors need the CUDA backend, which this build lacks");
  if (t->device != FB_DEVICE_CPU) invalid(name, ".device: expected FB_DEVICE_CPU (0), got ", t->device);
  if (t->device_index != 0) invalid(name, ".device_index: expected 0 for the CPU, got ", t->device_index);
  const char* const* dims = rank == 4 ? kDimNames4 : kDimNames3;
  int64_t numel = 1, max_offset = 0, min_offset = 0;
  for (int i = 0; i < rank; ++i) {
    if (t->shape[i] < 0) invalid(name, ".shape[", i, "] (", dims[i], "): expected >= 0, got ", t->shape[i]);
    if (mul_overflows(numel, t->shape[i], &numel))
      invalid(name, ".shape: expected an element count of at most 2^63 - 1, got the count of ", shape_str(*t),
              ", which overflows int64");
  }
  if (t->shape[rank - 1] > 1 && t->stride[rank - 1] != 1)
    invalid(name, ".stride[", rank - 1, "]: the last dimension must be contiguous: expected 1, got ",
            t->stride[rank - 1]);
  c.numel = numel;
  if (numel == 0) return c;
  // Element offsets from data span [min_offset, max_offset]: a negative stride (a reversed view, as
  // numpy's x[::-1]) reaches below data.
  for (int i = 0; i < rank; ++i) {
    int64_t span = 0;
    if (mul_overflows(t->shape[i] - 1, t->stride[i], &span) ||
        (span > 0 ? add_overflows(max_offset, span, &max_offset) : add_overflows(min_offset, span, &min_offset)))
      invalid(name, ".stride: expected element offsets within +-(2^63 - 1), got the ",
              t->stride[i] > 0 ? "largest" : "smallest", " element offset of shape ", shape_str(*t), " and strides ",
              stride_str(*t), ", which overflows int64");
  }
  const auto es = static_cast<int64_t>(dtype_size(c.dtype));
  int64_t extent = 0;
  if (min_offset == std::numeric_limits<int64_t>::min() || add_overflows(max_offset, 1, &extent) ||
      add_overflows(extent, -min_offset, &extent) ||
      mul_overflows(extent, es, &c.extent_bytes) || mul_overflows(min_offset, es, &c.low_bytes))
    invalid(name, ": expected a byte extent of at most 2^63 - 1, got the byte extent of shape ", shape_str(*t),
            " and strides ", stride_str(*t), ", which overflows int64");
  if (t->data == nullptr) invalid(name, ".data: expected a pointer to ", numel, " elements, got NULL");
  const auto data = reinterpret_cast<uintptr_t>(t->data);
  const uintptr_t below = uintptr_t{0} - static_cast<uintptr_t>(c.low_bytes); // bytes before data
  if (data < below)
    invalid(name, ".data: the tensor's negative strides reach ", below, " bytes before data, below address 0; ",
            "expected data >= ", below, ", got data = ", t->data);
  uintptr_t end = 0;
  if (__builtin_add_overflow(data - below, static_cast<uintptr_t>(c.extent_bytes), &end))
    invalid(name, ".data: the tensor's ", c.extent_bytes, " bytes wrap around the address space; expected them to end ",
            "at most at 2^64, got data = ", t->data);
  return c;
}

void expect_dim(const Checked& c, int dim, int64_t expected, const char* source) {
  const int64_t got = c.t->shape[dim];
  if (got != expected) {
    const char* const* dims = c.t->rank == 4 ? kDimNames4 : kDimNames3;
    invalid(c.name, ".shape[", dim, "] (", dims[dim], "): expected ", expected, " (", source, "), got ", got);
  }
}

// --- Overlap of strided tensors -------------------------------------------------------------------

// The bytes of a tensor as a set {base + sum_d i_d * stride_d, 0 <= i_d < shape_d}, the element's own
// bytes being the innermost dimension (stride 1, shape = element size).
struct Footprint {
  uintptr_t base = 0;
  int dims = 0;
  int64_t shape[FB_MAX_RANK + 1] = {};
  int64_t stride[FB_MAX_RANK + 1] = {};
  int64_t extent = 0;
};

Footprint footprint(const Checked& c) {
  Footprint f;
  // From the lowest byte up: a negative stride walks the same addresses upwards from there.
  f.base = reinterpret_cast<uintptr_t>(c.t->data) + static_cast<uintptr_t>(c.low_bytes); // modulo 2^64
  f.extent = c.extent_bytes;
  const int64_t es = static_cast<int64_t>(dtype_size(c.dtype));
  for (int i = 0; i < c.t->rank; ++i) {
    f.shape[i] = c.t->shape[i];
    // A dim of size 1, or any dim of a tensor without elements, never moves the address: its stride
    // is unbounded (and may be anything), so it counts as 0. The others are bounded by extent_bytes.
    const int64_t st = c.numel > 0 && c.t->shape[i] > 1 ? c.t->stride[i] * es : 0;
    f.stride[i] = st < 0 ? -st : st;
  }
  f.shape[c.t->rank] = es;
  f.stride[c.t->rank] = 1;
  f.dims = c.t->rank + 1;
  return f;
}

// Is there k with sum_d k_d * s_d == r, lo_d <= k_d <= hi_d? Dims are sorted by descending stride;
// reach[d] bounds |sum over dims after d|. Counts its steps in *budget and gives up (true) when spent.
bool solvable(const int64_t* s, const int64_t* lo, const int64_t* hi, const int64_t* reach_after, int d, int n,
              __int128 r, int* budget) {
  if (d == n) return r == 0;
  if (--*budget < 0) return true;
  const __int128 sd = s[d], reach = reach_after[d];
  // k such that |r - k * sd| <= reach.
  __int128 kmin = lo[d], kmax = hi[d];
  if (sd > 0) {
    auto floor_div = [](__int128 a, __int128 b) { return a >= 0 ? a / b : -((-a + b - 1) / b); };
    kmin = std::max<__int128>(kmin, -floor_div(-(r - reach), sd));
    kmax = std::min<__int128>(kmax, floor_div(r + reach, sd));
  }
  if (kmax - kmin > 64) return true; // not a nested layout: assume the worst
  for (__int128 k = kmin; k <= kmax; ++k)
    if (solvable(s, lo, hi, reach_after, d + 1, n, r - k * sd, budget)) return true;
  return false;
}

// Might a and b share a byte? Exact when both have the same strides (packed QKV, slices of one
// buffer); otherwise exact only when their byte ranges are disjoint.
bool may_overlap(const Footprint& a, const Footprint& b) {
  if (a.extent == 0 || b.extent == 0) return false;
  if (a.base + a.extent <= b.base || b.base + b.extent <= a.base) return false;
  if (a.dims != b.dims) return true;
  struct Dim {
    int64_t stride, lo, hi;
  } dims[FB_MAX_RANK + 1];
  int n = 0;
  for (int i = 0; i < a.dims; ++i) {
    const bool ua = a.shape[i] > 1, ub = b.shape[i] > 1;
    if (ua && ub && a.stride[i] != b.stride[i]) return true;
    if (!ua && !ub) continue;
    // Element i of a meets element j of b where k = i_a - i_b lies in [-(nb - 1), na - 1].
    dims[n++] = {ua ? a.stride[i] : b.stride[i], -(b.shape[i] - 1), a.shape[i] - 1};
  }
  for (int i = 1; i < n; ++i) // insertion sort, descending stride (n <= 5)
    for (int j = i; j > 0 && dims[j - 1].stride < dims[j].stride; --j) std::swap(dims[j - 1], dims[j]);
  int64_t s[FB_MAX_RANK + 1], lo[FB_MAX_RANK + 1], hi[FB_MAX_RANK + 1], reach[FB_MAX_RANK + 1];
  __int128 tail = 0;
  for (int i = n - 1; i >= 0; --i) {
    s[i] = dims[i].stride;
    lo[i] = dims[i].lo;
    hi[i] = dims[i].hi;
    reach[i] = static_cast<int64_t>(std::min<__int128>(tail, std::numeric_limits<int64_t>::max()));
    tail += static_cast<__int128>(std::max(-lo[i], hi[i])) * s[i];
  }
  int budget = 4096;
  return solvable(s, lo, hi, reach, 0, n, static_cast<__int128>(b.base) - static_cast<__int128>(a.base), &budget);
}

// The range of addresses a tensor's bytes lie in: "[0x..., 0x...)".
std::string bytes_str(const Footprint& f) {
  std::ostringstream s;
  s << "[0x" << std::hex << f.base << ", 0x" << f.base + static_cast<uintptr_t>(f.extent) << ")";
  return s.str();
}

// An output whose elements alias each other (a zero stride, interleaved strides) cannot be written.
bool self_overlaps(const Footprint& f) {
  int64_t strides[FB_MAX_RANK + 1], shapes[FB_MAX_RANK + 1];
  int n = 0;
  for (int i = 0; i < f.dims; ++i)
    if (f.shape[i] > 1) {
      strides[n] = f.stride[i];
      shapes[n++] = f.shape[i];
    }
  int order[FB_MAX_RANK + 1];
  for (int i = 0; i < n; ++i) // insertion sort, ascending stride (n <= 5)
    for (int j = order[i] = i; j > 0 && strides[order[j - 1]] > strides[order[j]]; --j) std::swap(order[j - 1], order[j]);
  __int128 inner = 0; // largest offset reachable by the dims of smaller stride
  for (int r = 0; r < n; ++r) {
    const int i = order[r];
    if (strides[i] <= inner) return true;
    inner += static_cast<__int128>(shapes[i] - 1) * strides[i];
  }
  return false;
}

void check_outputs_disjoint(const Checked* outputs, int n_out, const Checked* inputs, int n_in) {
  for (int i = 0; i < n_out; ++i) {
    if (!outputs[i].t) continue;
    const Footprint fo = footprint(outputs[i]);
    if (outputs[i].numel > 0 && self_overlaps(fo))
      invalid(outputs[i].name, ".stride: the output's elements overlap each other (strides ",
              "with a zero or interleaved stride); expected every element at its own address");
    for (int j = 0; j < n_in; ++j)
      if (inputs[j].t && may_overlap(fo, footprint(inputs[j])))
        invalid(outputs[i].name, ".data: the output overlaps the input ", inputs[j].name,
                "; expected disjoint memory, got bytes ", bytes_str(fo), " and ", bytes_str(footprint(inputs[j])));
    for (int j = 0; j < i; ++j)
      if (outputs[j].t && may_overlap(fo, footprint(outputs[j])))
        invalid(outputs[i].name, ".data: the output overlaps the output ", outputs[j].name,
                "; expected disjoint memory, got bytes ", bytes_str(fo), " and ", bytes_str(footprint(outputs[j])));
  }
}

// --- Params ------------------------------------------------------------------------------------------

void read_params(const fb_params* params, Problem& p) {
  if (params == nullptr) invalid("params: expected a pointer to fb_params (see fb_params_init), got NULL");
  if (params->struct_size != sizeof(fb_params))
    invalid("params.struct_size: expected ", sizeof(fb_params), " (call fb_params_init first), got ",
            params->struct_size);
  if (params->softcap != 0.0f) unsupported("params.softcap: soft-capping is not supported yet; expected 0, got ", params->softcap);
  if (params->dropout_p != 0.0f) unsupported("params.dropout_p: dropout is not supported yet; expected 0, got ", params->dropout_p);
  if (params->dropout_seed != 0)
    unsupported("params.dropout_seed: dropout is not supported yet; expected 0, got ", params->dropout_seed);
  if (params->alibi_slopes)
    unsupported("params.alibi_slopes: ALiBi is not supported yet; expected NULL, got ", params->alibi_slopes);
  if (params->bias) unsupported("params.bias: an additive bias is not supported yet; expected NULL, got ", params->bias);
  if (params->bias_grad)
    unsupported("params.bias_grad: bias gradients are not supported yet; expected NULL, got ", params->bias_grad);
  if (params->cu_seqlens_q || params->cu_seqlens_k)
    unsupported("params.cu_seqlens_q/cu_seqlens_k: variable-length batches are not supported yet; expected NULL, got ",
                static_cast<const void*>(params->cu_seqlens_q), " and ", static_cast<const void*>(params->cu_seqlens_k));
  if (params->window_left < -1) invalid("params.window_left: expected -1 (unbounded) or >= 0, got ", params->window_left);
  if (params->window_right < -1) invalid("params.window_right: expected -1 (unbounded) or >= 0, got ", params->window_right);
  if (params->num_threads < 0 || params->num_threads > 1024)
    invalid("params.num_threads: expected 0 (default) or 1..1024, got ", params->num_threads);
  p.num_threads = params->num_threads;
  p.window_left = params->window_left;
  p.window_right = params->causal ? 0 : params->window_right;
  if (params->has_scale) {
    const double s = params->scale;
    if (!std::isfinite(s) || !(s > 0))
      invalid("params.scale: expected a finite value > 0, got ", s);
    const float f = static_cast<float>(s);
    if (!std::isfinite(f) || !(f > 0))
      invalid("params.scale: expected a value that float32 represents as finite and > 0, got ", s);
    p.scale = f;
  } else {
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  }
}

void check_sizes(Problem& p) {
  if (p.batch < 1) invalid("q.shape[0] (batch): expected >= 1, got ", p.batch);
  if (p.heads_q < 1) invalid("q.shape[1] (heads): expected >= 1, got ", p.heads_q);
  if (p.heads_kv < 1) invalid("k.shape[1] (heads): expected >= 1, got ", p.heads_kv);
  if (p.heads_q % p.heads_kv != 0)
    invalid("k.shape[1] (heads): expected a divisor of q.shape[1] = ", p.heads_q, " (grouped-query heads), got ",
            p.heads_kv);
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim)
    invalid("q.shape[3] (head_dim): expected 1..", kMaxHeadDim, ", got ", p.head_dim);
  if (p.head_dim_v < 1 || p.head_dim_v > kMaxHeadDim)
    invalid("v.shape[3] (head_dim): expected 1..", kMaxHeadDim, ", got ", p.head_dim_v);
  int64_t sum = 0;
  if (add_overflows(p.seqlen_q, p.seqlen_k, &sum) || sum > (int64_t{1} << 62))
    invalid("q.shape[2] + k.shape[2] (seqlen): expected at most 2^62, got ", p.seqlen_q, " + ", p.seqlen_k);
  // Each tensor's element count fits int64 (check_tensor), but one with Sq = 0 may have any B and Hq, and
  // the workspace pads rows and blocks: bound the whole problem so that no size derived from it overflows.
  // The bound is 2^56 padded elements (2^62 bytes at 64 per element), far beyond any memory.
  int64_t rows_q = 0, rows_k = 0, rows = 0, padded = 0;
  if (mul_overflows(p.batch, p.heads_q, &rows_q) || mul_overflows(rows_q, p.seqlen_q + 256, &rows_q) ||
      mul_overflows(p.batch, p.heads_kv, &rows_k) || mul_overflows(rows_k, p.seqlen_k + 256, &rows_k) ||
      add_overflows(rows_q, rows_k, &rows) || mul_overflows(rows, p.head_dim + p.head_dim_v + 64, &padded) ||
      padded > (int64_t{1} << 56))
    invalid("q.shape, k.shape: the problem is too large: expected (B*Hq*(Sq+256) + B*Hk*(Sk+256)) * (D+Dv+64) "
            "at most 2^56, got B = ", p.batch, ", Hq = ", p.heads_q, ", Hk = ", p.heads_kv, ", Sq = ", p.seqlen_q,
            ", Sk = ", p.seqlen_k, ", D = ", p.head_dim, ", Dv = ", p.head_dim_v);
}

Strided4 strided4(const fb_tensor* t) {
  if (!t) return {};
  return {t->data, t->stride[0], t->stride[1], t->stride[2]};
}
Rows3 rows3(const fb_tensor* t) {
  if (!t) return {};
  return {static_cast<float*>(t->data), t->stride[0], t->stride[1]};
}

void expect_dtype(const Checked& c, DType expected, const char* source) {
  if (c.dtype != expected)
    invalid(c.name, ".dtype: expected ", dtype_name(expected), " (", source, "), got ", dtype_name(c.dtype));
}

// The checks forward and backward share: q, k, v, o, lse, their shapes and the params.
struct Common {
  Checked q, k, v, o, lse;
};

Common check_common(Problem& p, const fb_tensor* q, const fb_tensor* k, const fb_tensor* v, const fb_tensor* o,
                    const fb_tensor* lse, const fb_params* params) {
  Common c;
  c.q = check_tensor(q, "q", 4);
  c.k = check_tensor(k, "k", 4);
  c.v = check_tensor(v, "v", 4);
  c.o = check_tensor(o, "o", 4);
  c.lse = check_tensor(lse, "lse", 3);
  p.dtype = c.q.dtype;
  expect_dtype(c.k, p.dtype, "q.dtype");
  expect_dtype(c.v, p.dtype, "q.dtype");
  expect_dtype(c.o, p.dtype, "q.dtype");
  expect_dtype(c.lse, DType::f32, "lse is always f32");
  p.batch = q->shape[0];
  p.heads_q = q->shape[1];
  p.seqlen_q = q->shape[2];
  p.head_dim = q->shape[3];
  p.heads_kv = k->shape[1];
  p.seqlen_k = k->shape[2];
  p.head_dim_v = v->shape[3];
  expect_dim(c.k, 0, p.batch, "q.shape[0]");
  expect_dim(c.k, 3, p.head_dim, "q.shape[3]");
  expect_dim(c.v, 0, p.batch, "q.shape[0]");
  expect_dim(c.v, 1, p.heads_kv, "k.shape[1]");
  expect_dim(c.v, 2, p.seqlen_k, "k.shape[2]");
  expect_dim(c.o, 0, p.batch, "q.shape[0]");
  expect_dim(c.o, 1, p.heads_q, "q.shape[1]");
  expect_dim(c.o, 2, p.seqlen_q, "q.shape[2]");
  expect_dim(c.o, 3, p.head_dim_v, "v.shape[3]");
  expect_dim(c.lse, 0, p.batch, "q.shape[0]");
  expect_dim(c.lse, 1, p.heads_q, "q.shape[1]");
  expect_dim(c.lse, 2, p.seqlen_q, "q.shape[2]");
  check_sizes(p);
  read_params(params, p);
  p.band = make_band(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
  p.q = strided4(q);
  p.k = strided4(k);
  p.v = strided4(v);
  p.o = strided4(o);
  p.lse = rows3(lse);
  return c;
}

} // namespace

void Band::keys_of_rows(int64_t i0, int64_t i1, int64_t sk, int64_t* first, int64_t* last) const {
  *first = std::max<int64_t>(0, i0 + dlo);
  *last = std::min<int64_t>(sk - 1, (i1 - 1) + dhi);
}

void Band::rows_of_keys(int64_t j0, int64_t j1, int64_t sq, int64_t* first, int64_t* last) const {
  *first = std::max<int64_t>(0, j0 - dhi);
  *last = std::min<int64_t>(sq - 1, (j1 - 1) - dlo);
}

Problem validate_forward(const fb_tensor* q, const fb_tensor* k, const fb_tensor* v, const fb_tensor* o,
                         const fb_tensor* lse, const fb_params* params) {
  Problem p;
  Common c = check_common(p, q, k, v, o, lse, params);
  const Checked inputs[] = {c.q, c.k, c.v};
  const Checked outputs[] = {c.o, c.lse};
  check_outputs_disjoint(outputs, 2, inputs, 3);
  return p;
}

Problem validate_backward(const fb_tensor* dout, const fb_tensor* q, const fb_tensor* k, const fb_tensor* v,
                          const fb_tensor* o, const fb_tensor* lse, const fb_tensor* dq, const fb_tensor* dk,
                          const fb_tensor* dv, const fb_tensor* delta, const fb_params* params) {
  Problem p;
  Checked cdo = check_tensor(dout, "dout", 4);
  Common c = check_common(p, q, k, v, o, lse, params);
  expect_dtype(cdo, p.dtype, "q.dtype");
  for (int d = 0; d < 4; ++d) expect_dim(cdo, d, o->shape[d], "o.shape");
  Checked cdq, cdk, cdv, cdelta;
  if (dq) {
    cdq = check_tensor(dq, "dq", 4);
    expect_dtype(cdq, p.dtype, "q.dtype");
    for (int d = 0; d < 4; ++d) expect_dim(cdq, d, q->shape[d], "q.shape");
  }
  if (dk) {
    cdk = check_tensor(dk, "dk", 4);
    expect_dtype(cdk, p.dtype, "q.dtype");
    for (int d = 0; d < 4; ++d) expect_dim(cdk, d, k->shape[d], "k.shape");
  }
  if (dv) {
    cdv = check_tensor(dv, "dv", 4);
    expect_dtype(cdv, p.dtype, "q.dtype");
    for (int d = 0; d < 4; ++d) expect_dim(cdv, d, v->shape[d], "v.shape");
  }
  if (delta) {
    cdelta = check_tensor(delta, "delta", 3);
    expect_dtype(cdelta, DType::f32, "delta is always f32");
    for (int d = 0; d < 3; ++d) expect_dim(cdelta, d, lse->shape[d], "lse.shape");
  }
  const Checked inputs[] = {cdo, c.q, c.k, c.v, c.o, c.lse};
  const Checked outputs[] = {cdq, cdk, cdv, cdelta};
  check_outputs_disjoint(outputs, 4, inputs, 6);
  p.dout = strided4(dout);
  p.dq = strided4(dq);
  p.dk = strided4(dk);
  p.dv = strided4(dv);
  p.delta = rows3(delta);
  return p;
}

// dlo <= j - i <= dhi, the unbounded sides clamped to the extreme diagonals of the [Sq, Sk] rectangle.
Band make_band(int64_t sq, int64_t sk, int64_t left, int64_t right) {
  const __int128 offset = static_cast<__int128>(sk) - sq; // the diagonal query i = Sq-1 meets key Sk-1 on
  auto clamp = [&](__int128 x) { return static_cast<int64_t>(std::clamp<__int128>(x, -static_cast<__int128>(sq), sk)); };
  Band b;
  b.dlo = left < 0 ? -sq : clamp(offset - left);
  b.dhi = right < 0 ? sk : clamp(offset + right);
  return b;
}

} // namespace flashback::core
