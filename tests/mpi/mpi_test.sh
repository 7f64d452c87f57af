#!/usr/bin/env bash
# Multi-process end-to-end tests: flowrun under mpirun -np 2.
# Usage: mpi_test.sh CASE FLOWRUN SRC BUILD TESTTOOL
set -u
case_name=$1 flowrun=$2 src=$3 build=$4 tool=$5
tensordiff_bin=$(dirname "$tool")/tensordiff  # tests/tools/tensordiff.cpp: two checkpoints' largest difference
tmp=$(mktemp -d /tmp/flowrun-mpi.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export FLOWRUN_BUILD=$build
cd "$src"
graph=tests/mpi/ddp.yaml

# Two ranks on a 2-core machine: no core binding; as root Open MPI wants to be told it is fine;
# containers often forbid the cross-memory-attach copy mechanism, so do not use it.
mpi=(mpirun --oversubscribe -np 2 --bind-to none)
[ "$(id -u)" = 0 ] && mpi+=(--allow-run-as-root)
export OMPI_MCA_btl_vader_single_copy_mechanism=none
mpi4=("${mpi[@]}")
mpi4[3]=4  # -np 4: the mesh's layouts of 2 x 2

# fail, needs_data, expect_out, losses, same_numbers, whole_file, $tensordiff, params, from,
# same_states, tiny_gpt
source "$src/tests/mpi/lib.sh"
# run_code WANT CMD...: run with output in $tmp/out; WANT is a code or "nonzero"
run_code() {
  local want=$1; shift
  "$@" >"$tmp/out" 2>&1
  got=$?
  if [ "$want" = nonzero ]; then
    [ "$got" != 0 ] && [ "$got" != 124 ] || { cat "$tmp/out" >&2; fail "'$*' exited $got, expected a failure (not a timeout)"; }
  else
    [ "$got" = "$want" ] || { cat "$tmp/out" >&2; fail "'$*' exited $got, expected $want"; }
  fi
}
# graphs/dit_base.yaml at the same tiny size (tiny_gpt: lib.sh).
tiny_dit=(graphs/dit_base.yaml run.steps=6 run.log_every=1 run.progress=off run.threads=1 tok.max_length=12 text.dim=16
          text.heads=2 text.ffn=32 model.hidden=32 model.depth=3 model.heads=4 model.mlp_ratio=2.0 model.text_dim=16
          opt.warmup=2 ema.decay=0.9 ema.warmup=false vae.weights=null sample.steps=2 sample.per_prompt=1 sample.every=3
          fid.every=3 eval.every=3 evlog.every=3 eval.batches=1 ckpt.every=3)

case $case_name in
equivalence)
  # DDP's guarantee: 2 ranks with batch B/2 each end where 1 rank with batch B ends.
  run_code 0 "$flowrun" $graph run.out_dir="$tmp/one" data.batch=16
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/two" data.batch=8
  expect_out "[rank 1]"
  "$tensordiff" "$(params "$tmp/one" 10)" "$(params "$tmp/two" 10)" 1e-5 || fail "parameters differ"
  # The logged loss is the mean over ranks: the loss of the whole batch.
  losses "$tmp/one/metrics.jsonl" > "$tmp/l1"; losses "$tmp/two/metrics.jsonl" > "$tmp/l2"
  [ "$(wc -l < "$tmp/l1")" = 10 ] && [ "$(wc -l < "$tmp/l2")" = 10 ] || fail "expected 10 logged losses each"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-5 || fail "logged losses differ"
  # Grads accumulated into the all-reduce buffer (grad_layout buffer) train bit for bit like
  # fresh grads copied into it (the default).
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/buffer" data.batch=8 fb.grad_layout=buffer
  "$tensordiff" "$(params "$tmp/two" 10)" "$(params "$tmp/buffer" 10)" 0 || fail "grad_layout buffer differs from fresh"
  ;;
independent_collectives)
  # Collective nodes the graph leaves unordered (two metrics nodes, the gradient all-reduce),
  # one worker thread per rank, with the compute thread and without: every step completes
  # (before each communicating node got a thread of its own, rank 0 waited in the metrics
  # all-reduce while rank 1 waited in a bucket's, until run.comm_timeout_s ended the job).
  for ct in true false; do
    run_code 0 timeout 120 "${mpi[@]}" "$flowrun" tests/mpi/independent.yaml run.out_dir="$tmp/ind_$ct" run.compute_thread=$ct
    [ "$(grep -c '"loss"' "$tmp/ind_$ct/metrics.jsonl")" = 30 ] || fail "expected 30 logged losses (compute_thread $ct)"
  done
  # Without an allreduce each rank trains a replica of its own: allowed, with a warning.
  sed -e '/sync:/d' -e 's/grads: sync.grads/grads: fb.grads/' tests/mpi/independent.yaml > "$tmp/replicas.yaml"
  run_code 0 timeout 120 "${mpi[@]}" "$flowrun" "$tmp/replicas.yaml" run.out_dir="$tmp/rep" run.steps=3
  expect_out "2 ranks but no allreduce node: each rank trains a replica of its own"
  ;;
zero_states)
  # ZeRO stage 1 (zero.stage=states): each rank keeps the moments of half the parameters and the
  # run ends exactly where stage none ends; the checkpoint holds whole tensors, so a run resumes
  # at the same world size bit for bit and at another (2 -> 1, 1 -> 2) within the data-parallel
  # tolerance (the one-process batch of 16 against two ranks of 8, as equivalence).
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/none" data.batch=8
  grep -o "optimizer state [0-9.]* MB" "$tmp/out" | head -1 | awk '{print $3}' > "$tmp/mem_none"
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/sharded" data.batch=8 zero.stage=states
  expect_out "(ZeRO stage states, this rank's 1/2 slice)"
  grep -o "optimizer state [0-9.]* MB" "$tmp/out" | head -1 | awk '{print $3}' > "$tmp/mem_sharded"
  awk -v a="$(cat "$tmp/mem_none")" -v b="$(cat "$tmp/mem_sharded")" 'BEGIN { exit !(b <= 0.51 * a && b >= 0.49 * a) }' ||
    fail "optimizer state per rank: $(cat "$tmp/mem_none") MB unsharded, $(cat "$tmp/mem_sharded") MB sharded: not halved"
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/none/checkpoints/step_00000010/$f.safetensors" "$tmp/sharded/checkpoints/step_00000010/$f.safetensors" 0 ||
      fail "$f differs between stage states and stage none"
  done
  # 2 -> 2: five steps, a checkpoint, five more, as the straight run.
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/r22" data.batch=8 zero.stage=states run.steps=5 ckpt.every=5
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/r22" data.batch=8 zero.stage=states run.resume=auto
  "$tensordiff" "$(params "$tmp/sharded" 10)" "$(params "$tmp/r22" 10)" 0 || fail "resume 2 -> 2 differs"
  # 2 -> 1: the sharded checkpoint of step 5 continued by one process (batch 16).
  mkdir -p "$tmp/r21/checkpoints" && cp -r "$tmp/r22/checkpoints/step_00000005" "$tmp/r21/checkpoints/" &&
    echo step_00000005 > "$tmp/r21/checkpoints/latest"
  run_code 0 "$flowrun" $graph run.out_dir="$tmp/r21" data.batch=16 run.resume=auto
  "$tensordiff" "$(params "$tmp/sharded" 10)" "$(params "$tmp/r21" 10)" 1e-5 || fail "resume 2 -> 1 differs"
  # 1 -> 2: one process's checkpoint of step 5 continued by two sharded ranks.
  run_code 0 "$flowrun" $graph run.out_dir="$tmp/r12" data.batch=16 run.steps=5 ckpt.every=5
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/r12" data.batch=8 zero.stage=states run.resume=auto
  "$tensordiff" "$(params "$tmp/sharded" 10)" "$(params "$tmp/r12" 10)" 1e-5 || fail "resume 1 -> 2 differs"
  # Adafactor, sharded by whole parameters: the same run as unsharded, less state per rank, and
  # its checkpoint (the statistics gathered from their ranks) continued by one process.
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/af_none" data.batch=8 opt.kind=adafactor
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/af_sharded" data.batch=8 opt.kind=adafactor zero.stage=states
  for f in model.params opt.state; do
    "$tensordiff" "$tmp/af_none/checkpoints/step_00000010/$f.safetensors" "$tmp/af_sharded/checkpoints/step_00000010/$f.safetensors" 0 ||
      fail "Adafactor: $f differs between stage states and stage none"
  done
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/af21" data.batch=8 opt.kind=adafactor zero.stage=states \
    run.steps=5 ckpt.every=5
  rm -rf "$tmp/af21/checkpoints/step_00000010"
  run_code 0 "$flowrun" $graph run.out_dir="$tmp/af21" data.batch=16 opt.kind=adafactor run.resume=auto
  "$tensordiff" "$(params "$tmp/af_sharded" 10)" "$(params "$tmp/af21" 10)" 1e-5 || fail "Adafactor resume 2 -> 1 differs"
  # A rank killed, or hanging, mid-run while the other waits in the parameters' all-gather: the
  # job ends (a hang by run.comm_timeout_s), well within 60 s.
  start=$(date +%s)
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/kill" data.batch=8 zero.stage=states \
    run.steps=50 fault.rank=1 fault.step=5 fault.mode=kill
  [ $(( $(date +%s) - start )) -lt 60 ] || fail "a killed rank: the job took $(( $(date +%s) - start )) s to end"
  start=$(date +%s)
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/hang" data.batch=8 zero.stage=states \
    run.steps=50 run.comm_timeout_s=3 fault.rank=1 fault.step=5 fault.mode=hang
  expect_out "no answer from the other ranks in 3 s (run.comm_timeout_s)"
  [ $(( $(date +%s) - start )) -lt 60 ] || fail "a hanging rank: the job took $(( $(date +%s) - start )) s to end"
  ;;
zero_gradients)
  # ZeRO stage 2 (zero.stage=gradients): each bucket's gradients reduce-scattered, each rank
  # keeping the averaged gradients of its half only. Without clipping the run ends exactly where
  # stage none ends (the same sums: a pair of ranks adds in one order); with clipping within
  # rounding (the norm is summed per rank). Per-rank gradients and optimizer state halved (the
  # optimizer's log); the checkpoint holds whole tensors (resume 2 -> 2 bit for bit, 2 -> 1, 1 -> 2);
  # grads from anything but an allreduce are refused; a killed rank ends the job.
  for s in none gradients; do
    run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/$s" data.batch=8 zero.stage=$s opt.clip=0
    grep -o "gradients [0-9.]* MB, optimizer state [0-9.]* MB" "$tmp/out" | head -1 | awk '{print $2, $6}' > "$tmp/mem_$s"
  done
  expect_out "(ZeRO stage gradients, this rank's 1/2 slice)"
  expect_out "autograd's, freed bucket by bucket, + this rank's 1/2 (ZeRO stage gradients)"
  read -r g_none s_none < "$tmp/mem_none"; read -r g_sh s_sh < "$tmp/mem_gradients"
  awk -v a="$g_none" -v b="$g_sh" -v c="$s_none" -v d="$s_sh" \
    'BEGIN { exit !(b <= 0.51 * a && b >= 0.49 * a && d <= 0.51 * c && d >= 0.49 * c) }' ||
    fail "per rank: gradients $g_none -> $g_sh MB, optimizer state $s_none -> $s_sh MB: not halved"
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/none/checkpoints/step_00000010/$f.safetensors" "$tmp/gradients/checkpoints/step_00000010/$f.safetensors" 0 ||
      fail "$f differs between stage gradients and stage none"
  done
  # Launched after backward (overlap false) and sent as bf16 (compress): the same sums again.
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/late" data.batch=8 zero.stage=gradients opt.clip=0 sync.overlap=false
  "$tensordiff" "$(params "$tmp/none" 10)" "$(params "$tmp/late" 10)" 0 || fail "overlap false differs"
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/bf_none" data.batch=8 opt.clip=0 sync.compress=bf16
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/bf_sh" data.batch=8 opt.clip=0 sync.compress=bf16 zero.stage=gradients
  "$tensordiff" "$(params "$tmp/bf_none" 10)" "$(params "$tmp/bf_sh" 10)" 0 || fail "compress bf16 differs"
  # With the graph's clip (1.0), and Adafactor (sharded by whole parameters).
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/clip_none" data.batch=8
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/clip_full" data.batch=8 zero.stage=gradients
  "$tensordiff" "$(params "$tmp/clip_none" 10)" "$(params "$tmp/clip_full" 10)" 1e-5 || fail "with clip: differs"
  # 2 -> 2: five steps, a checkpoint, five more, as the straight run, bit for bit.
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/clip_sh" data.batch=8 zero.stage=gradients run.steps=5 ckpt.every=5
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/clip_sh" data.batch=8 zero.stage=gradients run.resume=auto
  "$tensordiff" "$(params "$tmp/clip_full" 10)" "$(params "$tmp/clip_sh" 10)" 0 || fail "resume 2 -> 2 differs"
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/af_none" data.batch=8 opt.kind=adafactor opt.clip=0
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/af_sh" data.batch=8 opt.kind=adafactor opt.clip=0 zero.stage=gradients zero.cut=tensors
  for f in model.params opt.state; do
    "$tensordiff" "$tmp/af_none/checkpoints/step_00000010/$f.safetensors" "$tmp/af_sh/checkpoints/step_00000010/$f.safetensors" 0 ||
      fail "Adafactor: $f differs between stage gradients and stage none"
  done
  # A plugin's update rule (examples/plugins/lion, element-wise) sharded like the built-in ones:
  # ZeRO-1 and ZeRO-2 end where stage none ends, its moment gathered whole into the checkpoint.
  sed 's#libt_plugin_fault.so" \]#libt_plugin_fault.so", "${FLOWRUN_BUILD}/examples/plugins/liblion.so" ]#' $graph > "$tmp/lion.yaml"
  for s in none states gradients; do
    run_code 0 "${mpi[@]}" "$flowrun" "$tmp/lion.yaml" run.out_dir="$tmp/lion_$s" data.batch=8 opt.kind=lion opt.lr=1e-3 \
      opt.clip=0 zero.stage=$s
  done
  expect_out "(ZeRO stage gradients, this rank's 1/2 slice)"
  for s in states gradients; do
    for f in model.params opt.state; do
      "$tensordiff" "$tmp/lion_none/checkpoints/step_00000010/$f.safetensors" \
        "$tmp/lion_$s/checkpoints/step_00000010/$f.safetensors" 0 || fail "Lion: $f differs between stage $s and stage none"
    done
  done
  # 2 -> 1: the sharded run's checkpoint of step 5 continued by one process (batch 16); 1 -> 2.
  rm -rf "$tmp/clip_sh/checkpoints/step_00000010" && echo step_00000005 > "$tmp/clip_sh/checkpoints/latest"
  run_code 0 "$flowrun" $graph run.out_dir="$tmp/clip_sh" data.batch=16 run.resume=auto
  "$tensordiff" "$(params "$tmp/clip_none" 10)" "$(params "$tmp/clip_sh" 10)" 1e-5 || fail "resume 2 -> 1 differs"
  run_code 0 "$flowrun" $graph run.out_dir="$tmp/r12" data.batch=16 run.steps=5 ckpt.every=5
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/r12" data.batch=8 zero.stage=gradients run.resume=auto
  "$tensordiff" "$(params "$tmp/clip_none" 10)" "$(params "$tmp/r12" 10)" 1e-5 || fail "resume 1 -> 2 differs"
  # grads not from an allreduce: refused, naming the fix.
  run_code nonzero "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/bad" data.batch=8 zero.stage=gradients opt.in.grads=fb.grads
  expect_out "ZeRO stage gradients reduce-scatters the gradients in an allreduce node, but 'grads' comes from 'fb.grads'"
  # The plan read by the optimizer only (forward_backward would keep whole gradients), and
  # Adafactor cut element-wise: refused, naming the fix.
  sed '/^  fb:/s/, zero: zero.plan//' $graph > "$tmp/fb_whole.yaml"
  run_code nonzero "${mpi[@]}" "$flowrun" "$tmp/fb_whole.yaml" run.out_dir="$tmp/bad" data.batch=8 zero.stage=gradients
  expect_out "the forward_backward 'fb' whose gradients this node updates from reads the ZeRO plan of nobody and this node 'zero.plan'"
  run_code nonzero "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/bad" data.batch=8 zero.stage=gradients opt.kind=adafactor
  expect_out "set zero.cut=tensors"
  # A rank killed mid-run while the other waits in a reduce-scatter or the all-gather.
  start=$(date +%s)
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/kill" data.batch=8 zero.stage=gradients \
    run.steps=50 fault.rank=1 fault.step=5 fault.mode=kill
  [ $(( $(date +%s) - start )) -lt 60 ] || fail "a killed rank: the job took $(( $(date +%s) - start )) s to end"
  ;;
