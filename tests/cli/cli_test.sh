#!/usr/bin/env bash
# End-to-end tests of the flowrun command line. Usage: cli_test.sh CASE FLOWRUN SRC BUILD
set -u
case_name=$1 flowrun=$2 src=$3 build=$4
tmp=$(mktemp -d /tmp/flowrun-cli.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export FLOWRUN_BUILD=$build
cd "$src"

fail() { echo "FAIL [$case_name]: $*" >&2; exit 1; }
# expect_code CODE CMD...: run, keep stdout+stderr in $tmp/out, check the exit code
expect_code() {
  local want=$1; shift
  "$@" >"$tmp/out" 2>&1
  local got=$?
  [ "$got" = "$want" ] || { cat "$tmp/out" >&2; fail "'$*' exited $got, expected $want"; }
}
expect_out() { grep -qF -- "$1" "$tmp/out" || { cat "$tmp/out" >&2; fail "output lacks: $1"; }; }
# write_failing_graph FILE: a graph whose one node (a test plugin's) fails at step 4
write_failing_graph() {
  cat > "$1" <<YAML
flowrun: 1
run: { steps: 10, out_dir: "$tmp/failrun" }
plugins: [ "$build/tests/plugins/libt_plugin_ok.so" ]
nodes:
  boom: { type: t_plugin_fail, with: { at: 4 } }
YAML
}
# needs_data FILE...: what scripts/data.sh makes; without it the case is skipped (exit 77, which
# ctest reports as skipped), saying what to run. scripts/test.sh runs data.sh first.
needs_data() {
  for f in "$@"; do
    [ -e "$f" ] || { echo "SKIP [$case_name]: $f is missing: run scripts/data.sh first (scripts/test.sh does it)"; exit 77; }
  done
}
# first and last "loss" in a metrics.jsonl
loss_at() { grep -o '"loss":[0-9.eE+-]*' "$1" | sed -n "$2" | cut -d: -f2; }

case $case_name in
help)
  expect_code 0 "$flowrun" --help; expect_out "flowrun validate FILE..."
  for c in run validate dot nodes prep plan; do expect_code 0 "$flowrun" $c --help; expect_out "usage: flowrun"; done
  expect_code 2 "$flowrun"; expect_out "usage:"
  expect_code 2 "$flowrun" frobnicate; expect_out "unknown command 'frobnicate'"
  ;;
