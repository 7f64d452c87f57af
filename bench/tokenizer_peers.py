#!/usr/bin/env python3
"""flowrun's tokenizer.json reader against Hugging Face `tokenizers` (Rust) on the same corpus and
threads, in one run (issue 71).

The corpus is what scripts/data.sh tokenizes: the 43 plain-text files of the Debian `fortunes`
package, one document per fortune (lines "%" between them), about 5 MB. flowrun's side is
`flowrun prep text --tokenizer data/tokenizers/NAME --split-on % --val-fraction 0`, which prints
the seconds spent in the tokenizer's encode calls (reading, writing and loading the tokenizer
excluded); the peer is `tokenizers.Tokenizer.from_file(...).encode_batch(documents)` in a fresh
process (so both start with a cold word cache), RAYON_NUM_THREADS set to the same thread count,
timing encode_batch alone (reading and loading excluded). Both must give the same number of
tokens. Rounds alternate which side goes first; the ratio (tokenizers' seconds over flowrun's,
above 1: flowrun is faster) is the median of the rounds', with min-max.

  .venv/bin/pip install --target .cache/hf-transformers transformers==5.17.0   (brings tokenizers)
  PYTHONPATH=.cache/hf-transformers .venv/bin/python bench/tokenizer_peers.py [--rounds 5] [--threads 1]
"""
import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEER = r'''
import os, sys, time
import tokenizers
path, files = sys.argv[1], sys.argv[2:]
docs = []
for f in files:
    with open(f, "rb") as fh:
        text = fh.read().decode("utf-8", "replace")
    doc = []  # as prep text: the lines between "%" lines, each with its newline
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.rstrip("\r") == "%":
            if "".join(doc).strip(" \t\n\r\v\f"):
                docs.append("".join(doc))
            doc = []
        else:
            doc.append(line + ("\n" if i + 1 < len(lines) else ""))
    if "".join(doc).strip(" \t\n\r\v\f"):
        docs.append("".join(doc))
tok = tokenizers.Tokenizer.from_file(path)
t0 = time.perf_counter()
enc = tok.encode_batch(docs, add_special_tokens=True)
seconds = time.perf_counter() - t0
print("seconds %.6f tokens %d documents %d" % (seconds, sum(len(e.ids) for e in enc), len(docs)))
'''


def fortune_files():
    return sorted(f for f in glob.glob("/usr/share/games/fortunes/*")
                  if os.path.isfile(f) and not os.path.islink(f) and not f.endswith((".dat", ".u8")))


def run_flowrun(binary, name, files, threads, out):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run([binary, "prep", "text", "--tokenizer", os.path.join(ROOT, "data/tokenizers", name),
                        "--split-on", "%", "--val-fraction", "0", "--out", out] + files,
                       capture_output=True, text=True, env=env, check=True)
    seconds = float(re.search(r"encoding ([0-9.]+) s", r.stdout).group(1))
    tokens = int(re.search(r"train\.\{bin,idx\}: \d+ documents, (\d+) tokens", r.stdout).group(1))
    return seconds, tokens


def run_peer(name, files, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    r = subprocess.run([sys.executable, "-c", PEER, os.path.join(ROOT, "data/tokenizers", name, "tokenizer.json")] + files,
                       capture_output=True, text=True, env=env, check=True)
    m = re.search(r"seconds ([0-9.]+) tokens (\d+) documents (\d+)", r.stdout)
    return float(m.group(1)), int(m.group(2)), int(m.group(3))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokenizers", default="llama3.2,qwen3")
    ap.add_argument("--flowrun", default=os.path.join(ROOT, "build/engine/flowrun"))
    a = ap.parse_args()
    import tokenizers
    files = fortune_files()
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    print("corpus: %d fortune files, %.1f MB; %d thread(s); tokenizers %s" % (len(files), mb, a.threads, tokenizers.__version__))
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.tokenizers.split(","):
            ratios, ours, theirs = [], [], []
            for r in range(a.rounds):
                sides = ["flowrun", "peer"] if r % 2 == 0 else ["peer", "flowrun"]
                got = {}
                for side in sides:
                    if side == "flowrun":
                        got[side] = run_flowrun(a.flowrun, name, files, a.threads, os.path.join(tmp, "shards"))
                    else:
                        got[side] = run_peer(name, files, a.threads)
                # flowrun's documents end in the end-of-text token; tokenizers' post-processor adds none
                (fs, ftok), (ps, ptok, pdocs) = got["flowrun"], got["peer"]
                if ftok != ptok + pdocs:
                    sys.exit("%s: flowrun wrote %d tokens, tokenizers gave %d + %d end-of-text: not the same corpus"
                             % (name, ftok, ptok, pdocs))
                ours.append(fs)
                theirs.append(ps)
                ratios.append(ps / fs)
            print("%-9s flowrun %.3f s (%.1f MB/s), tokenizers %.3f s (%.1f MB/s): %.2fx (%.2f-%.2f), %d rounds, %d tokens"
                  % (name, statistics.median(ours), mb / statistics.median(ours), statistics.median(theirs),
                     mb / statistics.median(theirs), statistics.median(ratios), min(ratios), max(ratios), a.rounds, ftok))


if __name__ == "__main__":
    main()
