#!/usr/bin/env bash
# The Debian packages a GPU machine without apt access needs to build flowrun against its pip
# PyTorch (tests/gpu/run.sh): fetched here, where Debian's registry is reachable, carried
# over, unpacked there into a prefix with `dpkg -x` (no root, no apt).
#
#   scripts/gpu_debs.sh                   # download into third_party/debs/ (git-ignored)
#   scripts/gpu_debs.sh unpack PREFIX     # on the GPU machine: unpack them into PREFIX and
#                                         # print the CMAKE_PREFIX_PATH / LD_LIBRARY_PATH to use
#
# libtorch, CUDA and NCCL come from the PyTorch install; MPI and SentencePiece are optional in
# the build and left out; cmake is included for machines that have none.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=third_party/debs
packages=(
  libyaml-cpp-dev libyaml-cpp0.7
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  nlohmann-json3-dev libgtest-dev libgmock-dev
  libpng-dev libpng16-16 libjpeg62-turbo-dev libjpeg62-turbo libjpeg-dev
  libicu-dev libicu72 zlib1g-dev
  cmake cmake-data libjsoncpp25 librhash0 libuv1
)

if [ "${1:-}" = unpack ]; then
  prefix=${2:?usage: scripts/gpu_debs.sh unpack PREFIX}
  ls "$dir"/*.deb >/dev/null 2>&1 || { echo "gpu_debs: no .deb files in $dir: run scripts/gpu_debs.sh where apt works, and carry $dir over" >&2; exit 1; }
  mkdir -p "$prefix"
  for d in "$dir"/*.deb; do dpkg -x "$d" "$prefix"; done
  # Debian's CMake package files name absolute /usr paths; point them into the prefix.
  grep -rl --include='*.cmake' '"/usr/' "$prefix/usr/lib" 2>/dev/null | while read -r f; do
    sed -i "s#\"/usr/#\"$prefix/usr/#g" "$f"
  done
  lib=$prefix/usr/lib/x86_64-linux-gnu
  # Unversioned .so links that point at /usr/lib/... absolute paths: make them relative.
  find "$lib" -maxdepth 1 -type l | while read -r l; do
    t=$(readlink "$l")
    case $t in /*) ln -sf "$(basename "$t")" "$l" ;; esac
  done
  echo "CMAKE_PREFIX_PATH=$prefix/usr;$lib/cmake"
  echo "LD_LIBRARY_PATH=$lib"
  exit 0
fi

mkdir -p "$dir"
cd "$dir"
rm -f ./*.deb
apt-get download "${packages[@]}"
echo "gpu_debs: $(ls ./*.deb | wc -l) packages, $(du -sh . | cut -f1) in $dir (carry it to the GPU machine)"