validate_graphs)
  expect_code 0 "$flowrun" validate graphs/*.yaml examples/plugins/*.yaml
  expect_out "graphs/regression.yaml: ok"
  ;;
validate_errors)
  cat > "$tmp/bad.yaml" <<'YAML'
flowrun: 1
run: { stesp: 10 }
nodes:
  data: { type: synthetic_regresion }
  model: { type: mlp, with: { hiden: 4 } }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: dat.batch, objective: loss.objective, model: model.params } }
YAML
  expect_code 2 "$flowrun" validate "$tmp/bad.yaml" graphs/regression.yaml
  expect_out "$tmp/bad.yaml:2:8: run.stesp: unknown parameter 'stesp' (did you mean 'steps'?)"
  expect_out "$tmp/bad.yaml:4:17: nodes.data.type: unknown node type 'synthetic_regresion' (did you mean 'synthetic_regression'?)"
  expect_out "$tmp/bad.yaml:5:31: nodes.model.with.hiden: unknown parameter 'hiden' (did you mean 'hidden'?)"
  expect_out "nodes.fb.in.batch: no node 'dat' (did you mean 'data'?)"
  expect_out "bad.yaml: 4 errors"
  expect_out "graphs/regression.yaml: ok"
  ;;
overrides_and_print_config)
  expect_code 0 "$flowrun" run graphs/regression.yaml run.steps=7 opt.lr=0.5 ema.every=3 --print-config
  expect_out "steps: 7"; expect_out "lr: 0.5"; expect_out "every: 3"
  expect_out "prefetch: 2"          # defaults are filled in
  expect_out "beta2: 0.999"         # the adamw rule's settings, filled in too
  grep -q "momentum:" "$tmp/out" && fail "--print-config lists the settings of a rule the graph does not use"
  # Another update rule from the command line: the file's adamw settings are refused with it,
  # and dropped by setting them to null.
  expect_code 2 "$flowrun" validate graphs/gpt.yaml opt.kind=sgd
  expect_out "'adamw' applies with kind: adamw only, and kind is sgd: drop 'adamw' (or set it to null)"
  expect_code 0 "$flowrun" validate graphs/gpt.yaml opt.kind=sgd opt.adamw=null
  expect_code 2 "$flowrun" graphs/regression.yaml opt.lrr=0.5
  expect_out "command line: nodes.opt.with.lrr: unknown parameter 'lrr' (did you mean 'lr'?)"
  expect_code 2 "$flowrun" graphs/regression.yaml run.steps=lots
  expect_out "run.steps: expected int >= 1, got 'lots'"
  ;;
run_writes_metrics)
  expect_code 0 "$flowrun" graphs/regression.yaml run.steps=60 run.log_every=10 run.out_dir="$tmp/run"
  expect_out "done: 60 steps"
  [ "$(wc -l < "$tmp/run/metrics.jsonl")" = 6 ] || fail "expected 6 metrics lines"
  grep -q '"step":60' "$tmp/run/metrics.jsonl" || fail "no step 60 in metrics"
  grep -q '"time":' "$tmp/run/metrics.jsonl" || fail "no time in metrics"
  first=$(loss_at "$tmp/run/metrics.jsonl" 1p); last=$(loss_at "$tmp/run/metrics.jsonl" '$p')
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a / 2) }' || fail "loss did not drop: $first -> $last"
  # run.threads 0 is $OMP_NUM_THREADS where set (as for torch), else the cores; a number is itself.
  OMP_NUM_THREADS=3 expect_code 0 "$flowrun" graphs/regression.yaml run.steps=1 run.out_dir="$tmp/omp"
  expect_out "device cpu, 3 intra-op threads"
  OMP_NUM_THREADS=3 expect_code 0 "$flowrun" graphs/regression.yaml run.steps=1 run.threads=1 run.out_dir="$tmp/one"
  expect_out "device cpu, 1 intra-op thread,"
  expect_code 0 env -u OMP_NUM_THREADS "$flowrun" graphs/regression.yaml run.steps=1 run.out_dir="$tmp/cores"
  expect_out "device cpu, $(getconf _NPROCESSORS_ONLN) intra-op thread"  # (nproc reads OMP_NUM_THREADS)
  ;;
device_selection)
  # A CPU build (Debian's libtorch): auto and cpu run on the CPU and say so; cuda is refused
  # before anything runs, naming run.device and what to do.
  expect_code 0 "$flowrun" graphs/regression.yaml run.steps=3 run.out_dir="$tmp/auto"
  expect_out "device cpu"
  expect_code 0 "$flowrun" graphs/regression.yaml run.steps=3 run.device=cpu run.out_dir="$tmp/cpu"
  if "$flowrun" graphs/regression.yaml run.steps=1 run.device=cuda run.out_dir="$tmp/probe" >/dev/null 2>&1; then
    echo "this build runs on a GPU: the refusal is checked by CPU builds only"
  else
    expect_code 2 "$flowrun" graphs/regression.yaml run.steps=3 run.device=cuda run.out_dir="$tmp/cuda"
    expect_out "run.device is cuda, but"
    expect_out "or set run.device=cpu"
    [ ! -e "$tmp/cuda/metrics.jsonl" ] || fail "a refused device still ran"
    expect_code 2 "$flowrun" graphs/regression.yaml run.device=cuda:1 run.out_dir="$tmp/cuda1"
    expect_out "run.device is cuda:1, but"
  fi
  expect_code 2 "$flowrun" validate graphs/regression.yaml run.device=gpu
  expect_out "run.device: 'gpu' is not a device: use auto, cpu, cuda or cuda:N"
  ;;
dot_renders)
  "$flowrun" dot graphs/regression.yaml > "$tmp/g.dot" || fail "dot failed"
  grep -q '"fb" -> "opt"' "$tmp/g.dot" || fail "no fb -> opt edge"
  grep -q 'style=dashed, label="params → model (write)"' "$tmp/g.dot" || fail "no dashed write edge"
  dot -Tsvg "$tmp/g.dot" > "$tmp/g.svg" || fail "graphviz rejected the dot output"
  grep -q "<svg" "$tmp/g.svg" || fail "no svg"
  # The step as a program: every node in file order with what it waits for.
  expect_code 0 "$flowrun" explain graphs/regression.yaml
  expect_out "5. opt   = optimizer(grads = fb.grads, model writes model.params)   [compute thread]"
  expect_out "waits for fb@s (grads; reads model.params), opt@s-1 (its previous step; wrote model.params before"
  expect_code 2 "$flowrun" explain graphs/nope.yaml
  # Every edge declared (issue 69): the EMA's note at setup on the model it reads, forward_backward's
  # profile as a state of its own; dot draws the setup write.
  expect_code 0 "$flowrun" explain graphs/gpt.yaml
  expect_out "ema   = ema(model reads (writes at setup) model.params)"
  expect_out "owns fb.profile (state, written each step)"
  "$flowrun" dot graphs/gpt.yaml | grep -qF 'label="params → model (read; write at setup)"' || fail "dot shows no setup write"
  # and every node's declared edges between ranks (the executor refuses a channel undeclared).
  "$flowrun" dot graphs/gpt.yaml | grep -qF '"fb" [label="fb : forward_backward\ncollectives: dp, pp, tp, ep"' ||
    fail "dot shows no collectives on fb"
  # Then the layout of the processes (run.parallel's mesh), for this job or --world N.
  expect_code 0 "$flowrun" explain graphs/regression.yaml
  expect_out "processes: dp 1 x pp 1 x tp 1 (1 process)"
  expect_code 0 "$flowrun" explain graphs/gpt.yaml --world 4 run.parallel.tp=2
  expect_out "processes: dp 2 x pp 1 x tp 2 (4 processes)"
  expect_out "rank 3: dp 1, pp 0, tp 1; tp group {2, 3}, dp group {1, 3}"
  expect_out "collectives over the tp group: under run.parallel.tp, the split model's (gpt, dit, cappa)"
  expect_code 0 "$flowrun" explain graphs/gpt.yaml --world 2 run.parallel.pp=2 run.parallel.microbatches=4
  expect_out "pipeline: 2 stages, schedule 1f1b, 4 micro-batches"
  expect_out "stage 0: F0 F1 .. B0 F2 B1 F3 B2 .. B3   (bubble 20 %, holds at most 2 micro-batches)"
  expect_out "collectives over the dp group: each bucket of gradients all-reduced"
  expect_code 2 "$flowrun" explain graphs/gpt.yaml --world 0
  expect_out "--world 0: expected a number of processes"
  # A layout a single process cannot be: refused before any node is made.
  expect_code 2 "$flowrun" graphs/regression.yaml run.parallel.tp=2 run.out_dir="$tmp/tp2"
  expect_out "this is a single process; launch a multiple of 2 (mpirun -np 2 flowrun ...)"
  ;;
nodes_docs)
  expect_code 0 "$flowrun" nodes
  for t in synthetic_regression mlp forward_backward optimizer ema metrics; do expect_out "$t"; done
  expect_code 0 "$flowrun" nodes optimizer
  expect_out "  lr: float >= 0, default 1.0e-3"
  expect_out "model: state (write) params"
  expect_code 0 "$flowrun" nodes graph
  expect_out "prefetch: int in [0, 64], default 2"
  expect_code 2 "$flowrun" nodes optimiser; expect_out "did you mean 'optimizer'"
  # A plugin's update rule joins the optimizer's kinds, its settings a group of their own.
  expect_code 0 "$flowrun" nodes optimizer
  expect_out "one of {adamw, sgd, adafactor}"
  expect_code 0 "$flowrun" nodes optimizer --plugin "$build/examples/plugins/liblion.so"
  expect_out "one of {adamw, sgd, adafactor, lion}"
  expect_out "lion: map, only with kind: lion"
  expect_out "kind lion (from $build/examples/plugins/liblion.so)"
  ;;
plugin_swap)
  # The optimizer's update rule from a plugin, flowrun not relinked: the binary does not depend
  # on the plugin, and the graph trains.
  ldd "$flowrun" | grep -q liblion && fail "flowrun links the plugin"
  expect_code 0 "$flowrun" examples/plugins/regression_lion.yaml run.steps=100 run.out_dir="$tmp/lion"
  first=$(loss_at "$tmp/lion/metrics.jsonl" 1p); last=$(loss_at "$tmp/lion/metrics.jsonl" '$p')
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a / 4) }' || fail "lion did not train: $first -> $last"
  # Another rule's settings beside kind: lion are refused, naming the key and the kind.
  expect_code 2 "$flowrun" validate examples/plugins/regression_lion.yaml opt.adamw.beta1=0.8
  expect_out "'adamw' applies with kind: adamw only, and kind is lion"
  ;;
objective_plugin)
  # A loss as a plugin (examples/plugins/zloss): listed by `flowrun nodes`, trains a graph,
  # and with label smoothing and z-loss off gives lm_loss's losses (graphs/gpt.yaml at the
  # same sizes), though the plugin computes the cross-entropy its own way.
  needs_data data/text/fortunes_byte.train.bin
  plugin="$build/examples/plugins/libzloss.so"
  ldd "$flowrun" | grep -q libzloss && fail "flowrun links the plugin"
  expect_code 0 "$flowrun" nodes --plugin "$plugin"; expect_out "lm_zloss"
  expect_code 0 "$flowrun" nodes lm_zloss --plugin "$plugin"; expect_out "z_loss: float >= 0, default 1.0e-4"
  expect_code 0 "$flowrun" examples/plugins/gpt_zloss.yaml run.steps=60 run.log_every=1 eval.every=60 evlog.every=60 \
    run.out_dir="$tmp/z"
  first=$(loss_at "$tmp/z/metrics.jsonl" 1p); last=$(loss_at "$tmp/z/metrics.jsonl" 60p)
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a * 0.7) }' || fail "lm_zloss did not train: $first -> $last"
  expect_out "eval step 60: val loss"
  small=(run.steps=3 run.log_every=1 eval.every=1000 evlog.every=1000)
  expect_code 0 "$flowrun" examples/plugins/gpt_zloss.yaml "${small[@]}" loss.label_smoothing=0 loss.z_loss=0 run.out_dir="$tmp/z0"
  expect_code 0 "$flowrun" graphs/gpt.yaml "${small[@]}" data.path=data/text/fortunes_byte data.seq_len=64 data.batch=16 \
    model.layers=2 model.dim=64 model.heads=4 model.vocab=256 model.context=64 opt.lr=3.0e-3 opt.warmup=20 \
    opt.schedule=constant opt.weight_decay=0.0 opt.adamw.beta2=0.999 opt.clip=0 ckpt.every=1000 ckpt.at=[] run.out_dir="$tmp/lm"
  for i in 1 2 3; do
    a=$(loss_at "$tmp/z0/metrics.jsonl" ${i}p); b=$(loss_at "$tmp/lm/metrics.jsonl" ${i}p)
    awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * b) }' ||
      fail "step $i: lm_zloss with smoothing and z-loss off gives $a, lm_loss $b"
  done
  ;;
node_failure_exit_code)
  write_failing_graph "$tmp/fail.yaml"
  expect_code 1 "$flowrun" "$tmp/fail.yaml"
  expect_out "node 'boom' (t_plugin_fail) failed at step 4: deliberate failure"
  ;;
sigint_stops_cleanly)
  "$flowrun" graphs/regression.yaml run.steps=100000 data.delay_ms=20 run.out_dir="$tmp/int" >"$tmp/out" 2>&1 &
  pid=$!
  # Interrupt training, not start-up: wait for the first logged step (start-up takes seconds
  # on a loaded machine). The bound below is generous for the same reason: what is tested is
  # that it stops by itself, not how fast a busy machine finishes a step.
  for i in $(seq 300); do [ -s "$tmp/int/metrics.jsonl" ] && break; sleep 0.1; done
  kill -INT $pid
  for i in $(seq 200); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  kill -0 $pid 2>/dev/null && { kill -9 $pid; fail "still running 20 s after SIGINT"; }
  wait $pid; code=$?
  [ $code = 130 ] || { cat "$tmp/out" >&2; fail "exit code $code after SIGINT, expected 130"; }
  expect_out "Ctrl-C: stopping after the steps in flight"
  expect_out "stopped after"
  ;;
trace_file)
  expect_code 0 "$flowrun" graphs/regression.yaml run.steps=20 run.out_dir="$tmp/t" run.trace="$tmp/t/trace.json"
  grep -q '"traceEvents"' "$tmp/t/trace.json" || fail "no traceEvents"
  for n in data fb opt ema log; do grep -q "\"name\":\"$n\"" "$tmp/t/trace.json" || fail "no span for $n"; done
  grep -q '"ph":"C"' "$tmp/t/trace.json" || fail "no counters"
  ;;
progress_line)
  # Not a terminal: plain log lines with step/total, steps/s and ETA.
  expect_code 0 "$flowrun" graphs/regression.yaml run.steps=40 run.log_every=20 run.progress=on run.out_dir="$tmp/p"
  expect_out "step 20/40 | "; expect_out " steps/s | ETA "
  # A terminal (script gives it one): the line is redrawn in place.
  if command -v script >/dev/null; then
    script -qec "$flowrun graphs/regression.yaml run.steps=40 run.out_dir=$tmp/p2" /dev/null > "$tmp/out" 2>&1
    grep -q $'\r' "$tmp/out" || fail "no carriage-return progress line on a terminal"
    expect_out "step 40/40"
  fi
  ;;
hostile_files)
  # Issue 13: shapes yaml-cpp accepted or crashed on are exit 2 with the line, in validate and run.
  printf 'flowrun: 1\nrun: 5\nnodes:\n  data: { type: synthetic_regression }\n' > "$tmp/scalar.yaml"
  for cmd in validate run dot; do
    expect_code 2 "$flowrun" $cmd "$tmp/scalar.yaml"; expect_out "scalar.yaml:2:6: run: expected map"
  done
  printf 'flowrun: 1\nrun: &r { steps: 5, self: *r }\nnodes:\n  data: { type: synthetic_regression }\n' > "$tmp/cycle.yaml"
  expect_code 2 "$flowrun" validate "$tmp/cycle.yaml"; expect_out "cycle.yaml:2:"; expect_out "would contain itself"
  expect_code 2 "$flowrun" run "$tmp/cycle.yaml"; expect_out "would contain itself"
  expect_code 2 "$flowrun" graphs/regression.yaml 'opt.lr=.inf'; expect_out "nodes.opt.with.lr: expected float"
  expect_code 2 "$flowrun" validate /dev/zero; expect_out "not a regular file"
  expect_code 2 "$flowrun" validate graphs; expect_out "it is a folder"
  # Item 10: a model that cannot fit is refused from its config, before allocating (it took
  # 44 s and ended in a bare std::bad_alloc).
  start=$(date +%s)
  expect_code 1 "$flowrun" graphs/regression.yaml model.layers=1000 model.hidden=100000 run.out_dir="$tmp/big"
  expect_out "node 'model' (mlp) (1000 layers of 100000, 8 in, 1 out) has about 9.99e+12 parameters"
  expect_out "make the model smaller"
  # A depth no model has is refused by itself (every model node: ModelNode's size check).
  expect_code 1 "$flowrun" graphs/regression.yaml model.layers=100000000 run.out_dir="$tmp/big"
  expect_out "node 'model' (mlp) (100000000 layers of 64, 8 in, 1 out): 100000000 layers, more than the 10000 flowrun builds"
  [ $(( $(date +%s) - start )) -lt 10 ] || fail "the size check took more than 10 s"
  # Unclear messages that now say why: a device as text input, a failed metrics write.
  expect_code 2 "$flowrun" prep text --tokenizer byte --out "$tmp/z" /dev/zero; expect_out "not a regular file or folder"
  mkdir -p "$tmp/full" && ln -s /dev/full "$tmp/full/metrics.jsonl"
  expect_code 1 "$flowrun" graphs/regression.yaml run.steps=20 run.out_dir="$tmp/full"
  expect_out "metrics.jsonl failed: No space left on device"
  ;;
resume_never_discards_work)
  # A run with checkpoints at steps 3, 6 and 7 (end); then every way `latest` can be broken.
  g=(tests/mpi/ddp.yaml run.out_dir="$tmp/r" ckpt.every=3 ckpt.keep_last=5)
  c="$tmp/r/checkpoints"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=7
  # A fresh start over them is refused, and touches nothing.
  expect_code 2 "$flowrun" "${g[@]}" run.steps=7
  expect_out "holds 3 checkpoint folder(s) of an earlier run (newest: step 7"; expect_out "run.resume=auto"
  [ "$(cat "$c/latest")" = step_00000007 ] || fail "latest changed by a refused run"
  for broken in missing empty folder; do
    rm -rf "$c/latest"
    case $broken in empty) : > "$c/latest" ;; folder) mkdir "$c/latest" ;; esac
    expect_code 0 "$flowrun" "${g[@]}" run.steps=8 run.resume=auto
    expect_out "resuming from the newest complete checkpoint, $c/step_00000007 (step 7)"
    expect_out "resumed from $c/step_00000007"
    rm -rf "$c/step_00000008"
  done
  # `latest` names a folder whose manifest is wrong: the newest good one, the field named.
  printf step_00000007 > "$c/latest"
  sed -i 's/"step": 7/"step": -5/' "$c/step_00000007/manifest.json"
  expect_code 2 "$flowrun" "${g[@]}" run.resume="$c/step_00000007"; expect_out "field 'step'"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=7 run.resume=auto
  expect_out "manifest.json: field 'step': expected the step number (an integer >= 1), got -5"
  expect_out "resumed from $c/step_00000006"
  # No complete checkpoint at all: refused, not "starting from step 1".
  for m in "$c"/step_*/manifest.json; do echo '{"format": "flowrun-checkpoint", "version": 1, "step": 3, "states": []}' > "$m"; done
  expect_code 2 "$flowrun" "${g[@]}" run.steps=7 run.resume=auto
  expect_out "is a complete checkpoint"; expect_out "field 'states': expected an object"
  # Asked for by name: start over. A run that fails before its first checkpoint has changed
  # nothing; once the new run has a checkpoint, the old ones are moved aside, never deleted.
  # (run.prefetch=0: one step in flight, so step 2's failure comes before step 3's checkpoint;
  # with more, nothing waits on the fault node and a loaded machine could write step 3 first.)
  before=$(cd "$c" && ls | sort | tr '\n' ' ')
  expect_code 1 "$flowrun" "${g[@]}" run.steps=4 run.resume=never run.prefetch=0 fault.rank=0 fault.step=2 fault.mode=throw
  [ "$(cd "$c" && ls | sort | tr '\n' ' ')" = "$before" ] || fail "a failed run.resume=never run changed $c: $(ls "$c")"
  ls -d "$c".previous-* > /dev/null 2>&1 && fail "moved the old checkpoints aside before a new one existed"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=4 run.resume=never
  expect_out "run.resume=never: the earlier run's"; expect_out "moved from $c to $c.previous-"
  [ "$(ls "$c" | grep -c '^step_')" = 2 ] || fail "expected steps 3 and 4 only after starting over: $(ls "$c")"
  [ "$(cat "$c/latest")" = step_00000004 ] || fail "latest does not name the new run's last checkpoint"
  old=$(ls -d "$c".previous-*)
  [ "$(ls "$old" | grep -c '^step_')" = 3 ] && [ -f "$old/latest" ] || fail "the earlier run's folders are not all in $old: $(ls "$old")"
  ;;
