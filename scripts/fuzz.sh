#!/usr/bin/env bash
# Fuzz flowrun's input formats with libFuzzer: scripts/fuzz.sh [SECONDS] [TARGET...]
#   SECONDS  how long each target fuzzes (default 600)
#   TARGET   graph overrides safetensors idx tar image manifest wordpiece bpe (default: all)
#   JOBS=N   targets fuzzed at the same time (default 1)
# Builds build-fuzz/ (clang, AddressSanitizer + UndefinedBehaviorSanitizer, FLOWRUN_TORCH=OFF,
# FLOWRUN_FUZZ=ON), then fuzzes each target from a copy of its seed corpus
# (tests/fuzz/corpus/TARGET/) in build-fuzz/fuzz-work/TARGET/: new inputs stay there, crashes
# go to build-fuzz/fuzz-work/TARGET/crash-*. A line per target at the end: executions,
# coverage (cov: edges, ft: features), corpus size, crashes (crash-, timeout-, oom-, leak-). Exit status 1 if any target crashed.
# docs/testing.md says what to do with a crash (fix it, keep the input as corpus/TARGET/crash-*).
set -euo pipefail
cd "$(dirname "$0")/.."
# The cores (nproc alone answers $OMP_NUM_THREADS where it is set, and the build would crawl).
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
SECONDS_EACH=${1:-600}
shift || true
ALL=(graph overrides safetensors idx tar image manifest wordpiece bpe)
TARGETS=("${@:-${ALL[@]}}")
JOBS=${JOBS:-1}
B=build-fuzz

[ -f "$B/CMakeCache.txt" ] ||
  CC=clang CXX=clang++ cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFLOWRUN_TORCH=OFF -DFLOWRUN_FUZZ=ON -DFLOWRUN_SANITIZE=address,undefined
cmake --build "$B" -j "$CORES" --target "${TARGETS[@]/#/fuzz_}"

fuzz_one() {
  local t=$1 w=$B/fuzz-work/$1
  mkdir -p "$w/corpus"
  cp -rn tests/fuzz/corpus/"$t"/. "$w/corpus/"
  # -timeout: an input running over 10 s is a hang; -rss_limit_mb: over 2 GB is a bug too.
  "$B/tests/fuzz/fuzz_$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$w/" "$w/corpus" >"$w/log" 2>&1 || true
}

echo "== fuzzing ${TARGETS[*]}: ${SECONDS_EACH} s each, $JOBS at a time (logs: $B/fuzz-work/TARGET/log)"
running=0
for t in "${TARGETS[@]}"; do
  fuzz_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait

status=0
printf '%-12s %12s %8s %8s %8s %8s %8s\n' target executions exec/s cov ft corpus crashes
for t in "${TARGETS[@]}"; do
  w=$B/fuzz-work/$t
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$w/log" | grep -o '[0-9]*$' || echo "?")
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$w/log" | grep -o '[0-9]*$' || echo "?")
  last=$(grep -E '^#[0-9]+' "$w/log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' <<<"$last" | grep -o '[0-9]*$' || echo "?")
  ft=$(grep -o 'ft: [0-9]*' <<<"$last" | grep -o '[0-9]*$' || echo "?")
  corp=$(grep -o 'corp: [0-9]*' <<<"$last" | grep -o '[0-9]*$' || echo "?")
  crashes=$(find "$w" -maxdepth 1 \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | wc -l)
  printf '%-12s %12s %8s %8s %8s %8s %8s\n' "$t" "$execs" "$rate" "$cov" "$ft" "$corp" "$crashes"
  [ "$crashes" = 0 ] || { status=1; find "$w" -maxdepth 1 -name '*-*' -newer "$w/corpus" -type f | sed 's/^/  found: /'; }
done
exit $status
