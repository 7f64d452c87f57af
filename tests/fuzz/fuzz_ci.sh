#!/usr/bin/env bash
# One deterministic fuzz run, the CTest test fuzz.NAME (tests/fuzz/CMakeLists.txt; CI runs it):
#   fuzz_ci.sh FUZZER CORPUS WORK SEED RUNS
# fuzzes FUZZER from a fresh copy of CORPUS in WORK/corpus for exactly RUNS executions from
# libFuzzer seed SEED, so the same build does the same work every time (issue 31, item 7):
# a failure is the code's, and rerunning the test reproduces it (the input is left in WORK/).
# What else would make two runs differ, measured with fuzz_manifest (three runs, three
# different corpora, until all of these were fixed):
#   - address randomization: -fsanitize=fuzzer tracks stack depth, and comparisons of
#     addresses feed the mutator: setarch -R turns it off for this process (where a container
#     forbids that, the run goes on and says it is not reproducible);
#   - -reload (default on) re-reads the corpus folder every second: -reload=0;
#   - the scratch folder of the harness (fuzz_util.hpp) is named after the process id, which
#     ends up in messages and comparisons: FLOWRUN_FUZZ_SCRATCH names a fixed one.
# Random, long fuzzing is scripts/fuzz.sh.
set -euo pipefail
fuzzer=$1 corpus=$2 work=$3 seed=$4 runs=$5
rm -rf "$work"
mkdir -p "$work/corpus" "$work/scratch"
cp -r "$corpus/." "$work/corpus/"
norand=(setarch "$(uname -m)" -R)
if ! "${norand[@]}" true 2>/dev/null; then
  echo "fuzz_ci.sh: cannot turn off address randomization (setarch -R is not permitted here):" \
    "this run is not reproducible"
  norand=()
fi
export FLOWRUN_FUZZ_SCRATCH="$work/scratch"
# -timeout: an input running over 10 s is a hang; -rss_limit_mb: over 2 GB is a bug too.
exec "${norand[@]}" "$fuzzer" -seed="$seed" -runs="$runs" -reload=0 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus"
