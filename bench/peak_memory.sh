#!/usr/bin/env bash
# Peak resident memory of one forward + backward at Sq = Sk = 131072, D = 128, B = Hq = 1 (issue 3):
# it must stay under 1.5x the bytes of the inputs and outputs.
#   bench/peak_memory.sh [build dir] [seqlen] [head_dim]
set -euo pipefail
build=${1:-build}
seqlen=${2:-131072}
head_dim=${3:-128}
log=$(mktemp)
/usr/bin/time -v "$build/bench/flashback_peak_memory" "$seqlen" "$head_dim" 2> "$log" | tee "$log.out"
peak_kib=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$log")
io_mib=$(awk '/inputs \+ outputs/ {print $4}' "$log.out")
grep -E "Elapsed|Maximum resident" "$log"
awk -v peak="$peak_kib" -v io="$io_mib" 'BEGIN { printf "peak resident %.1f MiB = %.3f x the %.1f MiB of inputs and outputs (limit 1.5)\n", peak / 1024, peak / 1024 / io, io; exit !(peak / 1024 / io < 1.5) }'
