#!/usr/bin/env bash
# Training across emulated hosts (issue 72): tests/mpi/hosts.sh makes 2 or 4 hosts of network
# namespaces on this machine, mpirun starts the ranks in them through its rsh agent, and the ranks
# of different hosts talk TCP over the emulated network (those of one host shared memory, as on
# real hosts). graphs/gpt.yaml at mpi_test.sh's tiny size, under each layout, trains what one
# process trains on the same global batch: every step's loss (AdamW) within 1e-6. ckpt2: per-rank
# checkpoints across hosts (each rank's files written on its host), resumed at other layouts, and
# the refusal of a checkpoint folder one host does not see. faults2: one of the hosts lost, its
# link cut or every process on it killed, at three points of a run; the job ends naming it, and
# continues from its last checkpoint where an uninterrupted run goes (faults2_link, faults2_host:
# one kind of fault only).
# Usage: hosts_test.sh CASE FLOWRUN SRC BUILD [TENSORDIFF]   (CASE: layouts2 | layouts4 | ckpt2 |
# faults2 | faults2_link | faults2_host; TENSORDIFF: tests/tools/tensordiff.cpp's binary, default
# BUILD/tests/mpi/tensordiff)
set -u
case_name=$1 flowrun=$2 src=$3 build=$4 tensordiff_bin=${5:-$4/tests/mpi/tensordiff}
hosts=$src/tests/mpi/hosts.sh
# fail, needs_data, expect_out, losses, same_numbers, whole_file, tensordiff_whole, from,
# same_states, tiny_gpt
source "$src/tests/mpi/lib.sh"
cd "$src" || exit 1
case $case_name in faults2*) ;; *) needs_data data/text/fortunes_byte.train.bin ;; esac  # faults2: synthetic data
"$hosts" check || exit 77  # not root, no iproute2, or namespaces refused (a container): skipped

# Absolute: ddp.yaml names its plugin under it (a relative one is taken from the graph file's folder).
FLOWRUN_BUILD=$(realpath "$build")
export FLOWRUN_BUILD
tmp=$(mktemp -d /tmp/flowrun-hoststest.XXXXXX)
prefix=frt$$
# A job left running in the background (faults2's, under scripts/restart.sh) in a process group of
# its own (setsid): ended with it, SIGTERM then SIGKILL (an mpirun whose daemon is cut off does not
# end on SIGTERM alone). Its daemons and ranks are in the hosts' namespaces: `down` ends those.
bg_pg=""
stop_bg() {
  [ -n "$bg_pg" ] || return 0
  kill -TERM -- -"$bg_pg" 2> /dev/null
  for _ in $(seq 20); do kill -0 -- -"$bg_pg" 2> /dev/null || break; sleep 0.1; done
  kill -KILL -- -"$bg_pg" 2> /dev/null
  bg_pg=""
}
# Whatever happens (a failure, Ctrl-C, ctest's SIGTERM), the hosts go: namespaces, links, state.
trap 'stop_bg; "$hosts" down $prefix; rm -rf "$tmp"' EXIT
child=""
trap '[ -n "$child" ] && kill -TERM $child 2> /dev/null; exit 143' TERM INT

# run_code WANT CMD...: run with output in $tmp/out (in the background, so that a signal to this
# script ends it and the trap above takes the hosts down at once); WANT is a code or "nonzero" (a
# failure, not a timeout's 124)
run_code() {
  local want=$1; shift
  "$@" > "$tmp/out" 2>&1 &
  child=$!
  wait $child
  got=$?
  child=""
  if [ "$want" = nonzero ]; then
    [ "$got" != 0 ] && [ "$got" != 124 ] || { cat "$tmp/out" >&2; fail "'$*' exited $got, expected a failure (not a timeout)"; }
  else
    [ "$got" = "$want" ] || { cat "$tmp/out" >&2; fail "'$*' exited $got, expected $want"; }
  fi
}
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