latest_behind)
  # A run stopped between renaming step 6's folder into place and updating `latest` leaves
  # `latest` at step 3 with a complete step 6: resume=auto continues from step 6 (saying so), so
  # step 6 is never written again; settings that differ from the checkpoint's run are listed.
  g=(tests/mpi/ddp.yaml run.out_dir="$tmp/b" ckpt.every=3 ckpt.keep_last=5)
  c="$tmp/b/checkpoints"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=6
  sum6=$(md5sum "$c/step_00000006/model.params.safetensors" | cut -d' ' -f1)
  printf step_00000003 > "$c/latest"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=8 run.resume=auto run.seed=9 opt.lr=0.02
  expect_out "latest names step 3, but $c/step_00000006 is complete and newer"
  expect_out "resumed from $c/step_00000006"
  expect_out "run.seed: 9 (the checkpoint's run had 3)"; expect_out "opt.lr: 0.02 (the checkpoint's run had 1.0e-2)"
  [ "$(md5sum "$c/step_00000006/model.params.safetensors" | cut -d' ' -f1)" = "$sum6" ] || fail "step 6 was rewritten"
  # Resuming by name from an older checkpoint would write steps 6..8 again, over them: refused.
  expect_code 2 "$flowrun" "${g[@]}" run.steps=8 run.resume="$c/step_00000003"
  expect_out "already holds later complete checkpoints"
  # The folder latest names lacks a state (issue 47: the warning said only what it resumed from).
  sed -i 's/"opt.state"/"opt.other"/' "$c/step_00000008/manifest.json"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=9 run.resume=auto
  expect_out "latest names step_00000008, which has no state opt.state (this graph saves it)"
  expect_out "resumed from $c/step_00000006"
  ;;