overlap_trace)
  # A model with several buckets and a backward long enough to see: bucket all-reduces must
  # start while forward_backward (backward) is still running.
  # Each rank's trace and profile (run.profile) draws on the graph with `flowrun dot --trace`.
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/o" run.steps=6 run.trace="$tmp/trace.json" \
    model.hidden=512 model.layers=4 data.batch=256 sync.bucket_mb=0.5 sync.first_bucket_mb=0.25 run.profile=true
  [ -f "$tmp/trace.json" ] && [ -f "$tmp/trace.rank1.json" ] || fail "expected one trace per rank"
  "$tool" trace-overlap "$tmp/trace.json" fb sync || fail "no bucket started before backward ended"
  [ -f "$tmp/o/profile.json" ] && [ -f "$tmp/o/profile.rank1.json" ] || fail "expected one profile per rank"
  expect_out "[rank 0] critical path ("
  for t in "$tmp/trace.json" "$tmp/trace.rank1.json"; do
    "$flowrun" dot --trace "$t" $graph > "$tmp/g.dot" 2>&1 || { cat "$tmp/g.dot" >&2; fail "dot --trace $t failed"; }
    grep -q '"sync" \[label="sync : allreduce.*mean ' "$tmp/g.dot" || { cat "$tmp/g.dot" >&2; fail "sync not timed in $t"; }
  done
  ;;
throw_ends_job)
  start=$(date +%s)
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/t" run.steps=50 fault.rank=1 fault.step=5 fault.mode=throw
  expect_out "rank 1 of 2: node 'fault' (t_fault) failed at step 5: deliberate failure on rank 1"
  expect_out "rank 1 failed, so the job ends here too"   # rank 0 learned why
  [ $(( $(date +%s) - start )) -lt 30 ] || fail "the job took longer than the comm timeout to end"
  ;;
sigkill_ends_job)
  start=$(date +%s)
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/k" run.steps=50 fault.rank=1 fault.step=5 fault.mode=kill
  grep -qE "rank 1 .*(exited on signal 9|Killed)|process rank 1" "$tmp/out" || { cat "$tmp/out" >&2; fail "the killed rank is not named"; }
  [ $(( $(date +%s) - start )) -lt 30 ] || fail "the job took longer than the comm timeout to end"
  ;;
hang_times_out)
  # Rank 1 hangs (alive, silent): rank 0's all-reduce times out and ends the job.
  start=$(date +%s)
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/h" run.steps=50 run.comm_timeout_s=3 \
    fault.rank=1 fault.step=5 fault.mode=hang
  expect_out "no answer from the other ranks in 3 s (run.comm_timeout_s)"
  expect_out "rank 0 of 2: node 'sync' (allreduce) failed at step"
  [ $(( $(date +%s) - start )) -lt 60 ] || fail "the job did not end within a bounded time"
  ;;
resume_identical)
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/straight" run.steps=20
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/split" run.steps=10
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/split" run.steps=20 run.resume=auto
  expect_out "resumed from"
  losses "$tmp/straight/metrics.jsonl" > "$tmp/a"; losses "$tmp/split/metrics.jsonl" > "$tmp/b"
  [ "$(wc -l < "$tmp/b")" = 20 ] || fail "expected 20 logged losses after the resume"
  cmp -s "$tmp/a" "$tmp/b" || { diff "$tmp/a" "$tmp/b" >&2; fail "losses after the resume differ"; }
  "$tensordiff" "$(params "$tmp/straight" 20)" "$(params "$tmp/split" 20)" 0 || fail "parameters differ"
  ;;
graph_mismatch)
  # The ranks disagree on the graph: both say so and the job ends without training.
  mm=(mpirun --oversubscribe --bind-to none); [ "$(id -u)" = 0 ] && mm+=(--allow-run-as-root)
  run_code nonzero timeout 60 "${mm[@]}" -np 1 "$flowrun" $graph run.out_dir="$tmp/m" : -np 1 "$flowrun" $graph run.out_dir="$tmp/m" opt.lr=0.5
  expect_out "the resolved graph (file, substitutions and overrides) of rank(s) 1 differs from rank 0's"
  [ ! -f "$tmp/m/metrics.jsonl" ] || [ ! -s "$tmp/m/metrics.jsonl" ] || fail "it trained anyway"
  ;;
signal_stops_every_rank)
  # SIGUSR1, then SIGTERM, to mpirun (which forwards both to the ranks): every rank stops before
  # the same step and the at-stop checkpoint holds that step; resuming from it with 2 ranks
  # continues exactly as a job that was never stopped.
  g=($graph ckpt.every=1000 'ckpt.at=[end, stop]' data.delay_ms=40)
  # stop_job SIGNAL DIR: start a long job in DIR, send SIGNAL to mpirun after 5 steps; sets $code
  # and $n (the last step) and checks that both ranks stopped cleanly with latest at step n.
  stop_job() {
    "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=100000 run.out_dir="$2" >"$tmp/out" 2>&1 &
    local pid=$!
    for i in $(seq 600); do [ "$(wc -l < "$2/metrics.jsonl" 2>/dev/null || echo 0)" -ge 5 ] && break; sleep 0.1; done
    kill -"$1" $pid
    for i in $(seq 300); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
    kill -0 $pid 2>/dev/null && { kill -9 $pid; cat "$tmp/out" >&2; fail "still running 30 s after SIG$1"; }
    code=0; wait $pid || code=$?
    [ "$(grep -c 'stopped after' "$tmp/out")" = 2 ] || { cat "$tmp/out" >&2; fail "SIG$1: not both ranks stopped cleanly"; }
    n=$(grep -o '"step":[0-9]*' "$2/metrics.jsonl" | tail -1 | cut -d: -f2)
    [ "$(cat "$2/checkpoints/latest")" = "step_$(printf %08d "$n")" ] || fail "SIG$1: latest is not the last step $n"
  }
  stop_job USR1 "$tmp/s"
  [ $code = 138 ] || { cat "$tmp/out" >&2; fail "exit code $code after SIGUSR1, expected 138"; }
  expect_out "SIGUSR1: stopping after the steps in flight"
  m=$((n + 4))
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=$m run.out_dir="$tmp/s" run.resume=auto
  expect_out "resumed from"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=$m run.out_dir="$tmp/straight"
  losses "$tmp/s/metrics.jsonl" | tail -4 > "$tmp/a"; losses "$tmp/straight/metrics.jsonl" | tail -4 > "$tmp/b"
  [ -s "$tmp/a" ] && cmp -s "$tmp/a" "$tmp/b" || { diff "$tmp/a" "$tmp/b" >&2; fail "losses after the resume differ"; }
  # SIGTERM (what a scheduler sends) the same way; mpirun then exits with a code of its own
  # (Open MPI 4: 1), the ranks with 143.
  stop_job TERM "$tmp/t"
  [ $code != 0 ] || { cat "$tmp/out" >&2; fail "exit code 0 after SIGTERM to mpirun"; }
  ;;
cappa_equivalence)
  # graphs/cappa.yaml at a tiny size: 2 ranks of 8 captions end where 1 process of 16 ends
  # (parallel-prediction rows are drawn per global row; the loss averages per caption). One
  # exception: the ViT's attention key bias (in attn.qkv.bias) gets a gradient that is zero in
  # exact arithmetic (softmax ignores a constant added to every score), so both runs hold only
  # rounding noise there, which Adafactor's normalisation turns into steps of about lr; it is
  # left out of the comparison (measured: every other element within 1e-5, that one 1.6e-3).
  needs_data data/shapes/base.json
  c=(graphs/cappa.yaml run.steps=10 run.log_every=1 data.size=32 model.image_size=32 model.patch=8 model.width=32
     model.depth=1 model.heads=2 model.mlp_dim=64 model.dec_width=32 model.dec_depth=1 model.dec_heads=2
     model.dec_mlp_dim=64 opt.warmup=2 opt.adafactor.min_dim_size_to_factor=8 eval.every=1000 evlog.every=1000)
  run_code 0 "$flowrun" "${c[@]}" run.out_dir="$tmp/one" data.batch=16
  run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" run.out_dir="$tmp/two" data.batch=8
  expect_out "[rank 1]"
  "$tensordiff" "$(params "$tmp/one" 10)" "$(params "$tmp/two" 10)" 1e-5 'attn\.qkv\.bias$' || fail "parameters differ"
  losses "$tmp/one/metrics.jsonl" > "$tmp/l1"; losses "$tmp/two/metrics.jsonl" > "$tmp/l2"
  [ "$(wc -l < "$tmp/l1")" = 10 ] && [ "$(wc -l < "$tmp/l2")" = 10 ] || fail "expected 10 logged losses each"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-5 || fail "logged losses differ"
  ;;
fidelity_ranks)
  # The sampler samples on rank 0 only; shapes_fidelity's all-reduce of the counts gives every
  # rank the figures of rank 0's images, so evlog's line (the mean over ranks) is the one-process
  # line. graphs/dit_base.yaml at a tiny size, lr 0 (the same model in both runs).
  needs_data data/shapes/base.json
  tiny=(graphs/dit_base.yaml run.steps=2 run.log_every=1 run.progress=off opt.lr=0 tok.max_length=12 text.dim=16
        text.heads=2 text.ffn=32 model.hidden=32 model.depth=2 model.heads=2 model.mlp_ratio=2.0 model.text_dim=16
        sample.steps=3 sample.per_prompt=2 eval.batch=8 eval.batches=1 vae.weights=null
        ckpt.at=[])
  run_code 0 "$flowrun" "${tiny[@]}" run.out_dir="$tmp/one" data.batch=16
  expect_out "over 14 prompts, 28 images"
  run_code 0 "${mpi[@]}" "$flowrun" "${tiny[@]}" run.out_dir="$tmp/two" data.batch=8
  expect_out "over 14 prompts, 28 images"
  for d in one two; do
    grep '"fidelity"' "$tmp/$d/metrics.jsonl" | python3 -c 'import json, sys
j = json.loads(sys.stdin.read())
print(json.dumps({k: v for k, v in j.items() if k == "fidelity" or k.startswith("per_prompt/")}, sort_keys=True))' \
      > "$tmp/$d.fid" || fail "no fidelity line in $d/metrics.jsonl"
  done
  grep -q per_prompt/ "$tmp/one.fid" || fail "no per_prompt fields"
  cmp -s "$tmp/one.fid" "$tmp/two.fid" || { cat "$tmp/one.fid" "$tmp/two.fid" >&2; fail "the figures differ"; }
  # Each rank's own training batch: different captions on each rank, so the counts would not
  # line up; every rank refuses, none hangs.
  cat > "$tmp/batch.yaml" <<'EOF'
flowrun: 1
run: { steps: 1 }
nodes:
  data: { type: image_text_shards, with: { path: data/shapes/base, size: 32, batch: 4 } }
  fid:  { type: shapes_fidelity, in: { images: data.batch, captions: data.captions } }
EOF
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" "$tmp/batch.yaml" run.out_dir="$tmp/b"
  expect_out "the ranks hold different captions"
  ;;