# one_process: the run every layout is compared with; its losses in $tmp/l1.
one_process() {
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one"
  losses "$tmp/one/metrics.jsonl" > "$tmp/l1"
  [ "$(wc -l < "$tmp/l1")" = 6 ] || fail "one process: expected 6 logged losses"
}
# writers STEP_DIR HOST_OF_RANK_0 HOST_OF_RANK_1 ...: every file of the checkpoint is in its
# manifest's `files` and every entry there on disk, at its size; a rank's file (NAME.rankRRRRR.*)
# written by rank R, on the host rank R ran on; every rank wrote files, so both hosts did.
writers() {
  local dir=$1; shift
  python3 - "$dir" "$@" <<'PY' || fail "$dir: the manifest's writers are not the ranks' hosts"
import json, os, re, sys
d, hosts = sys.argv[1], sys.argv[2:]
files = json.load(open(os.path.join(d, "manifest.json")))["files"]
bad = []
on_disk = sorted(f for f in os.listdir(d) if f != "manifest.json")
if sorted(files) != on_disk:
    bad.append(f"files on disk {on_disk}, in the manifest {sorted(files)}")
wrote = {}
for name, e in sorted(files.items()):
    r, h = e.get("rank"), e.get("host")
    m = re.search(r"\.rank(\d{5})\.", name)
    if m and int(m.group(1)) != r:
        bad.append(f"{name}: written by rank {r}, not the rank its name says")
    if not isinstance(r, int) or not 0 <= r < len(hosts):
        bad.append(f"{name}: rank {r!r}, not one of 0..{len(hosts) - 1}")
        continue
    if h != hosts[r]:
        bad.append(f"{name}: host {h!r}, but rank {r} ran on {hosts[r]!r}")
    if os.path.exists(os.path.join(d, name)) and os.path.getsize(os.path.join(d, name)) != e.get("bytes"):
        bad.append(f"{name}: {os.path.getsize(os.path.join(d, name))} bytes, the manifest says {e.get('bytes')}")
    wrote.setdefault(r, []).append(name)
for r in range(len(hosts)):
    if not any(".rank%05d." % r in n for n in wrote.get(r, [])):
        bad.append(f"rank {r} (on {hosts[r]}) wrote no file of its own")
if {files[n]["host"] for n in files} != set(hosts):
    bad.append(f"the files were written on {sorted({files[n]['host'] for n in files})}, not on every host {sorted(set(hosts))}")
for b in bad:
    print("  " + b)
for r in sorted(wrote):
    print(f"  rank {r} on {hosts[r]}: {len(wrote[r])} files ({', '.join(wrote[r])})")
sys.exit(1 if bad else 0)
PY
}

