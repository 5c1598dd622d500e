#!/usr/bin/env bash
# slurm/local/stop.sh - stop the daemons that start.sh started under $SLURM_LOCAL_DIR,
# found through their pid files there (never by process name, so other clusters on the
# machine are untouched). Cancels that cluster's jobs first.
#   SLURM_LOCAL_DIR    [${TMPDIR:-/tmp}/gpn-slurm]
#   SLURM_LOCAL_PURGE  1: delete the whole state directory afterwards [0]
set -uo pipefail
BASE=${SLURM_LOCAL_DIR:-${TMPDIR:-/tmp}/gpn-slurm}
export SLURM_CONF=$BASE/etc/slurm.conf PATH=$PATH:/usr/sbin:/sbin
RUN=$BASE/run
say() { echo "[slurm-local stop $(date +%T)] $*"; }

is_up() {
  local pid; pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ]
}
# alive PID: exists and is not a zombie (an init that reaps slowly leaves zombies around)
alive() { [ -e /proc/"$1" ] && [ "$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null)" != Z ]; }

# 1. cancel this cluster's jobs so that no job step outlives slurmd
if is_up "$RUN/slurmctld.pid" slurmctld; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    say "cancelling jobs $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 100); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

# 2. daemons, controller first (it then shuts down quickly), munge last
halt() { # halt NAME: SIGTERM the process in run/NAME.pid, SIGKILL after 15 s
  local pidfile=$RUN/$1.pid pid
  if ! is_up "$pidfile" "$1"; then rm -f "$pidfile"; return 0; fi
  pid=$(cat "$pidfile"); say "stopping $1 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 150); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then say "$1 ignored SIGTERM: SIGKILL"; kill -KILL "$pid" 2>/dev/null; sleep 0.5; fi
  rm -f "$pidfile"
}
for d in slurmctld slurmd slurmdbd mariadbd munged; do halt $d; done

if [ "${SLURM_LOCAL_PURGE:-0}" = 1 ]; then
  case "$BASE" in /|"") ;; *) say "removing $BASE"; rm -rf "$BASE" ;; esac
fi
say "stopped"
