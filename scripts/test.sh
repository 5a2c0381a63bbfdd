#!/usr/bin/env bash
# The test command (README; CI's .ci/run calls it). On a clean clone, as root, with no input:
#   deps      scripts/install-deps.sh (Debian packages, only those missing)
#   test      Release build (warnings are errors), the whole ctest suite                  build-test/
#   asan      GCC, AddressSanitizer + UndefinedBehaviorSanitizer, the suite again          build-asan/
#             (but for what stage_asan leaves out, and why)
#   tsan      GCC, ThreadSanitizer: concurrent callers, one library thread per call       build-tsan/
#   fuzz      clang + libFuzzer: each target for FUZZ_SECONDS from the committed corpus  build-fuzz/
#             (fuzz_c_api once more with the levels the machine lacks emulated)
#   valgrind  memcheck on a small forward and backward (build-test's binaries, FLASHBACK_ISA=avx2)
# Prints what each stage took and exits non-zero if any failed; logs and fuzz artifacts go to
# build-logs/. RELIABILITY.md explains each stage and records the figures of the last run.
# Environment: JOBS (default 2), FUZZ_SECONDS (default 60), STAGES (default: all, in the order above).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
JOBS=${JOBS:-2}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
STAGES=${STAGES:-deps test asan tsan fuzz valgrind}
LOGS=$ROOT/build-logs
mkdir -p "$LOGS"
SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"

# Sanitizer builds: -O1 with line tables keeps the reports exact and the build short (benchmarks off).
SAN_FLAGS="-O1 -g1 -DNDEBUG"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1

note() { echo "$*" | tee -a "$SUMMARY"; }

# Runs a command with its output in build-logs/<name>.log, showing the log's tail when it fails.
logged() {
  local name=$1 rc=0
  shift
  "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    echo "--- $name failed (exit $rc); the end of build-logs/$name.log:"
    tail -n 60 "$LOGS/$name.log"
  fi
  return $rc
}

# "N tests" from a ctest log.
ctest_count() { grep -Eo '[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$1" | tail -n 1; }

stage_deps() {
  logged deps scripts/install-deps.sh
}

# build <name>: builds build-<name> (configured).
build() { logged "$1-build" cmake --build "build-$1" -j "$JOBS"; }

# run_ctest <name> <per-test timeout> [ctest args...]: runs build-<name>'s whole suite (but what the
# extra ctest arguments exclude). JOBS test processes at a time, each with its OpenMP team of a thread
# per core: their threads that wait at a barrier sleep (OMP_WAIT_POLICY=passive) rather than spin on a
# core another process's threads could use, as libgomp's default does (the sanitized avx512
# Attention tests: 0.92x the time on the Xeon, 2026-12-07).
run_ctest() {
  local name=$1 timeout=$2
  shift 2
  OMP_WAIT_POLICY=passive logged "$name-ctest" ctest --test-dir "build-$name" --output-on-failure -j "$JOBS" \
    --timeout "$timeout" "$@"
  local rc=$?
  note "    $name: $(ctest_count "$LOGS/$name-ctest.log")"
  return $rc
}

stage_test() {
  logged test-configure cmake -S . -B build-test -DCMAKE_BUILD_TYPE=Release -DFLASHBACK_WARNINGS_AS_ERRORS=ON &&
    build test && run_ctest test 900
}

# The level build-test's library runs at on this machine (`flashback info`), or nothing without that build.
test_level() { build-test/tools/flashback info 2>/dev/null | sed -n 's/^isa: *//p'; }

# The kernels the sanitized and fuzz builds compile (kernel_options sets KERNELS): those this machine
# runs, at its level or emulated above it; the test stage compiles them all everywhere.
# - src/cpu/emulated/ (AVX-512 and vdpbf16ps on AVX2, the tiles in software) runs only on machines
#   without AVX-512 or AVX512_BF16: left out where build-test's library runs avx512bf16 or amx. Under
#   clang's sanitizers and coverage it took 114 s of the fuzz build's 341 s of compiling (one file, the
#   build's longest), under GCC's 53 s of the asan build's 328.
# - The avx512bf16 and amx kernels run only on machines with AVX512_BF16 (amx's on emulated tiles where
#   there are none), and avx512's only with AVX-512 (the emulated ones run above the machine's level):
#   left out below. On the Xeon without AVX512_BF16 (2026-12-07) the two took 94 s of the asan build's
#   501 s of compiling, and 213 s of the fuzz build's 490.
kernel_options() {
  case $(test_level) in
    avx512bf16 | amx) KERNELS=("-DFLASHBACK_ISA_KERNELS=avx2;avx512;avx512bf16;amx" -DFLASHBACK_EMULATED_KERNELS=OFF) ;;
    avx512) KERNELS=("-DFLASHBACK_ISA_KERNELS=avx2;avx512" -DFLASHBACK_EMULATED_KERNELS=ON) ;;
    avx2) KERNELS=(-DFLASHBACK_ISA_KERNELS=avx2 -DFLASHBACK_EMULATED_KERNELS=ON) ;;
    *) KERNELS=("-DFLASHBACK_ISA_KERNELS=avx2;avx512;avx512bf16;amx" -DFLASHBACK_EMULATED_KERNELS=ON) ;;
  esac
}

