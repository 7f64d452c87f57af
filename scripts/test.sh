#!/usr/bin/env bash
# Build (if needed) and run the whole test suite with CTest. Extra arguments go to ctest
# (e.g. -L engine, -R cli, --output-on-failure is already on).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
[ -f "$BUILD_DIR/CMakeCache.txt" ] || cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j "$(nproc)"
cd "$BUILD_DIR"
ctest --output-on-failure --timeout 600 "$@"
