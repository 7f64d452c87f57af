#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one script, run from the repository root on a machine
# with a GPU and a pip PyTorch built with CUDA (its libtorch, CUDA runtime and NCCL):
#   1. unpacks the Debian packages the build needs (yaml-cpp, oneTBB, spdlog, fmt, ...) into a
#      prefix: third_party/debs/, made by scripts/gpu_debs.sh on a machine with apt, and
#      carried over (the GPU machine may reach no package registry);
#   2. configures build-gpu/ with FLOWRUN_CUDA=ON against that PyTorch, builds;
#   3. runs the GPU tests: ctest -L gpu (tests/gpu/gpu_test.cpp) and the stream-ordering and
#      CUDA-path tests of the CPU suite that also apply there (engine tests);
#   4. runs the GPU benchmarks (bench/gpu_gpt2.py: GPT-2 124M flowrun vs a PyTorch eager loop,
#      torch.compile beside it; the DiT encoder-stream comparison) and prints their table last.
# Results go to build-gpu/gpu-results/. Needs the token shards and shapes sets of
# scripts/data.sh in data/ (make them on the CPU machine and carry data/ over with the debs).
# Exit status: non-zero if the build or any test failed (the benchmarks still run).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
PREFIX=${PREFIX:-$PWD/$BUILD/prefix}
RESULTS=$BUILD/gpu-results
PY=${PYTHON:-python3}
mkdir -p "$RESULTS"

say() { echo "== $*"; }
die() { echo "tests/gpu/run.sh: $*" >&2; exit 1; }

command -v nvidia-smi >/dev/null || die "no nvidia-smi: this script needs a machine with an NVIDIA GPU"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
say "GPU: $gpu"
$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  die "$PY has no CUDA PyTorch (import torch; torch.cuda.is_available() is False)"
torch_prefix=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
torch_version=$($PY -c 'import torch; print(torch.__version__)')
say "PyTorch $torch_version at $torch_prefix"
# NCCL: pip's nvidia-nccl package, if PyTorch brought one (else the CUDA toolkit's).
nccl_root=$($PY -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)

# 1. The Debian packages, unpacked once.
if [ ! -f "$PREFIX/.unpacked" ]; then
  say "unpacking third_party/debs into $PREFIX"
  scripts/gpu_debs.sh unpack "$PREFIX" > "$RESULTS/prefix.env"
  touch "$PREFIX/.unpacked"
fi
lib=$PREFIX/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH="$lib${nccl_root:+:$nccl_root/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:$PREFIX/usr/bin"  # cmake, if the machine has none
command -v cmake >/dev/null || die "no cmake (neither installed nor in third_party/debs)"

# 2. Configure and build.
say "configuring $BUILD (FLOWRUN_CUDA=ON)"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLOWRUN_CUDA=ON -DFLOWRUN_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$PREFIX/usr;$lib/cmake" \
  ${nccl_root:+-DFLOWRUN_NCCL_ROOT="$nccl_root"} > "$RESULTS/cmake.log" 2>&1 ||
  { tail -40 "$RESULTS/cmake.log"; die "cmake failed ($RESULTS/cmake.log)"; }
say "building ($(nproc) jobs)"
cmake --build "$BUILD" -j "$(nproc)" > "$RESULTS/build.log" 2>&1 ||
  { grep -E "error|Error" "$RESULTS/build.log" | head -40; die "build failed ($RESULTS/build.log)"; }

# Data: the token shards come from scripts/data.sh on the CPU machine (it needs Debian's
# fortunes and npm); the shapes set of the DiT benchmark is rendered here, as data.sh does.
for f in data/text/fortunes_byte.train.bin data/text/fortunes_gpt2.train.bin; do
  [ -f "$f" ] || echo "warning: $f missing: the GPT tests and benchmark need data/text from scripts/data.sh"
done
if ! ls data/shapes/base.train-*.tar > /dev/null 2>&1 || [ ! -f data/shapes/vocab.txt ]; then
  say "rendering data/shapes/base (flowrun prep shapes + prep images, as scripts/data.sh)"
  rm -rf data/shapes/base-png && mkdir -p data/shapes
  "$BUILD/engine/flowrun" prep shapes data/shapes/base-png --set base --count 3000 --size 32 --seed 1 > /dev/null
  "$BUILD/engine/flowrun" prep images data/shapes/base-png data/shapes/base --val-fraction 0.05 --seed 1 > /dev/null
  cp data/shapes/base-png/vocab.txt data/shapes/vocab.txt
fi

# 3. Tests.
status=0
say "ctest -L gpu"
ctest --test-dir "$BUILD" -L gpu --output-on-failure 2>&1 | tee "$RESULTS/ctest-gpu.log" || status=1
say "engine tests (stream ordering, executor) in the CUDA build"
ctest --test-dir "$BUILD" -L engine 2>&1 | tail -3 | tee "$RESULTS/ctest-engine.log" || status=1

# 4. Benchmarks, table last.
say "benchmarks (bench/gpu_gpt2.py)"
bench_status=0
$PY bench/gpu_gpt2.py --flowrun "$BUILD/engine/flowrun" --compile --dit --out "$RESULTS/bench.md" \
  > "$RESULTS/bench.log" 2>&1 || bench_status=$?
[ $bench_status = 0 ] || { tail -30 "$RESULTS/bench.log"; echo "benchmark failed (exit $bench_status)"; status=1; }
echo
echo "GPU: $gpu; PyTorch $torch_version; tests: $([ $status = 0 ] && echo passed || echo FAILED) ($RESULTS/)"
[ -f "$RESULTS/bench.md" ] && cat "$RESULTS/bench.md"
exit $status
