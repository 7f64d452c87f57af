#!/usr/bin/env bash
# A restart loop around a flowrun job (docs/checkpoints.md, "A lost host or link: restart"): runs
# the command until it ends well, restarting it after a failure, at most --max times. The command
# is an mpirun (or srun) of flowrun with run.resume=auto, so each restart continues from the newest
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
#
# The launcher itself may outlive its ranks: when a link is cut, every rank ends within
# run.heartbeat_timeout_s (`... went silent ...`), but Open MPI 4's mpirun waits for the cut-off
# host's daemon over TCP until the kernel gives up (15 minutes). So once the job has said a rank
# went silent or failed, the launcher gets --grace seconds (default 30) to end, then is ended
# (SIGTERM, then SIGKILL 5 s later) and the loop goes on.
set -u
max=3 wait_s=5 grace=30
while [ $# -gt 0 ]; do
  case $1 in
    --max) max=$2; shift 2 ;;
    --wait) wait_s=$2; shift 2 ;;
    --grace) grace=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--max N] [--wait S] [--grace S] -- COMMAND..." >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--max N] [--wait S] [--grace S] -- COMMAND..." >&2; exit 2; }
case " $* " in *" run.resume=auto "*) ;; *) echo "$0: the command should have run.resume=auto (each restart continues from the newest checkpoint)" >&2; exit 2 ;; esac
log=$(mktemp /tmp/flowrun-restart.XXXXXX)
trap 'rm -f "$log"' EXIT
attempt=0
while :; do
  : > "$log"
  "$@" > >(tee -a "$log") 2>&1 &
  pid=$!
  since=""
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.2
    if [ -z "$since" ] && grep -qE "went silent|so the job ends here too|ending the job on all" "$log"; then since=$SECONDS; fi
    if [ -n "$since" ] && [ $((SECONDS - since)) -ge "$grace" ]; then
      echo "$0: the job's ranks have ended (a rank failed or went silent) but the launcher has not, ${grace} s on; ending it" >&2
      kill -TERM "$pid" 2>/dev/null
      for _ in $(seq 25); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -KILL "$pid" 2>/dev/null
      break
    fi
  done
  wait "$pid"
  code=$?
  # Ended by the grace above (143, 137): a failure to restart after, not a stop asked for.
  if [ -n "$since" ] && [ "$code" != 0 ] && [ "$code" != 2 ]; then code=1; fi
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