mesh_groups)
  # run.parallel's mesh (nodes/parallel/mesh.hpp) as MPI channels, one per dimension, on 4
  # processes: every layout's groups hold exactly their members (testtool mesh-groups checks an
  # all-reduce, a reduce-scatter and an all-gather of uneven blocks in each).
  # Tensor parallel's conjugate operators (parallel/tensor_parallel.hpp): Megatron's column-then-
  # row MLP split over tp groups of 2 and of 4 equals the whole MLP, output and gradients.
  # The GPT split the same way (models/gpt/gpt.hpp Config::tp: each rank's heads, MLP units and
  # vocabulary rows, scored by the vocabulary-parallel cross-entropy; whole weights loaded as a
  # file's, each rank taking its parts) equals the whole model: the loss and every gradient.
  # The DiT too (models/dit/dit.hpp Config::tp: both attentions' heads, the MLP's units), with both
  # text streams, the T5 pooler, size and style conditioning and the long skips; and with LoRA
  # adapters on split layers of both kinds and on a whole one (lora.hpp).
  # And CapPa (models/cappa/cappa.hpp Config::tp: the ViT's and the decoder's heads and MLP units).
  # One job runs them all in turn (one start-up: testtool's "+").
  run_code 0 "${mpi4[@]}" "$tool" mesh-groups 2 1 + mesh-groups 1 2 + mesh-groups 2 2 + mesh-groups 1 1 \
    + tp-mlp 2 + tp-mlp 4 + gpt-tp 2 + gpt-tp 4 + dit-tp 2 + dit-tp 4 + dit-tp 2 lora + dit-tp 4 lora + cappa-tp 2 + cappa-tp 4
  expect_out "dp: 1 groups of 4"
  expect_out "tp 2: the split MLP equals the whole one (output and gradients)"
  expect_out "tp 2: the split GPT equals the whole one"
  expect_out "tp 2: the split DiT equals the whole one"
  expect_out "tp 2: the split DiT with LoRA adapters equals the whole one"
  expect_out "tp 2: the split CapPa equals the whole one"
  # A rank that never joins its group's collective (alive, silent) ends every rank of every group
  # within the collective timeout.
  start=$(date +%s)
  run_code nonzero timeout 100 "${mpi4[@]}" "$tool" mesh-hang 2 1
  expect_out "no answer from the other ranks in 2 s (run.comm_timeout_s)"
  expect_out "rank 0 of 4: 'hang (tp)': an all-reduce rank 1 never joins"
  [ $(( $(date +%s) - start )) -lt 60 ] || fail "the job did not end within a bounded time"
  # A layout the world does not divide, and a pipeline setting without pipeline stages, end every
  # rank before any node is made, saying why.
  run_code 2 "${mpi4[@]}" "$flowrun" $graph run.out_dir="$tmp/odd" run.parallel.tp=3
  expect_out "tp 3 x pp 1 = 3 does not divide the 4 processes"
  run_code 2 "${mpi4[@]}" "$flowrun" $graph run.out_dir="$tmp/mb" run.parallel.microbatches=4
  expect_out "run.parallel.microbatches (4) is set, but run.parallel.pp is 1"
  # pp with a model that does not cut into stages (this graph's MLP): refused at setup.
  run_code 1 "${mpi4[@]}" "$flowrun" $graph run.out_dir="$tmp/pp" run.parallel.pp=2
  expect_out "does not cut into pipeline stages (built for cappa, dit, gpt and llama)"
  # tp with a model that does not split (this graph's MLP): refused, not trained whole on every rank.
  run_code 1 "${mpi4[@]}" "$flowrun" $graph run.out_dir="$tmp/tp" run.parallel.tp=2
  expect_out "does not split over tensor parallel (built for cappa, dit, gpt and llama)"
  ;;
tensor_parallel)
  # run.parallel.tp (issue 48): graphs/gpt.yaml at a tiny size, its heads, MLP units and
  # vocabulary split over the tp ranks (one all-reduce per attention and MLP, forward and
  # backward; the loss over the vocabulary columns), trains what one process trains: with SGD
  # (momentum) the parameters, momenta and EMA within 1e-5 of each tensor's largest value; with
  # AdamW every step's loss within 1e-6 and the evaluation's. Checkpoints hold whole tensors
  # under the one-process names: tp 2 -> 1 and 1 -> tp 2 resume, tp 2 -> tp 2 bit for bit.
  needs_data data/text/fortunes_byte.train.bin
  g=("${tiny_gpt[@]}" data.batch=8)
  sgd=(opt.kind=sgd opt.adamw=null)
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/sgd1"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/sgd2" run.parallel.tp=2
  expect_out "processes: dp 1 x pp 1 x tp 2 (2 processes)"
  expect_out "split over tp 2: the count is this rank's part"
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/sgd1/checkpoints/step_00000006/$f.safetensors" "$tmp/sgd2/checkpoints/step_00000006/$f.safetensors" 1e-5 ||
      fail "SGD: $f differs between tp 2 and one process"
  done
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/two" run.parallel.tp=2
  losses "$tmp/one/metrics.jsonl" > "$tmp/l1"; losses "$tmp/two/metrics.jsonl" > "$tmp/l2"
  [ "$(wc -l < "$tmp/l1")" = 6 ] && [ "$(wc -l < "$tmp/l2")" = 6 ] || fail "expected 6 logged losses each"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-6 || fail "AdamW: the losses differ between tp 2 and one process"
  # The clipped norm (clip 1.0; about 2 here) is the whole model's: split parts summed over tp.
  grep -o '"grad_norm":[0-9.eE+-]*' "$tmp/one/metrics.jsonl" | cut -d: -f2 > "$tmp/n1"
  grep -o '"grad_norm":[0-9.eE+-]*' "$tmp/two/metrics.jsonl" | cut -d: -f2 > "$tmp/n2"
  same_numbers "$tmp/n1" "$tmp/n2" 1e-6 || fail "the gradient norm differs between tp 2 and one process"
  grep -o '"val_loss":[0-9.eE+-]*' "$tmp/one/metrics.jsonl" | cut -d: -f2 > "$tmp/v1"
  grep -o '"val_loss":[0-9.eE+-]*' "$tmp/two/metrics.jsonl" | cut -d: -f2 > "$tmp/v2"
  same_numbers "$tmp/v1" "$tmp/v2" 1e-6 || fail "the evaluation differs between tp 2 and one process"
  # dp 2 x tp 2 (4 processes, 4 rows each) against one process of 8 rows.
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/four" run.parallel.tp=2 data.batch=4
  expect_out "processes: dp 2 x pp 1 x tp 2 (4 processes)"
  losses "$tmp/four/metrics.jsonl" > "$tmp/l4"
  same_numbers "$tmp/l1" "$tmp/l4" 1e-6 || fail "AdamW: the losses differ between dp 2 x tp 2 and one process"
  # Tokens per step are the job's (8 rows x 32 tokens), not counted again by each tp rank.
  for run in two four; do
    grep '"tokens_per_s"' "$tmp/$run/metrics.jsonl" | tail -1 |
      awk '{ match($0, /"steps_per_s":[0-9.eE+-]*/); s = substr($0, RSTART + 14, RLENGTH - 14);
             match($0, /"tokens_per_s":[0-9.eE+-]*/); t = substr($0, RSTART + 15, RLENGTH - 15);
             r = t / s; exit !(r > 255.9 && r < 256.1) }' || fail "$run: tokens per step is not 256"
  done
  # Dropout on (embeddings, attention probabilities, residual branches): tp 2 draws the masks of
  # tp 1 (a split head's attention mask cut from the whole tensor's), so the losses agree too.
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/drop1" model.dropout=0.1
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/drop2" model.dropout=0.1 run.parallel.tp=2
  losses "$tmp/drop1/metrics.jsonl" > "$tmp/d1"; losses "$tmp/drop2/metrics.jsonl" > "$tmp/d2"
  same_numbers "$tmp/d1" "$tmp/d2" 1e-6 || fail "with dropout the losses differ between tp 2 and tp 1"
  cmp -s "$tmp/d1" "$tmp/l1" && fail "dropout 0.1 changed no loss: the masks were not applied"
  # Resume across layouts: the checkpoint of step 3 continued by the other layout.
  from "$tmp/two" "$tmp/r21"
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/r21" run.resume=auto
  "$tensordiff" "$(params "$tmp/one" 6)" "$(params "$tmp/r21" 6)" 1e-5 || fail "resume tp 2 -> 1 differs"
  # The resume warning names the layout, as one line (issue 69).
  expect_out "processes 1 (dp 1 x pp 1 x tp 1); the checkpoint's run had 2 (dp 1 x pp 1 x tp 2)"
  # A checkpoint of another width under tp: the whole shapes, as at tp 1, this rank's part after.
  from "$tmp/one" "$tmp/wide"
  run_code nonzero "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/wide" run.resume=auto run.parallel.tp=2 model.dim=48
  expect_out "has shape [144], the one given has [96] [this rank holds [72] of it, its part of tp 2]"
  from "$tmp/one" "$tmp/r12"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/r12" run.resume=auto run.parallel.tp=2
  "$tensordiff" "$(params "$tmp/one" 6)" "$(params "$tmp/r12" 6)" 1e-5 || fail "resume 1 -> tp 2 differs"
  from "$tmp/two" "$tmp/r22"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/r22" run.resume=auto run.parallel.tp=2
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/two/checkpoints/step_00000006/$f.safetensors" "$tmp/r22/checkpoints/step_00000006/$f.safetensors" 0 ||
      fail "resume tp 2 -> tp 2: $f is not bit-identical"
  done
  # LoRA under tp (adapters split with their base layers, lora.hpp), its dropout on: the losses
  # of one process, and the exported PEFT adapter (whole tensors under PEFT's names) the same.
  lora=(model.lora.rank=4 model.lora.targets=[c_attn,c_proj,c_fc] model.lora.dropout=0.1 ckpt.exports=true)
  run_code 0 "$flowrun" "${g[@]}" "${lora[@]}" run.out_dir="$tmp/lora1"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${lora[@]}" run.out_dir="$tmp/lora2" run.parallel.tp=2
  losses "$tmp/lora1/metrics.jsonl" > "$tmp/a1"; losses "$tmp/lora2/metrics.jsonl" > "$tmp/a2"
  same_numbers "$tmp/a1" "$tmp/a2" 1e-6 || fail "LoRA: the losses differ between tp 2 and one process"
  for m in model.params ema.params; do
    "$tensordiff" "$tmp/lora1/checkpoints/step_00000006/$m/adapter_model.safetensors" \
      "$tmp/lora2/checkpoints/step_00000006/$m/adapter_model.safetensors" 1e-4 || fail "LoRA: the PEFT adapters of $m differ"
  done
  # What does not split is refused at start (a node's setup: exit 1), saying what to change.
  run_code 1 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/no3" run.parallel.tp=2 model.heads=3 model.dim=33
  expect_out "do not split into 2 tensor-parallel parts"
  ;;
tensor_parallel_dit)
  # run.parallel.tp for the DiT (issue 48): graphs/dit_base.yaml at a tiny size, both attentions'
  # heads and the MLP's units split over 2 ranks (its frozen VAE and BERT whole on each; the VAE's
  # posterior draws and the diffusion noise by replica), trains what one process trains: with
  # SGD (momentum) the parameters, momenta and EMA within 1e-5; with AdamW every step's loss, the
  # held-out loss and the sampler's grid (drawn by rank 0 with its tp partner, scored by
  # shapes_fidelity) as one process's. dp 2 x tp 2 against dp 2 (the diffusion objective draws
  # its noise and timesteps per replica, not per global row, so any dp 2 differs from one
  # process of twice the rows; tp must change nothing at a given dp).
  needs_data data/shapes/base.json
  g=("${tiny_dit[@]}" data.batch=8 eval.batch=8)
  run_code 0 "$flowrun" "${g[@]}" opt.kind=sgd run.out_dir="$tmp/sgd1"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" opt.kind=sgd run.out_dir="$tmp/sgd2" run.parallel.tp=2
  expect_out "split over tp 2: the count is this rank's part"
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/sgd1/checkpoints/step_00000006/$f.safetensors" "$tmp/sgd2/checkpoints/step_00000006/$f.safetensors" 1e-5 ||
      fail "SGD: $f differs between tp 2 and one process"
  done
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/two" run.parallel.tp=2
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/dp2" data.batch=4 eval.batch=4
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/four" run.parallel.tp=2 data.batch=4 eval.batch=4
  expect_out "processes: dp 2 x pp 1 x tp 2 (4 processes)"
  # same_runs A B: A's and B's logged losses, held-out losses and fidelities agree within 1e-6.
  same_runs() {
    for key in loss val_loss fidelity; do
      grep -o "\"$key\":[0-9.eE+-]*" "$tmp/$1/metrics.jsonl" | cut -d: -f2 > "$tmp/k1"
      grep -o "\"$key\":[0-9.eE+-]*" "$tmp/$2/metrics.jsonl" | cut -d: -f2 > "$tmp/k2"
      [ "$key" != loss ] || [ "$(wc -l < "$tmp/k1")" = 6 ] || fail "$1: expected 6 logged losses"
      same_numbers "$tmp/k1" "$tmp/k2" 1e-6 || fail "AdamW: $key differs between $2 and $1"
    done
  }
  same_runs one two
  same_runs dp2 four
  [ -s "$tmp/two/samples/step_0000006.png" ] || fail "the sampler wrote no grid under tp 2"
  [ "$(grep -c '"fidelity"' "$tmp/two/metrics.jsonl")" = 2 ] || fail "expected 2 fidelity lines under tp 2"
  # Same layout: a resumed run is bit-identical.
  from "$tmp/two" "$tmp/r22"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/r22" run.resume=auto run.parallel.tp=2
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/two/checkpoints/step_00000006/$f.safetensors" "$tmp/r22/checkpoints/step_00000006/$f.safetensors" 0 ||
      fail "resume tp 2 -> tp 2: $f is not bit-identical"
  done
  # LoRA on the split attentions and MLPs (its dropout on), over the base trained above (at its
  # init the DiT's output projections are zero, so adapters would get no gradient): with SGD the
  # exported PEFT adapters (the model's and the EMA's) of tp 2 are one process's within 1e-5 of
  # each tensor's largest value (B is small after 6 steps: about 7e-5).
  lora=(model.lora.rank=4 model.lora.targets=[to_q,to_k,to_v,to_out.0,net.0.proj,net.2] model.lora.dropout=0.1
        ckpt.exports=true opt.kind=sgd model.weights="$(params "$tmp/one" 6)")
  run_code 0 "$flowrun" "${g[@]}" "${lora[@]}" run.out_dir="$tmp/lora1"
  grep -o '"grad_norm":[0-9.eE+-]*' "$tmp/lora1/metrics.jsonl" | tail -1 | awk -F: '{ exit !($2 > 0) }' ||
    fail "LoRA: the adapters got no gradient"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${lora[@]}" run.out_dir="$tmp/lora2" run.parallel.tp=2
  for m in model.params ema.params; do
    "$tensordiff" "$tmp/lora1/checkpoints/step_00000006/$m/adapter_model.safetensors" \
      "$tmp/lora2/checkpoints/step_00000006/$m/adapter_model.safetensors" 1e-5rel || fail "LoRA: the PEFT adapters of $m differ"
  done
  # Heads that do not split are refused at start, saying what to change.
  run_code 1 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/no" run.parallel.tp=2 model.heads=1
  expect_out "do not both split into 2 tensor-parallel parts"
  ;;
