#!/usr/bin/env bash
# Starts ps task TASK_INDEX of the cluster on this machine.
#
#   PS_HOSTS=ps0:2222 WORKER_HOSTS=w0:2222,w1:2222 ./run_ps.sh 0 [flags...]
#
# PS_HOSTS and WORKER_HOSTS list every task's host:port, the same on every
# machine; the chief (worker 0) comes first in WORKER_HOSTS. Extra flags go
# to `python -m trainer.main`. PYTHON picks the interpreter (default python3).
set -euo pipefail

usage() {
  echo "usage: PS_HOSTS=h:p[,h:p...] WORKER_HOSTS=h:p[,h:p...] $0 TASK_INDEX [trainer flags...]" >&2
  exit 2
}

[[ $# -ge 1 && $1 =~ ^[0-9]+$ ]] || usage
[[ -n "${PS_HOSTS:-}" ]] || { echo "$0: set PS_HOSTS to the ps tasks' host:port list" >&2; usage; }
[[ -n "${WORKER_HOSTS:-}" ]] || { echo "$0: set WORKER_HOSTS to the workers' host:port list" >&2; usage; }

task_index=$1
shift
# Find the trainer package next to this script even when it is not installed.
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m trainer.main --job_name=ps --task_index="$task_index" \
  --ps_hosts="$PS_HOSTS" --worker_hosts="$WORKER_HOSTS" "$@"