# configure_sanitized <name> <sanitizers> [cmake args...]: build-<name> at -O1 with the sanitizers.
configure_sanitized() {
  local name=$1 sanitizers=$2 KERNELS
  shift 2
  kernel_options
  logged "$name-configure" cmake -S . -B "build-$name" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=$SAN_FLAGS" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$SAN_FLAGS" \
    "-DFLASHBACK_SANITIZE=$sanitizers" -DFLASHBACK_WARNINGS_AS_ERRORS=ON -DFLASHBACK_BUILD_BENCHMARKS=OFF \
    "${KERNELS[@]}" "$@"
}

# Left out under the sanitizers, and still run by the test stage:
# - the bf16_dot registration (FLASHBACK_BF16_DOT=1: the vdpbf16ps kernels wherever AVX512_BF16 runs)
#   where bf16 does not run those kernels by default (Intel, where they run at half the FMA rate and
#   took 265 s of the sanitized suite's 1,520, pushing .ci/run past 25 minutes on a Xeon with AMX);
#   where bf16 runs them by default (AMD Zen 4 and 5) it is the only sanitized run of them on real
#   hardware, and stays;
# - the 20 runs over thread counts, at every level (determinism, which the sanitizers do not check;
#   Api.ThreadCountsGiveTheSameBits runs calls at 1, 2, 3, 4 and 8 threads under them): on emulated
#   tiles 142 s of the sanitized suite's 1,083 on an AMD Zen 4 guest, where .ci/run took 21 minutes
#   with it; at the other levels 77 s of 1,653 on an Intel Xeon without AVX512_BF16, where .ci/run
#   took 31 minutes (2026-12-07, with five levels to run: scalar, avx2, avx512, and avx512bf16 and amx
#   emulated);
# - the kept workspace full of NaN (Api.KeptWorkspaceOfNonFiniteValuesGivesTheSameBits: whether a call
#   reads workspace it did not write, which the sanitizers do not check; its cases run under them in the
#   sweeps, with caller workspaces and the kept one in the other Api tests, and with NaN inputs in
#   NonFiniteInputs): on emulated tiles 54 s of the sanitized suite's 1,129 on the Zen 4 guest, where
#   .ci/run took 22.8 minutes with it; at the other levels 33 s of 865 on the Xeon without AVX512_BF16,
#   where CI took 25.9 minutes (2026-12-07).
# (The non-finite inputs on emulated tiles stay, bf16's and f16's: the backward's copies and additions of
# NaN and infinity around the products with P and dS on tiles (math_bf16.h) run nowhere else here,
# since the vdpbf16ps backward takes those products in f32 (bd51694): 41 s and 200 s sanitized on the
# Xeon, then 31 - 37 s for f16 once the tiles' arithmetic ran unsanitized and called no instrumented
# function (amx_micro.h: EmulatedTiles::dot).)
stage_asan() {
  configure_sanitized asan address,undefined && build asan || return 1
  local exclude='\.Reliability\.TwentyRunsOverThreadCountsGiveTheSameBits$' dot=1
  exclude+='|\.Api\.KeptWorkspaceOfNonFiniteValuesGivesTheSameBits$'
  build-asan/tools/flashback info 2>/dev/null | grep -Eq '^kernels:.* bf16 avx512bf16,' || dot=0
  [ $dot -eq 1 ] || exclude="^bf16_dot\.|$exclude"
  run_ctest asan 1800 -E "$exclude"
  local rc=$?
  [ $dot -eq 1 ] || note "    asan: the bf16_dot registration left out (bf16 does not run vdpbf16ps here by default)"
  return $rc
}