tensor_parallel_cappa)
  # run.parallel.tp for CapPa (issue 48): graphs/cappa.yaml at a tiny size, the ViT's and the
  # decoder's heads and MLP units split over 2 ranks (the parallel-prediction rows and masks
  # drawn by replica), trains what one process trains: with SGD (momentum) the parameters and
  # momenta within 1e-5, with AdamW every step's loss within 1e-6 and the caption evaluator's
  # figures (greedy and parallel decoding through the split decoder) as one process's.
  needs_data data/shapes/base.json
  c=(graphs/cappa.yaml run.steps=6 run.log_every=1 run.threads=1 data.size=32 data.batch=8 model.image_size=32
     model.patch=8 model.width=32 model.depth=2 model.heads=2 model.mlp_dim=64 model.dec_width=32 model.dec_depth=2
     model.dec_heads=2 model.dec_mlp_dim=64 opt.warmup=2 eval.every=6 evlog.every=6 eval.batches=1 eval.batch=8
     eval.samples=2 ckpt.every=6)
  run_code 0 "$flowrun" "${c[@]}" opt.kind=sgd run.out_dir="$tmp/sgd1"
  run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" opt.kind=sgd run.out_dir="$tmp/sgd2" run.parallel.tp=2
  expect_out "split over tp 2: the count is this rank's part"
  for f in model.params opt.state; do
    "$tensordiff" "$tmp/sgd1/checkpoints/step_00000006/$f.safetensors" "$tmp/sgd2/checkpoints/step_00000006/$f.safetensors" 1e-5 ||
      fail "SGD: $f differs between tp 2 and one process"
  done
  run_code 0 "$flowrun" "${c[@]}" opt.kind=adamw run.out_dir="$tmp/one"
  run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" opt.kind=adamw run.out_dir="$tmp/two" run.parallel.tp=2
  losses "$tmp/one/metrics.jsonl" > "$tmp/l1"; losses "$tmp/two/metrics.jsonl" > "$tmp/l2"
  [ "$(wc -l < "$tmp/l1")" = 6 ] || fail "expected 6 logged losses"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-6 || fail "AdamW: the losses differ between tp 2 and one process"
  for key in val_loss val_token_acc val_par_token_acc; do
    grep -o "\"$key\":[0-9.eE+-]*" "$tmp/one/metrics.jsonl" | cut -d: -f2 > "$tmp/k1"
    grep -o "\"$key\":[0-9.eE+-]*" "$tmp/two/metrics.jsonl" | cut -d: -f2 > "$tmp/k2"
    same_numbers "$tmp/k1" "$tmp/k2" 1e-6 || fail "$key differs from one process's"
  done
  # Adafactor, the graph's own optimizer: its factored statistics of a split matrix are the
  # whole's (the factored dims chosen by the whole shape, a mean over the split dimension and the
  # update's RMS summed over the tp ranks, a statistic without it whole on each), so every loss
  # and the evaluation are one process's within 1e-6. (Its parameters are compared through the
  # loss, as AdamW's: the key bias's gradient is rounding noise, which Adafactor scales to a
  # whole step.) Checkpoints hold the whole statistics: tp 2 -> 1 and 1 -> tp 2 resume alike.
  # Every matrix factored (min_dim_size_to_factor 8), the MLPs narrower than the width so that
  # tp splits the second-largest dimension of some (the row statistic then split, the column one
  # whole) and the largest of others.
  c+=(opt.adafactor.min_dim_size_to_factor=8 model.mlp_dim=16 model.dec_mlp_dim=16 ckpt.every=3)
  run_code 0 "$flowrun" "${c[@]}" run.out_dir="$tmp/af1"
  run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" run.out_dir="$tmp/af2" run.parallel.tp=2
  from "$tmp/af2" "$tmp/af21"
  run_code 0 "$flowrun" "${c[@]}" run.out_dir="$tmp/af21" run.resume=auto
  from "$tmp/af1" "$tmp/af12"
  run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" run.out_dir="$tmp/af12" run.parallel.tp=2 run.resume=auto
  # With ZeRO over dp 2 (whole parameters a rank: cut tensors), dp 2 x tp 2 of 4 rows a replica
  # (its losses; its evaluation scores other rows).
  run_code 0 "${mpi4[@]}" "$flowrun" "${c[@]}" run.out_dir="$tmp/af4" run.parallel.tp=2 data.batch=4 zero.stage=gradients \
    zero.cut=tensors
  for run in af2 af21 af12 af4; do
    keys=(loss val_loss val_token_acc val_par_token_acc)
    [ $run = af4 ] && keys=(loss)
    for key in "${keys[@]}"; do
      grep -o "\"$key\":[0-9.eE+-]*" "$tmp/af1/metrics.jsonl" | cut -d: -f2 | tail -3 > "$tmp/k1"
      grep -o "\"$key\":[0-9.eE+-]*" "$tmp/$run/metrics.jsonl" | cut -d: -f2 | tail -3 > "$tmp/k2"
      same_numbers "$tmp/k1" "$tmp/k2" 1e-6 || fail "Adafactor ($run): $key differs from one process's"
    done
  done
  ;;
zero_params)
  # ZeRO stage 3 (zero.stage=params, train/fully_sharded.hpp): the parameters themselves sharded,
  # each rank keeping its half; blocks gathered around their use, recomputed ones again in
  # backward. Without clipping the run ends exactly where stage none ends (the same gradients,
  # reduce-scattered as stage 2's, the same update of each element): the MLP graph (no blocks:
  # gathered for the step) and graphs/gpt.yaml at a tiny size (its blocks gathered one by one),
  # with checkpoint: blocks too; the EMA (kept sharded like the parameters) and the evaluation
  # (of the EMA, gathered block by block) alike. Checkpoints hold whole tensors: resume 2 -> 2
  # bit for bit, 2 -> 1 and 1 -> 2 across stages.
  for s in none params; do
    run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/mlp_$s" data.batch=8 zero.stage=$s opt.clip=0
    grep -o "per rank: parameters [0-9.]* MB" "$tmp/out" | head -1 | awk '{print $4}' > "$tmp/p_$s"
  done
  expect_out "(ZeRO stage params, this rank's 1/2 slice)"
  awk -v a="$(cat "$tmp/p_none")" -v b="$(cat "$tmp/p_params")" 'BEGIN { exit !(b <= 0.51 * a && b >= 0.49 * a) }' ||
    fail "per rank parameters $(cat "$tmp/p_none") -> $(cat "$tmp/p_params") MB: not halved"
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/mlp_none/checkpoints/step_00000010/$f.safetensors" "$tmp/mlp_params/checkpoints/step_00000010/$f.safetensors" 0 ||
      fail "MLP: $f differs between stage params and stage none"
  done
  needs_data data/text/fortunes_byte.train.bin
  g=("${tiny_gpt[@]}" data.batch=4 model.layers=3 opt.clip=0)
  for c in none blocks; do
    run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/none_$c" model.checkpoint=$c
    run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/params_$c" model.checkpoint=$c zero.stage=params
    expect_out "ZeRO stage params (zero.plan): each rank keeps 1/2 of the"
    for f in model.params opt.state ema.params; do
      "$tensordiff" "$tmp/none_$c/checkpoints/step_00000006/$f.safetensors" "$tmp/params_$c/checkpoints/step_00000006/$f.safetensors" 0 ||
        fail "GPT (checkpoint $c): $f differs between stage params and stage none"
    done
    grep -o '"val_loss":[0-9.eE+-]*' "$tmp/none_$c/metrics.jsonl" > "$tmp/v1"
    grep -o '"val_loss":[0-9.eE+-]*' "$tmp/params_$c/metrics.jsonl" > "$tmp/v2"
    [ -s "$tmp/v1" ] && cmp -s "$tmp/v1" "$tmp/v2" || fail "GPT (checkpoint $c): the evaluation differs"
  done
  # The DiT (graphs/dit_base.yaml): its blocks gathered with the long skips' inputs kept, the
  # sampler run by every rank (each holds a slice), the evaluation and the fidelity of the grid
  # as stage none's.
  needs_data data/shapes/base.json
  d=("${tiny_dit[@]}" data.batch=4 eval.batch=4 opt.clip=0 ckpt.every=6)
  for s in none params; do
    run_code 0 "${mpi[@]}" "$flowrun" "${d[@]}" run.out_dir="$tmp/dit_$s" zero.stage=$s model.checkpoint=blocks
    grep -o '"val_loss":[0-9.eE+-]*\|"fidelity":[0-9.eE+-]*' "$tmp/dit_$s/metrics.jsonl" > "$tmp/dit_$s.figures"
  done
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/dit_none/checkpoints/step_00000006/$f.safetensors" "$tmp/dit_params/checkpoints/step_00000006/$f.safetensors" 0 ||
      fail "DiT: $f differs between stage params and stage none"
  done
  [ "$(wc -l < "$tmp/dit_none.figures")" = 4 ] && cmp -s "$tmp/dit_none.figures" "$tmp/dit_params.figures" ||
    fail "DiT: the evaluation or the sampler's fidelity differs"
  # Gradient accumulation: each micro-batch gathers its blocks again, let go as their gradients
  # of that micro-batch are made.
  for s in none params; do
    run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/acc_$s" zero.stage=$s fb.accumulate=2 model.checkpoint=blocks
  done
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/acc_none/checkpoints/step_00000006/$f.safetensors" "$tmp/acc_params/checkpoints/step_00000006/$f.safetensors" 0 ||
      fail "accumulate 2: $f differs between stage params and stage none"
  done
  # One process: it owns every element (the same path, nothing gathered).
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one_none" data.batch=8
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one_params" data.batch=8 zero.stage=params
  "$tensordiff" "$(params "$tmp/one_none" 6)" "$(params "$tmp/one_params" 6)" 0 || fail "one process: params differs from none"
  # Resume across layouts: the checkpoint of step 3 continued by the other.
  from "$tmp/params_none" "$tmp/r22"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/r22" zero.stage=params run.resume=auto
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/params_none/checkpoints/step_00000006/$f.safetensors" "$tmp/r22/checkpoints/step_00000006/$f.safetensors" 0 ||
      fail "resume params 2 -> 2: $f is not bit-identical"
  done
  from "$tmp/params_none" "$tmp/r21"
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/r21" data.batch=8 run.resume=auto
  "$tensordiff" "$(params "$tmp/params_none" 6)" "$(params "$tmp/r21" 6)" 1e-5 || fail "resume params 2 -> 1 process differs"
  from "$tmp/one_none" "$tmp/r12"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/r12" zero.stage=params run.resume=auto
  "$tensordiff" "$(params "$tmp/one_none" 6)" "$(params "$tmp/r12" 6)" 1e-5 || fail "resume 1 process -> params 2 differs"
  # bf16 (autocast over the gathered fp32 parameters) alike.
  for s in none params; do
    run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/bf16_$s" zero.stage=$s model.checkpoint=blocks run.precision=bf16
  done
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/bf16_none/checkpoints/step_00000006/$f.safetensors" "$tmp/bf16_params/checkpoints/step_00000006/$f.safetensors" 0 ||
      fail "bf16: $f differs between stage params and stage none"
  done
  # LoRA: the frozen base sharded too (gathered with its block's adapters, a block let go once
  # its backward is done: a recompute's end, else the step's). The GPT with and without
  # checkpoint: blocks, and the DiT's attentions and MLP over the base trained above: stage
  # params ends where stage none ends, bit for bit, the exported PEFT adapters included.
  lora=(model.lora.rank=4 model.lora.targets=[c_attn,c_proj,c_fc] ckpt.exports=true)
  for c in none blocks; do
    for s in none params; do
      run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${lora[@]}" run.out_dir="$tmp/lora_${s}_$c" zero.stage=$s model.checkpoint=$c
    done
    expect_out "each rank keeps 1/2 of the"
    for f in model.params opt.state ema.params model.params/adapter_model ema.params/adapter_model; do
      "$tensordiff" "$tmp/lora_none_$c/checkpoints/step_00000006/$f.safetensors" \
        "$tmp/lora_params_$c/checkpoints/step_00000006/$f.safetensors" 0 || fail "LoRA (checkpoint $c): $f differs"
    done
  done
  dlora=(model.lora.rank=4 model.lora.targets=[to_q,to_k,to_v,to_out.0,net.0.proj,net.2] ckpt.exports=true
         model.weights="$(whole_file "$tmp/dit_none/checkpoints/step_00000006/model.params.safetensors")")
  for s in none params; do
    run_code 0 "${mpi[@]}" "$flowrun" "${d[@]}" "${dlora[@]}" run.out_dir="$tmp/dlora_$s" zero.stage=$s model.checkpoint=blocks
    for k in loss val_loss fidelity; do grep -o "\"$k\":[0-9.eE+-]*" "$tmp/dlora_$s/metrics.jsonl"; done > "$tmp/dlora_$s.figures"
  done
  for f in model.params opt.state ema.params model.params/adapter_model; do
    "$tensordiff" "$tmp/dlora_none/checkpoints/step_00000006/$f.safetensors" \
      "$tmp/dlora_params/checkpoints/step_00000006/$f.safetensors" 0 || fail "DiT LoRA: $f differs"
  done
  cmp -s "$tmp/dlora_none.figures" "$tmp/dlora_params.figures" || fail "DiT LoRA: the losses, evaluation or fidelity differ"
  ;;
