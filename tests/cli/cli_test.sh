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
# first and last "loss" in a metrics.jsonl
loss_at() { grep -o '"loss":[0-9.eE+-]*' "$1" | sed -n "$2" | cut -d: -f2; }

case $case_name in
help)
  expect_code 0 "$flowrun" --help; expect_out "flowrun validate FILE..."
  for c in run validate dot nodes prep; do expect_code 0 "$flowrun" $c --help; expect_out "usage: flowrun"; done
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
  fb: { type: forward_backward, in: { batch: dat.batch, model: model.params } }
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
  expect_out "momentum: 0.9"
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
  expect_code 2 "$flowrun" nodes lion
  expect_code 0 "$flowrun" nodes lion --plugin "$build/examples/plugins/liblion.so"
  expect_out "lion  [from $build/examples/plugins/liblion.so]"
  ;;
plugin_swap)
  # The built-in optimizer replaced by a plugin node, flowrun not relinked: the binary does
  # not depend on the plugin, and the graph trains.
  ldd "$flowrun" | grep -q liblion && fail "flowrun links the plugin"
  expect_code 0 "$flowrun" examples/plugins/regression_lion.yaml run.steps=100 run.out_dir="$tmp/lion"
  first=$(loss_at "$tmp/lion/metrics.jsonl" 1p); last=$(loss_at "$tmp/lion/metrics.jsonl" '$p')
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a / 4) }' || fail "lion did not train: $first -> $last"
  "$flowrun" dot examples/plugins/regression_lion.yaml | grep -q 'opt : lion\\nplugin' || fail "dot does not mark the plugin node"
  ;;
node_failure_exit_code)
  cat > "$tmp/fail.yaml" <<YAML
flowrun: 1
run: { steps: 10, out_dir: "$tmp/failrun" }
plugins: [ "$build/tests/plugins/libt_plugin_ok.so" ]
nodes:
  boom: { type: t_plugin_fail, with: { at: 4 } }
YAML
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
*) fail "unknown case" ;;
esac
echo "ok [$case_name]"
