#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets: fuzz/corpus/fuzz_c_api and fuzz/corpus/fuzz_safetensors.

The committed seeds are this script's output; run it again after changing a harness's input format
(fuzz_c_api.cpp, decode()). Each seed is a small, deliberate case: valid calls in every dtype, mask,
layout and workspace mode, and one of each defect the harness knows, so that libFuzzer starts from
inputs that reach deep into the library instead of rediscovering the format.
"""
import base64
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


# --- fuzz_c_api ------------------------------------------------------------------------------------
# The byte layout decode() reads, front to back (missing bytes read as 0).

MODES = {"forward": 0, "forward_backward": 1, "backward_fuzzed_o": 2, "sizes_only": 3}
DTYPES = {"f32": 0, "bf16": 1, "f16": 2}
TENSORS = ["q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "delta"]
WS = {"library": 0, "exact": 1, "misaligned": 2, "too_small": 3, "null_with_bytes": 4, "larger": 5}
VALUES = {"moderate": 0, "integers": 1, "large": 2, "special": 3}


def small(value, base, modulo):
    assert base <= value < base + modulo
    return [value - base]


def head_dim(d):
    assert 1 <= d <= 64
    return [d - 1]


def c_api_seed(mode="forward_backward", dtype="f32", b=1, hq=2, group=1, sq=9, sk=11, d=8, dv=8, causal=False,
               left=None, right=None, scale_index=None, threads=1, reserved=0, grads=0x0F, layouts=None,
               ws="library", ws_extra=0, values="moderate", seed=1, late=0, sk_wild=None, sq_wild=None):
    # sk_wild, sq_wild: Sk, Sq as an index into the harness's kWild (9, 10, 11: 1023, 1024, 1025) instead of sk, sq
    # dtype: a name, or an int8 that is no dtype's value (the harness's fourth dtype choice reads it)
    if dtype in DTYPES:
        out = [MODES[mode] | DTYPES[dtype] << 2]
    else:
        out = [MODES[mode] | 3 << 2, dtype & 0xFF]
    out += small(b, 1, 2) + small(hq, 1, 4)
    divisors = [x for x in range(1, hq + 1) if hq % x == 0]
    out += [divisors.index(hq // group)]  # g % len(divisors) picks Hk; Hk = Hq / group
    out += [250, sq_wild] if sq_wild is not None else small(sq, 0, 100)
    out += [250, sk_wild] if sk_wild is not None else small(sk, 0, 100)
    out += head_dim(d) + head_dim(dv)
    p = (1 if causal else 0) | (2 if scale_index is not None else 0)
    extra = []
    for shift, w in ((2, left), (4, right)):
        if w is None:
            mode_bits = 0
        elif w == 0:
            mode_bits = 2
        else:
            mode_bits = 1
            extra.append(w)  # window_value reads left's byte, then right's
        p |= mode_bits << shift
    if scale_index is not None:
        extra.append(scale_index)
    if threads == 1:
        tbits = 0
    elif threads in (2, 3, 4):
        tbits = 1
        extra_threads = [threads - 2]
    elif threads == 0:
        tbits = 2
    else:
        raise ValueError(threads)
    p |= tbits << 6
    out += [p] + extra + (extra_threads if tbits == 1 else [])
    out += [reserved, grads]
    layouts = layouts or {}
    for name in TENSORS:
        out += layouts.get(name, [0])
    out += [WS[ws], ws_extra, VALUES[values]] + list(struct.pack("<Q", seed)) + [late]
    return bytes(out)


def c_api_seeds():
    seeds = {}
    for dt in DTYPES:
        seeds[f"fwd_bwd_{dt}"] = c_api_seed(dtype=dt)
        seeds[f"fwd_bwd_{dt}_causal_gqa"] = c_api_seed(dtype=dt, hq=4, group=2, sq=70, sk=66, d=32, dv=16, causal=True)
        seeds[f"fwd_bwd_{dt}_window_threads"] = c_api_seed(dtype=dt, b=2, hq=2, sq=80, sk=90, d=16, dv=24, left=20,
                                                           right=3, threads=3)
        seeds[f"backward_fuzzed_o_{dt}"] = c_api_seed(mode="backward_fuzzed_o", dtype=dt, sq=17, sk=5)
    seeds["forward_sk0"] = c_api_seed(mode="forward", sk=0)
    seeds["forward_sq0"] = c_api_seed(mode="forward", sq=0, dtype="f16")
    seeds["forward_one_key_causal"] = c_api_seed(sq=20, sk=1, causal=True)
    seeds["diagonal_only"] = c_api_seed(sq=40, sk=20, left=0, right=0)
    seeds["scale_default_threads0"] = c_api_seed(threads=0, scale_index=1)
    seeds["values_special"] = c_api_seed(values="special", dtype="bf16", sq=30, sk=30, causal=True)
    seeds["values_large"] = c_api_seed(values="large", dtype="f16")
    seeds["values_integers"] = c_api_seed(values="integers", hq=3, group=3)
    seeds["grads_subset"] = c_api_seed(grads=0x1A)  # dq and dk dropped where the bits say
    for ws, extra in (("exact", 0), ("misaligned", 5), ("too_small", 0), ("null_with_bytes", 3), ("larger", 77)):
        seeds[f"workspace_{ws}"] = c_api_seed(ws=ws, ws_extra=extra, dtype="bf16")
    # Layouts of every input (kinds 6..11 and 15 of decode_tensor) and of the outputs.
    kinds = {"bshd": [6], "padded": [7, 3], "zero_stride": [8, 1], "interleaved": [9, 1, 2], "random": [10, 7, 91, 33],
             "far_stride": [11, 2, 5], "reversed": [15, 1, 1, 1]}
    for kind, lb in kinds.items():
        seeds[f"inputs_{kind}"] = c_api_seed(layouts={t: lb for t in ("q", "k", "v", "dout")}, sq=21, sk=19)
        seeds[f"outputs_{kind}"] = c_api_seed(layouts={t: lb for t in ("o", "dq", "dk", "dv")}, sq=21, sk=19)
    # One of each defect of a tensor (kind 12, sub-case) and the dims, shapes and late defects.
    for sub, extra in ((0, [3]), (1, []), (2, [4]), (3, []), (4, []), (5, [1]), (6, [0]), (7, [2, 0]), (8, [1]),
                       (9, [0]), (10, [0, 0]), (11, [])):
        seeds[f"defect_{sub}"] = c_api_seed(layouts={"k": [12, sub] + extra})
    seeds["mismatch"] = c_api_seed(layouts={"v": [13, 2, 0]})
    seeds["wild_shape"] = c_api_seed(mode="sizes_only", layouts={"q": [14, 2, 22]})
    seeds["wild_dims"] = bytes([3, 252, 26, 250, 21, 0, 255, 23, 255, 24, 255, 25, 250, 27])
    seeds["late_null_data"] = c_api_seed(late=0x13)
    seeds["late_top_pointer"] = c_api_seed(late=0x21)
    seeds["late_alias"] = c_api_seed(late=0x30)
    for r in (240, 241, 242, 243, 244, 249, 250):
        seeds[f"reserved_{r}"] = c_api_seed(reserved=r)
    # Found by the fuzzer at d9e251f: window sides of INT64_MAX with Sq > Sk overflowed the reference's
    # visibility test (tests/reference.cpp), which checks the library's results.
    seeds["window_int64_max"] = base64.b64decode("BQADAU7RAAAfGgAAJwAAAAAAAAAAAAAAAAABAABAAAAAAAAAAA==")
    # Found by the fuzzer at ae78274: a workspace query for a masked problem with 2^28 query rows
    # timed out in a loop over the rows (cpu/tiles.h: visible_keys_per_row, now in closed form).
    seeds["wide_keys_many_rows"] = base64.b64decode("BQAAAP///w8LBghEAwAAAAAPAAAxAAAAAAAA+wAAAQAAAAAAAAAnAAAAAAAn")
    # Found by the fuzzer in CI at 79ea97e: one key (Sk = 1) at a row stride of 2^61 elements, which a
    # dim of size 1 may have, overflowed the backward's prefetch of the key rows (cpu/blocks.h:
    # Prefetch::rows_of) under UBSan.
    seeds["far_stride_one_key"] = base64.b64decode("AQABBwABABMVBw8LAgULAgUL7wUAQQsCBQAAAAAAAAD/DwEAAAAAAAAAAA==")
    # Found by the fuzzer (fixed at 525ca04): f16 on AMX tiles offset a null base while measuring its scratch.
    seeds["f16-tiles-measured-scratch"] = base64.b64decode("CQABAQkL/wcHAAAADwAAAAAAAAAAe0MBALBgAABfwAJ6akgA")
    # Found by the fuzzer at 586493f: the forward's fetch of the next item's keys where they have no
    # elements (cpu/attention.h: fetch_item_rows computes no row address without rows).
    seeds["forward-fetch-keys-without-elements"] = base64.b64decode(
        "AACLCwMAATIAAAAAAAAIAIsBAAABAAE6IHZhbHVlIGlzIG5vdCBkZWZpbmVk")
    # Found by the fuzzer in CI at 29f4fbc (emulated amx): a bf16 backward of 65535 heads of one query
    # row and no keys asked for a workspace of 2.8 GB, each head's query block padded to the tile's 128
    # rows, over libFuzzer's 2 GB (now 258 MiB: cpu/tiles.h, backward_block_rows; and the harness skips
    # calls whose workspace is over kMaxWorkspaceBytes).
    seeds["many_heads_one_row"] = base64.b64decode("BQD/////AAAAAAAAAwEAAAAAAAAAAA==")
    # Found by the fuzzer at 406d040 (emulated amx): 55042 heads of 3 query rows and one key took 9 s a
    # call on emulated tiles under ASan, past libFuzzer's 10 s an input; the harness bounds the blocks
    # of 16 x 16 a call pads to (kMaxBlocks) as well as its elements' work.
    seeds["many_heads_few_rows"] = base64.b64decode("BQD//wLXAAAAAAAAAAMBAAAAOwAAAAAA")
    # Found by the fuzzer at 69d3c4b: the harness's own extent of a tensor whose spans sum to about
    # 2^125.6, times the element size, overflowed __int128 (clang's UBSan; the library not involved).
    seeds["extent_past_int128"] = base64.b64decode("+P/+/t4EADogdmFsdWUgaXMgbm90IGRlZmluZWQiADwiAAAAAAAAAAAAAAAA")
    # 1025 keys against one block of 4 rows (decoding, swapped heads): the forward splits the keys into
    # parts and combines them (cpu/backend.cpp: forward_splits), also under a causal mask on 2 threads.
    seeds["split_keys_decoding"] = c_api_seed(hq=4, group=4, sq=1, sk_wild=11, d=8, dv=8)
    seeds["split_keys_causal_threads"] = c_api_seed(hq=2, group=1, sq=3, sk_wild=11, d=5, dv=7, causal=True, threads=2,
                                                    dtype="f16")
    # 1025 query rows against one key block (and against two, under a window): the backward splits
    # each key block's query blocks into parts and adds their dK and dV (cpu/backend.cpp:
    # backward_splits), on 2 threads.
    seeds["split_queries"] = c_api_seed(hq=2, group=2, sq_wild=11, sk=60, d=8, dv=6, threads=2)
    seeds["split_queries_window_bf16"] = c_api_seed(hq=2, group=1, sq_wild=11, sk=99, d=7, dv=9, left=3, threads=2,
                                                    dtype="bf16")
    # dtype values no dtype has, which the library must read as ints (c_api.cpp: enum_value)
    seeds["dtype_unknown"] = c_api_seed(dtype=7)
    seeds["dtype_negative"] = c_api_seed(dtype=-1)
    seeds["scale_nan"] = c_api_seed(scale_index=7)
    seeds["scale_underflow"] = c_api_seed(scale_index=9)
    return seeds


# --- fuzz_safetensors ------------------------------------------------------------------------------

def st_file(header, data=b""):
    text = header.encode()
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, 3.25)
    return {
        "one_f32": st_file('{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}', f32),
        "three_dtypes": st_file('{"__metadata__":{"format":"pt"},"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},'
                                '"y":{"dtype":"BF16","shape":[1,2],"data_offsets":[4,8]},'
                                '"z":{"dtype":"F32","shape":[],"data_offsets":[8,12]}}',
                                bytes([0, 60, 0, 192, 128, 63, 0, 64]) + struct.pack("<f", 42.0)),
        "empty_tensor": st_file('{"e":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]}}'),
        "empty_header": st_file("{}"),
        "padded_header": st_file('{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}     ', b"\x80\x3f"),
        "unsupported_dtype": st_file('{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}', bytes(8)),
        "overlap": st_file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                           '"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}', bytes(6)),
        "hole": st_file('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8)),
        "huge_dims": st_file('{"a":{"dtype":"F32","shape":[4611686018427387904,4,0],"data_offsets":[0,0]}}'),
        "truncated": st_file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(3)),
        "not_json": st_file('{"a":[1,2,'),
        "size_too_large": struct.pack("<Q", 1 << 40) + b"{}",
        "short": b"\x02\x00\x00",
        # Found by the fuzzer at ded3dcd (fixed in d52a953): a tensor with no elements and huge dims, which
        # the writer refused although the reader accepted it.
        "empty_tensor_huge_dims": base64.b64decode(
            "TAAAAAAAAAB7ImEiOnsiZHR5cGUiOiJGMzIiLCJzaGFwZSI6WzQ2MTE2ODYwMTg0MjczODc5MDQs"
            "NCwwXSwiZGF0YV9vZmZzZXRzIjpbMCwwXX19"),
    }


SAFETENSORS_DICT = [
    '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"F32"', '"F16"', '"BF16"', '"I64"', '"BOOL"',
    '"F8_E4M3"', "{", "}", "[", "]", ":", ",", "0", "1", "18446744073709551615", "9223372036854775807",
    "4611686018427387904", "-1", "1e3", "null", "true", '"\\u0000"', '"\\ud800"',
]


def write_dir(path, files):
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        os.remove(os.path.join(path, name))
    for name, data in sorted(files.items()):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


def main():
    write_dir(os.path.join(HERE, "corpus", "fuzz_c_api"), c_api_seeds())
    write_dir(os.path.join(HERE, "corpus", "fuzz_safetensors"), safetensors_seeds())
    with open(os.path.join(HERE, "safetensors.dict"), "w") as f:
        f.write("# libFuzzer dictionary for fuzz_safetensors (fuzz/make_corpus.py writes it)\n")
        for i, token in enumerate(SAFETENSORS_DICT):
            escaped = token.replace("\\", "\\\\").replace('"', '\\"')
            f.write(f'kw{i}="{escaped}"\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