tensor_parallel_zero)
  # ZeRO composed with tp (issue 48): each tp rank shards its parts of the split tensors over the
  # data-parallel ranks (its dp group), the gradient norm summed over both; checkpoints gather
  # the slices over dp, then the parts over tp, into the one-process files. dp 2 x tp 2 (4
  # processes, 4 rows each) at every stage against one process of 8 rows: with SGD (momentum,
  # clipping on) the parameters, momenta and EMA within 1e-5; with AdamW every loss within 1e-6.
  needs_data data/text/fortunes_byte.train.bin
  g=("${tiny_gpt[@]}" data.batch=4)
  sgd=(opt.kind=sgd opt.adamw=null)
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/one"
  for s in states gradients params; do
    run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/$s" run.parallel.tp=2 zero.stage=$s \
      model.checkpoint=blocks
    expect_out "processes: dp 2 x pp 1 x tp 2 (4 processes)"
    expect_out "(ZeRO stage $s, this rank's 1/2 slice)"
    for f in model.params opt.state ema.params; do
      "$tensordiff" "$tmp/one/checkpoints/step_00000006/$f.safetensors" "$tmp/$s/checkpoints/step_00000006/$f.safetensors" 1e-5 ||
        fail "SGD: $f differs between dp 2 x tp 2 with stage $s and one process"
    done
  done
  # tp 2 with stage params and one data-parallel rank: it owns every element of its parts.
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/tp2" run.parallel.tp=2 zero.stage=params
  expect_out "with one data-parallel rank: it owns every element"
  "$tensordiff" "$(params "$tmp/one" 6)" "$(params "$tmp/tp2" 6)" 1e-5 || fail "SGD: tp 2 with stage params differs"
  # AdamW: the losses, the clipped norm (the whole model's) and the evaluation of one process.
  run_code 0 "$flowrun" "${g[@]}" data.batch=8 run.out_dir="$tmp/adam1"
  # (the evaluation: each of the 2 replicas scores 1 batch of the 2 one process scores)
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/adam4" run.parallel.tp=2 zero.stage=params eval.batches=1
  for k in loss grad_norm val_loss; do
    grep -o "\"$k\":[0-9.eE+-]*" "$tmp/adam1/metrics.jsonl" | cut -d: -f2 > "$tmp/k1"
    grep -o "\"$k\":[0-9.eE+-]*" "$tmp/adam4/metrics.jsonl" | cut -d: -f2 > "$tmp/k4"
    same_numbers "$tmp/k1" "$tmp/k4" 1e-6 || fail "AdamW: $k differs between dp 2 x tp 2 with stage params and one process"
  done
  # Resume across layouts: ZeRO-3 at dp 2 -> dp 2 x tp 2, dp 2 x tp 2 -> one process, and the
  # same layout bit for bit.
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/dp2" zero.stage=params
  from "$tmp/dp2" "$tmp/r24"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/r24" run.parallel.tp=2 zero.stage=params run.resume=auto
  from "$tmp/params" "$tmp/r41"
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/r41" run.resume=auto
  for r in r24 r41; do
    for f in model.params opt.state ema.params; do
      "$tensordiff" "$tmp/one/checkpoints/step_00000006/$f.safetensors" "$tmp/$r/checkpoints/step_00000006/$f.safetensors" 1e-5 ||
        fail "resume ($r): $f differs from one process"
    done
  done
  # LoRA with its frozen base, split over tp and sharded over dp: the PEFT adapters one process exports.
  lora=(model.lora.rank=4 model.lora.targets=[c_attn,c_proj,c_fc] ckpt.exports=true)
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" "${lora[@]}" data.batch=8 run.out_dir="$tmp/lora1"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" "${lora[@]}" run.out_dir="$tmp/lora4" run.parallel.tp=2 \
    zero.stage=params model.checkpoint=blocks
  for m in model.params ema.params; do
    "$tensordiff" "$tmp/lora1/checkpoints/step_00000006/$m/adapter_model.safetensors" \
      "$tmp/lora4/checkpoints/step_00000006/$m/adapter_model.safetensors" 1e-5rel || fail "LoRA: the PEFT adapters of $m differ"
  done
  # The DiT (graphs/dit_base.yaml: both attentions' heads split, the per-head norms and the
  # modulations whole; blocks gathered with the long skips' inputs kept, the sampler and the
  # evaluator gathering their own copy): dp 2 x tp 2 at stage params against dp 2 at stage none
  # (the diffusion objective draws per replica, so against a dp of 2): every loss, the held-out
  # loss and the grid's fidelity within 1e-6.
  needs_data data/shapes/base.json
  d=("${tiny_dit[@]}" data.batch=4 eval.batch=4 ckpt.every=6)
  run_code 0 "${mpi[@]}" "$flowrun" "${d[@]}" run.out_dir="$tmp/dit2"
  run_code 0 "${mpi4[@]}" "$flowrun" "${d[@]}" run.out_dir="$tmp/dit4" run.parallel.tp=2 zero.stage=params model.checkpoint=blocks
  for k in loss val_loss fidelity; do
    grep -o "\"$k\":[0-9.eE+-]*" "$tmp/dit2/metrics.jsonl" | cut -d: -f2 > "$tmp/k1"
    grep -o "\"$k\":[0-9.eE+-]*" "$tmp/dit4/metrics.jsonl" | cut -d: -f2 > "$tmp/k4"
    same_numbers "$tmp/k1" "$tmp/k4" 1e-6 || fail "DiT: $k differs between dp 2 x tp 2 with stage params and dp 2"
  done
  from "$tmp/params" "$tmp/r44"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/r44" run.parallel.tp=2 zero.stage=params \
    model.checkpoint=blocks run.resume=auto
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/params/checkpoints/step_00000006/$f.safetensors" "$tmp/r44/checkpoints/step_00000006/$f.safetensors" 0 ||
      fail "resume dp 2 x tp 2 -> the same: $f is not bit-identical"
  done
  ;;
pipeline)
  # run.parallel.pp (issue 49): graphs/gpt.yaml at a tiny size of 4 blocks, cut into 2 stages (the
  # embedding with the first, the tied head and the loss with the last), 4 micro-batches, under each
  # schedule, trains what one process trains on the same batch: with SGD (momentum) the parameters,
  # momenta and EMA within 1e-5 of each tensor's largest value and every loss within 1e-6; with
  # AdamW every step's loss, gradient norm and evaluation within 1e-6, at pp 2, dp 2 x pp 2 (with
  # ZeRO states, gradients and params too) and pp 2 x tp 2. Checkpoints hold the one-process tensors:
  # pp 2 -> 1 and 1 -> pp 2 resume. The bubble measured against the schedule's prediction.
  needs_data data/text/fortunes_byte.train.bin
  g=("${tiny_gpt[@]}" model.layers=4 data.batch=8)
  sgd=(opt.kind=sgd opt.adamw=null)
  pp=(run.parallel.pp=2 run.parallel.microbatches=4)
  run_code 0 "$flowrun" explain --world 2 "${g[@]}" "${pp[@]}" run.parallel.schedule=zero_bubble
  expect_out "stage 0: F0 F1 .. B0 F2 B1 W0 F3 B2 W1 W2 B3 W3   (bubble 8 %"
  # What the stages do not do yet is refused at setup, naming it: LoRA adapters.
  run_code 1 "${mpi[@]}" "$flowrun" "${g[@]}" "${pp[@]}" run.out_dir="$tmp/lora" model.lora.rank=4 model.lora.alpha=8 \
    "model.lora.targets=[c_attn]"
  expect_out "lora with pipeline parallel (run.parallel.pp) is not built yet"
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/sgd1"
  losses "$tmp/sgd1/metrics.jsonl" > "$tmp/l1"
  for s in gpipe 1f1b interleaved zero_bubble; do
    v=1; [ $s = interleaved ] && v=2
    run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" "${pp[@]}" run.out_dir="$tmp/$s" run.parallel.schedule=$s \
      run.parallel.virtual_stages=$v
    expect_out "processes: dp 1 x pp 2 x tp 1 (2 processes)"
    same_states sgd1 $s 1e-5 "SGD, pp 2"
    losses "$tmp/$s/metrics.jsonl" > "$tmp/l2"
    same_numbers "$tmp/l1" "$tmp/l2" 1e-6 || fail "SGD: the losses differ between pp 2 ($s) and one process"
  done
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/adam1"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${pp[@]}" run.out_dir="$tmp/adam2"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${pp[@]}" run.out_dir="$tmp/dp2" data.batch=4 run.parallel.microbatches=2 eval.batches=1
  expect_out "processes: dp 2 x pp 2 x tp 1 (4 processes)"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${pp[@]}" run.out_dir="$tmp/tp2" run.parallel.tp=2
  # ZeRO within the stages: each stage's moments (states), its averaged gradients (gradients) and
  # its parameters (params: gathered for the step's micro-batches), sharded over its data-parallel
  # ranks.
  for z in states gradients params; do
    run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${pp[@]}" run.out_dir="$tmp/z$z" data.batch=4 run.parallel.microbatches=2 \
      eval.batches=1 zero.stage=$z
  done
  # And params with checkpoint: blocks over interleaved chunks (each block let go after each
  # micro-batch's forward, gathered again for its recompute).
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${pp[@]}" run.out_dir="$tmp/zckpt" data.batch=4 run.parallel.microbatches=2 \
    eval.batches=1 zero.stage=params model.checkpoint=blocks run.parallel.schedule=interleaved run.parallel.virtual_stages=2
  for run in adam2 dp2 tp2 zstates zgradients zparams zckpt; do
    for k in loss grad_norm val_loss; do
      grep -o "\"$k\":[0-9.eE+-]*" "$tmp/adam1/metrics.jsonl" | cut -d: -f2 > "$tmp/k1"
      grep -o "\"$k\":[0-9.eE+-]*" "$tmp/$run/metrics.jsonl" | cut -d: -f2 > "$tmp/k2"
      same_numbers "$tmp/k1" "$tmp/k2" 1e-6 || fail "AdamW: $k differs between $run and one process"
    done
  done
  # Each stage's trace (its operations' marks): every step the schedule's program, in its order;
  # the bubble within 15 points of the prediction (the program timed at the measured costs; it
  # leaves out the transfers between the stages, up to 9 points more idle here at M = 8), at M = 4
  # and 8; and zero_bubble's first stage idling less than 1F1B's program would at the same costs.
  # (Not less than a 1F1B run measured: on two shared cores the stages' relative speed differs from
  # run to run, and both bubbles with it, by more than the schedules differ.)
  b=(graphs/gpt.yaml data.path=data/text/fortunes_byte data.seq_len=64 model.layers=4 model.dim=256 model.heads=4
     model.vocab=256 model.context=64 run.steps=8 run.threads=1 data.batch=16 eval.every=1000 evlog.every=1000
     ckpt.every=1000 ckpt.at=[] ema.every=1000 run.parallel.pp=2)
  for m in 4 8; do
    for s in 1f1b zero_bubble; do
      run_code 0 "${mpi[@]}" "$flowrun" "${b[@]}" run.parallel.microbatches=$m run.parallel.schedule=$s \
        run.out_dir="$tmp/b$s$m" run.trace="$tmp/b$s$m/trace.json"
      versus=(); [ $s = zero_bubble ] && versus=(--versus 1f1b)
      "$tool" pipeline-bubble fb $s $m 1 0.15 "${versus[@]}" "$tmp/b$s$m/trace.json" "$tmp/b$s$m/trace.rank1.json" \
        > "$tmp/bubble" || { cat "$tmp/bubble" >&2; fail "$s at M=$m: not the program, the predicted bubble, or below 1f1b's"; }
      cat "$tmp/bubble"
    done
  done
  # Resume across layouts: the checkpoint of step 3 continued by the other layout.
  from "$tmp/1f1b" "$tmp/r21"
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/r21" run.resume=auto
  from "$tmp/sgd1" "$tmp/r12"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" "${pp[@]}" run.out_dir="$tmp/r12" run.resume=auto
  for r in r21 r12; do same_states sgd1 $r 1e-5 "resume"; done
  ;;
pipeline_dit)
  # run.parallel.pp for graphs/dit_base.yaml (issue 49): HunyuanDiT's long skips cross the stages
  # as extra activations (4 blocks: block 3 adds block 0's output; interleaved, 4 chunks of one
  # block, carries it through two stages), the diffusion objective draws its timesteps and noise
  # alike on every stage, and the sampler and the evaluator run forward through the stages. Each
  # schedule against one process reading the same batch in the same 2 micro-batches (accumulate 2:
  # the draws are per micro-batch): SGD parameters, momenta, EMA within 1e-5, every loss, the
  # evaluation and the samples' fidelity within 1e-6; dp 2 x pp 2 against dp 2 (the draws are per
  # replica), pp 2 x tp 2 against one process; resume pp 2 -> 1.
  needs_data data/shapes/base.json
  d=("${tiny_dit[@]}" model.depth=4 data.batch=4 eval.batch=4 opt.kind=sgd opt.adamw=null)
  same_metrics() {  # RUN_A RUN_B: loss, val_loss and fidelity within 1e-6
    for k in loss val_loss fidelity; do
      grep -o "\"$k\":[0-9.eE+-]*" "$tmp/$1/metrics.jsonl" | cut -d: -f2 > "$tmp/k1"
      grep -o "\"$k\":[0-9.eE+-]*" "$tmp/$2/metrics.jsonl" | cut -d: -f2 > "$tmp/k2"
      same_numbers "$tmp/k1" "$tmp/k2" 1e-6 || fail "DiT: $k differs between $2 and $1"
    done
  }
  run_code 0 "$flowrun" "${d[@]}" fb.accumulate=2 run.out_dir="$tmp/one"
  for s in gpipe 1f1b interleaved zero_bubble; do
    v=1; [ $s = interleaved ] && v=2
    run_code 0 "${mpi[@]}" "$flowrun" "${d[@]}" run.parallel.pp=2 run.parallel.microbatches=2 run.parallel.schedule=$s \
      run.parallel.virtual_stages=$v run.out_dir="$tmp/$s"
    same_states one $s 1e-5 "DiT, pp 2"
    same_metrics one $s
  done
  run_code 0 "${mpi4[@]}" "$flowrun" "${d[@]}" run.parallel.pp=2 run.parallel.tp=2 run.parallel.microbatches=2 run.out_dir="$tmp/tp2"
  same_metrics one tp2
  run_code 0 "${mpi[@]}" "$flowrun" "${d[@]}" data.batch=2 fb.accumulate=2 run.out_dir="$tmp/dp2"
  run_code 0 "${mpi4[@]}" "$flowrun" "${d[@]}" data.batch=2 run.parallel.pp=2 run.parallel.microbatches=2 run.out_dir="$tmp/dp2pp2"
  same_metrics dp2 dp2pp2
  from "$tmp/1f1b" "$tmp/r21"
  run_code 0 "$flowrun" "${d[@]}" fb.accumulate=2 run.out_dir="$tmp/r21" run.resume=auto
  "$tensordiff" "$(params "$tmp/one" 6)" "$(params "$tmp/r21" 6)" 1e-5 || fail "DiT: resume pp 2 -> 1 differs"
  ;;
