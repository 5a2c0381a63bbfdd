#!/usr/bin/env python3
"""Runs the benchmark suite (flashback_bench) once and prints, as Markdown: each benchmark's median and
spread, GFLOP/s, the fraction of the FMA ceiling measured in the same run (also for the library's f32
microkernel alone, kernel/...), the speedup over the materialized BLAS baseline, and issue 3's targets.

    python3 bench/report.py [--build build] [--reps 5] [--filter REGEX] [--save run.json]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile


def run_suite(build, reps, filt):
    binary = os.path.join(build, "bench", "flashback_bench")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [binary, f"--benchmark_out={out}", "--benchmark_out_format=json"]
    if filt:
        cmd.append(f"--benchmark_filter={filt}")
    env = dict(os.environ, FLASHBACK_BENCH_REPS=str(reps))
    print(f"running: FLASHBACK_BENCH_REPS={reps} {' '.join(cmd)}", file=sys.stderr)
    subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
    with open(out) as f:
        text = f.read()
    os.unlink(out)
    if not text.strip():
        sys.exit(f"no benchmark matched --filter {filt!r} (names look like flashback/backward/B1_H16_S4096_D128/...)")
    return json.loads(text)


def aggregates(data):
    """{benchmark: {median|min|max|mean|stddev: entry}}; benchmarks that skipped (no AMX here) are left out"""
    by = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "aggregate" or b.get("error_occurred"):
            continue
        name = b["run_name"].split("/iterations:")[0]
        by.setdefault(name, {})[b["aggregate_name"]] = b
    return by


def to_seconds(entry):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[entry["time_unit"]]
    return entry["real_time"] * scale


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--filter", default="")
    ap.add_argument("--save", help="also save the raw Google Benchmark JSON here")
    ap.add_argument("--load", help="report on a JSON saved by --save instead of running the suite")
    args = ap.parse_args()

    if args.load:
        with open(args.load) as f:
            data = json.load(f)
    else:
        data = run_suite(args.build, args.reps, args.filter)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(data, f, indent=1)
    agg = aggregates(data)
    ceilings = [a["median"]["ceiling_flops"] for a in agg.values() if "ceiling_flops" in a["median"]]
    ceiling = max(ceilings) if ceilings else float("nan")
    bf16_ceilings = {n: a["median"]["bf16_ceiling_flops"] for n, a in agg.items()
                     if "bf16_ceiling_flops" in a["median"]}
    ctx = data["context"]
    threads = next((a["median"].get("threads") for n, a in agg.items() if n.startswith("flashback/")), None)

    def secs(name, stat="median"):
        a = agg.get(name)
        return to_seconds(a[stat]) if a else None

    def rate(name):
        a = agg.get(name)
        return a["median"]["flop"] / to_seconds(a["median"]) if a else None

    bf16_note = "; ".join(f"{n.split('/')[-1]} {v / 1e9:.1f} GFLOP/s" for n, v in bf16_ceilings.items())
    print(f"Machine: {ctx.get('host_name', '?')}, {platform.processor() or platform.machine()}, "
          f"{ctx.get('num_cpus')} CPUs; threads {int(threads) if threads else '?'}; "
          f"{args.reps} repetitions, median; f32 FMA ceiling {ceiling / 1e9:.1f} GFLOP/s "
          f"(register-only probe, best of the two probes in this run)"
          f"{'; bf16 ceilings: ' + bf16_note if bf16_note else ''}.\n")
    print("| benchmark | median ms | min - max ms | GFLOP/s | % of ceiling | speedup vs BLAS |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, a in agg.items():
        if "ceiling_flops" in a["median"]:
            print(f"| {name} | | | {a['median']['ceiling_flops'] / 1e9:.1f} | 100 | |")
            continue
        if "kernel_flops" in a["median"]:
            k = a["median"]["kernel_flops"]
            print(f"| {name} | | {a['min']['kernel_flops'] / 1e9:.1f} - {a['max']['kernel_flops'] / 1e9:.1f} GFLOP/s "
                  f"| {k / 1e9:.1f} | {100 * k / ceiling:.1f} | |")
            continue
        if "bf16_ceiling_flops" in a["median"]:
            print(f"| {name} | | | {a['median']['bf16_ceiling_flops'] / 1e9:.1f} | (bf16 ceiling) | |")
            continue
        r = rate(name)
        blas = name.replace("flashback/", "blas/") if name.startswith("flashback/") else None
        speedup = f"{secs(blas) / secs(name):.2f}x" if blas and blas in agg else ""
        print(f"| {name} | {secs(name) * 1e3:.1f} | {secs(name, 'min') * 1e3:.1f} - {secs(name, 'max') * 1e3:.1f} "
              f"| {r / 1e9:.1f} | {100 * r / ceiling:.1f} | {speedup} |")

    print("\nIssue 3's targets (same run):\n")
    print("| target | measured | |")
    print("|---|---:|---|")

    def check(label, value, ok, fmt="{:.1f}"):
        if value is None:
            return
        print(f"| {label} | {fmt.format(value)} | {'met' if ok(value) else 'MISSED'} |")

    for d, fwd_t, bwd_t in ((128, 80, 70), (64, 70, 60)):
        base = f"B1_H16_S4096_D{d}"
        f, b = rate(f"flashback/forward/{base}"), rate(f"flashback/backward/{base}")
        check(f"forward D={d} >= {fwd_t}% of ceiling", f and 100 * f / ceiling, lambda v, t=fwd_t: v >= t, "{:.1f}%")
        check(f"backward D={d} >= {bwd_t}% of ceiling", b and 100 * b / ceiling, lambda v, t=bwd_t: v >= t, "{:.1f}%")
        bl = secs(f"blas/backward/{base}")
        fb = secs(f"flashback/backward/{base}")
        check(f"backward D={d} >= 3x faster than BLAS", bl and fb and bl / fb, lambda v: v >= 3, "{:.2f}x")
        for p, target in (("forward", {128: 2.5, 64: 1.8}[d]), ("backward", {128: 1.5, 64: 1.0}[d])):
            r16 = rate(f"flashback/{p}/{base}_bf16")
            check(f"bf16 {p} D={d} >= {target} TFLOP/s (set for AMX)", r16 and r16 / 1e12, lambda v, t=target: v >= t,
                  "{:.3f}")
            t16, tb = secs(f"flashback/{p}/{base}_f16"), secs(f"flashback/{p}/{base}_bf16")
            check(f"f16 {p} D={d} time <= 1.5x bf16's", t16 and tb and t16 / tb, lambda v: v <= 1.5, "{:.2f}x")
        for p in ("forward", "backward"):
            c, n = secs(f"flashback/{p}/{base}_causal"), secs(f"flashback/{p}/{base}")
            check(f"{p} D={d} causal time <= 0.55x non-causal", c and n and c / n, lambda v: v <= 0.55, "{:.3f}")
            l8, l4 = secs(f"flashback/{p}/B1_H16_S8192_D{d}"), secs(f"flashback/{p}/{base}")
            check(f"{p} D={d} S=8192 time / S=4096 in [3.6, 4.4]", l8 and l4 and l8 / l4, lambda v: 3.6 <= v <= 4.4, "{:.2f}")


if __name__ == "__main__":
    main()
