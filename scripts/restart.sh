#!/usr/bin/env bash
# A restart loop around a flowrun job (docs/checkpoints.md, "A lost host or link"): runs the
# command until it ends well, restarting it after a failure, at most --max times. The command is
# an mpirun (or srun) of flowrun with run.resume=auto, so each restart continues from the newest
# complete checkpoint that verifies; give it a host list that leaves the lost host out, or another
# layout, and the data cursor and every state follow (a checkpoint loads at any layout).
#
#   scripts/restart.sh --max 3 -- mpirun -H a:8,b:8 flowrun graphs/gpt.yaml run.resume=auto
#
# Exit codes: the command's last one. Not restarted: 0 (done), 2 (a bad graph file, usage, an
# out_dir in use: the same again would fail the same), 130 / 143 (stopped by Ctrl-C or SIGTERM:
# asked for). Restarted: any other (1: a node failed or a rank went silent; 137: a rank killed),
# after --wait seconds (default 5). Under Slurm, `#SBATCH --requeue` plays this part for a
# preempted job; this loop is for failures inside one allocation.
set -u
max=3 wait_s=5
while [ $# -gt 0 ]; do
  case $1 in
    --max) max=$2; shift 2 ;;
    --wait) wait_s=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--max N] [--wait S] -- COMMAND..." >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--max N] [--wait S] -- COMMAND..." >&2; exit 2; }
case " $* " in *" run.resume=auto "*) ;; *) echo "$0: the command should have run.resume=auto (each restart continues from the newest checkpoint)" >&2; exit 2 ;; esac
attempt=0
while :; do
  "$@"
  code=$?
  case $code in
    0 | 2 | 130 | 143) exit $code ;;
  esac
  attempt=$((attempt + 1))
  if [ $attempt -gt "$max" ]; then
    echo "$0: the job failed $attempt times (last exit code $code); not restarting again" >&2
    exit $code
  fi
  echo "$0: the job ended with exit code $code; restart $attempt of $max in ${wait_s} s (run.resume=auto)" >&2
  sleep "$wait_s"
done
