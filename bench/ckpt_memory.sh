#!/usr/bin/env bash
# Peak resident memory of each rank at a checkpoint (issue 72): np 4, ZeRO-3, graphs/gpt.yaml at
# 8 x 512, vocab 8192 (29.5 M parameters, a 471 MB checkpoint), 4 steps with checkpoints every 2
# against none, and a resume from the checkpoint of step 2 (steps 3 and 4, none written); each
# rank's "peak resident memory" line. OLD=DIR: also a checkout built in
# DIR/build (e.g. `git worktree add DIR cfc7717`, the rank-0 gather, then cmake + ninja there,
# with DIR/data linked to this one's), run the same way. Usage: bench/ckpt_memory.sh [OUT]
set -u
out=${1:-/tmp/ckpt-memory}
mkdir -p "$out"
export OMPI_MCA_btl_vader_single_copy_mechanism=none
mpi=(mpirun --oversubscribe --bind-to none -np 4)
[ "$(id -u)" = 0 ] && mpi+=(--allow-run-as-root)
m=(data.path=data/text/fortunes_byte data.seq_len=64 model.layers=8 model.dim=512 model.heads=8 model.vocab=8192
   model.context=64 run.steps=4 run.log_every=1 run.threads=1 opt.warmup=2 eval.every=1000 evlog.every=1000 eval.at=[]
   evlog.at=[] run.progress=off data.batch=2 zero.stage=params)
roots=("now:$(cd "$(dirname "$0")/.." && pwd)")
[ -n "${OLD:-}" ] && roots+=("old:$OLD")
for entry in "${roots[@]}"; do
  side=${entry%%:*} root=${entry#*:}
  for ck in none every2 resume; do
    dir=$out/$side-$ck
    rm -rf "$dir"
    extra=(ckpt.every=2); [ $ck != every2 ] && extra=(ckpt.every=1000 "ckpt.at=[]")
    [ $ck = resume ] && extra+=(run.resume="$out/$side-every2/checkpoints/step_00000002")
    (cd "$root" && "${mpi[@]}" build/engine/flowrun graphs/gpt.yaml "${m[@]}" "${extra[@]}" run.out_dir="$dir") > "$dir.log" 2>&1
    echo "== $side, checkpoints: $ck (exit $?)"
    grep -E "peak resident memory|written" "$dir.log" | sed 's/.*\[rank/[rank/' | sort
  done
done
