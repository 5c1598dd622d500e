#!/bin/bash
# Launch a sweep as one SLURM job array: task i trains run i of the sweep (slurm/train.sbatch).
#
#   sbatch slurm/sweep.sh configs/sweeps/gpn_m_ladder.yaml [flags]   (from the repo root)
#   bash   slurm/sweep.sh configs/sweeps/gpn_m_ladder.yaml [flags]   (same, without the
#                                                                      driver job)
# Design: this script only submits. Under sbatch it is a short driver job (1 CPU, a few
# minutes) that runs `sbatch --array=...` from inside the allocation and exits; it never
# trains. So the same file works from a login node (bash) and as a job (sbatch), and
# re-running it is always safe: runs that already have a DONE marker beside their
# checkpoints (local or s3://), and runs with a live job (in squeue: queued, running,
# requeued; or a live lease in their checkpoint root) are left out of the array
# (`gpn-scale sweep pending`), and a task whose run finished in the meantime exits 0 at once.
# The tasks read their argv from a table frozen at submit time
# (<logs>/gpn-<sweep>-<time>.argv.json, `gpn-scale sweep snapshot`): editing or pulling the
# sweep YAML afterwards never remaps a queued task.
#
# Flags (each also read from the environment; flags win):
#   -p|--partition P   SWEEP_PARTITION   [the driver job's partition under sbatch, else default]
#   -A|--account A     SWEEP_ACCOUNT     [the driver job's account under sbatch]
#   -q|--qos Q         SWEEP_QOS
#   -t|--time T        SWEEP_TIME        time limit per run task, as sbatch --time and
#                                        `gpn-scale sweep submit -t`: minutes (1440) or
#                                        [D-]HH:MM:SS (24:00:00, 1-00:00:00) [partition default]
#   -N|--nodes N       SWEEP_NODES       nodes per run [1]
#   -g|--gpus G        SWEEP_GPUS        GPUs per node (0: CPU, GPN_NPROC_PER_NODE procs) [8]
#   -c|--cpus C        SWEEP_CPUS        CPUs per task (the node's torchrun) [GPU runs: the
#                                        whole node (--exclusive); CPU runs: unset]
#   --mem M            SWEEP_MEM         memory per node, e.g. 200G [GPU runs: 0 = all of it]
#   -k|--concurrency K SWEEP_CONCURRENCY at most K runs at once (--array=...%K) [4]
#   --grace S          SWEEP_GRACE       seconds of warning before the time limit (USR1) [300]
#   --logs DIR         SWEEP_LOG_DIR     task logs <DIR>/<job>-<array>_<task>.out [./slurm-logs]
#   --dry-run                            print the sbatch command, submit nothing
#   -- ARGS                              further sbatch arguments, verbatim
# Prints "ARRAY_JOB_ID=<id>" after submitting, or "nothing to submit" when all runs are done.
# Exit status: 0 submitted (or nothing to submit), 2 bad input, an invalid sweep or a failed sbatch.
#
# ---- what a user edits: the #SBATCH lines of the driver job (tiny: it only submits) ---------
#SBATCH --job-name=gpn-sweep-driver
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=2G
#SBATCH --time=00:15:00
#SBATCH --output=slurm-sweep-driver-%j.out
# ---------------------------------------------------------------------------------------------
set -uo pipefail

die() { echo "sweep.sh: error: $*" >&2; exit 2; }

# Under sbatch this file runs from a spool copy: find the checkout from the submit dir.
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  ROOT="${GPN_SCALE_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
  DRIVER_PARTITION="${SLURM_JOB_PARTITION:-}"
  DRIVER_ACCOUNT="${SLURM_JOB_ACCOUNT:-}"
else
  ROOT="${GPN_SCALE_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
  DRIVER_PARTITION=""
  DRIVER_ACCOUNT=""
fi
TRAIN_SBATCH="$ROOT/slurm/train.sbatch"
[[ -f "$TRAIN_SBATCH" ]] || die "$TRAIN_SBATCH not found; run from the repo root or set GPN_SCALE_ROOT"

PARTITION="${SWEEP_PARTITION:-$DRIVER_PARTITION}"
ACCOUNT="${SWEEP_ACCOUNT:-$DRIVER_ACCOUNT}"
QOS="${SWEEP_QOS:-}"
TIME="${SWEEP_TIME:-}"
NODES="${SWEEP_NODES:-1}"
GPUS="${SWEEP_GPUS:-8}"
CPUS="${SWEEP_CPUS:-}"
MEM="${SWEEP_MEM:-}"
CONCURRENCY="${SWEEP_CONCURRENCY:-4}"
GRACE="${SWEEP_GRACE:-300}"
LOGS="${SWEEP_LOG_DIR:-$(pwd)/slurm-logs}"
DRY=0
SWEEP=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -p|--partition) PARTITION="${2:?}"; shift 2 ;;
    -A|--account) ACCOUNT="${2:?}"; shift 2 ;;
    -q|--qos) QOS="${2:?}"; shift 2 ;;
    -t|--time) TIME="${2:?}"; shift 2 ;;
    -N|--nodes) NODES="${2:?}"; shift 2 ;;
    -g|--gpus) GPUS="${2:?}"; shift 2 ;;
    -c|--cpus) CPUS="${2:?}"; shift 2 ;;
    --mem) MEM="${2:?}"; shift 2 ;;
    -k|--concurrency) CONCURRENCY="${2:?}"; shift 2 ;;
    --grace) GRACE="${2:?}"; shift 2 ;;
    --logs) LOGS="${2:?}"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown flag $1; see the header of slurm/sweep.sh (--help)" ;;
    *) [[ -z "$SWEEP" ]] || die "one sweep file only (got '$SWEEP' and '$1')"; SWEEP="$1"; shift ;;
  esac
