#!/usr/bin/env python3
"""README's workspace formulas against fb_forward_workspace_size / fb_backward_workspace_size.

Computes the workspace of random shapes (no mask) from the formulas README.md states, for f32 (the
avx512 and avx2 kernels) and bf16 (vdpbf16ps at avx512bf16, tiles at amx), and requires the library's
sizes to the byte. The sizes need no data: the tensors get distinct made-up addresses, which
validation checks but nothing reads. FLASHBACK_LIBRARY names the shared library; FLASHBACK_ISA and
FLASHBACK_EMULATION pick the level as for the library. Exit status 0 when every size agrees, 1 when
one does not, 77 (skipped) when the level runs neither dtype on kernels the formulas describe.
"""
import ctypes
import os
import random
import sys

lib = ctypes.CDLL(os.environ["FLASHBACK_LIBRARY"])


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("device_index", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("shape", ctypes.c_int64 * 4), ("stride", ctypes.c_int64 * 4)]


class Params(ctypes.Structure):
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
lib.fb_forward_workspace_size.argtypes = [P(Tensor)] * 5 + [P(Params), P(ctypes.c_size_t)]
lib.fb_backward_workspace_size.argtypes = [P(Tensor)] * 10 + [P(Params), P(ctypes.c_size_t)]
lib.fb_last_error.restype = ctypes.c_char_p
lib.fb_cpu_kernels_isa.restype = ctypes.c_char_p
lib.fb_cpu_kernels_isa.argtypes = [ctypes.c_int]
F32, BF16 = 0, 1

_next = [1 << 40]


def address():  # a new made-up address for each tensor, 2^34 bytes (more than any tensor here) apart
    _next[0] += 1 << 34
    return _next[0]


def t4(dt, *s):
    return lib.fb_tensor_contiguous4(address(), dt, *s)


def t3(*s):
    return lib.fb_tensor_contiguous3(address(), F32, *s)


def library_sizes(dt, B, Hq, Hk, Sq, Sk, D, Dv, threads):
    p = Params()
    lib.fb_params_init(ctypes.byref(p))
    p.num_threads = threads
    n = ctypes.c_size_t()
    q, k, v, o, do = t4(dt, B, Hq, Sq, D), t4(dt, B, Hk, Sk, D), t4(dt, B, Hk, Sk, Dv), t4(dt, B, Hq, Sq, Dv), t4(dt, B, Hq, Sq, Dv)
    lse = t3(B, Hq, Sq)
    st = lib.fb_forward_workspace_size(q, k, v, o, lse, p, ctypes.byref(n))
    assert st == 0, lib.fb_last_error()
    fwd = n.value
    dq, dk, dv = t4(dt, B, Hq, Sq, D), t4(dt, B, Hk, Sk, D), t4(dt, B, Hk, Sk, Dv)
    st = lib.fb_backward_workspace_size(do, q, k, v, o, lse, dq, dk, dv, None, p, ctypes.byref(n))
    assert st == 0, lib.fb_last_error()
    return fwd, n.value


def cd(a, b):
    return (a + b - 1) // b


def ru(x, m):
    return cd(x, m) * m


def r(x):
    return ru(x, 64)


def backward_rows(BM, Sq):  # the backward's query blocks: BM, or Sq rounded up to 16 where that is less
    return min(BM, ru(max(Sq, 1), 16))


def group(items, threads):  # G: 4, 2 or 1, the largest that gives each thread 4 items
    g = 4
    while g > 1 and items(g) < 4 * threads:
        g //= 2
    return g


