#!/usr/bin/env python3
"""Side-by-side comparison of `flashback bench` configurations on a noisy machine.

Runs each configuration in turn, round after round (A B C A B C ...), so that every configuration
sees the same moments of the machine, and reports per configuration and pass: the median over rounds
of each run's best time, its GFLOP/s, and the median over rounds of its time divided by the first
configuration's time in the same round. Use it to decide whether a change helps: a ratio that stays
within the noise of the rounds (printed as the spread of the ratios) is no result.

    python3 bench/interleave.py --rounds 10 \\
        'base=build-old/tools/flashback bench --heads 4 --seqlen 4096 --head-dim 128' \\
        'new=build/tools/flashback bench --heads 4 --seqlen 4096 --head-dim 128'

A configuration is NAME=COMMAND, optionally NAME=VAR=VALUE ... COMMAND for environment variables
(FLASHBACK_ISA=avx2 build/tools/flashback bench ...). `--json --no-check` are added to each command.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys


def parse_config(text):
    name, _, rest = text.partition("=")
    if not name or not rest:
        sys.exit(f"configuration {text!r}: expected NAME=COMMAND")
    words = shlex.split(rest)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        sys.exit(f"configuration {text!r}: no command")
    return name, env, words + ["--json", "--no-check"]


def run_once(env, argv):
    out = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, **env))
    if out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("configs", nargs="+", metavar="NAME=COMMAND")
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.configs]
    names = [c[0] for c in configs]
    if len(set(names)) != len(names):
        sys.exit("configuration names must differ")

    best = {name: {"forward": [], "backward": []} for name in names}
    flops = {}
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
        for name, env, argv in configs:
            result = run_once(env, argv)
            for passname in ("forward", "backward"):
                best[name][passname].append(result[passname]["min_s"])
                flops[(name, passname)] = result["flops"][passname]

    first = names[0]
    print(f"{args.rounds} rounds; per round each run's best time; ratio = time / {first}'s in the same round")
    print("| pass | configuration | median ms | GFLOP/s | ratio (median) | ratio (min - max) |")
    print("|---|---|---:|---:|---:|---|")
    for passname in ("forward", "backward"):
        for name in names:
            times = best[name][passname]
            ratios = [t / b for t, b in zip(times, best[first][passname])]
            med = statistics.median(times)
            print(f"| {passname} | {name} | {med * 1e3:.1f} | {flops[(name, passname)] / med / 1e9:.1f} | "
                  f"{statistics.median(ratios):.3f} | {min(ratios):.3f} - {max(ratios):.3f} |")


if __name__ == "__main__":
    main()