done
[[ -n "$SWEEP" ]] || die "usage: sbatch slurm/sweep.sh SWEEP.yaml [flags]"
[[ "$GPUS" =~ ^[0-9]+$ ]] || die "--gpus: a number of GPUs per node, got '$GPUS'"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes: a positive number, got '$NODES'"
[[ "$CONCURRENCY" =~ ^[1-9][0-9]*$ ]] || die "--concurrency: a positive number, got '$CONCURRENCY'"
[[ "$GRACE" =~ ^[0-9]+$ ]] || die "--grace: seconds, got '$GRACE'"
[[ -z "$TIME" || "$TIME" =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$ ]] \
  || die "--time: minutes or [D-]HH:MM:SS (as sbatch --time), got '$TIME'"
# a sweep path is taken relative to where sweep.sh was started (the submit dir under sbatch)
case "$SWEEP" in
  /*) ;;
  *.yaml|*.yml) SWEEP="$(pwd)/$SWEEP" ;;
esac

VENV="${VENV:-$ROOT/.venv}"
if [[ -n "${GPN_SCALE_PYTHON:-}" ]]; then PY="$GPN_SCALE_PYTHON"
elif [[ -x "$VENV/bin/python" ]]; then PY="$VENV/bin/python"
else PY="$(command -v python3 || true)"; fi
[[ -n "$PY" ]] || die "no python: set GPN_SCALE_PYTHON or VENV (tried $VENV/bin/python)"
export GPN_SCALE_ROOT="$ROOT" GPN_SCALE_PYTHON="$PY"
if [[ $DRY -eq 0 ]] && ! command -v sbatch >/dev/null; then
  die "no sbatch on PATH; run on a SLURM login node (or add SLURM's bin dir to PATH)"
fi

# validate the whole sweep (every run's trainer config) and find its unfinished runs
INFO="$("$PY" -m gpn_scale.cli sweep pending "$SWEEP" --validate --shell)" || exit 2
NAME="$(sed -n 's/^SWEEP_NAME=//p' <<< "$INFO")"
PENDING="$(sed -n 's/^PENDING=//p' <<< "$INFO")"
LIVE="$(sed -n 's/^LIVE=//p' <<< "$INFO")"
[[ -n "$NAME" ]] || die "gpn-scale sweep pending printed no sweep name: $INFO"
if [[ -z "$PENDING" ]]; then
  echo "nothing to submit: every run of sweep $NAME is finished (DONE markers present)${LIVE:+ or has a live job (runs $LIVE)}"
  exit 0
fi
N_PENDING=$(tr ',' '\n' <<< "$PENDING" | wc -l)

ARGS=(--parsable --job-name="gpn-$NAME" --array="$PENDING%$CONCURRENCY"
      --nodes="$NODES" --ntasks-per-node=1 --requeue
      --signal="B:USR1@$GRACE" --open-mode=append
      --output="$LOGS/%x-%A_%a.out" --export=ALL)
[[ -n "$PARTITION" ]] && ARGS+=(--partition="$PARTITION")
[[ -n "$ACCOUNT" ]] && ARGS+=(--account="$ACCOUNT")
[[ -n "$QOS" ]] && ARGS+=(--qos="$QOS")
[[ -n "$TIME" ]] && ARGS+=(--time="$TIME")
[[ -n "$CPUS" ]] && ARGS+=(--cpus-per-task="$CPUS")
[[ -n "$MEM" ]] && ARGS+=(--mem="$MEM")
if [[ "$GPUS" -gt 0 ]]; then
  ARGS+=(--gpus-per-node="$GPUS")
  # GPU runs take whole nodes unless told otherwise: without --cpus-per-task/--mem SLURM
  # gives one CPU and DefMemPerCPU (the trainers and their data loaders then starve or OOM)
  [[ -z "$CPUS" ]] && ARGS+=(--exclusive)
  [[ -z "$MEM" ]] && ARGS+=(--mem=0)
  export GPUS_PER_NODE="$GPUS"
else
  unset GPUS_PER_NODE
fi
export GPN_SHUTDOWN_TIMEOUT="$GRACE"
export GPN_RANK_LOG_DIR="${GPN_RANK_LOG_DIR:-$LOGS/ranks}"

TABLE="$LOGS/gpn-$NAME-$(date -u +%Y%m%dT%H%M%S)-$$.argv.json"
if [[ $DRY -eq 1 ]]; then
  echo "sbatch ${ARGS[*]} ${EXTRA[*]} $TRAIN_SBATCH --sweep $TABLE   (the argv table of $SWEEP)"
  exit 0
fi
mkdir -p "$LOGS"
"$PY" -m gpn_scale.cli sweep snapshot "$SWEEP" "$TABLE" >/dev/null || exit 2
# Inside the driver job: drop its SLURM_* variables so the array tasks do not inherit them
# (sbatch sets fresh ones); keep SLURM_CONF.
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  for v in $(compgen -e | grep '^SLURM_' || true); do
    [[ "$v" == SLURM_CONF ]] || unset "$v"
  done
fi
JOB="$(sbatch "${ARGS[@]}" "${EXTRA[@]}" "$TRAIN_SBATCH" --sweep "$TABLE")" || die "sbatch failed (see above)"
JOB="${JOB%%;*}"
echo "submitted sweep $NAME: $N_PENDING of its runs ($PENDING) as array job $JOB (at most $CONCURRENCY at once); logs in $LOGS; argv table $TABLE${LIVE:+; skipped runs with a live job: $LIVE}"
echo "ARRAY_JOB_ID=$JOB"
