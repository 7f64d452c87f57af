#!/usr/bin/env bash
# How long flowrun's commands that train nothing take to answer (issue 68), and a tiny run for
# comparison: the median of N wall times each (default 5), in ms. The binary links no libtorch
# (cli/torch_side.hpp); `run` opens libflowrun_cli_torch.so and pays libtorch's start-up.
#   bench/startup.sh [FLOWRUN] [N]        (from the repository root; FLOWRUN: build/engine/flowrun)
set -euo pipefail
cd "$(dirname "$0")/.."
flowrun=${1:-build/engine/flowrun}
n=${2:-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median_ms() {
  local i t0
  for ((i = 0; i < n; i++)); do
    t0=$(date +%s%N)
    "$@" > /dev/null 2>&1 || { echo "failed: $*" >&2; exit 1; }
    echo $((($(date +%s%N) - t0) / 1000000))
  done | sort -n | sed -n "$(((n + 1) / 2))p"
}
printf "%-44s %s\n" "command ($flowrun, median of $n)" "ms"
for cmd in "--help" "validate graphs/gpt.yaml" "validate graphs/hydit_lora.yaml" "dot graphs/hydit_lora.yaml" \
           "explain graphs/gpt.yaml" "nodes" "nodes optimizer"; do
  # shellcheck disable=SC2086
  printf "%-44s %5d\n" "flowrun $cmd" "$(median_ms "$flowrun" $cmd)"
done
printf "%-44s %5d\n" "flowrun graphs/regression.yaml run.steps=1" \
  "$(median_ms "$flowrun" graphs/regression.yaml run.steps=1 run.progress=off run.out_dir="$tmp/r" run.resume=never)"
