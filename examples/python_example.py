# Causal attention forward and backward from Python through flashback's C API, with ctypes only
# (no compiled glue). FLASHBACK_LIBRARY names the shared library (default: libflashback.so.0).
import ctypes
import math
import os
import random

lib = ctypes.CDLL(os.environ.get("FLASHBACK_LIBRARY", "libflashback.so.0"))


class Tensor(ctypes.Structure):  # fb_tensor
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("device_index", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("shape", ctypes.c_int64 * 4), ("stride", ctypes.c_int64 * 4)]


class Params(ctypes.Structure):  # fb_params
    _fields_ = [("struct_size", ctypes.c_uint32), ("causal", ctypes.c_int32),
                ("window_left", ctypes.c_int64), ("window_right", ctypes.c_int64),
                ("has_scale", ctypes.c_int32), ("scale", ctypes.c_double), ("num_threads", ctypes.c_int32),
                ("softcap", ctypes.c_float), ("dropout_p", ctypes.c_float), ("dropout_seed", ctypes.c_uint64),
                ("alibi_slopes", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("bias_grad", ctypes.c_void_p),
                ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p)]


P = ctypes.POINTER
lib.fb_tensor_contiguous4.restype = Tensor
lib.fb_tensor_contiguous4.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 4
lib.fb_tensor_contiguous3.restype = Tensor
lib.fb_tensor_contiguous3.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 3
lib.fb_params_init.argtypes = [ctypes.c_void_p]
lib.fb_forward.argtypes = [P(Tensor)] * 5 + [P(Params), ctypes.c_void_p, ctypes.c_size_t]
lib.fb_backward.argtypes = [P(Tensor)] * 10 + [P(Params), ctypes.c_void_p, ctypes.c_size_t]
lib.fb_last_error.restype = ctypes.c_char_p
lib.fb_status_name.restype = ctypes.c_char_p
lib.fb_version.restype = ctypes.c_char_p
lib.fb_cpu_isa.restype = ctypes.c_char_p
FB_F32 = 0


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: {lib.fb_status_name(status).decode()}: {lib.fb_last_error().decode()}")


B, H, S, D = 1, 2, 16, 32  # batch, heads, sequence length, head dim; [B, H, S, D] row-major
N = B * H * S * D
rng = random.Random(7)
q, k, v, dout = ((ctypes.c_float * N)(*(rng.uniform(-1, 1) for _ in range(N))) for _ in range(4))
o, dq, dk, dv = ((ctypes.c_float * N)() for _ in range(4))
lse = (ctypes.c_float * (B * H * S))()


def tensor(x):
    return lib.fb_tensor_contiguous4(x, FB_F32, B, H, S, D)


tq, tk, tv, to, tdout, tdq, tdk, tdv = map(tensor, (q, k, v, o, dout, dq, dk, dv))
tlse = lib.fb_tensor_contiguous3(lse, FB_F32, B, H, S)

# Always start from fb_params_init: it sets struct_size and the defaults. Initialized in a roomy
# buffer first, so that a Params smaller than this library's fb_params is caught, not overrun.
raw = ctypes.create_string_buffer(1024)
lib.fb_params_init(raw)
assert Params.from_buffer(raw).struct_size == ctypes.sizeof(Params), "Params does not match fb_params"
params = Params.from_buffer_copy(raw, 0)
params.causal = 1

check(lib.fb_forward(tq, tk, tv, to, tlse, params, None, 0), "fb_forward")
check(lib.fb_backward(tdout, tq, tk, tv, to, tlse, tdq, tdk, tdv, None, params, None, 0), "fb_backward")

# A float64 check of o and dv (dv = P^T dout) for head 1.
h, scale, err_o, err_dv = 1, 1 / math.sqrt(D), 0.0, 0.0
at = lambda x, i, d: x[(h * S + i) * D + d]
ref_dv = [[0.0] * D for _ in range(S)]
for i in range(S):  # causal, Sq = Sk: query i sees keys 0..i
    s = [scale * sum(at(q, i, d) * at(k, j, d) for d in range(D)) for j in range(i + 1)]
    m = max(s)
    p = [math.exp(x - m) for x in s]
    total = sum(p)
    p = [x / total for x in p]
    for d in range(D):
        err_o = max(err_o, abs(sum(p[j] * at(v, j, d) for j in range(i + 1)) - at(o, i, d)))
        for j in range(i + 1):
            ref_dv[j][d] += p[j] * at(dout, i, d)
err_dv = max(abs(ref_dv[j][d] - at(dv, j, d)) for j in range(S) for d in range(D))
assert err_o < 1e-5 and err_dv < 1e-5, (err_o, err_dv)
print(f"flashback {lib.fb_version().decode()} on {lib.fb_cpu_isa().decode()} from Python: "
      f"max |o - ref| = {err_o:.1e}, max |dv - ref| = {err_dv:.1e}")