moe)
  # A mixture of experts (issue 73; graphs/moe.yaml at a tiny size: 2 layers of 8 experts, top 2)
  # in the layouts built for it so far, each against one process reading the same global batch:
  # data parallel (2 ranks of batch 4 end where one process of batch 8 ends: SGD's parameters and
  # momenta within 1e-5), ZeRO-3 bit for bit where stage none ends, pp 2 (a sparse layer a stage)
  # within 1e-5, a checkpoint of dp 2 resumed by one process. The load-balancing loss off for the
  # comparisons (each rank's is over its own tokens, as under DDP: not the global batch's); on,
  # dp 2 trains and logs fb.experts. Tensor parallel is refused naming expert parallel.
  needs_data data/text/fortunes_byte.train.bin
  g=(graphs/moe.yaml data.path=data/text/fortunes_byte data.seq_len=32 model.layers=2 model.dim=32 model.heads=4
     model.kv_heads=2 model.mlp_dim=48 model.vocab=256 model.context=32 model.moe.experts=8 model.moe.expert_dim=16
     model.moe.aux_loss=false run.steps=6 run.log_every=1 run.threads=1 opt.warmup=2 opt.kind=sgd opt.adamw=null
     eval.every=3 eval.batches=2 eval.batch=4 evlog.every=3 ckpt.every=3)
  same() {  # same_states without an EMA (graphs/moe.yaml has none)
    for f in model.params opt.state; do
      tensordiff_whole "$tmp/$1/checkpoints/step_00000006/$f.safetensors" "$tmp/$2/checkpoints/step_00000006/$f.safetensors" "$3" ||
        fail "$4: $f differs between $2 and $1"
    done
  }
  run_code 0 "$flowrun" "${g[@]}" data.batch=8 run.out_dir="$tmp/one"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=4 run.out_dir="$tmp/dp2"
  expect_out "experts/balance"
  same one dp2 1e-5 "moe: dp 2"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=4 run.out_dir="$tmp/z3" zero.stage=params
  # Within 1e-6, not bit for bit: on the AVX2 path (ATEN_CPU_CAPABILITY=avx2, a host without
  # AVX-512) the attention's gradients of a step differ by ~1e-10 between stage params and none
  # (ZeRO-3 gathers each block into a buffer of its own, so the weights lie at other alignments,
  # and the AVX2 kernels' results depend on it); on AVX-512 they are equal.
  for f in model.params opt.state; do
    tensordiff_whole "$tmp/dp2/checkpoints/step_00000006/$f.safetensors" "$tmp/z3/checkpoints/step_00000006/$f.safetensors" 1e-6 ||
      fail "moe: $f differs between ZeRO stage params and none"
  done
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=8 run.out_dir="$tmp/pp2" run.parallel.pp=2 run.parallel.microbatches=2
  same one pp2 1e-5 "moe: pp 2"
  from "$tmp/dp2" "$tmp/r21"
  run_code 0 "$flowrun" "${g[@]}" data.batch=8 run.out_dir="$tmp/r21" run.resume=auto
  same one r21 1e-5 "moe: dp 2 resumed by one process"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=4 run.out_dir="$tmp/aux" model.moe.aux_loss=true
  expect_out "experts/unused"
  run_code 1 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=8 run.out_dir="$tmp/tp2" run.parallel.tp=2
  expect_out "a mixture of experts under tensor parallel (run.parallel.tp) is not built yet"
  # Expert parallel (run.parallel.ep: the experts split over ep ranks cut out of dp, the tokens
  # exchanged by all-to-alls): ep 2, ep 4, ep 2 x dp 2, ep 2 x pp 2 and ep 2 with every block
  # recomputed, each against one process reading the same global batch (SGD at a learning rate
  # that moves the experts: parameters and momenta within 1e-5), its exported Hugging Face folder
  # (every expert whole under HF's per-expert names) as one process's, and AdamW's losses within
  # 1e-6; a checkpoint written at ep 2 resumed at ep 1 and at ep 4, equal to the uninterrupted run.
  ep=(opt.lr=0.3 ckpt.exports=true)
  run_code 0 "$flowrun" "${g[@]}" "${ep[@]}" data.batch=8 run.out_dir="$tmp/ep_one"
  layouts=("ep2 mpi data.batch=4 run.parallel.ep=2" "ep4 mpi4 data.batch=2 run.parallel.ep=4"
           "ep2dp2 mpi4 data.batch=2 run.parallel.ep=2"
           "ep2pp2 mpi4 data.batch=4 run.parallel.ep=2 run.parallel.pp=2 run.parallel.microbatches=2"
           "ep2ck mpi data.batch=4 run.parallel.ep=2 model.checkpoint=blocks")
  for l in "${layouts[@]}"; do
    read -r name procs settings <<< "$l"
    launcher=("${mpi[@]}"); [ "$procs" = mpi4 ] && launcher=("${mpi4[@]}")
    # shellcheck disable=SC2086
    run_code 0 "${launcher[@]}" "$flowrun" "${g[@]}" "${ep[@]}" $settings run.out_dir="$tmp/$name"
    same ep_one "$name" 1e-5 "moe: $name"
    tensordiff_whole "$tmp/ep_one/checkpoints/step_00000006/model.safetensors" "$tmp/$name/checkpoints/step_00000006/model.safetensors" 1e-5 ||
      fail "moe: the Hugging Face export differs between $name and one process"
  done
  expect_out "experts split over ep 2: the count is this rank's part"
  from "$tmp/ep2" "$tmp/ep2to1"
  run_code 0 "$flowrun" "${g[@]}" "${ep[@]}" data.batch=8 run.out_dir="$tmp/ep2to1" run.resume=auto
  same ep_one ep2to1 1e-5 "moe: ep 2 resumed by one process"
  from "$tmp/ep2" "$tmp/ep2to4"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${ep[@]}" data.batch=2 run.parallel.ep=4 run.out_dir="$tmp/ep2to4" run.resume=auto
  same ep_one ep2to4 1e-5 "moe: ep 2 resumed at ep 4"
  adam=(opt.kind=adamw)
  run_code 0 "$flowrun" "${g[@]}" "${adam[@]}" data.batch=8 run.out_dir="$tmp/adam_one"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${adam[@]}" data.batch=4 run.parallel.ep=2 run.out_dir="$tmp/adam_ep2"
  losses "$tmp/adam_one/metrics.jsonl" > "$tmp/l1"; losses "$tmp/adam_ep2/metrics.jsonl" > "$tmp/l2"
  [ "$(wc -l < "$tmp/l2")" = 6 ] || fail "moe ep 2, AdamW: expected 6 logged losses"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-6 || fail "moe, AdamW: the losses differ between ep 2 and one process"
  # With the load-balancing loss and under bf16 it trains and logs the routing.
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${adam[@]}" data.batch=4 run.parallel.ep=2 run.precision=bf16 model.moe.aux_loss=true \
    run.out_dir="$tmp/ep_bf16"
  expect_out "experts/balance"
  # Refused, naming the setting: an ep that does not divide dp, ZeRO (not built under ep), a dense model.
  run_code 2 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=4 run.parallel.ep=4 run.out_dir="$tmp/ep_bad"
  expect_out "ep 4 does not divide the data-parallel size 2"
  run_code 1 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=4 run.parallel.ep=2 zero.stage=params run.out_dir="$tmp/ep_zero"
  expect_out "under expert parallel (run.parallel.ep) is not built yet"
  run_code 1 "${mpi[@]}" "$flowrun" "${g[@]}" data.batch=4 run.parallel.ep=2 model.moe=null run.out_dir="$tmp/ep_dense"
  expect_out "run.parallel.ep is 2, and this model has no experts to split"
  ;;
llama)
  # The llama family (graphs/llama.yaml at a tiny size: 4 blocks, GQA 4:2) in every layout, each
  # against one process reading the same global batch (issue 70). Data parallel: 2 ranks of batch 4
  # end where one process of batch 8 ends (DDP's guarantee, within 1e-5), and ZeRO stages 1, 2 and 3
  # (stage 3's blocks gathered one by one, recomputed ones again) end exactly where stage none ends. Then the
  # split and the stages the family declares (models/family.hpp): tp 2 (the 2 kv heads split), tp 4
  # (2 kv heads whole on every rank, their gradients summed), dp 2 x tp 2, pp 2 under 1f1b and
  # interleaved, pp 2 x tp 2: with SGD (momentum) the parameters and momenta within 1e-5 of each
  # tensor's largest value, with AdamW every step's loss within 1e-6; LoRA under tp 2 and tp 4 too;
  # checkpoints resumed across layouts; Qwen 3's q/k norms and bf16 at tp 2, tp 4 and pp 2 x tp 2.
  needs_data data/text/fortunes_byte.train.bin
  g=(graphs/llama.yaml data.path=data/text/fortunes_byte data.seq_len=32 model.layers=4 model.dim=32 model.heads=4
     model.kv_heads=2 model.mlp_dim=48 model.vocab=256 model.context=32 run.steps=6 run.log_every=1 run.threads=1
     opt.warmup=2 opt.clip=0 eval.every=3 eval.batches=2 eval.batch=4 evlog.every=3 ckpt.every=3)
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one" data.batch=8
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/two" data.batch=4
  "$tensordiff" "$(params "$tmp/one" 6)" "$(params "$tmp/two" 6)" 1e-5 || fail "llama: dp 2 differs from one process"
  losses "$tmp/one/metrics.jsonl" > "$tmp/l1"; losses "$tmp/two/metrics.jsonl" > "$tmp/l2"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-5 || fail "llama: dp 2's losses differ from one process's"
  for c in none blocks; do
    run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/none_$c" data.batch=4 model.checkpoint=$c
    stages=(params); [ $c = none ] && stages=(states gradients params)  # ZeRO-1, 2 and 3
    for z in "${stages[@]}"; do
      run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/${z}_$c" data.batch=4 model.checkpoint=$c zero.stage=$z
      if [ "$z" = params ]; then expect_out "ZeRO stage params (zero.plan): each rank keeps 1/2 of the"; fi
      for f in model.params opt.state; do
        "$tensordiff" "$tmp/none_$c/checkpoints/step_00000006/$f.safetensors" "$tmp/${z}_$c/checkpoints/step_00000006/$f.safetensors" 0 ||
          fail "llama (checkpoint $c): $f differs between ZeRO stage $z and none"
      done
    done
  done
  # The layouts: name, processes, settings.
  layouts=("tp2 mpi run.parallel.tp=2" "tp4 mpi4 run.parallel.tp=4" "dp2tp2 mpi4 run.parallel.tp=2 data.batch=4"
           "pp2 mpi run.parallel.pp=2 run.parallel.microbatches=4"
           "pp2i mpi run.parallel.pp=2 run.parallel.microbatches=4 run.parallel.schedule=interleaved run.parallel.virtual_stages=2"
           "pp2tp2 mpi4 run.parallel.pp=2 run.parallel.tp=2 run.parallel.microbatches=4")
  sgd=(opt.kind=sgd opt.adamw=null data.batch=8 ckpt.exports=true)  # exports: the HF folder too
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/sgd1"
  losses "$tmp/sgd1/metrics.jsonl" > "$tmp/s1"
  for l in "${layouts[@]}"; do
    read -r name procs settings <<< "$l"
    launcher=("${mpi[@]}"); [ "$procs" = mpi4 ] && launcher=("${mpi4[@]}")
    # shellcheck disable=SC2086
    run_code 0 "${launcher[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" $settings run.out_dir="$tmp/sgd_$name"
    # The checkpoint, and the Hugging Face folder it exports (whole tensors under HF's names, whatever
    # the layout), as one process's.
    for f in model.params opt.state model; do
      "$tensordiff" "$tmp/sgd1/checkpoints/step_00000006/$f.safetensors" "$tmp/sgd_$name/checkpoints/step_00000006/$f.safetensors" 1e-5 ||
        fail "llama, SGD: $f differs between $name and one process"
    done
    # shellcheck disable=SC2086
    run_code 0 "${launcher[@]}" "$flowrun" "${g[@]}" data.batch=8 $settings run.out_dir="$tmp/adam_$name"
    losses "$tmp/adam_$name/metrics.jsonl" > "$tmp/a2"
    [ "$(wc -l < "$tmp/a2")" = 6 ] || fail "llama $name: expected 6 logged losses"
    same_numbers "$tmp/l1" "$tmp/a2" 1e-6 || fail "llama, AdamW: the losses differ between $name and one process"
    [ "$name" = tp4 ] && expect_out "kv_heads 2 do not split over tp 4: k_proj and v_proj are whole on every tp rank"
  done
  # Checkpoints hold the one-process tensors whatever the layout: step 3 of tp 4 (kv heads whole)
  # and of pp 2 x tp 2 continued by one process, and one process's step 3 by tp 2, end where one
  # process ends (SGD, within 1e-5).
  for name in tp4 pp2tp2; do
    from "$tmp/sgd_$name" "$tmp/r_$name"
    run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" run.out_dir="$tmp/r_$name" run.resume=auto
    "$tensordiff" "$(params "$tmp/sgd1" 6)" "$(params "$tmp/r_$name" 6)" 1e-5 || fail "llama: resume $name -> 1 differs"
  done
  from "$tmp/sgd1" "$tmp/r12"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" run.parallel.tp=2 run.out_dir="$tmp/r12" run.resume=auto
  "$tensordiff" "$(params "$tmp/sgd1" 6)" "$(params "$tmp/r12" 6)" 1e-5 || fail "llama: resume 1 -> tp 2 differs"
  # LoRA on every projection (v_proj whole at tp 4): the adapters train as in one process.
  lora=(model.lora.rank=4 model.lora.alpha=8 "model.lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj]" data.batch=8)
  run_code 0 "$flowrun" "${g[@]}" "${lora[@]}" run.out_dir="$tmp/lora1"
  losses "$tmp/lora1/metrics.jsonl" > "$tmp/q1"
  for t in 2 4; do
    launcher=("${mpi[@]}"); [ $t = 4 ] && launcher=("${mpi4[@]}")
    run_code 0 "${launcher[@]}" "$flowrun" "${g[@]}" "${lora[@]}" run.parallel.tp=$t run.out_dir="$tmp/lora$t"
    losses "$tmp/lora$t/metrics.jsonl" > "$tmp/q2"
    same_numbers "$tmp/q1" "$tmp/q2" 1e-6 || fail "llama, LoRA: the losses differ between tp $t and one process"
  done
  # split_layouts NAME TOL SETTING...: AdamW with SETTINGs in one process (a loss must differ from
  # the plain run's: the setting acts), then at tp 2 (kv heads split), tp 4 (kv heads whole) and
  # pp 2 x tp 2, every step's loss within TOL of one process's.
  split_layouts() {
    local what=$1 tol=$2; shift 2
    run_code 0 "$flowrun" "${g[@]}" data.batch=8 "$@" run.out_dir="$tmp/${what}_one"
    losses "$tmp/${what}_one/metrics.jsonl" > "$tmp/w1"
    cmp -s "$tmp/w1" "$tmp/l1" && fail "llama with $what changed no loss"
    for l in "tp2 mpi run.parallel.tp=2" "tp4 mpi4 run.parallel.tp=4" "pp2tp2 mpi4 run.parallel.pp=2 run.parallel.tp=2 run.parallel.microbatches=4"; do
      read -r name procs settings <<< "$l"
      launcher=("${mpi[@]}"); [ "$procs" = mpi4 ] && launcher=("${mpi4[@]}")
      # shellcheck disable=SC2086
      run_code 0 "${launcher[@]}" "$flowrun" "${g[@]}" data.batch=8 "$@" $settings run.out_dir="$tmp/${what}_$name"
      losses "$tmp/${what}_$name/metrics.jsonl" > "$tmp/w2"
      same_numbers "$tmp/w1" "$tmp/w2" "$tol" || fail "llama with $what: the losses differ between $name and one process"
    done
  }
  # Qwen 3's q/k norms (whole on every rank, over each rank's heads: their gradients summed).
  split_layouts qk_norm 1e-6 model.qk_norm=true
  # bf16 (autocast, fp32 weights): within 1e-4, the layouts summing bf16 products in other orders.
  split_layouts bf16 1e-4 run.precision=bf16
  ;;