# ---- faults2: host 2 of 2 hosts x 2 ranks cut off or killed, at three points of a run ----
ms() { echo $(( $(date +%s%N) / 1000000 )); }  # now, in milliseconds
secs() { printf '%d.%d' $(( $1 / 1000 )) $(( $1 % 1000 / 100 )); }  # milliseconds as seconds, 1 decimal
# wait_for SECONDS CMD...: until CMD succeeds (0), or SECONDS have passed (1).
wait_for() {
  local until=$(( $(ms) + $1 * 1000 ))
  shift
  until "$@"; do [ "$(ms)" -gt $until ] && return 1; sleep 0.05; done
}
# ranks_on HOST: the flowrun processes running in HOST's namespace; procs_on HOST: every process.
ranks_on() {
  local n=0 p
  for p in $(ip netns pids "$1" 2> /dev/null); do [ "$(cat "/proc/$p/comm" 2> /dev/null)" = flowrun ] && n=$((n + 1)); done
  echo $n
}
procs_on() { ip netns pids "$1" 2> /dev/null | wc -l; }
# last_logged OUT: the last step in OUT's metrics.jsonl (0 before the first).
last_logged() { local s; s=$(grep -o '"step":[0-9]*' "$1/metrics.jsonl" 2> /dev/null | tail -n 1 | cut -d: -f2); echo "${s:-0}"; }
logged() { [ "$(last_logged "$1")" -ge "$2" ]; }  # logged OUT STEP: OUT's metrics.jsonl has come to STEP
# step_losses OUT: "STEP LOSS" lines of OUT's metrics.jsonl.
step_losses() { sed -n 's/.*"step":\([0-9]*\),.*"loss":\([0-9.eE+-]*\).*/\1 \2/p' "$1/metrics.jsonl"; }
# host2_wrote DIR: a file of host 2's ranks (2, 3) is in DIR (a checkpoint's folder being written).
host2_wrote() { compgen -G "$1/*.rank0000[23].safetensors" > /dev/null; }
# continues REF OUT WHAT: OUT's run ends where the uninterrupted REF ends: every step logged once,
# each step's loss within 1e-6 (those after the resume computed by the restarted job), and the
# parameters, optimizer state and EMA of the last step within 1e-5.
continues() {
  local ref=$1 out=$2 what=$3 f a b last
  step_losses "$ref" > "$tmp/la"
  step_losses "$out" > "$tmp/lb"
  [ "$(cut -d' ' -f1 "$tmp/la" | tr '\n' ' ')" = "$(cut -d' ' -f1 "$tmp/lb" | tr '\n' ' ')" ] ||
    fail "$what: steps logged $(cut -d' ' -f1 "$tmp/lb" | tr '\n' ' '), the uninterrupted run $(cut -d' ' -f1 "$tmp/la" | tr '\n' ' ')"
  cut -d' ' -f2 "$tmp/la" > "$tmp/la2"
  cut -d' ' -f2 "$tmp/lb" > "$tmp/lb2"
  same_numbers "$tmp/la2" "$tmp/lb2" 1e-6 || fail "$what: the losses differ from the uninterrupted run's"
  last=$(printf 'step_%08d' "$(tail -n 1 "$tmp/la" | cut -d' ' -f1)")
  for f in model.params opt.state ema.params; do
    a=$(whole_file "$ref/checkpoints/$last/$f.safetensors") || exit 1
    b=$(whole_file "$out/checkpoints/$last/$f.safetensors") || exit 1
    "$tensordiff_bin" "$a" "$b" 1e-5 > /dev/null || { "$tensordiff_bin" "$a" "$b" 1e-5; fail "$what: $f of $last differs from the uninterrupted run's"; }
  done
}
# fault KIND POINT: one run of tests/mpi/ddp.yaml on the 2 hosts x 2 ranks (dp 4) under
# scripts/restart.sh, and host 2 lost at POINT: KIND link, its link cut (the root-namespace end of
# its veth down, as a switch port failing), or host, every process in it SIGKILLed (orted too).
# Then: every rank ends within $bound s, the output names host 2, `latest` names a checkpoint that
# `flowrun ckpt verify` accepts; the loop restarts the job on the same 2 hosts (the link up again)
# and, from a copy of the out_dir, a second restart runs on host 1 alone (dp 2, the same global
# batch): both end as the uninterrupted run $tmp/ref does.
fault() {
  local kind=$1 point=$2 name=$1_$2
  local out=$tmp/$name log=$tmp/$name.log marker=$tmp/$name.marker pace=(data.delay_ms=100) fa=()
  case $point in
    # Rank 2 (host 2) marks step 5 and sleeps in its fault node (after fb.loss, inside the step);
    # the test acts on the marker: host 2 goes while that rank is inside a step.
    step) fa=(fault.mode=mark fault.rank=2 fault.step=5 fault.delay_ms=30000) ;;
    # Rank 1 (host 1) sleeps in step 5's fault node. Its step 5 cannot retire, so with run.prefetch
    # 2 it runs steps 6 and 7 (their all-reduces need nothing of the fault node) but never admits
    # step 8; every other rank retires 5..7 and enters step 8's gradient all-reduce, which waits
    # for rank 1's part. Marking a rank of host 2 would leave that host computing, not in the
    # collective; marking rank 0 would leave rank 0, the watcher of host 2's rank 3 and the rank
    # that logs, outside it. With rank 1 marked, both host 2's ranks and rank 0 sit in the
    # all-reduce when host 2 goes: the test acts once step 7 is logged (every rank has done its
    # all-reduces; rank 0 logs after the metrics' own) and 0.5 s more (step 8's data, 0.1 s),
    # and the log then never passes step 7 (checked).
    allreduce) fa=(fault.mode=mark fault.rank=1 fault.step=5 fault.delay_ms=30000) ;;
    # Each file of a checkpoint written 0.5 s after the one before (rank 0: 5 files, the others 3):
    # the test acts once host 2's ranks have written a file of step 8's checkpoint, into its
    # .step_00000008.tmp folder (step 4's complete, `latest`), before they write the rest.
    ckpt) pace+=(ckpt.write_delay_ms=500) ;;
  esac
  printf '%s\n' "${pace[@]}" > "$tmp/go"
  rm -f "$tmp/ended" "$marker"
  local t_start; t_start=$(ms)
  setsid bash scripts/restart.sh --max 1 --wait 0 -- bash "$tmp/attempt" "$hosts" mpirun $prefix -H "$hl" -np 4 \
    "$flowrun" "${g[@]}" data.batch=4 "${fa[@]}" fault.marker="$marker" run.out_dir="$out" run.resume=auto > "$log" 2>&1 &
  bg_pg=$!
  case $point in
    step) wait_for 60 test -e "$marker" || { cat "$log" >&2; fail "$name: rank 2 never reached step 5"; } ;;
    allreduce)
      wait_for 60 test -e "$marker" || { cat "$log" >&2; fail "$name: rank 1 never reached step 5"; }
      wait_for 30 logged "$out" 7 || { cat "$log" >&2; fail "$name: step 7 was never logged"; }
      sleep 0.5
      [ "$(last_logged "$out")" = 7 ] || fail "$name: step $(last_logged "$out") logged: the ranks did not wait for rank 1" ;;
    ckpt)
      wait_for 60 host2_wrote "$out/checkpoints/.step_00000008.tmp" ||
        { cat "$log" >&2; fail "$name: host 2 never wrote a file of step 8's checkpoint"; } ;;
  esac
  [ -e "$out/checkpoints/step_00000008" ] && fail "$name: step 8's checkpoint was complete before the fault (the test came late)"
  local t0; t0=$(ms)
  case $kind in
    link) ip link set "$veth" down || fail "$name: cannot take $veth down" ;;
    host) ip netns pids "$h2" | xargs -r kill -9 ;;
  esac
  # Every 0.1 s: has each host's last rank ended, has mpirun returned (the attempt notes when)?
  local e1="" e2="" em="" up="" now
  while :; do
    now=$(( $(ms) - t0 ))
    [ -z "$e1" ] && [ "$(ranks_on "$h1")" = 0 ] && e1=$now
    [ -z "$e2" ] && [ "$(ranks_on "$h2")" = 0 ] && e2=$now
    [ -z "$em" ] && [ -f "$tmp/ended" ] && em=$(( $(cat "$tmp/ended") - t0 ))
    [ -n "$e1" ] && [ -n "$e2" ] && [ -n "$em" ] && break
    [ $now -gt $(( bound * 1000 )) ] && break
    sleep 0.1
  done
  [ -n "$e1" ] || { cat "$log" >&2; fail "$name: host 1's ranks still ran $bound s after the fault"; }
  [ -n "$e2" ] || { cat "$log" >&2; fail "$name: host 2's ranks still ran $bound s after the fault"; }
  local mpirun_end
  if [ -n "$em" ]; then
    mpirun_end="mpirun returned after $(secs $em) s"
  elif [ "$kind" = link ]; then
    # Open MPI's mpirun does not return while a daemon is cut off, though every rank has ended: it
    # waits for host 2's daemon to report its ranks ended, over TCP that retransmits into the cut
    # until the kernel gives up (tcp_retries2: 948 s measured with the link left down; Open MPI
    # 4.1's daemons have no heartbeat, and oob_tcp_keepalive_* changed nothing). Noted, and the
    # link brought back: then mpirun hears the daemon and returns within TCP's back-off.
    up=$(( $(ms) - t0 ))
    ip link set "$veth" up || fail "$name: cannot bring $veth up"
    wait_for 60 test -f "$tmp/ended" || { cat "$log" >&2; fail "$name: mpirun still ran 60 s after the link came back"; }
    em=$(( $(cat "$tmp/ended") - t0 ))
    mpirun_end="mpirun still ran at $(secs $up) s with the link down, returned $(secs $((em - up))) s after it came back"
  else
    cat "$log" >&2
    fail "$name: mpirun still ran $bound s after host 2 was killed"
  fi
  [ "$kind" = link ] && { ip link set "$veth" up || fail "$name: cannot bring $veth up"; }
  ip -n "$h2" link show eth0 | grep -q LOWER_UP || fail "$name: $h2's eth0 is not up again: $(ip -n "$h2" -br link show eth0)"
  # The job's exit code: restart.sh's line (a failure it restarts: not 0, 2, 130, 143, nor a timeout).
  local code
  wait_for 10 grep -q "restart 1 of 1" "$log"  # (restart.sh looks at its launcher every 0.2 s)
  code=$(sed -n 's/.*the job ended with exit code \([0-9]*\); restart 1 of 1.*/\1/p' "$log")
  [ -n "$code" ] || { cat "$log" >&2; fail "$name: restart.sh did not restart the job"; }
  [ "$code" != 0 ] && [ "$code" != 124 ] || fail "$name: the job exited $code"
  # Who named host 2: our heartbeat's message (rank 0, which watches rank 3 across the link), or
  # Open MPI's on the lost daemon.
  local named ours="rank 3 on host $h2 went silent: no heartbeat for $hb s (run.heartbeat_timeout_s)"
  local theirs="ORTE has lost communication with a remote daemon"
  if grep -qF -- "$ours" "$log"; then named="ours (rank 0: $ours)"
  elif grep -qF -- "$theirs" "$log" && grep -qF -- "on node $h2" "$log"; then named="Open MPI's ($theirs: $h2)"
  else cat "$log" >&2; fail "$name: the output does not name host $h2"; fi
  if [ "$kind" = link ]; then
    grep -qF -- "$ours" "$log" || { cat "$log" >&2; fail "$name: the output lacks: $ours"; }
    # Host 2's ranks watched host 1's across the cut: rank 2 names rank 1 (its output comes
    # through once the link is back).
    grep -qF -- "rank 1 on host $h1 went silent" "$log" || { cat "$log" >&2; fail "$name: rank 2 did not name rank 1 on $h1"; }
  fi
  # Nothing written is lost: `latest` is step 4's complete, verified checkpoint; step 8's was never
  # made `latest` (at ckpt: its half-written folder is left, for the next write to replace).
  [ "$(cat "$out/checkpoints/latest" 2> /dev/null)" = step_00000004 ] ||
    fail "$name: latest names '$(cat "$out/checkpoints/latest" 2> /dev/null)', not step_00000004"
  [ -e "$out/checkpoints/step_00000008" ] && fail "$name: step 8's checkpoint was completed after the fault"
  [ "$point" = allreduce ] && [ "$(last_logged "$out")" != 7 ] &&
    fail "$name: step $(last_logged "$out") logged: the ranks were not held in step 8's all-reduce"
  [ "$point" = ckpt ] && { [ -d "$out/checkpoints/.step_00000008.tmp" ] || fail "$name: no half-written .step_00000008.tmp"; }
  run_code 0 "$flowrun" ckpt verify "$out/checkpoints"
  expect_out "step_00000004: every file matches"
  # No process left in either host (daemons, ranks).
  wait_for 10 test "$(procs_on "$h1")$(procs_on "$h2")" = 00 ||
    fail "$name: processes left: $h1: $(ip netns pids "$h1" | xargs -r ps -o comm= -p | tr '\n' ' ') $h2: $(ip netns pids "$h2" | xargs -r ps -o comm= -p | tr '\n' ' ')"
  # The restart: a copy for host 1 alone, then the loop's second attempt on both hosts (full pace).
  cp -a "$out" "$out.1host"
  local t1; t1=$(ms)
  : > "$tmp/go.new" && mv "$tmp/go.new" "$tmp/go"
  wait_for 120 eval '! kill -0 $bg_pg 2> /dev/null' || { cat "$log" >&2; fail "$name: the restarted job did not end"; }
  wait "$bg_pg"
  local rc=$?
  bg_pg=""
  [ $rc = 0 ] || { cat "$log" >&2; fail "$name: the restart on 2 hosts exited $rc"; }
  grep -qF "resumed from $out/checkpoints/step_00000004 (step 4)" "$log" || { cat "$log" >&2; fail "$name: the restart did not resume from step 4"; }
  continues "$tmp/ref" "$out" "$name, restarted on 2 hosts"
  local t2; t2=$(ms)
  # On host 1 alone (dp 2, the same global batch): after a cut link mid-checkpoint and a killed
  # host mid-step (the other four restart on both hosts only, to keep the suite's time).
  if [ "$kind/$point" = link/ckpt ] || [ "$kind/$point" = host/step ]; then
    run_code 0 timeout 120 bash scripts/restart.sh --max 1 --wait 0 -- "$hosts" mpirun $prefix -H "$h1:2" -np 2 \
      "$flowrun" "${g[@]}" data.batch=8 "${fa[@]}" fault.marker="$marker" run.out_dir="$out.1host" run.resume=auto
    expect_out "processes: dp 2 x pp 1 x tp 1 (2 processes)"
    expect_out "resumed from $out.1host/checkpoints/step_00000004 (step 4)"
    continues "$tmp/ref" "$out.1host" "$name, restarted on host 1 alone"
  fi
  printf '%-14s ranks ended %s s (%s), %s s (%s) after the fault; %s (exit %s); host 2 named by %s\n' "$name:" \
    "$(secs "$e1")" "$h1" "$(secs "$e2")" "$h2" "$mpirun_end" "$code" "${named%% (*}"
  local alone=""
  [ -d "$out.1host/checkpoints/step_00000012" ] && alone=" and on $h1 alone, dp 2 ($(secs $(( $(ms) - t2 ))) s)"
  printf '%-14s latest step 4 verified; restarted from it on both hosts (%s s)%s: losses within 1e-6, states within 1e-5 (%s s in all)\n' \
    "" "$(secs $((t2 - t1)))" "$alone" "$(secs $(( $(ms) - t_start )))"
}

