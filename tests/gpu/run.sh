#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one script, run from the repository root on a machine
# with a GPU, a pip PyTorch built with CUDA (its libtorch and NCCL), a C++ compiler and the CUDA
# toolkit (nvcc):
#   1. build: the README's first command, scripts/setup.sh --no-demo, which builds the CUDA build
#      where it sees a GPU (here into build-gpu/, against PYTHON's PyTorch; a machine without apt
#      unpacks third_party/debs/, made by scripts/gpu_debs.sh elsewhere and carried over), and
#      then the GPU tests and the torch-free engine tests;
#   2. test: ctest -L gpu (tests/gpu/gpu_test.cpp), then the engine tests (stream ordering,
#      executor) in the CUDA build;
#   3. bench, in parts (BENCH_PARTS, default all, in this order): gpt2, gpt2_16 (bench/gpu_gpt2.py:
#      GPT-2 124M at batch 8 / 16, flowrun, flowrun with run.cuda_graph, a PyTorch eager loop and that loop under torch.compile
#      in 5 alternating rounds); kernels (bench/gpu_kernels.py: per-kernel GPU time of each, by
#      family); memory (activation checkpointing's peak memory at GPT-2 350M size); dit
#      (bench/gpu_dit.py: a DiT-XL/2-size DiT against bench/torch_dit.py, its encoders' stream
#      against inline, 3 rounds); hydit (bench/gpu_hydit.py: graphs/hydit_v12_lora.yaml at
#      HunyuanDiT-v1.2 size, 1024 px, against diffusers + peft, 3 rounds); the tables are printed
#      last. The whole bench stage takes longer than one 10-minute call: split it by BENCH_PARTS.
# Usage: tests/gpu/run.sh [all|build|test|bench]   (default all; the stages can be run one per
#        call when a call has a time limit: build-gpu/ is kept between them)
# Carry data/text/ and data/gpt2/ (scripts/data.sh) from the CPU machine where this one reaches no
# registry; data/shapes is rendered here.
# Environment: PYTHON (default python3), BUILD (build-gpu), RESULTS (BUILD/gpu-results: logs,
# ctest output, bench.md), BENCH_PARTS (the bench parts to run, above), BENCH_ARGS (extra
# bench/gpu_gpt2.py args for gpt2 and gpt2_16), HYDIT_ROUNDS (default 3), DIFFUSERS (diffusers'
# source for bench/gpu_hydit.py: a folder holding diffusers/, or a .tar.xz of it, where pip's
# diffusers is not installed).
# Exit status: non-zero if a prerequisite, the build, a test or the benchmark failed; the
# benchmark runs even when tests failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=${1:-all}
case $stage in all | build | test | bench) ;; *) echo "usage: tests/gpu/run.sh [all|build|test|bench]" >&2; exit 2 ;; esac
BUILD=${BUILD:-build-gpu}
PREFIX=${PREFIX:-$BUILD/prefix}
case $PREFIX in /*) ;; *) PREFIX=$PWD/$PREFIX ;; esac  # CMake and LD_LIBRARY_PATH need it absolute
RESULTS=${RESULTS:-$BUILD/gpu-results}
PY=${PYTHON:-python3}
say() { echo "== $*"; }
die() { echo "tests/gpu/run.sh: $*" >&2; exit 1; }
want() { [ "$stage" = all ] || [ "$stage" = "$1" ]; }

# ---- what this machine has ----------------------------------------------------------------
command -v nvidia-smi > /dev/null || die "no nvidia-smi: this script needs a machine with an NVIDIA GPU and its driver"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) || die "nvidia-smi fails: no usable GPU or driver"
say "GPU: $gpu"
command -v "$PY" > /dev/null || die "no $PY (set PYTHON to the Python that has PyTorch)"
$PY -c 'import torch' 2> /dev/null || die "$PY cannot import torch: install a CUDA build of PyTorch (pip install torch), or set PYTHON"
torch_cuda=$($PY -c 'import torch; print(torch.version.cuda or "")')
[ -n "$torch_cuda" ] || die "$PY has a CPU-only PyTorch ($($PY -c 'import torch; print(torch.__version__)')): a CUDA build is needed"
$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  die "PyTorch (CUDA $torch_cuda) sees no GPU: torch.cuda.is_available() is False (driver too old for CUDA $torch_cuda?)"
torch_prefix=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
torch_version=$($PY -c 'import torch; print(torch.__version__)')
say "PyTorch $torch_version (CUDA $torch_cuda) at $torch_prefix"
lib=$PREFIX/usr/lib/x86_64-linux-gnu
# The unpacked libraries, for everything from here on: the build runs the test binaries to list
# their tests (gtest_discover_tests), and libicuuc's libicudata is found by no RUNPATH.
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# pkg-config finds the unpacked SentencePiece (the mT5 tokenizer); the machine's pkg-config, else
# the unpacked pkgconf.
export PKG_CONFIG_PATH="$lib/pkgconfig:$PREFIX/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
mkdir -p "$RESULTS"

# cmake >= 3.25: the machine's, else the one unpacked from third_party/debs/cmake (run with its
# own libraries on LD_LIBRARY_PATH, only for cmake and ctest).
cmake_ok() {
  "$@" --version 2> /dev/null |
    awk 'BEGIN {r = 1} /cmake version/ {split($3, v, "."); r = !(v[1] > 3 || (v[1] == 3 && v[2] >= 25))} END {exit r}'
}
pick_cmake() {
  if cmake_ok cmake; then CMAKE=(cmake) CTEST=(ctest); return; fi
  local own=$PREFIX/cmake/usr
  local env=(env "LD_LIBRARY_PATH=$own/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH")
  CMAKE=("${env[@]}" "$own/bin/cmake") CTEST=("${env[@]}" "$own/bin/ctest")
  cmake_ok "${CMAKE[@]}" || die "no cmake >= 3.25 on this machine, and none runs from $own (third_party/debs/cmake)"
}

# nvcc: on PATH, under CUDA_HOME / /usr/local/cuda*, or from pip's nvidia packages.
find_nvcc() {
  command -v nvcc && return
  local d
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-*; do
    [ -n "$d" ] && [ -x "$d/bin/nvcc" ] && { echo "$d/bin/nvcc"; return; }
  done
  d=$($PY -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2> /dev/null) &&
    find "$d" -path '*/bin/nvcc' -type f 2> /dev/null | head -1 | grep .
}

