#!/usr/bin/env python3
"""flashback beside PyTorch's CPU flash attention: the kernel that torch.nn.functional.scaled_dot_product_attention
runs on the CPU (aten::_scaled_dot_product_flash_attention_for_cpu and its backward), timed and checked.

PyTorch is not a Debian package, and nothing in the build or the test suite uses this script. To run it:
    python3 -m venv torchenv && torchenv/bin/pip install torch      # from PyPI
and run the script with torchenv/bin/python.

    bench     Times PyTorch's forward and backward on random inputs. Takes the flags of `flashback bench`
              that PyTorch's kernel has (no --window) and prints the same --json object, so that
              bench/interleave.py runs the two in alternation, round after round:
                  python3 bench/interleave.py --rounds 5 \\
                    'flashback=build/tools/flashback bench --batch 1 --heads 16 --seqlen 4096' \\
                    'torch=torchenv/bin/python bench/torch_sdpa.py bench --batch 1 --heads 16 --seqlen 4096'
    accuracy  Runs flashback (its C API through ctypes) and PyTorch on the same inputs, rounded to the
              dtype, and prints each output's largest error against a float64 reference, with issue 4's
              bar: max |out - ref64| <= 2 * max |naive - ref64| + 1e-5 * max |ref64|, where naive computes
              in f32 from the rounded inputs and rounds its outputs to the dtype. Both backwards get the
              same o (the reference's, rounded to the dtype) and lse (the reference's, in f32), so that
              the backward's rows compare the two backwards alone.
                  torchenv/bin/python bench/torch_sdpa.py accuracy --library build/libflashback.so.0
"""
import argparse
import ctypes
import json
import math
import statistics
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("bench/torch_sdpa.py needs PyTorch: python3 -m venv torchenv && torchenv/bin/pip install torch, "
             "then run it with torchenv/bin/python")

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def torch_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def torch_backward(dout, q, k, v, o, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, o, lse, 0.0, causal,
                                                                               scale=scale)


def bhsd(b, h, s, d, dtype, layout, gen):
    """Random normal [b, h, s, d] in the given memory layout (bshd: a transposed view, as a framework passes)"""
    if layout == "bshd":
        return torch.randn(b, s, h, d, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(b, h, s, d, generator=gen).to(dtype)


def timed(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t)
    return seconds


def bench(args):
    sq = args.seqlen_q or args.seqlen
    sk = args.seqlen_k or args.seqlen
    hk = args.kv_heads or args.heads
    dv = args.head_dim_v or args.head_dim
    if args.heads % hk:
        sys.exit(f"--kv-heads: expected a divisor of --heads = {args.heads}, got {hk}")
    if args.causal and sq != sk:
        # PyTorch's is_causal aligns the mask to the top left, FlashAttention (and flashback) to the bottom right.
        sys.exit(f"--causal: PyTorch's mask is top-left aligned, flashback's bottom-right; they agree only for "
                 f"Sq = Sk, got Sq = {sq}, Sk = {sk}")
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = args.scale or 1 / math.sqrt(args.head_dim)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed)
    q = bhsd(args.batch, args.heads, sq, args.head_dim, dtype, args.layout, gen)
    k = bhsd(args.batch, hk, sk, args.head_dim, dtype, args.layout, gen)
    v = bhsd(args.batch, hk, sk, dv, dtype, args.layout, gen)
    dout = bhsd(args.batch, args.heads, sq, dv, dtype, args.layout, gen)

    state = {}

    def forward():
        state["o"], state["lse"] = torch_forward(q, k, v, args.causal, scale)

    def backward():
        torch_backward(dout, q, k, v, state["o"], state["lse"], args.causal, scale)

    fwd = timed(forward, args.warmup, args.repeats)
    bwd = timed(backward, args.warmup, args.repeats)
    pairs = sq * sk / (2 if args.causal else 1)  # flashback bench's convention
    flops = 2 * args.batch * args.heads * pairs * (args.head_dim + dv)

    def summary(seconds, f):
        med = statistics.median(seconds)
        return {"median_s": med, "min_s": min(seconds), "max_s": max(seconds), "seconds": seconds,
                "tflops": f / med / 1e12, "tflops_best": f / min(seconds) / 1e12}

    result = {
        "command": "torch_sdpa.py bench",
        "library": f"torch {torch.__version__}, aten::_scaled_dot_product_flash_attention_for_cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "shape": {"batch": args.batch, "heads_q": args.heads, "heads_kv": hk, "seqlen_q": sq, "seqlen_k": sk,
                  "head_dim": args.head_dim, "head_dim_v": dv},
        "params": {"causal": args.causal, "scale": scale, "dtype": args.dtype, "layout": args.layout},
        "threads": torch.get_num_threads(), "warmup": args.warmup, "repeats": args.repeats,
        "flops": {"convention": "FlashAttention's: pairs = Sq*Sk, halved when causal",
                  "forward": flops, "backward": 2.5 * flops},
        "forward": summary(fwd, flops), "backward": summary(bwd, 2.5 * flops),
        "check": {"skipped": True},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['library']} ({result['cpu_capability']}), {result['threads']} threads; "
          f"B={args.batch} Hq={args.heads} Hk={hk} Sq={sq} Sk={sk} D={args.head_dim} Dv={dv} {args.dtype} "
          f"{args.layout} causal={'yes' if args.causal else 'no'}")
    print("pass      median (ms)    min (ms)    max (ms)    TFLOP/s")
    for name in ("forward", "backward"):
        r = result[name]
        print(f"{name:<8} {r['median_s'] * 1e3:>12.2f} {r['min_s'] * 1e3:>11.2f} {r['max_s'] * 1e3:>11.2f} "
              f"{r['tflops']:>10.4f}")