start=$(date +%s)
case $case_name in
layouts2)
  one_process
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
  one_process
  up 4 1
  placement "0 ${prefix}-1 1 ${prefix}-2 2 ${prefix}-3 3 ${prefix}-4 "
  layout dp4 "dp 4 x pp 1 x tp 1" -- data.batch=2
  layout dp2_tp2 "dp 2 x pp 1 x tp 2" -- run.parallel.tp=2 data.batch=4
  layout pp2_tp2 "dp 1 x pp 2 x tp 2" -- run.parallel.pp=2 run.parallel.tp=2 run.parallel.microbatches=4
  layout zero3_dp4 "dp 4 x pp 1 x tp 1" -- zero.stage=params data.batch=2
  # Expert parallel across hosts (issue 73): graphs/moe.yaml at the tests' size, its experts split
  # over 4 hosts (each token's row sent to its expert's host and back) and over 2 ep groups of 2.
  g=(graphs/moe.yaml data.path=data/text/fortunes_byte data.seq_len=32 model.layers=2 model.dim=32 model.heads=4
     model.kv_heads=2 model.mlp_dim=48 model.vocab=256 model.context=32 model.moe.experts=8 model.moe.expert_dim=16
     model.moe.aux_loss=false run.steps=6 run.log_every=1 run.threads=1 opt.warmup=2 eval.every=3 eval.batches=2
     eval.batch=4 evlog.every=3 ckpt.every=3 data.batch=8)
  rm -rf "$tmp/one"  # the GPT's one-process run (its checkpoints would be resumed)
  one_process
  layout moe_ep4 "dp 4 (ep 4) x pp 1 x tp 1" -- run.parallel.ep=4 data.batch=2
  layout moe_ep2_dp2 "dp 4 (ep 2) x pp 1 x tp 1" -- run.parallel.ep=2 data.batch=2
  ;;