# ---- 1. build -------------------------------------------------------------------------------
if want build; then
  nvcc=$(find_nvcc) || die "no nvcc (CUDA toolkit $torch_cuda): the CUDA build needs it; install the CUDA toolkit $torch_cuda or set CUDA_HOME"
  nvcc_version=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  say "nvcc $nvcc_version at $nvcc"
  [ "${nvcc_version%%.*}" = "${torch_cuda%%.*}" ] || echo "warning: nvcc is CUDA $nvcc_version, PyTorch was built with CUDA $torch_cuda"
  PATH="$(dirname "$nvcc"):$PATH"
  # A cmake >= 3.25 first on PATH for setup.sh: the machine's, else third_party/debs/cmake's.
  if ! cmake_ok cmake; then
    # (unpack.env: the search paths it prints, which scripts/setup.sh reads)
    [ -f "$PREFIX/.unpacked" ] ||
      { mkdir -p "$PREFIX" && scripts/gpu_debs.sh unpack "$PREFIX" > "$PREFIX/unpack.env" && touch "$PREFIX/.unpacked"; }
    pick_cmake
    mkdir -p "$BUILD/bin"
    for t in cmake ctest; do
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PREFIX/cmake/usr/lib/x86_64-linux-gnu:\$LD_LIBRARY_PATH" "$PREFIX/cmake/usr/bin/$t" > "$BUILD/bin/$t"
      chmod +x "$BUILD/bin/$t"
    done
    PATH="$PWD/$BUILD/bin:$PATH"
  fi
  say "scripts/setup.sh --no-demo (the CUDA build in $BUILD; log: $RESULTS/setup.log)"
  PYTHON=$(command -v "$PY") BUILD_DIR=$BUILD FLOWRUN_CUDA=1 CMAKE_ARGS="-DFLOWRUN_BENCH=OFF" scripts/setup.sh --no-demo \
    > "$RESULTS/setup.log" 2>&1 || { tail -40 "$RESULTS/setup.log"; die "scripts/setup.sh failed ($RESULTS/setup.log)"; }
  pick_cmake
  # The GPU tests and the torch-free engine tests (with their plugins); not the node tests,
  # benchmarks or tools.
  say "building gpu_tests engine_tests ($(nproc) jobs; log: $RESULTS/build.log)"
  "${CMAKE[@]}" --build "$BUILD" -j "$(nproc)" --target gpu_tests engine_tests > "$RESULTS/build.log" 2>&1 ||
    { grep -E -A3 "error|Error" "$RESULTS/build.log" | head -60; die "build failed ($RESULTS/build.log)"; }
  say "built $BUILD/engine/flowrun"
fi

