#!/usr/bin/env bash
# Build (if needed) and run the whole test suite with CTest, in two build folders:
#   build/      the product (gcc, libtorch): unit, node, end-to-end and multi-process tests;
#   build-san/  the torch-free engine and file-format library built with clang,
#               AddressSanitizer and UndefinedBehaviorSanitizer (FLOWRUN_TORCH=OFF): their
#               tests, the fuzzers' corpora replayed, and each fuzzer run briefly with a fixed
#               seed and a fixed number of executions (tests/fuzz/fuzz_ci.sh; FLOWRUN_FUZZ_SEED,
#               -runs per target in tests/fuzz/CMakeLists.txt): deterministic, the same work on
#               every commit, about 10 s each. Random fuzzing is scripts/fuzz.sh, outside CI.
#               docs/testing.md.
# Then build/'s node tests once more on another CPU path of PyTorch's (CPU_PATHS, below).
# Extra arguments go to every ctest run (e.g. -L engine, -R cli; --output-on-failure is on).
# SANITIZE=0 skips the second folder.
set -euo pipefail
cd "$(dirname "$0")/.."
# The cores (nproc alone answers $OMP_NUM_THREADS where it is set, and the build would crawl).
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
BUILD_DIR=${BUILD_DIR:-build}
SAN_BUILD_DIR=${SAN_BUILD_DIR:-build-san}
[ -f "$BUILD_DIR/CMakeCache.txt" ] || cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j "$CORES"
# The tests that read data/ (token shards, GPT-2's BPE files, the shapes sets) skip without it;
# here they all run: make it first when it is missing (scripts/setup.sh has, normally).
[ -f data/shapes/vocab.txt ] && [ -f data/text/fortunes_byte.train.bin ] && [ -f data/gpt2/vocab.json ] ||
  scripts/data.sh "$BUILD_DIR/engine/flowrun"
# As many tests at once as there are cores; the ones that must run alone (the multi-process
# cases, the README commands) say so (RUN_SERIAL in their CMakeLists.txt).
# The demo's matrix (tests/cli/CMakeLists.txt: demo.matrix, about 2.5 hours on 2 cores) only with DEMO_MATRIX=1.
demo=(-LE demo)
[ "${DEMO_MATRIX:-0}" = 1 ] && demo=()
(cd "$BUILD_DIR" && ctest --output-on-failure --timeout 600 -j "$CORES" "${demo[@]}" "$@")
# The node tests again on another of PyTorch's CPU paths (ATEN_CPU_CAPABILITY; oneDNN held to the
# same ISA): its kernels round otherwise (vector widths, orders of summation), and a bound that
# holds on one path only fails on the next CPU (issue 68). default: the scalar kernels, the path
# furthest from AVX-512's. All but the suites that train whole graphs to a quality bar (Graph*,
# ActivationCheckpoint: two thirds of the time, and no comparison of kernels' rounding).
# CPU_PATHS="" skips it; CPU_PATHS="avx2 default" runs both.
for cap in ${CPU_PATHS-default}; do
  case $cap in default) isa=SSE41 ;; avx2) isa=AVX2 ;; *) isa=ALL ;; esac
  echo "== the node tests under ATEN_CPU_CAPABILITY=$cap"
  (cd "$BUILD_DIR" && ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa ctest --output-on-failure --timeout 600 -j "$CORES" \
     -L nodes -E '^(Graph.*|ActivationCheckpoint)$' "$@")
done
[ "${SANITIZE:-1}" = 0 ] && exit 0

# The same Python as build/'s (its tiktoken is the GPT-2 tokenizer test's reference).
py=$(sed -n 's/^FLOWRUN_PYTHON:FILEPATH=//p' "$BUILD_DIR/CMakeCache.txt")
gen=()
[ -f "$SAN_BUILD_DIR/CMakeCache.txt" ] || ! command -v ninja > /dev/null || gen=(-G Ninja)
[ -f "$SAN_BUILD_DIR/CMakeCache.txt" ] ||
  CC=clang CXX=clang++ cmake -S . -B "$SAN_BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFLOWRUN_TORCH=OFF -DFLOWRUN_SANITIZE=address,undefined -DFLOWRUN_FUZZ=ON ${py:+-DFLOWRUN_PYTHON="$py"}
cmake --build "$SAN_BUILD_DIR" -j "$CORES"
cd "$SAN_BUILD_DIR"
# Any sanitizer report fails the test that triggered it (-fno-sanitize-recover, abort_on_error).
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} \
  ctest --output-on-failure --timeout 600 -j "$CORES" "$@"
