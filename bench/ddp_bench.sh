#!/usr/bin/env bash
# Data-parallel benchmark: the same GPT config and global batch, run as
#   one   : 1 process, batch 2B, 2 intra-op threads
#   ovl   : mpirun -np 2, batch B per rank, 1 thread each, buckets reduced during backward
#   after : the same with sync.overlap=false (every bucket reduced after backward ended)
# in alternating rounds; prints steps/s (rank 0's "done:" line) and the ratios
# ovl/after (what overlapping buys) and ovl/one (1 -> 2 processes on the same cores).
# Usage: bench/ddp_bench.sh [ROUNDS] [STEPS]   (from the repository root, after a build and
# scripts/data.sh). Results: bench/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3} steps=${2:-30}
flowrun=${FLOWRUN:-build/engine/flowrun}
tmp=$(mktemp -d /tmp/flowrun-ddp-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mpi=(mpirun --oversubscribe -np 2 --bind-to none)
[ "$(id -u)" = 0 ] && mpi+=(--allow-run-as-root)
export OMPI_MCA_btl_vader_single_copy_mechanism=none
B=${B:-8}
# GPT, 4 layers x 256 wide, 128 tokens, byte vocabulary: 3.2M parameters, 13 MB of fp32
# gradients: 4 MB buckets make 4-5 of them (25 MB would be a single bucket).
common=(graphs/gpt.yaml run.steps=$steps run.log_every=1000 eval.every=100000 evlog.every=100000
        ckpt.every=100000 ckpt.at=[] model.layers=4 model.dim=256 model.heads=4 model.context=128
        model.vocab=256 data.path=data/text/fortunes_byte data.seq_len=128 sync.bucket_mb=4)
rate() { grep -E '(\[rank 0\] )?done: ' "$1" | grep -v '\[rank 1\]' | sed -E 's/.*\(([0-9.]+) steps\/s\).*/\1/' | head -1; }
declare -A sum
for r in $(seq 1 "$rounds"); do
  OMP_NUM_THREADS=2 "$flowrun" "${common[@]}" run.out_dir="$tmp/one" run.threads=2 data.batch=$((2*B)) >"$tmp/one.log" 2>&1
  "${mpi[@]}" "$flowrun" "${common[@]}" run.out_dir="$tmp/ovl" run.threads=1 data.batch=$B >"$tmp/ovl.log" 2>&1
  "${mpi[@]}" "$flowrun" "${common[@]}" run.out_dir="$tmp/after" run.threads=1 data.batch=$B sync.overlap=false >"$tmp/after.log" 2>&1
  one=$(rate "$tmp/one.log") ovl=$(rate "$tmp/ovl.log") after=$(rate "$tmp/after.log")
  echo "round $r: one $one  ovl $ovl  after $after steps/s"
  echo "$one $ovl $after" >> "$tmp/rounds"
done
# medians of the rounds
med() { cut -d' ' -f"$1" "$tmp/rounds" | sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
one=$(med 1) ovl=$(med 2) after=$(med 3)
awk -v one="$one" -v ovl="$ovl" -v after="$after" -v b="$B" 'BEGIN{
  printf "median steps/s (global batch %d sequences): 1 process %.3f | 2 ranks overlap %.3f | 2 ranks reduce-after-backward %.3f\n", 2*b, one, ovl, after;
  printf "overlap / reduce-after-backward = %.3f x\n", ovl/after;
  printf "2 ranks (overlap) / 1 process   = %.3f x\n", ovl/one }'
