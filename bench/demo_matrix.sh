#!/usr/bin/env bash
# The README's demo (scripts/setup.sh's three graphs: the VAE, the base DiT, the LoRA) on several
# CPU paths and seeds, each in a folder of its own, and scripts/demo_outcome.py's verdict on each
# as a table. A CPU path is ATEN_CPU_CAPABILITY (PyTorch's kernels: default, avx2, avx512) with
# oneDNN held to the same ISA (ONEDNN_MAX_CPU_ISA: its convolutions), as a CPU without AVX-512
# runs them; a seed S is run.seed=S for the VAE and the base and S+1 for the LoRA (the graphs'
# own seeds are 1, 1 and 2).
#
#   bench/demo_matrix.sh OUT [CAPS] [SEEDS]     e.g. bench/demo_matrix.sh runs-matrix "default avx2 avx512" "1 2 3"
#
# VAE_ARGS, DIT_ARGS, LORA_ARGS: more overrides for each graph (a reduced size). STAGES: "vae dit
# lora" (default), or "lora" to fine-tune again on bases already in OUT. SHARED_VAE=1: one VAE a
# CPU path (trained with the first seed, in OUT/CAP-vae), used by every seed's base and LoRA (the
# VAE is 40 % of the demo natively and most of it on the default path). FLOWRUN: the binary.
# Prints a line per run (its figures and verdict) and a summary; exit 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/demo_matrix.sh OUT [CAPS] [SEEDS]}
caps=${2:-"default avx2 avx512"}
seeds=${3:-"1 2 3"}
stages=${STAGES:-"vae dit lora"}
B=${FLOWRUN:-build/engine/flowrun}
read -r -a vae_args <<< "${VAE_ARGS:-}"
read -r -a dit_args <<< "${DIT_ARGS:-}"
read -r -a lora_args <<< "${LORA_ARGS:-}"
mkdir -p "$out"
isa() { case $1 in default) echo SSE41 ;; avx2) echo AVX2 ;; *) echo ALL ;; esac; }
failed=0 runs=0
for cap in $caps; do
  for seed in $seeds; do
    d=$out/$cap-seed$seed
    mkdir -p "$d"
    t0=$SECONDS
    run() {  # run NAME GRAPH ARGS...: one graph of the demo, its log in $d/NAME.log
      local name=$1; shift
      ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$(isa "$cap") "$B" "$@" run.progress=off > "$d/$name.log" 2>&1 ||
        { echo "$cap seed $seed: $name failed (exit $?): see $d/$name.log"; return 1; }
    }
    vae_dir=$d/vae vae_seed=$seed
    if [ "${SHARED_VAE:-0}" = 1 ]; then vae_dir=$out/$cap-vae vae_seed=${seeds%% *}; fi
    vae_w=$vae_dir/checkpoints/latest/ema.params.safetensors  # flowrun reads `latest` (a file naming the folder)
    ok=1
    case " $stages " in *" vae "*)
      if [ "${SHARED_VAE:-0}" != 1 ] || [ ! -e "$vae_dir/.done" ]; then  # a shared one: once, when complete
        run vae graphs/vae.yaml run.out_dir="$vae_dir" run.resume=never run.seed="$vae_seed" "${vae_args[@]}" &&
          touch "$vae_dir/.done" || ok=0
      fi ;; esac
    case " $stages " in *" dit "*)
      [ $ok = 1 ] && { run dit graphs/dit_base.yaml run.out_dir="$d/dit_base" run.resume=never run.seed="$seed" \
        vae.weights="$vae_w" "${dit_args[@]}" || ok=0; } ;; esac
    case " $stages " in *" lora "*)
      [ $ok = 1 ] && { run lora graphs/hydit_lora.yaml run.out_dir="$d/hydit_lora" run.resume=never run.seed=$((seed + 1)) \
        vae.weights="$vae_w" model.weights="$d/dit_base/checkpoints/latest/ema.params.safetensors" "${lora_args[@]}" ||
        ok=0; } ;; esac
    runs=$((runs + 1))
    if [ $ok = 1 ]; then
      verdict=$(PYTHONDONTWRITEBYTECODE=1 python3 scripts/demo_outcome.py "$d" --json)
      code=$?
      line=$(python3 -c 'import json, sys
j = json.loads(sys.argv[1]); f = j["figures"]
print("base %5.1f | purple %5.1f -> %5.1f | control %5.1f -> %5.1f | %s" % (f["base_color"] if f["base_color"] is not None else float("nan"),
      f["before"]["purple"], f["after"]["purple"], f["before"]["control"], f["after"]["control"],
      "pass" if not j["failed"] else "FAIL: " + " / ".join(x.split(":")[0] for x in j["failed"])))' "$verdict")
      [ $code = 0 ] || failed=$((failed + 1))
    else
      line="FAIL: a graph did not run"
      failed=$((failed + 1))
    fi
    printf "%-8s seed %s  %s  (%d s)\n" "$cap" "$seed" "$line" $((SECONDS - t0))
  done
done
echo "== $((runs - failed)) of $runs runs passed the demo's bars (scripts/demo_outcome.py)"
[ $failed = 0 ]