sft)
  # graphs/llama_sft.yaml at a tiny size (issue 71): packed conversations whose counted (answer)
  # tokens differ from row to row, so the loss must be normalized by the whole step's count over
  # all ranks, not averaged from each rank's mean: 2 ranks of 2 rows end where one process of 4
  # rows ends (parameters within 1e-5, every logged loss within 1e-5).
  needs_data data/chat/fortunes_qwen3.train.mask.bin
  g=(graphs/llama_sft.yaml model.pretrained=null model.lora=null model.layers=1 model.dim=16 model.heads=2 model.kv_heads=1
     model.mlp_dim=32 model.vocab=151669 model.context=64 data.seq_len=64 run.steps=4 run.log_every=1 run.threads=1
     opt.warmup=1 opt.clip=0 eval.every=1000 evlog.every=1000 gen.every=1000 ckpt.every=4 ckpt.at=[])
  run_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/one" data.batch=4
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.out_dir="$tmp/two" data.batch=2
  "$tensordiff" "$(params "$tmp/one" 4)" "$(params "$tmp/two" 4)" 1e-5 || fail "sft: dp 2 differs from one process"
  losses "$tmp/one/metrics.jsonl" > "$tmp/l1"; losses "$tmp/two/metrics.jsonl" > "$tmp/l2"
  [ "$(wc -l < "$tmp/l1")" = 4 ] || fail "sft: expected 4 logged losses"
  same_numbers "$tmp/l1" "$tmp/l2" 1e-5 || fail "sft: dp 2's losses differ from one process's"
  ;;
generate)
  # The generate node under tensor parallel (issue 71): the Llama and GPT-2 models transformers made
  # for the generation test, split over tp 2 (their heads, their vocabulary: the logits gathered
  # whole on each rank), complete the same prompts greedily into the same text as one process.
  # A byte-level tokenizer.json of 256 ids (the models' vocabulary), written here.
  python3 - "$tmp/bytes.json" <<'PY'
import json, sys
printable = lambda b: 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255
m, n = {}, 0
for b in range(256):
    m[b] = b if printable(b) else 256 + n
    n += 0 if printable(b) else 1
vocab = {chr(m[b]): b for b in range(256)}
json.dump({"version": "1.0", "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "post_processor": None, "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": vocab, "merges": []}}, open(sys.argv[1], "w"))
PY
  for m in llama:llama gpt2:gpt; do
    cat > "$tmp/gen.yaml" <<GRAPH
flowrun: 1
run: { steps: 1, threads: 1 }
nodes:
  model: { type: ${m#*:}, with: { pretrained: $src/tests/fixtures/hf/generate/${m%%:*} } }
  gen:   { type: generate, in: { model: model.params },
           with: { tokenizer: $tmp/bytes.json, chat: false, max_new_tokens: 48, prompts: ["Hello", "a longer prompt, to pad the other"] } }
GRAPH
    run_code 0 "$flowrun" "$tmp/gen.yaml" run.out_dir="$tmp/g1_${m%%:*}"
    run_code 0 "${mpi[@]}" "$flowrun" "$tmp/gen.yaml" run.parallel.tp=2 run.out_dir="$tmp/g2_${m%%:*}"
    [ "$(wc -l < "$tmp/g1_${m%%:*}/generations.jsonl")" = 2 ] || fail "generate ${m%%:*}: expected 2 completions"
    cmp -s "$tmp/g1_${m%%:*}/generations.jsonl" "$tmp/g2_${m%%:*}/generations.jsonl" ||
      fail "generate ${m%%:*}: tp 2's completions differ from one process's"
  done
  ;;
pipeline_cappa)
  # run.parallel.pp for graphs/cappa.yaml (issue 49): the ViT's 2 blocks then the decoder's 2 cut
  # into stages, the encoded image travelling on through the decoder's stages to every
  # cross-attention (its gradient summed on the way back); each schedule, and cuts with a chunk that
  # ends the encoder and starts the decoder, against one process reading the same batch in the same
  # micro-batches (accumulate 2: the parallel-prediction draws are per micro-batch): with SGD the
  # parameters and momenta within 1e-5; every loss and the caption evaluator's (greedy and parallel
  # decoding through the stages) as one process's; pp 2 x tp 2 and pp 2 x dp 2 with ZeRO params;
  # resume pp 2 -> 1.
  needs_data data/shapes/base.json
  c=(graphs/cappa.yaml run.steps=6 run.log_every=1 run.threads=1 data.size=32 data.batch=8 model.image_size=32
     model.patch=8 model.width=32 model.depth=2 model.heads=2 model.mlp_dim=64 model.dec_width=32 model.dec_depth=2
     model.dec_heads=2 model.dec_mlp_dim=64 opt.warmup=2 eval.every=3 evlog.every=3 eval.batches=1 eval.batch=8
     eval.samples=2 ckpt.every=3 opt.kind=sgd opt.lr=0.5)
  pp=(run.parallel.pp=2 run.parallel.microbatches=2)
  # RUN_A RUN_B: the training and evaluation losses within 1e-6; the decoded captions' token
  # accuracies (an argmax each: a near tie between two logits may go either way with the order
  # of the sums, which the stages change) within 3 of the 99 counted tokens.
  same_captions() {
    for k in loss val_loss val_token_acc val_par_token_acc; do
      grep -o "\"$k\":[0-9.eE+-]*" "$tmp/$1/metrics.jsonl" | cut -d: -f2 > "$tmp/k1"
      grep -o "\"$k\":[0-9.eE+-]*" "$tmp/$2/metrics.jsonl" | cut -d: -f2 > "$tmp/k2"
      [ -s "$tmp/k1" ] || fail "no $k logged"
      tol=1e-6; case $k in *acc) tol=0.031 ;; esac
      same_numbers "$tmp/k1" "$tmp/k2" $tol || fail "CapPa: $k differs between $2 and $1"
    done
  }
  same_params() {  # RUN_A RUN_B
    for f in model.params opt.state; do
      "$tensordiff" "$tmp/$1/checkpoints/step_00000006/$f.safetensors" "$tmp/$2/checkpoints/step_00000006/$f.safetensors" 1e-5 ||
        fail "CapPa: $f differs between $2 and $1"
    done
  }
  run_code 0 "$flowrun" "${c[@]}" fb.accumulate=2 run.out_dir="$tmp/one"
  for s in gpipe 1f1b interleaved zero_bubble; do
    v=1; [ $s = interleaved ] && v=2
    run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" "${pp[@]}" run.parallel.schedule=$s run.parallel.virtual_stages=$v \
      run.out_dir="$tmp/$s"
    same_params one $s
    same_captions one $s
  done
  # A chunk that ends the encoder and starts the decoder: on the first stage (3 + 1 blocks: the
  # encoded image and the decoder's stream sent on) and on the second (1 + 3).
  for cut in 3,1 1,3; do
    run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" "${pp[@]}" "run.parallel.stage_layers=[$cut]" run.out_dir="$tmp/cut${cut/,/}"
    same_params one "cut${cut/,/}"
    same_captions one "cut${cut/,/}"
  done
  run_code 0 "${mpi4[@]}" "$flowrun" "${c[@]}" "${pp[@]}" run.parallel.tp=2 run.out_dir="$tmp/tp2"
  same_captions one tp2
  run_code 0 "${mpi[@]}" "$flowrun" "${c[@]}" data.batch=4 fb.accumulate=2 run.out_dir="$tmp/dp2"
  run_code 0 "${mpi4[@]}" "$flowrun" "${c[@]}" "${pp[@]}" data.batch=4 zero.stage=params run.out_dir="$tmp/dp2pp2"
  same_captions dp2 dp2pp2
  same_params dp2 dp2pp2
  from "$tmp/1f1b" "$tmp/r21"
  run_code 0 "$flowrun" "${c[@]}" fb.accumulate=2 run.out_dir="$tmp/r21" run.resume=auto
  same_params one r21
  ;;
plan)
  # flowrun plan (issue 50): graphs/gpt.yaml at a tiny size profiled here (one process, a few
  # steps), the layouts of 2 and 4 devices predicted and ranked, the fastest that fits written as
  # overrides that run under mpirun as they are; with devices of 4 MB, which one replica's weights,
  # gradients, moments and EMA overflow, the plan shards (ZeRO) or splits (tp, pp), never plain
  # data parallel, and stays within the 4 MB; a saved profile plans again without running.
  needs_data data/text/fortunes_byte.train.bin
  g=(graphs/gpt.yaml data.path=data/text/fortunes_byte data.seq_len=32 model.layers=4 model.dim=64 model.heads=4
     model.vocab=256 model.context=32 data.batch=8 run.threads=1)
  run_code 0 "$flowrun" plan "${g[@]}" --devices 2 --save-profile "$tmp/profile.json" --out "$tmp/plan2"
  # The profile (issue 69): one of the 4 alike blocks timed, the others repeating it; a progress
  # line a size (1, 2, 4 rows: a replica's), each with its estimate of the whole model's step.
  expect_out "profiling graphs/gpt.yaml here, one process: 1 of model 'model''s 4 blocks (the others alike"
  for rows in "1 row" "2 rows" "4 rows"; do expect_out "  $rows: "; done
  expect_out "model 'model' (gpt): 4 blocks (1 timed, the others repeating the last), 0.22M parameters"
  # The whole model timed instead: the same parameters.
  run_code 0 "$flowrun" plan "${g[@]}" --devices 2 --profile-blocks all --profile-rounds 1
  expect_out "model 'model' (gpt): 4 blocks, 0.22M parameters"
  # A model whose one-row run takes over a second: a budget of 1 s times that size only (the
  # next is predicted past it); its plan is still made.
  big=(model.layers=8 model.dim=1024 model.heads=8 data.seq_len=512 model.context=512 data.batch=64)
  run_code 0 "$flowrun" plan "${g[@]}" "${big[@]}" --devices 2 --profile-seconds 1 --profile-rounds 1
  expect_out "  1 row: 1 round"
  grep -q "  2 rows: " "$tmp/out" && fail "a budget of 1 s started a second size"
  expect_out "fastest that fits: "
  # A LoRA DiT fed by two data sources (the demo's purple shapes and its prior): every block timed
  # (the first one's input takes no gradient), each source's rows scaled alike (24 + 8 a replica).
  if [ -e data/shapes/lora.json ] && [ -e data/shapes/base.json ]; then
    run_code 0 "$flowrun" plan graphs/hydit_lora.yaml vae.weights=null model.weights=null --devices 2 --profile-seconds 5 \
      --profile-rounds 1 --out "$tmp/plan_lora"
    grep -qx "data.batch=24" "$tmp/plan_lora" && grep -qx "prior.batch=8" "$tmp/plan_lora" ||
      { cat "$tmp/plan_lora" >&2; fail "the two sources' rows were not kept in their proportion"; }
  fi
  # The first SIGTERM ends a plan at once (it trains nothing worth a stop): a model whose profile
  # takes minutes, stopped as soon as it starts.
  "$flowrun" plan "${g[@]}" "${big[@]}" --devices 1 --profile-seconds 600 > "$tmp/term.out" 2>&1 &
  pid=$!
  for _ in $(seq 300); do grep -q "profiling" "$tmp/term.out" && break; sleep 0.1; done
  sleep 1
  kill -TERM $pid
  t0=$(date +%s%N)
  wait $pid
  code=$?
  waited_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  [ "$code" = 143 ] || { cat "$tmp/term.out" >&2; fail "plan exited $code on SIGTERM, expected 143"; }
  [ "$waited_ms" -lt 3000 ] || fail "plan took $waited_ms ms to stop after SIGTERM"
  expect_out "fastest that fits: dp "
  grep -qx "run.parallel.tp=[12]" "$tmp/plan2" && grep -qx "data.batch=[0-9]*" "$tmp/plan2" || fail "no layout in $tmp/plan2"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=2 run.out_dir="$tmp/run2" $(cat "$tmp/plan2")
  run_code 0 "$flowrun" plan "${g[@]}" --devices 4 --profile "$tmp/profile.json" --device-memory 4MB --out "$tmp/plan4"
  awk -F= '{v[$1] = $2} END {exit !(v["run.parallel.tp"] > 1 || v["run.parallel.pp"] > 1 || v["zero.stage"] != "none")}' \
    "$tmp/plan4" || fail "a model 4 MB devices cannot hold whole was planned as plain data parallel"
  awk '/fastest that fits/ {exit} $1 == 1 && $0 ~ /MB =/ {for (i = 1; i <= NF; ++i) if ($(i + 1) == "=") {exit !($(i - 1) <= 4)}}' \
    "$tmp/out" || fail "the fastest layout needs more than the 4 MB a device has"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" run.steps=2 run.out_dir="$tmp/run4" $(cat "$tmp/plan4")
  # No layout fits: said, exit 1. Usage: the device count is required.
  run_code 1 "$flowrun" plan "${g[@]}" --devices 2 --profile "$tmp/profile.json" --device-memory 100KB
  expect_out "no layout of 2 devices fits"
  run_code 2 "$flowrun" plan "${g[@]}"
  expect_out "--devices N is required"
  # The links measured under mpirun (each collective over groups of 2 ranks, 4 KiB to 16 MiB,
  # fitted), planned with; the table of every layout as JSON, its overrides the ones --out writes
  # for the fastest; MFU against a given peak.
  run_code 0 "${mpi[@]}" "$flowrun" plan --measure-links --out "$tmp/links.json"
  expect_out "all_reduce       2"
  expect_out "written to $tmp/links.json"
  run_code 0 "$flowrun" plan "${g[@]}" --devices 2 --profile "$tmp/profile.json" --links "$tmp/links.json" \
    --peak-tflops 0.05 --table "$tmp/table.json" --out "$tmp/plan2m"
  expect_out "links within a node measured ($tmp/links.json)"
  grep -q '"overrides"' "$tmp/table.json" || fail "no overrides in the --table file"
  python3 - "$tmp/table.json" "$tmp/plan2m" <<'PY' || fail "the table's first fitting layout is not the one --out wrote, or has no MFU"
import json, sys
t = json.load(open(sys.argv[1]))["layouts"]
best = next(x for x in t if x["fits"])
assert best["overrides"] == open(sys.argv[2]).read().split(), (best["overrides"], open(sys.argv[2]).read())
assert 0 < best["mfu"] < 10, best["mfu"]
assert all(a["step_s"] <= b["step_s"] * 1.0101 for a, b in zip(t, t[1:]) if a["fits"] and b["fits"])
PY
  run_code 2 "$flowrun" plan --measure-links --out "$tmp/links1.json"
  expect_out "runs under mpirun with 2 or more ranks"
  run_code 2 "$flowrun" plan "${g[@]}" --devices 2 --links "$tmp/links.json" --bandwidth intra=5
  expect_out "not both"
  run_code 2 "$flowrun" plan "${g[@]}" --devices 2 --profile "$tmp/profile.json" --profile-rounds 2
  expect_out "--profile-rounds belongs to a profile run here"
  ;;
ckpt_reshard)
  # Per-rank checkpoints (issue 72): every rank writes its own files, nothing gathered; a checkpoint
  # written at dp 2 x tp 2 with ZeRO-3 loads at pp 2, at tp 4, at one process and, consolidated by
  # `flowrun ckpt consolidate`, as one process's checkpoint: each continues from step 3 to where an
  # uninterrupted run of one process ends (SGD with momentum: every tensor within 1e-5).
  needs_data data/text/fortunes_byte.train.bin
  g=("${tiny_gpt[@]}" model.layers=4)
  sgd=(opt.kind=sgd opt.adamw=null)
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/one"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=4 run.out_dir="$tmp/w" run.parallel.tp=2 zero.stage=params
  expect_out "4 ranks, this one"
  step3=$tmp/w/checkpoints/step_00000003
  # Each rank's files are its own: one per state it holds pieces of, named by its rank, as the
  # manifest records (the rank and host that wrote each).
  for r in 0 1 2 3; do
    for s in model.params opt.state ema.params; do
      f=$(printf "%s.rank%05d.safetensors" $s $r)
      [ -f "$step3/$f" ] || fail "rank $r wrote no $f"
      python3 -c "import json,sys; m=json.load(open('$step3/manifest.json')); assert m['files']['$f']['rank']==$r" ||
        fail "the manifest does not say rank $r wrote $f"
    done
  done
  [ -f "$step3/model.params.safetensors" ] && fail "a whole-model file was written (gathered) at 4 ranks"
  run_code 0 "$flowrun" ckpt verify "$step3"
  expect_out "every file matches its size and CRC32C"
  # The same tensors as one process's checkpoint of step 3, whichever layout wrote them.
  run_code 0 "$flowrun" ckpt consolidate "$step3" "$tmp/cons/checkpoints/step_00000003"
  echo step_00000003 > "$tmp/cons/checkpoints/latest"
  for f in model.params opt.state ema.params; do
    "$tensordiff" "$tmp/one/checkpoints/step_00000003/$f.safetensors" "$tmp/cons/checkpoints/step_00000003/$f.safetensors" 1e-5 ||
      fail "$f of step 3 written at dp 2 x tp 2 (ZeRO-3) differs from one process's"
  done
  run_code 0 "$flowrun" ckpt consolidate "$step3" "$tmp/params3.safetensors" --state model.params
  "$tensordiff" "$tmp/one/checkpoints/step_00000003/model.params.safetensors" "$tmp/params3.safetensors" 1e-5 ||
    fail "consolidate --state: the parameters differ"
  from "$tmp/w" "$tmp/pp2"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/pp2" run.parallel.pp=2 \
    run.parallel.microbatches=2 run.resume=auto
  expect_out "resumed from $tmp/pp2/checkpoints/step_00000003"
  from "$tmp/w" "$tmp/tp4"
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/tp4" run.parallel.tp=4 run.resume=auto
  from "$tmp/w" "$tmp/np1"
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/np1" run.resume=auto
  run_code 0 "$flowrun" "${g[@]}" "${sgd[@]}" data.batch=8 run.out_dir="$tmp/cons" run.resume=auto
  for r in pp2 tp4 np1 cons; do same_states one $r 1e-5 "resumed at $r from dp 2 x tp 2 (ZeRO-3)"; done
  ;;
