#!/usr/bin/env bash
# The Debian 12 packages a GPU machine without apt needs to build flowrun against its pip
# PyTorch (tests/gpu/run.sh): fetched here, where Debian's registry is reachable, carried
# over, unpacked there into a prefix with `dpkg -x` (no root, no apt).
#
#   scripts/gpu_debs.sh                  # download into third_party/debs/ (git-ignored), ~40 MB
#   scripts/gpu_debs.sh unpack PREFIX    # on the GPU machine: unpack them into PREFIX and print
#                                        # the CMAKE_PREFIX_PATH and LD_LIBRARY_PATH to use
#
# third_party/debs/       the build's libraries: yaml-cpp, oneTBB, spdlog + fmt, nlohmann-json,
#                         GoogleTest, libpng, libjpeg, ICU, zlib (headers, CMake files, .so);
#                         SentencePiece (the mT5 tokenizer of the HunyuanDiT graphs, and spm_train
#                         for bench/gpu_hydit.py's tokenizer) with pkgconf, which finds it
# third_party/debs/cmake/ CMake 3.25 and the libraries it runs on, for a machine without a
#                         cmake >= 3.25; unpacked into PREFIX/cmake, never on LD_LIBRARY_PATH
#                         of anything but cmake itself (see tests/gpu/run.sh)
# libtorch, CUDA and NCCL come from the PyTorch install (and the CUDA toolkit); MPI is optional
# in the build and left out.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=third_party/debs
libs=(
  libyaml-cpp-dev libyaml-cpp0.7
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  nlohmann-json3-dev libgtest-dev libgmock-dev
  libpng-dev libpng16-16 libjpeg62-turbo-dev libjpeg62-turbo libjpeg-dev
  libicu-dev libicu72 zlib1g-dev
  libsentencepiece-dev libsentencepiece0 sentencepiece pkgconf pkgconf-bin libpkgconf3
)
# cmake's dependencies beyond a base Debian system (libc, libstdc++, zlib, zstd, lzma, bz2,
# acl, gnutls, nettle, gmp, ssl are assumed there).
cmake_debs=(
  cmake cmake-data libjsoncpp25 librhash0 libuv1 libarchive13 libxml2 libexpat1
  libcurl4 libnghttp2-14 libpsl5 librtmp1 libssh2-1 libldap-2.5-0 libsasl2-2 libsasl2-modules-db
  libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2
)

unpack() {  # unpack DEB_DIR PREFIX: dpkg -x each .deb, then make the result relocatable
  local from=$1 prefix=$2 lib=$2/usr/lib/x86_64-linux-gnu d f l t so
  for d in "$from"/*.deb; do dpkg -x "$d" "$prefix"; done
  # Debian's CMake package files name their absolute /usr install dir; point them into PREFIX.
  { grep -rl --include='*.cmake' '"/usr/' "$prefix/usr/lib" "$prefix/usr/share/cmake" 2>/dev/null || true; } |
    while read -r f; do sed -i "s#\"/usr/#\"$prefix/usr/#g" "$f"; done
  # pkg-config files too (sentencepiece.pc: prefix=/usr).
  { grep -rl --include='*.pc' '^prefix=/usr' "$prefix/usr/lib" "$prefix/usr/share" 2>/dev/null || true; } |
    while read -r f; do sed -i "s#^prefix=/usr#prefix=$prefix/usr#" "$f"; done
  [ -d "$lib" ] || return 0
  # .so links to absolute /usr/lib or /lib paths: into PREFIX when the target was unpacked
  # there, else to the system's copy of that library (libz.so -> the system libz.so.1).
  find "$lib" -maxdepth 1 -type l | while read -r l; do
    t=$(readlink "$l")
    case $t in /*) ln -sf "$(basename "$t")" "$l" ;; esac
    if [ ! -e "$l" ]; then
      so=$(basename "$l"); so=${so%%.so*}.so
      t=$(/sbin/ldconfig -p 2>/dev/null | awk -v s="$so." 'index($1, s) == 1 && !f {f = $NF} END {print f}')
      if [ -n "$t" ]; then ln -sf "$t" "$l"; else echo "gpu_debs: warning: $l has no target on this machine" >&2; fi
    fi
  done
}

if [ "${1:-}" = unpack ]; then
  prefix=${2:?usage: scripts/gpu_debs.sh unpack PREFIX}
  mkdir -p "$prefix" && prefix=$(cd "$prefix" && pwd)
  ls "$dir"/*.deb > /dev/null 2>&1 ||
    { echo "gpu_debs: no .deb files in $dir: run scripts/gpu_debs.sh on a machine with apt and carry $dir over" >&2; exit 1; }
  unpack "$dir" "$prefix"
  ls "$dir"/cmake/*.deb > /dev/null 2>&1 && unpack "$dir/cmake" "$prefix/cmake"
  lib=$prefix/usr/lib/x86_64-linux-gnu
  echo "CMAKE_PREFIX_PATH=$prefix/usr;$lib/cmake;$prefix/usr/share/cmake"
  echo "LD_LIBRARY_PATH=$lib"
  echo "PKG_CONFIG_PATH=$lib/pkgconfig:$prefix/usr/share/pkgconfig"
  [ -x "$prefix/cmake/usr/bin/cmake" ] &&
    echo "CMAKE=env LD_LIBRARY_PATH=$prefix/cmake/usr/lib/x86_64-linux-gnu:$lib $prefix/cmake/usr/bin/cmake"
  exit 0
fi
[ $# = 0 ] || { echo "usage: scripts/gpu_debs.sh [unpack PREFIX]" >&2; exit 2; }

command -v apt-get > /dev/null || { echo "gpu_debs: apt-get not found: run this on a Debian 12 machine" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir/cmake"
# apt-get download as root warns that its sandbox user cannot write here: run it as root.
opts=(-q -o APT::Sandbox::User=root)
(cd "$dir" && apt-get download "${opts[@]}" "${libs[@]}") ||
  { echo "gpu_debs: apt-get download failed (an old package index? try: apt-get update)" >&2; exit 1; }
(cd "$dir/cmake" && apt-get download "${opts[@]}" "${cmake_debs[@]}")
echo "gpu_debs: $(find "$dir" -maxdepth 1 -name "*.deb" | wc -l) + $(find "$dir/cmake" -name "*.deb" | wc -l) (cmake) packages," \
  "$(du -sh "$dir" | cut -f1) in $dir: carry it to the GPU machine"