def few_rows(Hq, Hk, Sq):  # a kv head's query rows, its group's counted together, in at most 4 blocks of 64
    return cd((Hq // Hk) * Sq, 64) <= 4


def swapped(B, Hq, Hk, Sq, Sk, threads):  # a decoding forward, as README says it is sized
    if Sq == 1 and Hq > Hk and Sk > 0 and not (Hq // Hk < 4 and B * Hk < threads):
        return Hk, Hq // Hk
    return Hq, Sq


def forward_split(B, Hq, Hk, Sq, Sk, BM, BN):
    q = B * Hk * cd((Hq // Hk) * Sq, BM)
    return max(1, min(cd(16, q), cd(Sk, BN) // 8)) if q < 16 else 1


def backward_split(B, Hq, Hk, Sq, Sk, BM, BN):
    kb = B * Hk * cd(Sk, BN)
    return max(1, min(cd(16, kb), (Hq // Hk) * cd(Sq, BM) // 4)) if kb < 16 else 1


def forward_common(B, Hq, Hk, Sq, Sk, Dv, threads, BM, BN):
    S = forward_split(B, Hq, Hk, Sq, Sk, BM, BN)
    items = lambda G: B * Hk * cd((Hq // Hk) * cd(Sq, BM), G) * S
    G = group(items, threads)
    T = max(1, min(threads, items(G)))
    part = 4 * B * Hq * cd(Sq, BM) * S * ru(min(Sq, BM) * (ru(Dv, 16) + 1), 16) if S > 1 else 0
    return T * G, part


def backward_common(B, Hq, Hk, Sq, Sk, D, Dv, threads, BM, BN):
    S = backward_split(B, Hq, Hk, Sq, Sk, BM, BN)
    items = lambda G: B * Hk * cd(cd(Sk, BN), G) * S
    G = 1 if S > 1 else group(items, threads)
    T = max(1, min(threads, items(G)))
    part = 4 * B * Hk * cd(Sk, BN) * S * ru(min(Sk, BN) * (ru(D, 16) + ru(Dv, 16)), 16) if S > 1 else 0
    return T * G, part


def f32_sizes(isa, B, Hq, Hk, Sq, Sk, D, Dv, threads):
    hq, sq = swapped(B, Hq, Hk, Sq, Sk, threads)
    if isa == "avx2":
        BM, BN = 64, 128 if D >= 128 else 64
    else:  # avx512, no mask: 64 x 64 where a kv head's query rows are few, else 64 x 256 from D = 128, 64 x 128 below
        BM, BN = 64, 64 if few_rows(hq, Hk, sq) else 256 if D >= 128 else 128
    BMp, BNp, Dvp = ru(BM, 16), ru(BN, 16), ru(Dv, 16)
    TG, part = forward_common(B, hq, Hk, sq, Sk, Dv, threads, BM, BN)
    F = 1 if 1 <= sq % BM <= 8 else 0
    fwd = 64 + TG * r(4 * (D * BMp + BN * BMp + BMp * Dvp + 4 * BMp + F * (D * BNp + 8 * BNp))) + part
    BM, BN = backward_rows(128, Sq), 64
    BNp, Dp = ru(BN, 16), ru(D, 16)
    TG, part = backward_common(B, Hq, Hk, Sq, Sk, D, Dv, threads, BM, BN)
    scratch = r(4 * (D * BNp + Dv * BNp + 2 * BM * BNp + BN * Dp + BN * Dvp))
    bwd = 64 + TG * scratch + 2 * r(4 * B * Hq * Sq) + r(8 * B * Hq * cd(Sq, BM)) + part
    return fwd, bwd


def bf16_sizes(isa, B, Hq, Hk, Sq, Sk, D, Dv, threads):
    K = 32 if isa.startswith("amx") else 16

    def dims(BM, BN):
        z = dict(Dk=ru(D, K), Dn=ru(D, 16), Dvk=ru(Dv, K), Dvn=ru(Dv, 16), BMp=ru(BM, 16), BMk=ru(BM, K),
                 BNp=ru(BN, 16), BNk=ru(BN, K))
        z.update(kt=2 * z["BNp"] + 32, dn=2 * z["Dn"] + 32, dv=2 * z["Dvn"] + 32, pa=z["BNk"] + 32,
                 t=z["BMk"] + 32, s=z["BNp"] + 16, o=z["Dvn"] + 16, dk=z["Dn"] + 16)
        return z

    hq, sq = swapped(B, Hq, Hk, Sq, Sk, threads)
    few = (hq // Hk) * cd(sq, 64) <= 4  # each work item packs its key blocks itself
    BM, BN = 64, 256 if K == 32 and not few_rows(hq, Hk, sq) else 128
    z = dims(BM, BN)
    TG, part = forward_common(B, hq, Hk, sq, Sk, Dv, threads, BM, BN)
    scratch = (r(2 * z["BMp"] * (z["Dk"] + 32)) + 2 * r(2 * z["BMp"] * z["pa"]) + r(4 * z["BMp"] * z["s"]) +
               r(4 * z["BMp"] * z["o"]) + 3 * r(4 * z["BMp"]) + r(z["BNk"] * z["dv"]))
    kv_block = z["Dk"] * z["kt"] + z["BNk"] * z["dv"]  # bytes of one key block's packed K^T and V
    if few:
        scratch += r(kv_block)
    fwd = 64 + TG * scratch + (0 if few else r(B * Hk * cd(Sk, BN) * kv_block)) + part
    BM, BN = backward_rows(128, Sq), 64 if K == 32 else 128
    z = dims(BM, BN)
    TG, part = backward_common(B, Hq, Hk, Sq, Sk, D, Dv, threads, BM, BN)
    hilo = K == 32  # at amx the products with P and dS on tiles (hi + lo); with vdpbf16ps all in f32
    scratch = (r(z["Dk"] * z["kt"]) + r(z["Dvk"] * z["kt"]) + 2 * r(4 * z["BMp"] * z["s"]) + r(4 * z["BNp"] * z["dk"]) +
               r(4 * z["BNp"] * z["o"]) + r(4 * BN * z["Dn"]) + r(4 * BM * z["Dn"]) + r(4 * BM * z["Dvn"]))
    q_block = 2 * (z["BMp"] * (z["Dk"] + 32) + z["BMp"] * (z["Dvk"] + 32))
    if hilo:
        scratch += (r(z["BNk"] * z["dn"]) + 2 * r(2 * z["BMk"] * z["kt"]) + 2 * r(2 * z["BMp"] * z["pa"]) +
                    r(4 * z["Dn"] * z["s"]) + r(4 * z["Dvn"] * z["s"]))
        if z["BMp"] > 24:  # Q^T and dO^T, where some blocks have more than 24 rows (products on tiles)
            q_block += 2 * (z["Dn"] * z["t"] + z["Dvn"] * z["t"])
    rows = B * Hq * Sq
    bwd = (64 + TG * scratch + 2 * r(4 * rows) + r(8 * B * Hq * cd(Sq, BM)) + r(4 * rows * D) +
           r(B * Hq * cd(Sq, BM) * q_block) + part)
    return fwd, bwd


def main():
    models = []
    f32_isa = lib.fb_cpu_kernels_isa(F32).decode()
    bf16_isa = lib.fb_cpu_kernels_isa(BF16).decode()
    if f32_isa in ("avx512", "avx2", "avx512-emulated"):
        models.append(("f32", F32, f32_isa, f32_sizes))
    if bf16_isa in ("avx512bf16", "amx", "amx-emulated"):
        models.append(("bf16", BF16, bf16_isa, bf16_sizes))
    if not models:
        print(f"skipped: f32 runs {f32_isa}, bf16 {bf16_isa}: kernels the formulas here do not describe")
        return 77
    seed = int(os.environ.get("FLASHBACK_TEST_SEED", random.SystemRandom().randrange(1 << 32)))
    rng = random.Random(seed)
    shapes = [(1, 16, 16, 4096, 4096, 128, 128, 2), (1, 16, 16, 4096, 4096, 64, 64, 2), (1, 32, 8, 1, 8192, 128, 128, 2),
              (1, 1, 1, 131072, 131072, 128, 128, 2), (1, 1, 1, 4096, 64, 128, 128, 2), (1, 8, 1, 5, 4000, 96, 96, 2)]
    for _ in range(300):
        hk, g = rng.randint(1, 4), rng.choice([1, 2, 4, 8])
        shapes.append((rng.randint(1, 3), hk * g, hk, rng.choice([1, rng.randint(1, 700)]),
                       rng.choice([rng.randint(1, 700), rng.randint(1, 9000)]), rng.randint(1, 256), rng.randint(1, 256),
                       rng.randint(1, 3)))
    bad = 0
    for name, dt, isa, model in models:
        for shape in shapes:
            got, want = library_sizes(dt, *shape), model(isa, *shape)
            if got != want:
                bad += 1
                print(f"{name} at {isa}, (B, Hq, Hk, Sq, Sk, D, Dv, threads) = {shape}: library (forward, backward)"
                      f" {got}, README's formulas {want}")
        print(f"{name} at {isa}: {len(shapes)} shapes")
    print(f"{bad} sizes differ (FLASHBACK_TEST_SEED={seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