ckpt2)
  # Per-rank checkpoints across hosts (issue 72; mpi_test.sh's ckpt_reshard on 2 hosts x 2 ranks).
  # dp 2 x tp 2 with ZeRO-3 writes its checkpoints into the shared out_dir, each rank its own files
  # on its own host, as the manifest records; from step 3 the run continues at pp 2 (a stage a
  # host), at tp 4 (tp across the hosts) and at one process, each ending where an uninterrupted
  # run of one process ends (SGD with momentum: every tensor within 1e-5).
  [ -x "$tensordiff_bin" ] || fail "no tensordiff at $tensordiff_bin (build the tensordiff target)"
  g=("${tiny_gpt[@]}" model.layers=4 opt.kind=sgd opt.adamw=null)
  up 2 2
  h1=${prefix}-1 h2=${prefix}-2
  placement "0 $h1 1 $h1 2 $h2 3 $h2 "
  t0=$(date +%s.%N)
  run_code 0 "$flowrun" "${g[@]}" data.batch=8 run.out_dir="$tmp/one"
  run_code 0 timeout 300 "$hosts" mpirun $prefix -H "$hl" -np 4 "$flowrun" "${g[@]}" data.batch=4 run.parallel.tp=2 \
    zero.stage=params run.out_dir="$tmp/w"
  expect_out "processes: dp 2 x pp 1 x tp 2 (4 processes)"
  expect_out "(ZeRO stage params, this rank's 1/2 slice)"  # ZeRO shards over dp
  step3=$tmp/w/checkpoints/step_00000003
  [ -f "$step3/model.params.safetensors" ] && fail "a whole-model file was written (gathered) at 4 ranks"
  writers "$step3" $h1 $h1 $h2 $h2
  writers "$tmp/w/checkpoints/step_00000006" $h1 $h1 $h2 $h2 > /dev/null
  printf 'dp 2 x tp 2, ZeRO-3, on 2 hosts: steps 3 and 6 written by every rank on its host (%.1f s with one process)\n' \
    "$(echo "$(date +%s.%N) - $t0" | bc)"
  # pp 2: one rank a host, stage 0 on the first, stage 1 on the second.
  t0=$(date +%s.%N)
  from "$tmp/w" "$tmp/pp2"
  run_code 0 timeout 300 "$hosts" mpirun $prefix -H "$("$hosts" hosts $prefix 1)" -np 2 "$flowrun" "${g[@]}" data.batch=8 \
    run.parallel.pp=2 run.parallel.microbatches=2 run.out_dir="$tmp/pp2" run.resume=auto
  expect_out "processes: dp 1 x pp 2 x tp 1 (2 processes)"
  expect_out "resumed from $tmp/pp2/checkpoints/step_00000003"
  writers "$tmp/pp2/checkpoints/step_00000006" $h1 $h2 > /dev/null
  # tp 4: every tp group spans both hosts.
  from "$tmp/w" "$tmp/tp4"
  run_code 0 timeout 300 "$hosts" mpirun $prefix -H "$hl" -np 4 "$flowrun" "${g[@]}" data.batch=8 run.parallel.tp=4 \
    run.out_dir="$tmp/tp4" run.resume=auto
  expect_out "processes: dp 1 x pp 1 x tp 4 (4 processes)"
  expect_out "resumed from $tmp/tp4/checkpoints/step_00000003"
  writers "$tmp/tp4/checkpoints/step_00000006" $h1 $h1 $h2 $h2 > /dev/null
  from "$tmp/w" "$tmp/np1"
  run_code 0 "$flowrun" "${g[@]}" data.batch=8 run.out_dir="$tmp/np1" run.resume=auto
  expect_out "resumed from $tmp/np1/checkpoints/step_00000003"
  for r in pp2 tp4 np1; do same_states one $r 1e-5 "resumed at $r from dp 2 x tp 2 (ZeRO-3) across hosts"; done
  printf 'resumed from step 3 at pp 2 (1 rank a host), tp 4 (2 hosts x 2), one process: step 6 as one process (%.1f s)\n' \
    "$(echo "$(date +%s.%N) - $t0" | bc)"
  # The folder not shared: the second host sees an empty file system of its own at the checkpoints
  # folder (hosts.sh's FLOWRUN_HOSTS_PRIVATE: a tmpfs in its processes' mount namespace). First
  # the emulation itself: the first host sees a file there, the second an empty tmpfs.
  t0=$(date +%s.%N)
  priv=$tmp/priv/checkpoints
  mkdir -p "$priv" && echo shared > "$priv/seen"
  export FLOWRUN_HOSTS_PRIVATE="$h2:$priv"
  [ "$("$hosts" exec $prefix $h1 cat "$priv/seen")" = shared ] || fail "$h1 does not see $priv/seen"
  [ "$("$hosts" exec $prefix $h2 stat -f -c %T "$priv")" = tmpfs ] || fail "$h2: no private tmpfs on $priv"
  [ -z "$("$hosts" exec $prefix $h2 ls -A "$priv")" ] || fail "$h2 sees the shared files in $priv"
  rm "$priv/seen"
  # dp 4, 2 ranks a host: every rank fails at the checkpoint node's setup (before step 1), naming
  # the second host's ranks.
  run_code nonzero timeout 120 "$hosts" mpirun $prefix -H "$hl" -np 4 "$flowrun" "${g[@]}" data.batch=2 run.out_dir="$tmp/priv"
  unset FLOWRUN_HOSTS_PRIVATE
  grep -o "checkpoint: every rank writes its own files.*" "$tmp/out" | head -n 1 | sed 's/^/  /'
  expect_out "does not see the file rank 0 wrote in $priv"
  expect_out "rank 2 on host $h2 does not see"
  expect_out "rank 3 on host $h2 does not see"
  expect_out "(rank 0 is on host $h1)"
  grep -q "rank 1 on host $h1 does not see" "$tmp/out" && { cat "$tmp/out" >&2; fail "rank 1 (on $h1, beside rank 0) is said not to see the folder"; }
  grep -q '"step":1,' "$tmp/priv/metrics.jsonl" 2> /dev/null && fail "the run trained with a folder one host does not see"
  mountpoint -q "$priv" && fail "the private tmpfs on $priv leaked into this namespace"
  [ -z "$(ls -A "$priv")" ] || fail "rank 0 left files in $priv: $(ls -A "$priv")"
  printf 'checkpoints folder private to %s: refused at setup (exit %s), naming its ranks (%.1f s)\n' "$h2" "$got" "$(echo "$(date +%s.%N) - $t0" | bc)"
  ;;