two_checkpoint_nodes)
  # resume=auto considers every checkpoint node: the newest complete checkpoint that holds all
  # the graph's states, wherever it is.
  cat > "$tmp/two.yaml" <<YAML
flowrun: 1
run: { steps: 7, seed: 3, log_every: 1, out_dir: "$tmp/two" }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 4, out_dim: 1, batch: 8 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 2, out_dim: 1 } }
  loss:  { type: mse_loss }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params } }
  log:   { type: metrics, in: { loss: fb.loss } }
  ckpt:  { type: checkpoint, every: 3, in: { state: [model.params, opt.state, data.cursor] } }
  more:  { type: checkpoint, every: 5, with: { dir: more }, in: { state: [model.params, opt.state, data.cursor] } }
YAML
  expect_code 0 "$flowrun" "$tmp/two.yaml"
  rm -rf "$tmp/two/checkpoints/step_00000006" && printf step_00000003 > "$tmp/two/checkpoints/latest"
  expect_code 0 "$flowrun" "$tmp/two.yaml" run.steps=9 run.resume=auto
  expect_out "resumed from $tmp/two/more/step_00000005"
  ;;
fresh_start_logs)
  # A fresh start moves the earlier run's metrics and TensorBoard folder aside; a resume drops
  # the metrics lines of steps the stopped run logged after its checkpoint.
  g=(graphs/regression.yaml run.out_dir="$tmp/f" log.tensorboard=true)
  expect_code 0 "$flowrun" "${g[@]}" run.steps=40
  expect_code 0 "$flowrun" "${g[@]}" run.steps=20
  expect_out "the earlier run's metrics.jsonl moved to $tmp/f/metrics.previous-"
  ls "$tmp"/f/metrics.previous-*.jsonl > /dev/null && ls -d "$tmp"/f/tb.previous-* > /dev/null || fail "nothing moved aside: $(ls "$tmp/f")"
  [ "$(grep -c '"step"' "$tmp/f/metrics.jsonl")" = 1 ] || fail "metrics.jsonl holds more than the new run's line: $(cat "$tmp/f/metrics.jsonl")"
  g=(tests/mpi/ddp.yaml run.out_dir="$tmp/r" ckpt.every=4)
  expect_code 0 "$flowrun" "${g[@]}" run.steps=6   # checkpoints at 4 and 6 (end); lines 1..6
  rm -rf "$tmp/r/checkpoints/step_00000006" && printf step_00000004 > "$tmp/r/checkpoints/latest"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=8 run.resume=auto
  expect_out "metrics.jsonl: dropped 2 line(s) of steps from 5 on"
  [ "$(grep -o '"step":[0-9]*' "$tmp/r/metrics.jsonl" | cut -d: -f2 | tr '\n' ' ')" = "1 2 3 4 5 6 7 8 " ] ||
    fail "expected steps 1..8 once each: $(grep -o '"step":[0-9]*' "$tmp/r/metrics.jsonl" | tr '\n' ' ')"
  ;;
