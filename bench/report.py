#!/usr/bin/env python3
"""Runs the benchmark suite (flashback_bench) once and prints, as Markdown: each benchmark's median and
spread, GFLOP/s, the fraction of the FMA ceiling measured in the same run (also for the library's f32
microkernel alone, kernel/...), the speedup over the materialized BLAS baseline, and issue 3's targets.

The guest's speed moves within a run (the host's other tenants: the FMA probe has read 320 and 450
GFLOP/s an hour apart, and changed inside one 13-minute run), so each timed repetition carries the FMA
ceiling measured right before it (`adjacent_ceiling_flops`). Fractions of the ceiling are the median
over repetitions of rate / adjacent ceiling; ratios between benchmarks (causal / non-causal, S = 8192 /
4096, f16 / bf16, BLAS / flashback) compare times scaled by the adjacent ceiling (time x ceiling: the
work in units of the probe's FLOP), so that a change of machine speed between two rows cancels. Runs
saved before the adjacent probe existed fall back to the run's own two probes and raw times.

The register-only probe does not see every slow spell: in a full run of issue 3's rows (2026-12-07,
a331de0), three of the five repetitions of the causal forward at D = 128 took 1.14 - 1.19x its best time
while the probes before them read their usual rate, and the ratio to the non-causal row missed its
bound by 3%. So the repetitions of all the benchmarks run interleaved in a random order (Google
Benchmark's --benchmark_enable_random_interleaving): each row's repetitions are spread over the whole
run, and two rows compared in a ratio sample the same spells rather than one row taking a spell whole.
--in-order runs each benchmark's repetitions one after the other, as before. Each repetition also
records the time the hypervisor stole from the guest's CPUs while it ran (`steal_ms`, from /proc/stat),
printed below the table.

    python3 bench/report.py [--build build] [--reps 5] [--filter REGEX] [--in-order] [--save run.json]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile


def run_suite(build, reps, filt, in_order):
    binary = os.path.join(build, "bench", "flashback_bench")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [binary, f"--benchmark_out={out}", "--benchmark_out_format=json"]
    if not in_order:
        cmd.append("--benchmark_enable_random_interleaving=true")
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
    """{benchmark: {median|min|max|mean|stddev: entry}}, in the suite's order (interleaved runs write each
    benchmark's statistics when its last repetition ends); benchmarks that skipped (no AMX here) are left out"""
    by = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "aggregate" or b.get("error_occurred"):
            continue
        name = b["run_name"].split("/iterations:")[0]
        by.setdefault(name, {})[b["aggregate_name"]] = b
    return dict(sorted(by.items(), key=lambda kv: kv[1]["median"].get("family_index", 0)))


def to_seconds(entry):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[entry["time_unit"]]
    return entry["real_time"] * scale


