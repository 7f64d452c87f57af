# The helpers mpi_test.sh and hosts_test.sh share (sourced). The sourcing script sets case_name,
# tmp (its scratch folder, with $tmp/out the last command's output), flowrun and tensordiff_bin
# (tests/tools/tensordiff.cpp: two safetensors files' largest difference) before calling them.
fail() { echo "FAIL [$case_name]: $*" >&2; exit 1; }
# needs_data FILE...: what scripts/data.sh makes; without it the case is skipped (exit 77).
needs_data() {
  for f in "$@"; do
    [ -e "$f" ] || { echo "SKIP [$case_name]: $f is missing: run scripts/data.sh first (scripts/test.sh does it)"; exit 77; }
  done
}
expect_out() { grep -qF -- "$1" "$tmp/out" || { cat "$tmp/out" >&2; fail "output lacks: $1"; }; }
# The "loss" column of a metrics.jsonl, one per line.
losses() { grep -o '"loss":[0-9.eE+-]*' "$1" | cut -d: -f2; }
# same_numbers A B TOL: two files of numbers, line by line, |a-b| <= TOL * max(1, |a|)
same_numbers() {
  paste "$1" "$2" | awk -v tol="$3" 'BEGIN{bad=0; n=0} {n++; d=$1-$2; if (d<0) d=-d; m=$1<0?-$1:$1; if (m<1) m=1;
    if (d > tol*m) {bad++; print "line " n ": " $1 " vs " $2}} END{if (n==0) {print "no numbers"; exit 1} exit bad>0}'
}
# whole_file DIR/REF.safetensors: that file, or, in a checkpoint that several ranks wrote (each its
# own pieces, formats/checkpoint_io.hpp), the state consolidated whole by `flowrun ckpt
# consolidate` (once per folder, under $tmp/whole).
whole_file() {
  local f=$1 dir out
  dir=$(dirname "$f")
  if [ -e "$f" ] || [ ! -f "$dir/manifest.json" ]; then echo "$f"; return; fi
  out=$tmp/whole/$(echo "$dir" | md5sum | cut -c1-16)
  if [ ! -d "$out" ]; then
    mkdir -p "$tmp/whole"
    "$flowrun" ckpt consolidate "$dir" "$out" > /dev/null || { echo "FAIL [$case_name]: consolidating $dir" >&2; exit 1; }
  fi
  echo "$out/$(basename "$f")"
}
# tensordiff A B TOL: two state files (whole_file of each) within TOL.
tensordiff_whole() { "$tensordiff_bin" "$(whole_file "$1")" "$(whole_file "$2")" "${@:3}"; }
tensordiff=tensordiff_whole
params() { echo "$1/checkpoints/step_$(printf %08d "$2")/model.params.safetensors"; }
# from RUN DIR: DIR set up to continue RUN's checkpoint of step 3 (run.resume=auto takes it).
from() { mkdir -p "$2/checkpoints" && cp -r "$1/checkpoints/step_00000003" "$2/checkpoints/" &&
         echo step_00000003 > "$2/checkpoints/latest"; }
# same_states RUN_A RUN_B TOL WHAT: the parameters, the optimizer's state and the EMA of both runs'
# step-6 checkpoints within TOL of each tensor's largest value.
same_states() {
  local f
  for f in model.params opt.state ema.params; do
    tensordiff_whole "$tmp/$1/checkpoints/step_00000006/$f.safetensors" "$tmp/$2/checkpoints/step_00000006/$f.safetensors" "$3" ||
      fail "$4: $f differs between $2 and $1"
  done
}
# The tiny sizes of the real graph files that the tensor-parallel, ZeRO and host cases train (6
# steps, checkpoints at 3 and 6); each case adds its batch and what it varies (a later KEY=VALUE wins).
tiny_gpt=(graphs/gpt.yaml data.path=data/text/fortunes_byte data.seq_len=32 model.layers=2 model.dim=32 model.heads=4
          model.vocab=256 model.context=32 run.steps=6 run.log_every=1 run.threads=1 opt.warmup=2 ema.decay=0.9
          eval.every=3 eval.batches=2 eval.batch=4 evlog.every=3 ckpt.every=3)