[ -x "$BUILD/engine/flowrun" ] || die "$BUILD/engine/flowrun missing: run tests/gpu/run.sh build first"
[ -n "${CMAKE+x}" ] || pick_cmake

# Data: the token shards come from scripts/data.sh on the CPU machine; the shapes set of the
# DiT benchmark is rendered here, as data.sh does.
for f in data/text/fortunes_byte.train.bin data/text/fortunes_gpt2.train.bin; do
  [ -f "$f" ] || echo "warning: $f missing: the GPT tests and benchmark need data/text/ (scripts/data.sh on the CPU machine, carried here)"
done
if ! ls data/shapes/base.train-*.tar > /dev/null 2>&1 || [ ! -f data/shapes/vocab.txt ]; then
  say "rendering data/shapes/base (flowrun prep shapes + prep images, as scripts/data.sh)"
  rm -rf data/shapes/base-png data/shapes/base.*.tar && mkdir -p data/shapes
  "$BUILD/engine/flowrun" prep shapes data/shapes/base-png --set base --count 3000 --size 32 --seed 1 > /dev/null
  "$BUILD/engine/flowrun" prep images data/shapes/base-png data/shapes/base --val-fraction 0.05 --seed 1 > /dev/null
  cp data/shapes/base-png/vocab.txt data/shapes/vocab.txt
fi

# ---- 2. tests -------------------------------------------------------------------------------
status=0 ctest_gpu=- ctest_engine=-
if want test; then
  say "ctest -L gpu"
  set +e
  "${CTEST[@]}" --test-dir "$BUILD" -L gpu --no-tests=error --output-on-failure > "$RESULTS/ctest-gpu.log" 2>&1
  ctest_gpu=$?
  tail -25 "$RESULTS/ctest-gpu.log"
  say "ctest -L engine (stream ordering, executor) in the CUDA build"
  # The dot rendering test needs Graphviz, which a GPU machine may lack (it is no GPU matter).
  skip=()
  command -v dot > /dev/null || { skip=(-E '^Dot\.StylesAndRendering$'); echo "no Graphviz (dot): Dot.StylesAndRendering left out"; }
  "${CTEST[@]}" --test-dir "$BUILD" -L engine "${skip[@]}" --no-tests=error --output-on-failure > "$RESULTS/ctest-engine.log" 2>&1
  ctest_engine=$?
  set -e
  grep -E "tests passed|tests failed" "$RESULTS/ctest-engine.log" || tail -5 "$RESULTS/ctest-engine.log"
  [ $ctest_gpu = 0 ] && [ $ctest_engine = 0 ] || status=1
fi