def repetitions(data):
    """{benchmark: [(seconds, adjacent ceiling FLOP/s, entry)]} over the repetitions that carry an adjacent
    ceiling: the AMX one where the repetition has it (bf16 and f16 on AMX, the AMX kernel), the vdpbf16ps one
    for the vdpbf16ps kernel, else the FMA one"""
    by = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration" or b.get("error_occurred"):
            continue
        c = b.get("adjacent_amx_ceiling_flops") or b.get("adjacent_bf16_ceiling_flops") or b.get("adjacent_ceiling_flops")
        if not c:
            continue
        name = b["run_name"].split("/iterations:")[0]
        by.setdefault(name, []).append((to_seconds(b), c, b))
    return by


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--filter", default="")
    ap.add_argument("--in-order", action="store_true",
                    help="run each benchmark's repetitions one after the other, not interleaved with the others'")
    ap.add_argument("--save", help="also save the raw Google Benchmark JSON here")
    ap.add_argument("--load", help="report on a JSON saved by --save instead of running the suite")
    args = ap.parse_args()

    if args.load:
        with open(args.load) as f:
            data = json.load(f)
    else:
        data = run_suite(args.build, args.reps, args.filter, args.in_order)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(data, f, indent=1)
    agg = aggregates(data)
    reps = repetitions(data)
    ceilings = [a["median"]["ceiling_flops"] for a in agg.values() if "ceiling_flops" in a["median"]]
    ceiling = max(ceilings) if ceilings else float("nan")
    adjacent = [e["adjacent_ceiling_flops"] for r in reps.values() for _, _, e in r if "adjacent_ceiling_flops" in e]
    adjacent_amx = [e["adjacent_amx_ceiling_flops"] for r in reps.values() for _, _, e in r
                    if "adjacent_amx_ceiling_flops" in e]
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

    def fraction(name, key="flop"):
        """median over repetitions of rate / adjacent ceiling; without adjacent probes, median rate / run ceiling"""
        if name in reps:
            return statistics.median(
                (e[key] / t if key == "flop" else e[key]) / c for t, c, e in reps[name])
        a = agg.get(name)
        if not a:
            return None
        return (rate(name) if key == "flop" else a["median"][key]) / ceiling

    def work(name):
        """time scaled by the machine's speed at that moment: median of seconds x adjacent FMA ceiling (else
        seconds); the FMA one for every row, so that rows on AMX and rows on FMA compare in one unit"""
        if name in reps and all("adjacent_ceiling_flops" in e for _, _, e in reps[name]):
            return statistics.median(t * e["adjacent_ceiling_flops"] for t, _, e in reps[name])
        return secs(name)

    def ratio(a, b):
        wa, wb = work(a), work(b)
        return wa / wb if wa and wb else None

    bf16_note = "; ".join(f"{n.split('/')[-1]} {v / 1e9:.1f} GFLOP/s" for n, v in bf16_ceilings.items())
    print(f"Machine: {ctx.get('host_name', '?')}, {platform.processor() or platform.machine()}, "
          f"{ctx.get('num_cpus')} CPUs; threads {int(threads) if threads else '?'}; "
          f"{args.reps} repetitions, median; f32 FMA ceiling {ceiling / 1e9:.1f} GFLOP/s "
          f"(register-only probe, best of the two probes in this run)"
          f"{'; bf16 ceilings: ' + bf16_note if bf16_note else ''}.")
    if adjacent:
        print(f"The FMA ceiling right before each timed repetition ranged {min(adjacent) / 1e9:.1f} - "
              f"{max(adjacent) / 1e9:.1f} GFLOP/s (median {statistics.median(adjacent) / 1e9:.1f}); '% of ceiling' "
              f"divides each repetition by its own, and ratios compare times scaled by it.")
    else:
        print("(A run without adjacent probes: '% of ceiling' divides by the run's ceiling, ratios compare raw times.)")
    if adjacent_amx:
        print(f"Rows on AMX (bf16, f16 where it runs the tiles, and the AMX kernel) divide by the AMX TDPBF16PS ceiling measured right before "
              f"each repetition instead: {min(adjacent_amx) / 1e12:.2f} - {max(adjacent_amx) / 1e12:.2f} TFLOP/s "
              f"(median {statistics.median(adjacent_amx) / 1e12:.2f}).")
    print()
    print("| benchmark | median ms | min - max ms | GFLOP/s | % of ceiling | speedup vs BLAS |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, a in agg.items():
        if "ceiling_flops" in a["median"]:
            print(f"| {name} | | | {a['median']['ceiling_flops'] / 1e9:.1f} | 100 | |")
            continue
        if "kernel_flops" in a["median"]:
            k = a["median"]["kernel_flops"]
            print(f"| {name} | | {a['min']['kernel_flops'] / 1e9:.1f} - {a['max']['kernel_flops'] / 1e9:.1f} GFLOP/s "
                  f"| {k / 1e9:.1f} | {100 * fraction(name, 'kernel_flops'):.1f} | |")
            continue
        if "bf16_ceiling_flops" in a["median"]:
            print(f"| {name} | | | {a['median']['bf16_ceiling_flops'] / 1e9:.1f} | (bf16 ceiling) | |")
            continue
        r = rate(name)
        blas = name.replace("flashback/", "blas/") if name.startswith("flashback/") else None
        speedup = f"{ratio(blas, name):.2f}x" if blas and blas in agg else ""
        print(f"| {name} | {secs(name) * 1e3:.1f} | {secs(name, 'min') * 1e3:.1f} - {secs(name, 'max') * 1e3:.1f} "
              f"| {r / 1e9:.1f} | {100 * fraction(name):.1f} | {speedup} |")

    steal = [(e["steal_ms"], n) for n, r in reps.items() for _, _, e in r if e.get("steal_ms", -1) >= 0]
    if steal:
        most, where = max(steal)
        total, some = sum(s for s, _ in steal), sum(1 for s, _ in steal if s > 0)
        print(f"\nTime stolen by the hypervisor during the timed repetitions: {total:.0f} ms in all, {some} of "
              f"{len(steal)} repetitions with some, at most {most:.0f} ms ({where}).")

    print("\nIssue 3's targets (same run):\n")
    print("| target | measured | |")
    print("|---|---:|---|")

    def check(label, value, ok, fmt="{:.1f}"):
        if value is None:
            return
        print(f"| {label} | {fmt.format(value)} | {'met' if ok(value) else 'MISSED'} |")

    for d, fwd_t, bwd_t in ((128, 80, 70), (64, 70, 60)):
        base = f"B1_H16_S4096_D{d}"
        f, b = fraction(f"flashback/forward/{base}"), fraction(f"flashback/backward/{base}")
        check(f"forward D={d} >= {fwd_t}% of ceiling", f and 100 * f, lambda v, t=fwd_t: v >= t, "{:.1f}%")
        check(f"backward D={d} >= {bwd_t}% of ceiling", b and 100 * b, lambda v, t=bwd_t: v >= t, "{:.1f}%")
        check(f"backward D={d} >= 3x faster than BLAS", ratio(f"blas/backward/{base}", f"flashback/backward/{base}"),
              lambda v: v >= 3, "{:.2f}x")
        for p, target in (("forward", {128: 2.5, 64: 1.8}[d]), ("backward", {128: 1.5, 64: 1.0}[d])):
            r16 = rate(f"flashback/{p}/{base}_bf16")
            check(f"bf16 {p} D={d} >= {target} TFLOP/s (set for AMX)", r16 and r16 / 1e12, lambda v, t=target: v >= t,
                  "{:.3f}")
            check(f"f16 {p} D={d} time <= 1.5x bf16's", ratio(f"flashback/{p}/{base}_f16", f"flashback/{p}/{base}_bf16"),
                  lambda v: v <= 1.5, "{:.2f}x")
        for p in ("forward", "backward"):
            check(f"{p} D={d} causal time <= 0.55x non-causal", ratio(f"flashback/{p}/{base}_causal", f"flashback/{p}/{base}"),
                  lambda v: v <= 0.55, "{:.3f}")
            check(f"{p} D={d} S=8192 time / S=4096 in [3.6, 4.4]",
                  ratio(f"flashback/{p}/B1_H16_S8192_D{d}", f"flashback/{p}/{base}"), lambda v: 3.6 <= v <= 4.4, "{:.2f}")
        for p in ("forward", "backward"):
            r = ratio(f"flashback/{p}/{base}_bf16_causal", f"flashback/{p}/{base}_bf16")
            if r:
                print(f"| (not a target) bf16 {p} D={d} causal time / non-causal | {r:.3f} | |")
        r = ratio(f"flashback/forward/{base}_shift4", f"flashback/forward/{base}")
        if r:
            print(f"| (not a target) D={d} rows 16 bytes off cache lines / aligned, forward | {r:.2f}x | |")
            print(f"| (not a target) D={d} rows 16 bytes off cache lines / aligned, backward | "
                  f"{ratio(f'flashback/backward/{base}_shift4', f'flashback/backward/{base}'):.2f}x | |")


if __name__ == "__main__":
    main()
