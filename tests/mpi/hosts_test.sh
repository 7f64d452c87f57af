#!/usr/bin/env bash
# Training across emulated hosts (issue 72): tests/mpi/hosts.sh makes 2 or 4 hosts of network
# namespaces on this machine, mpirun starts the ranks in them through its rsh agent, and the ranks
# of different hosts talk TCP over the emulated network (those of one host shared memory, as on
# real hosts). graphs/gpt.yaml at mpi_test.sh's tiny size, under each layout, trains what one
# process trains on the same global batch: every step's loss (AdamW) within 1e-6.
# Usage: hosts_test.sh CASE FLOWRUN SRC BUILD      (CASE: layouts2 | layouts4)
set -u
case_name=$1 flowrun=$2 src=$3 build=$4
hosts=$src/tests/mpi/hosts.sh
fail() { echo "FAIL [$case_name]: $*" >&2; exit 1; }
needs_data() {
  for f in "$@"; do
    [ -e "$f" ] || { echo "SKIP [$case_name]: $f is missing: run scripts/data.sh first (scripts/test.sh does it)"; exit 77; }
  done
}
cd "$src" || exit 1
needs_data data/text/fortunes_byte.train.bin
"$hosts" check || exit 77  # not root, no iproute2, or namespaces refused (a container): skipped

export FLOWRUN_BUILD=$build
tmp=$(mktemp -d /tmp/flowrun-hoststest.XXXXXX)
prefix=frt$$
# Whatever happens (a failure, Ctrl-C, ctest's SIGTERM), the hosts go: namespaces, links, state.
trap '"$hosts" down $prefix; rm -rf "$tmp"' EXIT
child=""
trap '[ -n "$child" ] && kill -TERM $child 2> /dev/null; exit 143' TERM INT

# run_code WANT CMD...: run with output in $tmp/out (in the background, so that a signal to this
# script ends it and the trap above takes the hosts down at once)
run_code() {
  local want=$1; shift
  "$@" > "$tmp/out" 2>&1 &
  child=$!
  wait $child
  got=$?
  child=""
  [ "$got" = "$want" ] || { cat "$tmp/out" >&2; fail "'$*' exited $got, expected $want"; }
}
expect_out() { grep -qF -- "$1" "$tmp/out" || { cat "$tmp/out" >&2; fail "output lacks: $1"; }; }
losses() { grep -o '"loss":[0-9.eE+-]*' "$1" | cut -d: -f2; }
# same_numbers A B TOL: two files of numbers, line by line, |a-b| <= TOL * max(1, |a|)
same_numbers() {
  paste "$1" "$2" | awk -v tol="$3" 'BEGIN{bad=0; n=0} {n++; d=$1-$2; if (d<0) d=-d; m=$1<0?-$1:$1; if (m<1) m=1;
    if (d > tol*m) {bad++; print "line " n ": " $1 " vs " $2}} END{if (n==0) {print "no numbers"; exit 1} exit bad>0}'
}
# mpi_test.sh's tiny graphs/gpt.yaml (its tiny_gpt) at 4 blocks (2 pipeline stages of 2), batch 8.
tiny_gpt=(graphs/gpt.yaml data.path=data/text/fortunes_byte data.seq_len=32 model.layers=2 model.dim=32 model.heads=4
          model.vocab=256 model.context=32 run.steps=6 run.log_every=1 run.threads=1 opt.warmup=2 ema.decay=0.9
          eval.every=3 eval.batches=2 eval.batch=4 evlog.every=3 ckpt.every=3)
g=("${tiny_gpt[@]}" model.layers=4 data.batch=8)