faults2 | faults2_link | faults2_host)
  # Host 2 of 2 hosts x 2 ranks lost (issue 72, run.heartbeat_timeout_s): its link cut (faults2_link),
  # or every process on it killed (faults2_host), mid-step, mid-all-reduce and mid-checkpoint
  # (fault() above says how each is reached). Each time every rank ends within the heartbeat
  # timeout and a margin, the output names host 2, the checkpoints stay whole, and the job,
  # restarted by scripts/restart.sh on both hosts and on host 1 alone, ends as an uninterrupted run.
  [ -x "$tensordiff_bin" ] || fail "no tensordiff at $tensordiff_bin (build the tensordiff target)"
  hb=3
  bound=$((hb + 4))  # the heartbeat timeout, then up to 2 s for the failure notices (do_abort) and Open MPI's teardown
  # ddp.yaml (its fault node from tests/plugins, under FLOWRUN_BUILD): 12 steps, checkpoints at 4, 8, 12.
  g=(tests/mpi/ddp.yaml run.steps=12 ckpt.every=4 "run.heartbeat_timeout_s=$hb")
  up 2 2
  h1=${prefix}-1 h2=${prefix}-2 veth=fr${x}v2  # veth: host 2's link, its root-namespace end (hosts.sh up)
  placement "0 $h1 1 $h1 2 $h2 3 $h2 "
  # One attempt of the job under scripts/restart.sh: it waits for the test's go-ahead (the file go,
  # whose lines, this attempt's pace: data.delay_ms, ckpt.write_delay_ms, are added to the job's
  # command), runs the command, and notes when it returned (ms) in the file ended.
  cat > "$tmp/attempt" <<'ATTEMPT'
dir=$(dirname "$0")
until [ -f "$dir/go" ]; do sleep 0.05; done
mapfile -t pace < "$dir/go"
rm -f "$dir/go"
"$@" "${pace[@]}"
rc=$?
echo $(( $(date +%s%N) / 1000000 )) > "$dir/ended"
exit $rc
ATTEMPT
  t0=$(date +%s.%N)
  run_code 0 timeout 120 "$hosts" mpirun $prefix -H "$hl" -np 4 "$flowrun" "${g[@]}" data.batch=4 run.out_dir="$tmp/ref"
  printf 'the uninterrupted run (dp 4 on 2 hosts): %.1f s\n' "$(echo "$(date +%s.%N) - $t0" | bc)"
  case $case_name in faults2) kinds="link host" ;; faults2_link) kinds="link" ;; faults2_host) kinds="host" ;; esac
  for kind in $kinds; do
    for point in step allreduce ckpt; do fault $kind $point; done
  done
  ;;
*) fail "unknown case" ;;
esac
echo "PASS [$case_name] ($(( $(date +%s) - start )) s)"
