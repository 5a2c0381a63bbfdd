/*
 * flashback: exact scaled-dot-product attention, forward and backward.
 *
 * The C API. It is the one surface other languages bind (Rust, Python): plain structs, status codes,
 * no exceptions, no C++ types. flashback.hpp is the C++ API over the same functions.
 *
 * Conventions (FlashAttention-2's):
 *   q [B, Hq, Sq, D]  k [B, Hk, Sk, D]  v [B, Hk, Sk, Dv]  o, do [B, Hq, Sq, Dv]  lse [B, Hq, Sq] (f32)
 *   Every tensor is a pointer, a shape and element strides (int64). The last dimension must have
 *   stride 1 (or size 1); any other strides are accepted (BHSD, BSHD, slices, packed QKV, and
 *   negative ones: reversed views, whose elements lie before data too).
 *   Grouped-query heads: Hq % Hk == 0, query head h reads kv head h / (Hq / Hk).
 *   Causal is aligned bottom-right: query i sees key j iff j <= i + Sk - Sq.
 *   Window (left, right), -1 = unbounded: j in [i + Sk - Sq - left, i + Sk - Sq + right].
 *   causal = window (left, 0). LSE is in natural log. A row that sees no key gets O = 0, LSE = -inf,
 *   and contributes nothing to any gradient.
 */
#ifndef FLASHBACK_FLASHBACK_H
#define FLASHBACK_FLASHBACK_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define FB_API
#else
#define FB_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FLASHBACK_VERSION_MAJOR 0
#define FLASHBACK_VERSION_MINOR 1
#define FLASHBACK_VERSION_PATCH 0

typedef enum fb_status {
  FB_SUCCESS = 0,
  FB_ERROR_INVALID_ARGUMENT = 1, /* the call is wrong: see fb_last_error() */
  FB_ERROR_UNSUPPORTED = 2,      /* the call is valid but this build or backend cannot do it (yet) */
  FB_ERROR_OUT_OF_MEMORY = 3,    /* the library could not allocate its workspace */
  FB_ERROR_INTERNAL = 4          /* a bug in flashback: please report it with fb_last_error() */
} fb_status;

typedef enum fb_dtype {
  FB_F32 = 0,
  FB_BF16 = 1,
  FB_F16 = 2
} fb_dtype;

typedef enum fb_device_type {
  FB_DEVICE_CPU = 0,
  FB_DEVICE_CUDA = 1 /* reserved: no CUDA backend is built yet */
} fb_device_type;

#define FB_MAX_RANK 4

/* A strided view of memory the caller owns. dtype and device are int32_t rather than the enums so
 * that any value a binding passes is representable and gets a clear error when unknown. */
typedef struct fb_tensor {
  void* data;
  int32_t dtype;        /* fb_dtype */
  int32_t device;       /* fb_device_type */
  int32_t device_index; /* which device of that type; 0 for the CPU */
  int32_t rank;         /* 4 for q, k, v, o, do, dq, dk, dv; 3 for lse and delta */
  int64_t shape[FB_MAX_RANK];
  int64_t stride[FB_MAX_RANK]; /* in elements; negative ones too (reversed views) */
} fb_tensor;

/* Options. Always start from fb_params_init(): later versions add fields at the end, and
 * struct_size tells the library which ones the caller knows. */
typedef struct fb_params {
  uint32_t struct_size; /* sizeof(fb_params), set by fb_params_init */
  int32_t causal;       /* non-zero: bottom-right causal mask; sets window_right to 0 */
  int64_t window_left;  /* -1: unbounded */
  int64_t window_right; /* -1: unbounded */
  int32_t has_scale;    /* 0: scale = 1/sqrt(D); else `scale`, which must be finite and > 0 and stay so
                         * in float32 (about 1.4e-45 to 3.4e38), the precision it is applied in */
  double scale;
  int32_t num_threads; /* 0: the library's default (FLASHBACK_NUM_THREADS, else OpenMP's) */

  /* Reserved for features that are planned but not implemented. Calls with values other than
   * those fb_params_init sets fail with FB_ERROR_UNSUPPORTED. */
  float softcap;                 /* tanh soft-capping of the logits; 0 = off */
  float dropout_p;               /* dropout probability on P; 0 = off */
  uint64_t dropout_seed;
  const fb_tensor* alibi_slopes; /* [Hq] or [B, Hq] f32 */
  const fb_tensor* bias;         /* additive bias, broadcastable to [B, Hq, Sq, Sk] */
  fb_tensor* bias_grad;          /* backward: gradient of bias, reduced over broadcast dims */
  const fb_tensor* cu_seqlens_q; /* packed variable-length batches: int32 [B + 1] offsets */
  const fb_tensor* cu_seqlens_k;
} fb_params;