ckpt_export)
  # `flowrun ckpt export` (issue 72): a checkpoint written at dp 2 x tp 2 with ZeRO-3 and without
  # exports, as the Hugging Face or PEFT folders its models export: byte for byte what the
  # checkpoint node's exports: true wrote during the run (which other cases hold against
  # transformers and peft). GPT with LoRA: PEFT's adapters of the model and of its EMA (OUT/REF
  # each); Llama: a Hugging Face folder (OUT itself). Then what is refused: an OUT that is there, a
  # graph that does not match, a checkpoint whose models export nothing (DiT without adapters).
  needs_data data/text/fortunes_byte.train.bin
  g=("${tiny_gpt[@]}" opt.kind=sgd opt.adamw=null data.batch=4 model.lora.rank=4 "model.lora.targets=[c_attn,c_proj,c_fc]")
  run_code 0 "${mpi4[@]}" "$flowrun" "${g[@]}" ckpt.exports=true run.out_dir="$tmp/lora" run.parallel.tp=2 zero.stage=params
  # The layout need not be given (the export is one process); the model's settings must.
  run_code 0 "$flowrun" ckpt export graphs/gpt.yaml "$tmp/lora" "$tmp/peft" "${g[@]:1}"
  expect_out "$tmp/peft/model.params: step 6 of $tmp/lora/checkpoints/step_00000006"
  for m in model.params ema.params; do
    for f in adapter_model.safetensors adapter_config.json; do
      cmp "$tmp/lora/checkpoints/step_00000006/$m/$f" "$tmp/peft/$m/$f" || fail "export: $m/$f differs from the run's exports"
    done
  done
  [ -e "$tmp/peft.tmp" ] || [ -e "$tmp/peft.run.tmp" ] && fail "export left its scratch folders"
  run_code 2 "$flowrun" ckpt export graphs/gpt.yaml "$tmp/lora" "$tmp/peft" "${g[@]:1}"
  expect_out "$tmp/peft is already there; give a new folder"
  run_code 1 "$flowrun" ckpt export graphs/gpt.yaml "$tmp/lora" "$tmp/peft8" "${g[@]:1}" model.lora.rank=8
  expect_out "model.lora.rank: 8 (the checkpoint's run had 4)"
  expect_out "the graph and overrides must be those of the run that wrote it"
  [ -e "$tmp/peft8" ] && fail "a failed export left $tmp/peft8"
  l=(graphs/llama.yaml data.path=data/text/fortunes_byte data.seq_len=32 model.layers=2 model.dim=32 model.heads=4
     model.kv_heads=2 model.mlp_dim=48 model.vocab=256 model.context=32 run.steps=3 run.threads=1 opt.warmup=2 eval.every=3
     eval.batches=1 eval.batch=4 evlog.every=3 ckpt.every=3 data.batch=4)
  run_code 0 "${mpi4[@]}" "$flowrun" "${l[@]}" ckpt.exports=true run.out_dir="$tmp/llama" run.parallel.tp=2 zero.stage=params
  run_code 0 "$flowrun" ckpt export graphs/llama.yaml "$tmp/llama/checkpoints/step_00000003" "$tmp/hf" "${l[@]:1}"
  for f in config.json model.safetensors; do
    cmp "$tmp/llama/checkpoints/step_00000003/$f" "$tmp/hf/$f" || fail "export: llama's $f differs from the run's exports"
  done
  needs_data data/shapes/base.json
  run_code 0 "$flowrun" "${tiny_dit[@]}" run.steps=3 data.batch=4 eval.batch=4 run.out_dir="$tmp/dit"
  run_code 2 "$flowrun" ckpt export graphs/dit_base.yaml "$tmp/dit" "$tmp/ditout" "${tiny_dit[@]:1}" run.steps=3 data.batch=4 eval.batch=4
  expect_out "is a model that exports a folder"
  ;;
ckpt_damage)
  # The red team's damages of a checkpoint (issue 72): bytes overwritten (same size), a file
  # truncated, a file missing, a manifest that does not read. Each is found (the sizes when the
  # folders are listed, the CRC32C of every file before a resume, each chunk's as it is read);
  # run.resume=auto falls back to the newest complete checkpoint that verifies, with a warning
  # naming the file, and continues bit for bit as the uninterrupted run; run.resume=PATH to an
  # older one is accepted with a warning; to the damaged one, refused naming the file.
  needs_data data/text/fortunes_byte.train.bin
  g=("${tiny_gpt[@]}" data.batch=4 opt.kind=sgd opt.adamw=null ckpt.every=2 eval.every=2 evlog.every=2)
  # (The learning rate's schedule runs to run.steps: every run here has 8; `base` is the full run
  # stopped after its checkpoint of step 6.)
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=8 run.out_dir="$tmp/full"
  cp -r "$tmp/full" "$tmp/base"
  rm -r "$tmp/base/checkpoints/step_00000008"
  echo step_00000006 > "$tmp/base/checkpoints/latest"
  f=model.params.rank00001.safetensors
  for d in overwrite truncate missing manifest; do
    cp -r "$tmp/base" "$tmp/$d"
    s6=$tmp/$d/checkpoints/step_00000006
    case $d in
      overwrite) size=$(stat -c %s "$s6/$f"); printf 'XXXXXXXX' | dd of="$s6/$f" bs=1 seek=$((size - 64)) conv=notrunc 2>/dev/null
                 [ "$(stat -c %s "$s6/$f")" = "$size" ] || fail "the overwrite changed the size" ;;
      truncate) truncate -s -16 "$s6/$f" ;;
      missing) rm "$s6/$f" ;;
      manifest) echo '{"format": "flowrun-checkpoint", "version": 2, "step": 6, "states": {}, "files": {"x": 1}}' > "$s6/manifest.json" ;;
    esac
    run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=8 run.out_dir="$tmp/$d" run.resume=auto
    [ $d = manifest ] && expect_out "manifest.json" || expect_out "$s6/$f"
    expect_out "resumed from $tmp/$d/checkpoints/step_00000004"
    for s in model.params opt.state ema.params data.cursor; do
      "$tensordiff" "$tmp/full/checkpoints/step_00000008/$s.safetensors" "$tmp/$d/checkpoints/step_00000008/$s.safetensors" 0 ||
        fail "$d: after falling back to step 4, $s of step 8 differs from the uninterrupted run's"
    done
  done
  # flowrun ckpt verify names the damaged file (exit 1).
  cp -r "$tmp/base" "$tmp/v"
  size=$(stat -c %s "$tmp/v/checkpoints/step_00000006/$f")
  printf 'X' | dd of="$tmp/v/checkpoints/step_00000006/$f" bs=1 seek=$((size - 8)) conv=notrunc 2>/dev/null
  run_code 1 "$flowrun" ckpt verify "$tmp/v/checkpoints"
  expect_out "step_00000006: DAMAGED: $tmp/v/checkpoints/step_00000006/$f: its CRC32C is"
  expect_out "step_00000004: every file matches"
  # Named by path: the damaged one refused, naming the file; an older one accepted, with a warning.
  run_code 2 "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=8 run.out_dir="$tmp/v" run.resume="$tmp/v/checkpoints/step_00000006"
  expect_out "the checkpoint is damaged: $tmp/v/checkpoints/step_00000006/$f"
  run_code 0 "${mpi[@]}" "$flowrun" "${g[@]}" run.steps=8 run.out_dir="$tmp/v" run.resume="$tmp/v/checkpoints/step_00000004"
  expect_out "the later checkpoint $tmp/v/checkpoints/step_00000006 is damaged"
  "$tensordiff" "$tmp/full/checkpoints/step_00000008/model.params.safetensors" "$tmp/v/checkpoints/step_00000008/model.params.safetensors" 0 ||
    fail "resumed from the older checkpoint by path: the parameters of step 8 differ"
  ls "$tmp/v/checkpoints" | grep -q "^replaced.step_00000006" || fail "the damaged step_00000006 was not moved aside"
  ;;
silent_rank)
  # Rank 1 stops (SIGSTOP: every thread of it silent, as a dead host or a cut link would be)
  # while rank 0 waits in the step's all-reduce: rank 0, its watcher in the heartbeats' ring, ends
  # the job within run.heartbeat_timeout_s, naming the rank and its host, long before the
  # collective's run.comm_timeout_s (30 s in this graph).
  start=$(date +%s)
  run_code nonzero timeout 120 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/s" run.steps=50 run.heartbeat_timeout_s=2 \
    fault.rank=1 fault.step=5 fault.mode=stop
  expect_out "rank 1 on host $(hostname) went silent: no heartbeat for 2 s (run.heartbeat_timeout_s)"
  [ $(( $(date +%s) - start )) -lt 20 ] || fail "the job took longer than the heartbeat timeout to end"
  # Ranks alive but busy (1.5 s in each batch, longer than the heartbeat timeout; their
  # communication threads beating) are not silent.
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/busy" run.steps=3 run.heartbeat_timeout_s=1 data.delay_ms=1500
  ;;
restart_loop)
  # scripts/restart.sh around mpirun: rank 1 is killed at step 5 (once: a marker file), the loop
  # restarts the job, which resumes from the newest complete checkpoint (step 4's, or step 2's
  # when the kill came while step 4's was being written) and ends where an uninterrupted run
  # ends: every loss and the parameters bit for bit.
  run_code 0 "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/straight" ckpt.every=2
  run_code 0 bash scripts/restart.sh --max 2 --wait 1 -- "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/r" ckpt.every=2 \
    run.resume=auto fault.rank=1 fault.step=5 fault.mode=kill fault.marker="$tmp/killed-once"
  expect_out "the job ended with exit code"
  expect_out "restart 1 of 2"
  expect_out "resumed from $tmp/r/checkpoints/step_0000000"
  [ -f "$tmp/killed-once" ] || fail "the fault never fired"
  losses "$tmp/straight/metrics.jsonl" > "$tmp/a"; losses "$tmp/r/metrics.jsonl" > "$tmp/b"
  cmp -s "$tmp/a" "$tmp/b" || { diff "$tmp/a" "$tmp/b" >&2; fail "the losses after the restart differ"; }
  "$tensordiff" "$(params "$tmp/straight" 10)" "$(params "$tmp/r" 10)" 0 || fail "the parameters after the restart differ"
  # Not restarted: a bad setting (exit 2) ends the loop at once.
  run_code 2 bash scripts/restart.sh --max 2 --wait 1 -- "${mpi[@]}" "$flowrun" $graph run.out_dir="$tmp/bad" run.resume=auto \
    run.nonsense=1
  grep -q "restart 1" "$tmp/out" && fail "a bad setting was restarted"
  ;;
restart_grace)
  # scripts/restart.sh ends a launcher that outlives its ranks (Open MPI 4's mpirun across a cut
  # link waits minutes for the cut-off host's daemon, hosts_test.sh faults2): --grace seconds after
  # the job says a rank went silent, it is ended and the loop goes on; a launcher that hangs
  # without such a message is left alone (here: ended by the test's timeout).
  start=$(date +%s)
  run_code 1 bash scripts/restart.sh --max 1 --wait 0 --grace 2 -- bash -c \
    'echo "rank 3 on host b went silent: no heartbeat for 10 s (run.heartbeat_timeout_s)"; exec sleep 60' run.resume=auto
  expect_out "the launcher has not, 2 s on; ending it"
  expect_out "restart 1 of 1"
  expect_out "the job failed 2 times (last exit code 1)"
  [ $(( $(date +%s) - start )) -lt 30 ] || fail "the loop did not end the launcher within its grace"
  run_code 124 timeout 5 bash scripts/restart.sh --max 1 --wait 0 --grace 2 -- bash -c 'exec sleep 60' run.resume=auto
  ;;
*) fail "unknown case" ;;
esac
echo "PASS [$case_name]"