out_dir_lock)
  "$flowrun" graphs/regression.yaml run.steps=100000 data.delay_ms=20 run.out_dir="$tmp/l" >"$tmp/first" 2>&1 &
  pid=$!
  for i in $(seq 300); do [ -s "$tmp/l/metrics.jsonl" ] && break; sleep 0.1; done
  expect_code 2 "$flowrun" graphs/regression.yaml run.steps=3 run.out_dir="$tmp/l"
  expect_out "another flowrun is running in $tmp/l (pid $pid on "
  kill -9 $pid; wait $pid 2>/dev/null
  # The lock died with its process: the next run goes ahead.
  expect_code 0 "$flowrun" graphs/regression.yaml run.steps=3 run.out_dir="$tmp/l"
  ;;
tensorboard_events)
  # graphs/dit_base.yaml at a tiny size (its VAE seeded random: no trained one needed): two
  # metrics nodes and the sampler write one event file (OUT_DIR/tb). tests/tools/read_tfevents.py, a reader written apart from the writer, checks
  # every record's length and data CRC and each PNG, and decodes the events; every number of
  # metrics.jsonl is there as a scalar NODE/NAME of its step, and the grid as an image of the
  # PNG's size.
  needs_data data/shapes/base.json
  expect_code 0 "$flowrun" graphs/dit_base.yaml run.out_dir="$tmp/o" run.steps=6 run.log_every=2 run.progress=off \
    log.tensorboard=true evlog.tensorboard=true sample.tensorboard=true data.batch=8 tok.max_length=12 text.dim=16 \
    text.heads=2 text.ffn=32 model.hidden=32 model.depth=2 model.heads=2 model.mlp_ratio=2.0 model.text_dim=16 \
    sample.steps=2 sample.per_prompt=1 sample.every=6 fid.every=6 eval.every=3 evlog.every=6 eval.batch=8 eval.batches=1 \
    vae.weights=null
  [ "$(ls "$tmp/o/tb" | wc -l)" = 1 ] || { ls -l "$tmp/o/tb" >&2; fail "expected one event file in OUT_DIR/tb"; }
  python3 tests/tools/read_tfevents.py "$tmp/o/tb" > "$tmp/events" || fail "the event file does not read back"
  python3 - "$tmp/events" "$tmp/o/metrics.jsonl" "$tmp/o/samples/step_0000006.png" <<'PY' || fail "events differ from metrics.jsonl"
import json, struct, sys
node = {"loss": "log", "val_loss": "evlog"}  # which metrics node logged a line, by its input
events = [json.loads(l) for l in open(sys.argv[1])]
assert events[0].get("file_version") == "brain.Event:2", events[0]
scalars = {}
for e in events:
    for tag, v in e["scalars"].items():
        scalars[(e["step"], tag)] = v
