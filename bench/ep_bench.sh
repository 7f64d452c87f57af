#!/usr/bin/env bash
# Expert parallel against the same model without it, at the same ranks (issue 73): graphs/moe.yaml
# (4 layers of 16 experts, top 2, the load-balancing loss on) on the byte-level fortunes shards,
# 256 tokens x BATCH rows a rank, trained under `mpirun -np NP` at run.parallel.ep=1 (every rank
# holds every expert: data parallel) and ep=NP (each rank 16/NP experts, the tokens exchanged by
# all-to-alls), ROUNDS rounds alternating the two. Per run the median step (from metrics.jsonl's
# steps_per_s, the first SKIP steps left out: start-up and the first allocations) and, under ep,
# the median of fb's experts/a2a_ms: the step's time in the all-to-alls (waiting included).
#
#   bench/ep_bench.sh [ROUNDS=3] [STEPS=14] [NP=2] [BATCH=8]
#   FLOWRUN=build/engine/flowrun PY=.venv/bin/python (defaults)
set -euo pipefail
rounds=${1:-3} steps=${2:-14} np=${3:-2} batch=${4:-8} skip=4
flowrun=${FLOWRUN:-build/engine/flowrun}
py=${PY:-.venv/bin/python}
out=$(mktemp -d /tmp/ep_bench.XXXXXX)
trap 'rm -rf "$out"' EXIT
g=(graphs/moe.yaml data.path=data/text/fortunes_byte model.vocab=256 data.seq_len=256 "data.batch=$batch"
   "run.steps=$steps" run.log_every=1 run.threads=1 eval.every=100000 evlog.every=100000 ckpt.every=100000 "ckpt.at=[]")
export OMP_NUM_THREADS=1
for r in $(seq 1 "$rounds"); do
  for ep in 1 "$np"; do
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$flowrun" "${g[@]}" "run.parallel.ep=$ep" \
      "run.out_dir=$out/r${r}_ep$ep" > "$out/r${r}_ep$ep.log" 2>&1 || { cat "$out/r${r}_ep$ep.log"; exit 1; }
  done
done
"$py" - "$out" "$rounds" "$np" "$skip" <<'PY'
import json, statistics, sys
out, rounds, np_, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def run(r, ep):
    rows = [json.loads(l) for l in open(f"{out}/r{r}_ep{ep}/metrics.jsonl")]
    rows = [x for x in rows if "steps_per_s" in x and x["step"] > skip]
    step = statistics.median(1 / x["steps_per_s"] for x in rows)
    a2a = statistics.median(x.get("experts/a2a_ms", 0) for x in rows) / 1e3
    return step, a2a
base, ep, share = [], [], []
for r in range(1, rounds + 1):
    (b, _), (e, a) = run(r, 1), run(r, np_)
    base.append(b); ep.append(e); share.append(a / e)
    print(f"round {r}: ep 1 {b*1e3:.0f} ms, ep {np_} {e*1e3:.0f} ms ({b/e:.2f}x), all-to-all {a*1e3:.0f} ms = {100*a/e:.1f}% of the ep step")
ratios = [b / e for b, e in zip(base, ep)]
print(f"median over {rounds} rounds: ep 1 {statistics.median(base)*1e3:.0f} ms a step, ep {np_} {statistics.median(ep)*1e3:.0f} ms: "
      f"ep {np_} / ep 1 speed {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
      f"all-to-all {100*statistics.median(share):.1f}% of the ep step")
PY