# ---- 3. benchmarks, table last --------------------------------------------------------------
# BENCH_PARTS picks and orders them (default: all, in this order); each part's table is appended
# to $RESULTS/bench.md as it finishes, so a call cut short keeps the parts done.
bench=-
part() { [[ " ${BENCH_PARTS:-gpt2 gpt2_16 kernels memory dit hydit} " == *" $1 "* ]]; }
note_status() { [ "$bench" = - ] || [ "$bench" = 0 ] && bench=$1; return 0; }
if want bench; then
  rm -f "$RESULTS/bench.md"
  set +e
  for p in ${BENCH_PARTS:-gpt2 gpt2_16 kernels memory dit hydit}; do
    case $p in
      gpt2 | gpt2_16)
        # GPT-2 124M at batch 8 / 16: flowrun, flowrun with run.cuda_graph, eager, torch.compile alternating, 5 rounds.
        b=8; [ $p = gpt2_16 ] && b=16
        say "bench/gpu_gpt2.py --batch $b --compile (log: $RESULTS/bench_$p.log)"
        # shellcheck disable=SC2086  # BENCH_ARGS: extra words on purpose
        $PY bench/gpu_gpt2.py --flowrun "$BUILD/engine/flowrun" --batch $b --compile --cuda-graph --out "$RESULTS/bench_$p.md" ${BENCH_ARGS:-} \
          2>&1 | tee "$RESULTS/bench_$p.log" | grep -E "^(round|flowrun failed|flowrun: no run|torch.compile failed|gpu_gpt2.py:)"
        note_status "${PIPESTATUS[0]}"
        [ -f "$RESULTS/bench_$p.md" ] && sed -n '/^## GPT-2/,$p' "$RESULTS/bench_$p.md" >> "$RESULTS/bench.md" ;;
      memory)
        # Activation checkpointing's peak memory at GPT-2 350M size (issue 32).
        say "bench/gpu_gpt2.py --only memory (log: $RESULTS/bench_memory.log)"
        $PY bench/gpu_gpt2.py --flowrun "$BUILD/engine/flowrun" --only memory --out "$RESULTS/bench_memory.md" \
          2>&1 | tee "$RESULTS/bench_memory.log" | grep -E "^(memory:|flowrun failed|gpu_gpt2.py:)"
        note_status "${PIPESTATUS[0]}"
        [ -f "$RESULTS/bench_memory.md" ] && sed -n '/^## /,$p' "$RESULTS/bench_memory.md" >> "$RESULTS/bench.md" ;;
      kernels)
        # Per-kernel GPU time of a 3-step run of flowrun, eager and compile, summed by family
        # (bench/ncu_compare.py): bench/README.md's kernel table.
        if command -v ncu > /dev/null; then
          say "ncu: bench/gpu_kernels.py (log: $RESULTS/ncu.log)"
          $PY bench/gpu_kernels.py --flowrun "$BUILD/engine/flowrun" --out "$RESULTS" > "$RESULTS/ncu.log" 2>&1
          note_status $?
          { echo; echo "## GPU time per step by kernel family (ncu, 3 steps each side, start-up included)"; echo
            sed -n '/^| family/,/^| total/p' "$RESULTS/ncu.log"; } >> "$RESULTS/bench.md"
        else
          echo "no ncu: the kernel table left out"
        fi ;;
      dit)
        # A DiT-XL/2-size DiT against bench/torch_dit.py, and its encoders' stream against inline, on
        # 256 px shapes rendered here (1200 images).
        if ! ls data/shapes/xl.train-*.tar > /dev/null 2>&1; then
          say "rendering data/shapes/xl (256 px) for bench/gpu_dit.py"
          "$BUILD/engine/flowrun" prep shapes data/shapes/xl-png --set base --count 1200 --size 256 --seed 1 > /dev/null
          "$BUILD/engine/flowrun" prep images data/shapes/xl-png data/shapes/xl --val-fraction 0.05 --seed 1 > /dev/null
        fi
        say "bench/gpu_dit.py (log: $RESULTS/bench_dit.log)"
        $PY bench/gpu_dit.py --flowrun "$BUILD/engine/flowrun" --rounds 3 --out "$RESULTS/bench_dit.md" 2>&1 |
          tee "$RESULTS/bench_dit.log" | grep -E "^(round|flowrun failed|gpu_dit.py:)"
        note_status "${PIPESTATUS[0]}"
        [ -f "$RESULTS/bench_dit.md" ] && { echo; cat "$RESULTS/bench_dit.md"; } >> "$RESULTS/bench.md" ;;
      hydit)
        # HunyuanDiT-v1.2 size at 1024 px (issue 33): graphs/hydit_v12_lora.yaml against diffusers +
        # peft, with a random-weight pipeline folder and 1024 px shapes made here (~90 s a round on an
        # H200). diffusers: installed, or its source by DIFFUSERS (a folder holding diffusers/, or a
        # .tar.xz of one).
        if [ -n "${DIFFUSERS:-}" ] || $PY -c 'import diffusers' 2> /dev/null; then
          say "bench/gpu_hydit.py (log: $RESULTS/bench_hydit.log)"
          $PY bench/gpu_hydit.py --flowrun "$BUILD/engine/flowrun" ${DIFFUSERS:+--diffusers "$DIFFUSERS"} \
            --rounds "${HYDIT_ROUNDS:-3}" --inline --out "$RESULTS/bench_hydit.md" 2>&1 | tee "$RESULTS/bench_hydit.log" |
            grep -E "^(== round|flowrun failed|gpu_hydit.py:)"
          note_status "${PIPESTATUS[0]}"
          [ -f "$RESULTS/bench_hydit.md" ] && { echo; cat "$RESULTS/bench_hydit.md"; } >> "$RESULTS/bench.md"
        else
          echo "no diffusers (pip install diffusers, or DIFFUSERS=its source): bench/gpu_hydit.py left out"
        fi ;;
      *) echo "BENCH_PARTS: unknown part '$p' (gpt2 gpt2_16 kernels memory dit hydit)"; bench=2 ;;
    esac
  done
  set -e
  [ "$bench" = 0 ] || status=1
fi

echo
echo "GPU: $gpu; PyTorch $torch_version (CUDA $torch_cuda); ctest -L gpu exit $ctest_gpu, -L engine exit $ctest_engine;" \
  "bench exit $bench; results in $RESULTS/"
if want bench && [ -f "$RESULTS/bench.md" ]; then cat "$RESULTS/bench.md"; fi
exit $status