# up N R: N emulated hosts, R ranks each; $hl is mpirun's -H list.
up() {
  "$hosts" up "$1" $prefix "$2" > /dev/null || fail "hosts.sh up $1 $prefix failed"
  hl=$("$hosts" hosts $prefix "$2")
  x=$(cat /tmp/flowrun-hosts-$prefix/subnet)
}
# placement WANT MPIRUN_ARGS...: each rank's host as the rank itself sees it (gethostname), "rank host"
# lines by rank, is WANT.
placement() {
  local want=$1; shift
  "$hosts" mpirun $prefix -H "$hl" -np 4 "$@" sh -c 'echo "$OMPI_COMM_WORLD_RANK $(hostname)"' > "$tmp/place" 2> "$tmp/place.err" ||
    { cat "$tmp/place.err" "$tmp/place" >&2; fail "mpirun of hostname across the hosts failed"; }
  [ "$(sort -n "$tmp/place" | tr '\n' ' ')" = "$want" ] || fail "ranks on hosts: '$(sort -n "$tmp/place" | tr '\n' ' ')', expected '$want'"
}
# The bytes the hosts have sent so far (what their root-side veths received: to other hosts, and
# the daemons' messages to mpirun).
wire_bytes() {
  local s=0 f
  for f in /sys/class/net/fr"${x}"v*/statistics/rx_bytes; do s=$((s + $(cat "$f"))); done
  echo $s
}
# layout NAME EXPECT MPIRUN_ARGS... -- OVERRIDES...: the run over the hosts, its mesh line EXPECT,
# every step's loss within 1e-6 of one process's; the emulated network carried its traffic.
layout() {
  local name=$1 expect=$2; shift 2
  local margs=()
  while [ "$1" != -- ]; do margs+=("$1"); shift; done
  shift
  local b0 t0; b0=$(wire_bytes); t0=$(date +%s.%N)
  run_code 0 timeout 300 "$hosts" mpirun $prefix -H "$hl" -np 4 "${margs[@]}" "$flowrun" "${g[@]}" "$@" run.out_dir="$tmp/$name"
  expect_out "processes: $expect (4 processes)"
  losses "$tmp/$name/metrics.jsonl" > "$tmp/l2"
  [ "$(wc -l < "$tmp/l2")" = 6 ] || fail "$name: expected 6 logged losses"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-6 || fail "$name: the losses differ from one process's"
  [ -e "$tmp/$name/checkpoints/step_00000006" ] || fail "$name: no checkpoint of step 6 in the shared out_dir"
  local kb=$(( ($(wire_bytes) - b0) / 1024 ))
  [ $kb -gt 64 ] || fail "$name: the hosts sent $kb KiB only: the ranks did not talk over the emulated network"
  printf '%s: %s, %.1f s, %d KiB sent by the hosts: losses as one process\n' "$name" "$expect" \
    "$(echo "$(date +%s.%N) - $t0" | bc)" $kb
}

start=$(date +%s)
run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one"
losses "$tmp/one/metrics.jsonl" > "$tmp/l1"
[ "$(wc -l < "$tmp/l1")" = 6 ] || fail "one process: expected 6 logged losses"

case $case_name in
layouts2)
  # 2 hosts x 2 ranks: ranks 0, 1 on the first host, 2, 3 on the second (mpirun -H a:2,b:2 fills a
  # host's slots first). tp varies fastest in the mesh (nodes/parallel/mesh.hpp), so at tp 2 each
  # tp group is one host's ranks (its all-reduces over shared memory) and dp or pp goes across.
  up 2 2
  placement "0 ${prefix}-1 1 ${prefix}-1 2 ${prefix}-2 3 ${prefix}-2 "
  layout dp4 "dp 4 x pp 1 x tp 1" -- data.batch=2
  layout dp2_tp2 "dp 2 x pp 1 x tp 2" -- run.parallel.tp=2 data.batch=4
  # Stage 0 on the first host, stage 1 on the second; tp inside each.
  layout pp2_tp2 "dp 1 x pp 2 x tp 2" -- run.parallel.pp=2 run.parallel.tp=2 run.parallel.microbatches=4
  # Ranks dealt round-robin (--map-by node): ranks 0, 2 on the first host, 1, 3 on the second, so
  # the stages (ranks r, r + 1) are on different hosts and each dp pair on one.
  placement "0 ${prefix}-1 1 ${prefix}-2 2 ${prefix}-1 3 ${prefix}-2 " --map-by node
  layout pp2_dp2_bynode "dp 2 x pp 2 x tp 1" --map-by node -- run.parallel.pp=2 run.parallel.microbatches=2 data.batch=4 \
    eval.batches=1
  # ZeRO stage 3: the parameters sharded over the 4 ranks, gathered block by block across hosts.
  layout zero3_dp4 "dp 4 x pp 1 x tp 1" -- zero.stage=params data.batch=2
  expect_out "(ZeRO stage params, this rank's 1/4 slice)"
  ;;
layouts4)
  # 4 hosts x 1 rank: every collective crosses the emulated network, tp's too.
  up 4 1
  placement "0 ${prefix}-1 1 ${prefix}-2 2 ${prefix}-3 3 ${prefix}-4 "
  layout dp4 "dp 4 x pp 1 x tp 1" -- data.batch=2
  layout dp2_tp2 "dp 2 x pp 1 x tp 2" -- run.parallel.tp=2 data.batch=4
  layout pp2_tp2 "dp 1 x pp 2 x tp 2" -- run.parallel.pp=2 run.parallel.tp=2 run.parallel.microbatches=4
  layout zero3_dp4 "dp 4 x pp 1 x tp 1" -- zero.stage=params data.batch=2
  ;;
*) fail "unknown case" ;;
esac
echo "PASS [$case_name] ($(( $(date +%s) - start )) s)"