FB_API void fb_params_init(fb_params* params);

/* A tensor of the given dtype, shape [d0, d1, d2, d3] (rank 4) in row-major (contiguous) layout. */
FB_API fb_tensor fb_tensor_contiguous4(void* data, fb_dtype dtype, int64_t d0, int64_t d1, int64_t d2,
                                       int64_t d3);
/* The same for rank 3 (lse, delta). */
FB_API fb_tensor fb_tensor_contiguous3(void* data, fb_dtype dtype, int64_t d0, int64_t d1, int64_t d2);

/*
 * Forward: o = softmax(scale * q k^T + mask) v and lse = logsumexp of each row (natural log).
 *
 * Workspace: pass workspace = NULL and workspace_bytes = 0 to let the library allocate; or pass a
 * buffer of at least fb_forward_workspace_size() bytes (any alignment). See README for the formula.
 * On any error nothing is written to o or lse.
 */
FB_API fb_status fb_forward_workspace_size(const fb_tensor* q, const fb_tensor* k, const fb_tensor* v,
                                           const fb_tensor* o, const fb_tensor* lse,
                                           const fb_params* params, size_t* workspace_bytes);
FB_API fb_status fb_forward(const fb_tensor* q, const fb_tensor* k, const fb_tensor* v, const fb_tensor* o,
                            const fb_tensor* lse, const fb_params* params, void* workspace,
                            size_t workspace_bytes);

/*
 * Backward: given dout, q, k, v and the forward's o and lse, compute dq, dk, dv.
 * Any of dq, dk, dv may be NULL: the work only it needs is skipped. delta (optional, [B, Hq, Sq] f32)
 * receives rowsum(dout * o). dk and dv sum over the query heads of each group.
 * On any error nothing is written to dq, dk, dv or delta.
 */
FB_API fb_status fb_backward_workspace_size(const fb_tensor* dout, const fb_tensor* q, const fb_tensor* k,
                                            const fb_tensor* v, const fb_tensor* o, const fb_tensor* lse,
                                            const fb_tensor* dq, const fb_tensor* dk, const fb_tensor* dv,
                                            const fb_tensor* delta, const fb_params* params,
                                            size_t* workspace_bytes);
FB_API fb_status fb_backward(const fb_tensor* dout, const fb_tensor* q, const fb_tensor* k, const fb_tensor* v,
                             const fb_tensor* o, const fb_tensor* lse, const fb_tensor* dq, const fb_tensor* dk,
                             const fb_tensor* dv, const fb_tensor* delta, const fb_params* params,
                             void* workspace, size_t workspace_bytes);

/* The workspace the library allocates for a call given none (workspace = NULL) is kept for the next such
 * call, in any thread, since a fresh buffer's pages cost a first touch each (README: Workspace). One
 * buffer is kept in the process, the largest a recent call needed: a call that needs more frees it and
 * allocates its own, which it then leaves. FLASHBACK_WORKSPACE_CACHE=0 (read once) keeps none.
 * fb_workspace_cache_bytes: the bytes kept now. fb_workspace_cache_release: frees them (the buffer of
 * a call still running comes back when it ends). */
FB_API size_t fb_workspace_cache_bytes(void);
FB_API void fb_workspace_cache_release(void);

/* The thread count a call with params.num_threads == 0 uses: FLASHBACK_NUM_THREADS (read once), else
 * OpenMP's default (omp_get_max_threads in the calling thread). */
FB_API int fb_default_num_threads(void);

/* The message of the last failed call in this thread ("" after a success). Valid until the next
 * flashback call in this thread. */
FB_API const char* fb_last_error(void);
FB_API const char* fb_status_name(fb_status status);
FB_API const char* fb_version(void);

/* The instruction-set level the CPU backend runs at on this machine: "amx", "avx512bf16", "avx512",
 * "avx2" or "scalar"; the level with "-emulated" (e.g. "amx-emulated") under FLASHBACK_EMULATION, for tests. The
 * environment variable FLASHBACK_ISA (read once) caps it. README lists which kernels each level runs
 * per dtype. */
FB_API const char* fb_cpu_isa(void);

/* The instruction-set level of the kernels that run a dtype here, named as fb_cpu_isa() names levels:
 * "amx" (bf16, and f16 with head dims of 64 and more, on AMX tiles), "avx512bf16" (bf16 with
 * vdpbf16ps), or the f32 kernels' level ("avx512", "avx2", "scalar"), which f16, and bf16 elsewhere, run
 * after converting to f32. For f16 at "amx": the level of problems whose larger head dim max(D, Dv) is
 * at least 64; smaller ones run the "avx512" kernels. NULL for a value that is not an fb_dtype. */
FB_API const char* fb_cpu_kernels_isa(fb_dtype dtype);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHBACK_FLASHBACK_H */