n = 0
for line in open(sys.argv[2]):
    j = json.loads(line)
    prefix = next(node[k] for k in j if k in node)
    for k, v in j.items():
        if k in ("step", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        got = scalars.pop((j["step"], prefix + "/" + k))
        assert abs(got - v) <= 1e-6 * max(1.0, abs(v)), (j["step"], k, got, v)
        n += 1
assert not scalars, "scalars not in metrics.jsonl: %s" % scalars
# 3 training lines (loss lr grad_norm skipped steps_per_s), 1 eval line (val_loss fidelity color kind
# steps_per_s, and per_prompt/PROMPT and per_prompt_color/PROMPT for each of the 14 prompts)
assert n == 3 * 5 + 5 + 2 * 14, n
images = [(e["step"], t, i) for e in events for t, i in e["images"].items()]
w, h = struct.unpack(">II", open(sys.argv[3], "rb").read()[16:24])
assert images == [(6, "sample", images[0][2])], images
i = images[0][2]
assert (i["width"], i["height"], i["colorspace"]) == (w, h, 3), (i, w, h)
print("ok: %d scalars, image %dx%d" % (n, w, h))
PY
  ;;
json_logs)
  # FLOWRUN_LOG=json: every stderr line of a run is one JSON object (time, level, rank, msg),
  # the progress among them; a failure is an error line; an unknown word is refused.
  FLOWRUN_LOG=json expect_code 0 "$flowrun" graphs/regression.yaml run.steps=20 run.log_every=10 run.progress=on \
    run.out_dir="$tmp/j \"q\""$'\t'"b"   # a quote and a tab in a logged path
  python3 - "$tmp/out" <<'PY' || { cat "$tmp/out" >&2; fail "a line is not a JSON log object"; }
import json, sys
lines = open(sys.argv[1]).read().splitlines()
objs = [json.loads(l) for l in lines]
for o in objs:
    assert list(o) == ["time", "level", "rank", "msg"] and o["rank"] == 0, o
    assert o["time"].endswith("Z") and o["time"][10] == "T", o
msgs = [o["msg"] for o in objs]
assert any(m.startswith("step 10/20 | ") for m in msgs), msgs   # the progress line, logged
assert any(m.startswith("done: 20 steps") for m in msgs), msgs
assert any('j "q"\tb' in m for m in msgs), msgs
PY
  write_failing_graph "$tmp/fail.yaml"
  FLOWRUN_LOG=json,debug expect_code 1 "$flowrun" "$tmp/fail.yaml"
  python3 -c 'import json,sys; o=[json.loads(l) for l in open(sys.argv[1])]; assert any(x["level"]=="error" for x in o); assert any(x["level"]=="debug" for x in o)' "$tmp/out" \
    || { cat "$tmp/out" >&2; fail "no JSON error/debug lines"; }
  FLOWRUN_LOG=json expect_code 2 "$flowrun" graphs/regression.yaml run.stesp=5
  python3 -c 'import json,sys; o=[json.loads(l) for l in open(sys.argv[1])]; assert any("stesp" in x["msg"] for x in o)' "$tmp/out" \
    || { cat "$tmp/out" >&2; fail "graph errors are not JSON lines"; }
  FLOWRUN_LOG=verbose expect_code 2 "$flowrun" graphs/regression.yaml run.steps=5
  expect_out "FLOWRUN_LOG: unknown word 'verbose'"
  ;;
profile_and_dot_trace)
  # graphs/regression.yaml with its reader slowed on purpose (synthetic_regression delay_ms:
  # 60 ms a step, far above the rest of a step even on a busy machine; a serial node: it reads
  # its steps in order): the progress line names it, the
  # profile shows it as the bottleneck (largest share, first on the critical path, fb waiting on
  # it), profile.json's totals are the trace's spans summed, and `dot --trace` puts it on the
  # bold critical path with its mean within 10 % of the trace's spans; Graphviz renders it.
  expect_code 0 "$flowrun" graphs/regression.yaml run.steps=30 run.log_every=10 run.progress=on data.delay_ms=60 \
    run.out_dir="$tmp/p" run.trace="$tmp/p/trace.json" run.profile=true
  expect_out "| slowest data "; expect_out "critical path ("; expect_out "profile written to $tmp/p/profile.json"
  "$flowrun" dot --trace "$tmp/p/trace.json" graphs/regression.yaml > "$tmp/g.dot" 2> "$tmp/err" ||
    { cat "$tmp/err" >&2; fail "dot --trace failed"; }
  dot -Tsvg "$tmp/g.dot" > "$tmp/g.svg" && grep -q "<svg" "$tmp/g.svg" || fail "graphviz rejected the dot output"
  # A folder as the trace (issue 47: it printed the JSON parser's raw stream text).
  expect_code 2 "$flowrun" dot --trace "$tmp/p" graphs/regression.yaml
  expect_out "$tmp/p is a folder; --trace takes the file a run wrote with run.trace=FILE"
  python3 - "$tmp/p/trace.json" "$tmp/p/profile.json" "$tmp/g.dot" <<'PY' || fail "profile or dot --trace wrong"
import json, re, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
spans = {}
for e in events:
    if e.get("ph") == "X" and "deps" in e.get("args", {}):
        spans.setdefault(e["name"], []).append(e["dur"])
prof = json.load(open(sys.argv[2]))
for n in prof["nodes"]:
    total_us = sum(spans[n["name"]])
    assert n["runs"] == len(spans[n["name"]]), n
    assert abs(n["total_s"] * 1e6 - total_us) <= 1e-3 * total_us + 1, (n, total_us)
top = max(prof["nodes"], key=lambda n: n["share_of_wall"])
assert top["name"] == "data" and top["share_of_wall"] > 0.8, top
assert prof["critical_path"]["nodes"][0] == "data", prof["critical_path"]
waits = {(w["from"], w["to"]): w["total_s"] for w in prof["waits"]}
into_fb = {f: t for (f, to), t in waits.items() if to == "fb"}
assert max(into_fb, key=into_fb.get) == "data", waits  # fb waited for the reader more than for anything else
dot = open(sys.argv[3]).read()
line = next(l for l in dot.splitlines() if l.strip().startswith('"data" [label='))
assert "penwidth=3" in line, line
mean_ms = float(re.search(r"mean ([0-9.]+) ms", line).group(1))
trace_ms = sum(spans["data"]) / len(spans["data"]) / 1000
assert abs(mean_ms - trace_ms) <= 0.1 * trace_ms and mean_ms >= 60, (mean_ms, trace_ms)
assert re.search(r'"data" -> "fb" \[penwidth=3, label="batch, waited [0-9.]+ ms/run"', dot), dot
print("ok: data mean %.2f ms (trace %.2f ms), critical path %s" % (mean_ms, trace_ms, prof["critical_path"]["nodes"]))
PY
  expect_code 2 "$flowrun" dot --trace "$tmp/p/trace.json" graphs/gpt.yaml
  expect_out "are not the graph's"
  expect_code 2 "$flowrun" dot --trace "$tmp/none.json" graphs/regression.yaml
  expect_out "cannot read the trace $tmp/none.json"
  ;;