# --- accuracy -------------------------------------------------------------------------------------------------------

class FbTensor(ctypes.Structure):  # fb_tensor (include/flashback/flashback.h)
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("device_index", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("shape", ctypes.c_int64 * 4), ("stride", ctypes.c_int64 * 4)]


FB_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # fb_dtype


class Flashback:
    """fb_forward and fb_backward on torch tensors through the C API"""

    class Params(ctypes.Structure):  # the leading fields of fb_params; fb_params_init fills the whole struct
        _fields_ = [("struct_size", ctypes.c_uint32), ("causal", ctypes.c_int32), ("window_left", ctypes.c_int64),
                    ("window_right", ctypes.c_int64), ("has_scale", ctypes.c_int32), ("scale", ctypes.c_double)]

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.fb_last_error.restype = ctypes.c_char_p
        self.lib.fb_version.restype = ctypes.c_char_p
        self.lib.fb_cpu_isa.restype = ctypes.c_char_p
        p = ctypes.POINTER(FbTensor)
        self.lib.fb_forward.argtypes = [p] * 5 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.lib.fb_backward.argtypes = [p] * 10 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def describe(self):
        return f"flashback {self.lib.fb_version().decode()} ({self.lib.fb_cpu_isa().decode()})"

    def params(self, causal, scale):
        raw = ctypes.create_string_buffer(1024)  # roomier than any fb_params
        self.lib.fb_params_init(raw)
        p = self.Params.from_buffer(raw)
        p.causal, p.has_scale, p.scale = int(causal), 1, scale
        return raw

    @staticmethod
    def tensor(x):
        t = FbTensor(x.data_ptr(), FB_DTYPES[x.dtype], 0, 0, x.dim())
        for i, (n, s) in enumerate(zip(x.shape, x.stride())):
            t.shape[i], t.stride[i] = n, s
        return ctypes.byref(t)

    def check(self, status, what):
        if status != 0:
            sys.exit(f"{what}: status {status}: {self.lib.fb_last_error().decode()}")

    def forward(self, q, k, v, causal, scale):
        b, h, s, _ = q.shape
        o = torch.empty(b, h, s, v.shape[3], dtype=q.dtype)
        lse = torch.empty(b, h, s, dtype=torch.float32)
        t = self.tensor
        self.check(self.lib.fb_forward(t(q), t(k), t(v), t(o), t(lse), self.params(causal, scale), None, 0),
                   "fb_forward")
        return o, lse

    def backward(self, dout, q, k, v, o, lse, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        t = self.tensor
        self.check(self.lib.fb_backward(t(dout), t(q), t(k), t(v), t(o), t(lse), t(dq), t(dk), t(dv), None,
                                        self.params(causal, scale), None, 0), "fb_backward")
        return dq, dk, dv


def scores(q, k, causal, scale):
    s = scale * (q @ k.T)
    if causal:  # Sq = Sk here, where top-left and bottom-right agree
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    return s


def materialized_forward(s, v):
    """One head's o and lse from its scores s (scores()), written from the definitions in s's precision
    (float64: the reference; float32: issue 4's naive)"""
    return torch.softmax(s, dim=1) @ v, torch.logsumexp(s, dim=1)


def materialized_backward(s, q, k, v, dout, o, lse, scale):
    """One head's dq, dk, dv from its scores s and the given o and lse, as the libraries compute them:
    P = exp(s - lse), delta = rowsum(dout * o)"""
    p = torch.exp(s - lse[:, None])
    ds = p * (dout @ v.T - (dout * o).sum(dim=1, keepdim=True))
    return scale * (ds @ k), scale * (ds.T @ q), p.T @ dout


def error_cell(out, ref, naive, half):
    err = (out.double() - ref).abs().max().item()
    if err != err:
        return "NaN"
    if not half:
        return f"{err / ref.abs().max().item():.1e}"
    bar = 2 * (naive.double() - ref).abs().max().item() + 1e-5 * ref.abs().max().item()
    return f"{err / bar:.2f}" + ("" if err <= bar else " (over)")


def accuracy(args):
    fb = Flashback(args.library)
    if args.threads:
        torch.set_num_threads(args.threads)
    libs = ((fb.describe(), fb.forward, fb.backward),
            (f"torch {torch.__version__.split('+')[0]}", torch_forward, torch_backward))
    print(f"{fb.describe()} and torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); "
          f"B = 1, H = {args.heads}, D = {args.head_dim}, Sq = Sk, random normal inputs rounded to the dtype, "
          f"causal = {'yes' if args.causal else 'no'}")
    print("Each cell: max |out - ref64| / (2 * max |naive - ref64| + 1e-5 * max |ref64|), issue 4's bar "
          "(<= 1 passes); f32 rows: max |out - ref64| / max |ref64|.")
    print()
    print("| dtype | S | library | o | lse | dq | dk | dv |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    names = ("o", "lse", "dq", "dk", "dv")
    scale = 1 / math.sqrt(args.head_dim)
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for s in (int(x) for x in args.seqlens.split(",")):
            gen = torch.Generator().manual_seed(args.seed)
            q, k, v, dout = (torch.randn(1, args.heads, s, args.head_dim, generator=gen).to(dtype) for _ in range(4))
            # Head by head: the float64 reference and naive. The backwards' o and lse are the reference's.
            ref, naive = {n: [] for n in names}, {n: [] for n in names}
            for h in range(args.heads):
                x64 = [x[0, h].double() for x in (q, k, v, dout)]
                s64 = scores(x64[0], x64[1], args.causal, scale)
                o64, lse64 = materialized_forward(s64, x64[2])
                o_in, lse_in = o64.to(dtype), lse64.float()
                r = (o64, lse64) + materialized_backward(s64, *x64, o_in.double(), lse_in.double(), scale)
                x32 = [x.float() for x in x64]
                s32 = scores(x32[0], x32[1], args.causal, scale)
                nv = materialized_forward(s32, x32[2]) + materialized_backward(s32, *x32, o_in.float(), lse_in, scale)
                for n, a, b in zip(names, r, nv):
                    ref[n].append(a)
                    naive[n].append(b if n == "lse" else b.to(dtype))
            ref = {n: torch.stack(x)[None] for n, x in ref.items()}
            naive = {n: torch.stack(x)[None] for n, x in naive.items()}
            o_in, lse_in = ref["o"].to(dtype), ref["lse"].float()
            for lib, forward, backward in libs:
                out = dict(zip(names, forward(q, k, v, args.causal, scale) +
                               tuple(backward(dout, q, k, v, o_in, lse_in, args.causal, scale))))
                cells = [error_cell(out[n], ref[n], naive[n], dtype != torch.float32) for n in names]
                print(f"| {dname} | {s} | {lib} | " + " | ".join(cells) + " |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time PyTorch's forward and backward; flags as flashback bench's")
    b.add_argument("--batch", type=int, default=2)
    b.add_argument("--heads", type=int, default=16)
    b.add_argument("--kv-heads", type=int)
    b.add_argument("--seqlen", type=int, default=2048)
    b.add_argument("--seqlen-q", type=int)
    b.add_argument("--seqlen-k", type=int)
    b.add_argument("--head-dim", type=int, default=128)
    b.add_argument("--head-dim-v", type=int)
    b.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--causal", action="store_true")
    b.add_argument("--scale", type=float)
    b.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    b.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--json", action="store_true")
    b.add_argument("--no-check", action="store_true", help="accepted for interleave.py; bench never checks "
                   "(see accuracy)")
    a = sub.add_parser("accuracy", help="errors of both libraries against a float64 reference")
    a.add_argument("--library", default="build/libflashback.so.0", help="flashback's shared library")
    a.add_argument("--dtypes", default="bf16,f16,f32")
    a.add_argument("--seqlens", default="512,2048,8192")
    a.add_argument("--heads", type=int, default=2)
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--causal", action="store_true")
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    bench(args) if args.command == "bench" else accuracy(args)


if __name__ == "__main__":
    main()