# ThreadSanitizer does not see inside the OpenMP runtime (libgomp is not instrumented), so it runs
# the configuration it understands: every call with one library thread (params.num_threads = 1, or
# FLASHBACK_NUM_THREADS=1 for calls that use the default), which runs on the caller's thread without
# entering OpenMP; the concurrency comes from the application threads.
stage_tsan() {
  configure_sanitized tsan thread -DFLASHBACK_BUILD_TOOLS=OFF &&
    logged tsan-build cmake --build build-tsan -j "$JOBS" --target concurrency_test api_test errors_test || return 1
  local t=build-tsan/tests
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" FLASHBACK_NUM_THREADS=1 logged tsan-run bash -c "
    set -e
    $t/concurrency_test --gtest_filter='Concurrency.*OneThreadPerCall'
    $t/api_test --gtest_filter='Api.ConcurrentCallsGiveTheSameBits'
    $t/errors_test --gtest_filter='LastError.*'"
  local rc=$?
  note "    tsan: $(grep -c '^\[       OK \]' "$LOGS/tsan-run.log") tests, $(grep -c 'WARNING: ThreadSanitizer' "$LOGS/tsan-run.log") reports"
  return $rc
}

# Each target from a copy of its committed corpus (the repository is not modified); a crash, a leak,
# an input slower than 10 s or a harness check leaves an artifact in build-logs/ and fails the stage.
# Built at -O2 with line tables only (file:line in the reports): full debug info took 201 s of build time
# against 183 (the Xeon without AVX512_BF16, 2026-12-07).
stage_fuzz() {
  local KERNELS flags="-O2 -gline-tables-only -DNDEBUG"
  kernel_options
  CC=clang CXX=clang++ logged fuzz-configure cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=$flags" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$flags" -DFLASHBACK_FUZZ=ON \
    -DFLASHBACK_BUILD_TESTS=OFF -DFLASHBACK_BUILD_BENCHMARKS=OFF "${KERNELS[@]}" &&
    logged fuzz-build cmake --build build-fuzz -j "$JOBS" --target fuzz_c_api fuzz_safetensors || return 1
  local rc=0 run target emulation name i
  # fuzz_c_api twice: at this machine's level, and with the levels it lacks emulated up to amx
  # (FLASHBACK_EMULATION, README "Instruction sets").
  local runs=(fuzz_c_api fuzz_safetensors fuzz_c_api:amx)
  # Where the machine has AMX the emulated run is the first one again: left out.
  [ "$(test_level)" = amx ] && runs=(fuzz_c_api fuzz_safetensors)
  # The runs go side by side, JOBS cores among them, each for FUZZ_SECONDS of a core: three runs on two
  # cores for 1.5 FUZZ_SECONDS of wall time (one after the other, they left a core idle for 180 s).
  # Their inputs take well under a second each, against libFuzzer's limit of 10 s.
  local cores=$((JOBS < ${#runs[@]} ? JOBS : ${#runs[@]}))
  local seconds=$(((FUZZ_SECONDS * ${#runs[@]} + cores - 1) / cores))
  local pids=() works=() names=() targets=()
  for run in "${runs[@]}"; do
    target=${run%%:*}
    emulation=${run#"$target"}
    emulation=${emulation#:}
    name=$target${emulation:+-emulated-$emulation}
    local work
    work=$(mktemp -d)
    works+=("$work")
    names+=("$name")
    targets+=("$target")
    cp -r "fuzz/corpus/$target" "$work/corpus"
    local extra=()
    [ "$target" = fuzz_safetensors ] && extra=(-dict=fuzz/safetensors.dict)
    FLASHBACK_EMULATION=$emulation LSAN_OPTIONS=suppressions=$ROOT/fuzz/lsan.supp logged "$name" \
      timeout $((3 * seconds + 120)) "build-fuzz/fuzz/$target" -max_total_time="$seconds" -timeout=10 \
      -print_final_stats=1 -artifact_prefix="$LOGS/$name-" "${extra[@]}" "$work/corpus" &
    pids+=($!)
  done
  for i in "${!runs[@]}"; do
    wait "${pids[$i]}" || rc=1
    name=${names[$i]}
    target=${targets[$i]}
    local execs seeds final
    execs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$LOGS/$name.log" | grep -Eo '[0-9]+$')
    seeds=$(ls "fuzz/corpus/$target" | wc -l)
    final=$(ls "${works[$i]}/corpus" | wc -l)
    note "    $name: ${execs:-?} inputs executed in ${seconds} s (${#runs[@]} runs on $cores cores)," \
      "corpus $seeds seeds -> $final inputs," \
      "$(grep -Eo 'cov: [0-9]+' "$LOGS/$name.log" | tail -n 1 | grep -Eo '[0-9]+') coverage points"
    rm -rf "${works[$i]}"
  done
  return $rc
}

# valgrind 3.19 has no AVX-512: the avx2 kernels. One and two OpenMP threads.
stage_valgrind() {
  local vg=(valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite --show-leak-kinds=definite)
  [ -x build-test/tests/reliability_test ] || { echo "valgrind: build-test is missing (run the test stage)"; return 1; }
  FLASHBACK_ISA=avx2 OMP_NUM_THREADS=1 logged valgrind-c-example "${vg[@]}" build-test/tests/c_example &&
    FLASHBACK_ISA=avx2 OMP_NUM_THREADS=2 logged valgrind-small "${vg[@]}" build-test/tests/reliability_test \
      --gtest_filter=Reliability.SmallForwardBackward
  local rc=$?
  local run
  for run in c-example small; do
    note "    valgrind $run: $(grep -h 'ERROR SUMMARY' "$LOGS/valgrind-$run.log" | sed 's/==[0-9]*== ERROR SUMMARY: //; s/ (suppressed.*//')," \
      "$(grep -h 'definitely lost' "$LOGS/valgrind-$run.log" | sed 's/==[0-9]*== *//')"
  done
  return $rc
}

failed=()
start_all=$(date +%s)
note "scripts/test.sh on $(uname -m), $(nproc) cores, JOBS=$JOBS, $(date -u '+%Y-%m-%d %H:%M UTC')"
for stage in $STAGES; do
  echo "=== $stage"
  t0=$(date +%s)
  if "stage_$stage"; then status=ok; else status=FAILED; failed+=("$stage"); fi
  note "$(printf '%-9s %-6s %5d s' "$stage" "$status" $(($(date +%s) - t0)))"
done
note "$(printf '%-9s %-6s %5d s' total "$([ ${#failed[@]} -eq 0 ] && echo ok || echo FAILED)" $(($(date +%s) - start_all)))"
echo
echo "=== summary (build-logs/summary.txt)"
cat "$SUMMARY"
if [ ${#failed[@]} -ne 0 ]; then
  echo "failed stages: ${failed[*]}"
  exit 1
fi