trace_unwritable)
  expect_code 2 "$flowrun" graphs/regression.yaml run.steps=3 run.out_dir="$tmp/t" run.trace=/proc/nope/trace.json
  expect_out "run.trace: cannot write /proc/nope/trace.json"
  grep -q "done:" "$tmp/out" && fail "ran steps before refusing the trace path"
  # A folder where the trace file would go: refused at start, nothing left behind.
  mkdir -p "$tmp/t/tracedir"
  expect_code 2 "$flowrun" graphs/regression.yaml run.steps=3 run.out_dir="$tmp/t" run.trace="$tmp/t/tracedir"
  expect_out "run.trace: $tmp/t/tracedir is a folder"
  grep -q "done:" "$tmp/out" && fail "ran steps before refusing the trace folder"
  ls "$tmp"/t/*.tmp > /dev/null 2>&1 && fail "left a .tmp file: $(ls "$tmp/t")"
  mkdir -p "$tmp/p/profile.json"
  expect_code 2 "$flowrun" graphs/regression.yaml run.steps=3 run.out_dir="$tmp/p" run.profile=true
  expect_out "profile.json is a folder"
  ;;
sigterm_final_checkpoint)
  # SIGTERM mid-run: exit 143 after a checkpoint at the last finished step (at: [end, stop]);
  # resuming from it continues bit-identically to a run that was never stopped.
  g=(tests/mpi/ddp.yaml ckpt.every=1000 'ckpt.at=[end, stop]' data.delay_ms=30)
  "$flowrun" "${g[@]}" run.steps=100000 run.out_dir="$tmp/s" >"$tmp/out" 2>&1 &
  pid=$!
  for i in $(seq 300); do [ "$(wc -l < "$tmp/s/metrics.jsonl" 2>/dev/null || echo 0)" -ge 5 ] && break; sleep 0.1; done
  kill -TERM $pid
  for i in $(seq 200); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  kill -0 $pid 2>/dev/null && { kill -9 $pid; fail "still running 20 s after SIGTERM"; }
  wait $pid; code=$?
  [ $code = 143 ] || { cat "$tmp/out" >&2; fail "exit code $code after SIGTERM, expected 143"; }
  expect_out "SIGTERM: stopping after the steps in flight"
  n=$(grep -o '"step":[0-9]*' "$tmp/s/metrics.jsonl" | tail -1 | cut -d: -f2)
  [ "$(cat "$tmp/s/checkpoints/latest")" = "step_$(printf %08d "$n")" ] || fail "latest is not the last step $n"
  m=$((n + 4))
  expect_code 0 "$flowrun" "${g[@]}" run.steps=$m run.out_dir="$tmp/s" run.resume=auto
  expect_out "resumed from"
  expect_code 0 "$flowrun" "${g[@]}" run.steps=$m run.out_dir="$tmp/straight"
  tail -4 "$tmp/s/metrics.jsonl" | grep -o '"loss":[^,]*' > "$tmp/a"
  tail -4 "$tmp/straight/metrics.jsonl" | grep -o '"loss":[^,]*' > "$tmp/b"
  [ -s "$tmp/a" ] && cmp -s "$tmp/a" "$tmp/b" || { diff "$tmp/a" "$tmp/b" >&2; fail "losses after the resume differ"; }
  # SIGHUP (the terminal or ssh session closed) stops the same way, exit 129, with the stop
  # checkpoint (issue 47: it ended the run without one).
  "$flowrun" "${g[@]}" run.steps=100000 run.out_dir="$tmp/h" >"$tmp/out" 2>&1 &
  pid=$!
  for i in $(seq 300); do [ "$(wc -l < "$tmp/h/metrics.jsonl" 2>/dev/null || echo 0)" -ge 3 ] && break; sleep 0.1; done
  kill -HUP $pid
  wait $pid; code=$?
  [ $code = 129 ] || { cat "$tmp/out" >&2; fail "exit code $code after SIGHUP, expected 129"; }
  n=$(grep -o '"step":[0-9]*' "$tmp/h/metrics.jsonl" | tail -1 | cut -d: -f2)
  [ "$(cat "$tmp/h/checkpoints/latest")" = "step_$(printf %08d "$n")" ] || fail "no stop checkpoint at step $n after SIGHUP"
  # SIGUSR1 (Slurm's --signal) stops the same way, exit 138. A stop that outlasts
  # run.stop_grace_s exits then, leaving latest on a complete checkpoint.
  "$flowrun" "${g[@]}" run.steps=100000 run.out_dir="$tmp/u" ckpt.every=2 ckpt.with.write_delay_ms=1000 \
    run.stop_grace_s=1 >"$tmp/out" 2>&1 &
  pid=$!
  for i in $(seq 300); do [ -f "$tmp/u/checkpoints/latest" ] && break; sleep 0.1; done
  kill -USR1 $pid
  wait $pid; code=$?
  [ $code = 138 ] || { cat "$tmp/out" >&2; fail "exit code $code after SIGUSR1, expected 138"; }
  expect_out "run.stop_grace_s passed"
  l=$(cat "$tmp/u/checkpoints/latest")
  [ -f "$tmp/u/checkpoints/$l/manifest.json" ] || fail "latest ($l) is not a complete checkpoint"
  ;;
checkpoint_write_fails)
  # A checkpoint write that fails (a full disk; here a file-size limit, SIGXFSZ ignored so the
  # write returns EFBIG) removes its half-written folder and says latest still names the
  # previous checkpoint (issue 47: a partial .step_*.tmp was left).
  g=(tests/mpi/ddp.yaml ckpt.every=10 run.out_dir="$tmp/f")
  expect_code 0 "$flowrun" "${g[@]}" run.steps=10
  ( ulimit -f 20; trap '' XFSZ; exec "$flowrun" "${g[@]}" run.steps=20 run.resume=auto ) > "$tmp/out" 2>&1; code=$?
  [ $code = 1 ] || { cat "$tmp/out" >&2; fail "exit code $code after a failed checkpoint write, expected 1"; }
  expect_out "checkpoint of step 20 failed: writing $tmp/f/checkpoints/.step_00000020.tmp/"
  expect_out "its half-written folder was removed; latest still names step_00000010"
  ls -a "$tmp/f/checkpoints" | grep -q 'tmp' && fail "left a half-written folder: $(ls -a "$tmp/f/checkpoints")"
  [ "$(cat "$tmp/f/checkpoints/latest")" = step_00000010 ] || fail "latest moved"
  ;;
quick_commands)
  # The commands that train nothing answer at once (cli/torch_side.hpp): the binary links no
  # libtorch, whose start-up alone takes 0.3-0.9 s; they measure 5-30 ms. Each under a
  # generous 250 ms (the median of 5, beside the other tests).
  ldd "$flowrun" | grep -q torch && fail "the flowrun binary links libtorch: $(ldd "$flowrun" | grep torch)"
  median_ms() {  # median_ms CMD...: the median wall time of 5 runs, in ms
    for _ in 1 2 3 4 5; do
      local t0=$(date +%s%N); "$@" > /dev/null 2>&1; echo $(( ($(date +%s%N) - t0) / 1000000 ))
    done | sort -n | sed -n 3p
  }
  for cmd in "--help" "validate graphs/gpt.yaml" "dot graphs/hydit_lora.yaml" "explain graphs/gpt.yaml" "nodes" "nodes optimizer"; do
    # shellcheck disable=SC2086
    expect_code 0 "$flowrun" $cmd
    ms=$(median_ms "$flowrun" $cmd)
    echo "flowrun $cmd: $ms ms"
    [ "$ms" -lt 250 ] || fail "flowrun $cmd took $ms ms (median of 5), bound 250"
  done
  # And they see every built-in type without the node library: the same list as a run's.
  expect_code 0 "$flowrun" nodes
  for f in schemas/*.yaml; do
    t=$(basename "$f" .yaml); [ "$t" = graph ] || grep -q "^$t " "$tmp/out" || fail "flowrun nodes does not list $t"
  done
  ;;
gtest_suite_runner)
  # tests/tools/gtest_suite.sh, which runs a node test suite as one ctest test: a suite whose
  # every case skipped is "skipped" (77), a failure is never hidden by skips beside it.
  fake() {  # fake NAME RC LINES...: a gtest binary that prints LINES and exits RC
    printf '#!/bin/sh\nprintf "%%s\\n" %s\nexit %s\n' "$(printf "'%s' " "${@:3}")" "$2" > "$tmp/$1"; chmod +x "$tmp/$1"
  }
  runner=tests/tools/gtest_suite.sh
  fake all_skipped 0 "[  SKIPPED ] S.a" "[  PASSED  ] 0 tests." "[  SKIPPED ] 2 tests, listed below:"
  expect_code 77 bash $runner "$tmp/all_skipped" --gtest_filter='S.*'
  fake some_skipped 0 "[  SKIPPED ] S.a" "[  PASSED  ] 1 test." "[  SKIPPED ] 1 test, listed below:"
  expect_code 0 bash $runner "$tmp/some_skipped" --gtest_filter='S.*'
  fake failed 1 "[  SKIPPED ] S.a" "[  FAILED  ] S.b" "[  PASSED  ] 0 tests." "[  FAILED  ] 1 test, listed below:"
  expect_code 1 bash $runner "$tmp/failed" --gtest_filter='S.*'
  expect_out "[  FAILED  ] S.b"
  fake passed 0 "[  PASSED  ] 3 tests."
  expect_code 0 bash $runner "$tmp/passed" --gtest_filter='S.*'
  ;;
cpu_gemm_choice)
  # run.cpu_gemm auto (nodes/common/cpu_blas.hpp): each float32 product shape is timed once per
  # machine in OpenBLAS and in libtorch, the faster takes it, and the verdicts stay in a cache
  # file that later runs read (so they multiply alike: the same losses bit for bit); an OpenBLAS
  # whose kernels are older than the CPU (OPENBLAS_CORETYPE=Prescott on a CPU with AVX2) is refused.
  needs_data data/text/fortunes_byte.train.bin
  export FLOWRUN_CACHE_DIR="$tmp/cache"
  g=(graphs/gpt.yaml data.path=data/text/fortunes_byte data.seq_len=32 data.batch=4 model.layers=2 model.dim=32
     model.heads=4 model.vocab=256 model.context=32 run.steps=4 run.log_every=1 opt.warmup=2 eval.every=100 evlog.every=100 ckpt.every=100)
  expect_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/a"
  if grep -q "multiply through libtorch (no OpenBLAS" "$tmp/out"; then
    echo "SKIP [$case_name]: no OpenMP OpenBLAS installed (apt install libopenblas0-openmp)"; exit 77
  fi
  expect_out "float32 linear layers multiply through the faster of OpenBLAS"
  expect_out "run.cpu_gemm auto: "
  expect_out "OpenBLAS took"
  cache=$(ls "$tmp"/cache/cpu_gemm-*.txt) || fail "no cache file in $tmp/cache"
  verdicts=$(($(wc -l < "$cache") - 1))
  [ "$verdicts" -ge 3 ] || fail "the cache file holds $verdicts verdicts: $(cat "$cache")"
  expect_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/b"
  [ $(($(wc -l < "$cache") - 1)) = "$verdicts" ] || fail "the second run measured again: $(cat "$cache")"
  cmp -s <(grep -o '"loss":[^,]*' "$tmp/a/metrics.jsonl") <(grep -o '"loss":[^,]*' "$tmp/b/metrics.jsonl") ||
    fail "two runs with the same verdicts differ"
  if grep -qw avx2 /proc/cpuinfo; then
    OPENBLAS_CORETYPE=Prescott expect_code 0 "$flowrun" "${g[@]}" run.out_dir="$tmp/c"
    expect_out "multiply through libtorch (OpenBLAS refused: its kernels are Prescott's, older than this CPU"
    grep -q "run.cpu_gemm auto:" "$tmp/out" && fail "a refused OpenBLAS still multiplied"
  fi
  ;;
*) fail "unknown case" ;;
esac
echo "ok [$case_name]"
