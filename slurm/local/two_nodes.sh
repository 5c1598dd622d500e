#!/usr/bin/env bash
# slurm/local/two_nodes.sh start|stop - a real TWO-node SLURM cluster on this machine: each
# node is a network + UTS namespace of its own (its own address on a veth link and its own
# host name; its own /dev/shm and IPC), both sharing this machine's file system the way compute nodes share NFS.
#
#   node n1: netns <tag>a, address 10.<x>.<y>.1 on interface gpn0, host name <tag>n1;
#            runs slurmctld and slurmd -N n1
#   node n2: netns <tag>b, address 10.<x>.<y>.2 on interface gpn0, host name <tag>n2;
#            runs slurmd -N n2
# Every packet (SLURM RPCs, srun I/O, torchrun's store, gloo) stays on the veth link between
# the two namespaces. munge listens on a unix socket in the shared state dir, which works
# across network namespaces. No accounting (no slurmdbd): squeue/scontrol only.
#
# Clients must run inside a node: `ip netns exec <tag>a sbatch ...` (the harness in
# gpn_scale/testing/slurm.py, `TwoNodeSlurm`, does that). Needs root (ip netns, unshare).
#
# Environment: SLURM_LOCAL_DIR (state dir, short: a unix socket lives in it) [required],
#   SLURM_LOCAL_TAG (namespace/interface prefix, <= 8 chars) [gpn$$], SLURM_LOCAL_NET
#   (the /24 prefix, "10.x.y") [10.<random>.<random>], SLURM_LOCAL_PORTBASE [6817],
#   SLURM_LOCAL_CPUS (per node) [4], SLURM_LOCAL_MEM_MB (per node) [4096].
# stop: cancels the jobs, stops the daemons by pid file, deletes the namespaces.
set -euo pipefail
ACTION=${1:?usage: two_nodes.sh start|stop}
BASE=${SLURM_LOCAL_DIR:?set SLURM_LOCAL_DIR}
export PATH=$PATH:/usr/sbin:/sbin
export SLURM_CONF=$BASE/etc/slurm.conf
RUN=$BASE/run LOG=$BASE/log
say() { echo "[two_nodes $(date +%T)] $*"; }
fail() { echo "[two_nodes] ERROR: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root (ip netns, unshare)"

is_up() {
  local pid; pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ] &&
    [ "$(awk '{print $3}' /proc/"$pid"/stat 2>/dev/null)" != Z ]
}
# on NS CMD...: run CMD in the node's network namespace. nsenter, not `ip netns exec`: the
# latter remounts /sys, which hides /sys/fs/cgroup (slurmd 22.05 refuses to start without it)
on() { local ns=$1; shift; nsenter --net=/run/netns/"$ns" "$@"; }
retry() { local until=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do [ $SECONDS -lt "$until" ] || return 1; sleep 0.2; done; }

if [ "$ACTION" = stop ]; then
  [ -s "$BASE/tag" ] || { say "nothing to stop in $BASE"; exit 0; }
  TAG=$(cat "$BASE/tag")
  if is_up "$RUN/slurmctld.pid" slurmctld; then
    jobs=$(on "${TAG}a" squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      # shellcheck disable=SC2086
      on "${TAG}a" scancel $jobs 2>/dev/null || true
      for _ in $(seq 100); do
        [ -z "$(on "${TAG}a" squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2
      done
    fi
  fi
  for d in slurmctld slurmd-n1 slurmd-n2 munged; do
    f=$RUN/$d.pid; comm=${d%%-*}
    is_up "$f" "$comm" || { rm -f "$f"; continue; }
    pid=$(cat "$f"); kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do is_up "$f" "$comm" || break; sleep 0.1; done
    is_up "$f" "$comm" && kill -KILL "$pid" 2>/dev/null
    rm -f "$f"
  done
  for ns in "${TAG}a" "${TAG}b"; do ip netns del "$ns" 2>/dev/null || true; done
  say "stopped; namespaces ${TAG}a ${TAG}b removed"
  exit 0
fi
[ "$ACTION" = start ] || fail "usage: two_nodes.sh start|stop"

TAG=${SLURM_LOCAL_TAG:-gpn$$}
[ ${#TAG} -le 8 ] || fail "SLURM_LOCAL_TAG '$TAG' longer than 8 characters"
[ -z "${SLURM_LOCAL_NET:-}" ] && [ -s "$BASE/net" ] && SLURM_LOCAL_NET=$(cat "$BASE/net")
NET=${SLURM_LOCAL_NET:-10.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1))}
PORT=${SLURM_LOCAL_PORTBASE:-6817}
CPUS=${SLURM_LOCAL_CPUS:-4}
MEM_MB=${SLURM_LOCAL_MEM_MB:-4096}
A=${TAG}a B=${TAG}b
mkdir -p "$BASE"/{etc,state,spool/n1,spool/n2,munge,key} "$RUN" "$LOG"
echo "$TAG" >"$BASE/tag"; echo "$NET" >"$BASE/net"
chmod 700 "$BASE/key"; chmod 755 "$BASE/munge"
"$(dirname "${BASH_SOURCE[0]}")/install.sh" >/dev/null

# --- the two "nodes": namespaces joined by one veth link
if ! ip netns list | grep -qw "$A"; then
  say "namespaces $A, $B; link $NET.1 <-> $NET.2"
  ip netns add "$A"; ip netns add "$B"
  ip link add "${TAG}va" type veth peer name "${TAG}vb"
  ip link set "${TAG}va" netns "$A"; ip link set "${TAG}vb" netns "$B"
  ip -n "$A" link set "${TAG}va" name gpn0; ip -n "$B" link set "${TAG}vb" name gpn0
  ip -n "$A" addr add "$NET.1/24" dev gpn0; ip -n "$B" addr add "$NET.2/24" dev gpn0
  for ns in "$A" "$B"; do ip -n "$ns" link set lo up; ip -n "$ns" link set gpn0 up; done
fi
ip -n "$A" -br addr show gpn0 | grep -q "$NET.1" || fail "no address on $A's link"

# --- munge on a unix socket in the shared state dir
MUNGE_SOCKET=$BASE/munge/munge.socket
[ -s "$BASE/key/munge.key" ] || mungekey --create --keyfile="$BASE/key/munge.key"
chmod 600 "$BASE/key/munge.key"
if ! is_up "$RUN/munged.pid" munged; then
  munged --socket="$MUNGE_SOCKET" --key-file="$BASE/key/munge.key" --pid-file="$RUN/munged.pid" \
         --log-file="$LOG/munged.log" --seed-file="$BASE/key/munged.seed" --num-threads=2 --force
  retry 10 sh -c "munge -S '$MUNGE_SOCKET' -n | unmunge -S '$MUNGE_SOCKET'" \
    || fail "munged does not answer; see $LOG/munged.log"
fi

cat >"$SLURM_CONF" <<CONF
# written by slurm/local/two_nodes.sh
ClusterName=gpn2node
SlurmctldHost=${TAG}n1($NET.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=300
MessageTimeout=10
DefMemPerCPU=$((MEM_MB / CPUS))
NodeName=n1 NodeHostname=${TAG}n1 NodeAddr=$NET.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
NodeName=n2 NodeHostname=${TAG}n2 NodeAddr=$NET.2 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=01:00:00 State=UP
CONF
printf 'export SLURM_CONF=%q\nexport PATH="$PATH:/usr/sbin"\n' "$SLURM_CONF" >"$BASE/env.sh"

# Each node gets its own /dev/shm and SysV IPC (a mount + IPC namespace), as real nodes
# have: streaming coordinates the processes of one node through shared memory there.
PRIVATE_SHM="mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm"
# --- daemons, each started inside its node's namespaces (a fresh UTS namespace per node
# gives it its own host name; the daemons keep the namespaces they were started in)
if ! is_up "$RUN/slurmctld.pid" slurmctld || ! is_up "$RUN/slurmd-n1.pid" slurmd; then
  on "$A" unshare --uts --ipc --mount --propagation private sh -c "$PRIVATE_SHM; hostname ${TAG}n1
    $(is_up "$RUN/slurmctld.pid" slurmctld || echo slurmctld)
    slurmd -N n1" || fail "slurmd n1 did not start; see $LOG/slurmd-n1.log"
fi
retry 30 on "$A" scontrol ping || fail "slurmctld does not answer; see $LOG/slurmctld.log"
if ! is_up "$RUN/slurmd-n2.pid" slurmd; then
  on "$B" unshare --uts --ipc --mount --propagation private sh -c "$PRIVATE_SHM; hostname ${TAG}n2; slurmd -N n2" \
    || fail "slurmd n2 did not start; see $LOG/slurmd-n2.log"
fi
until_=$((SECONDS + 60))
while :; do
  states=$(on "$A" sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
  case "$states" in "idle ") break ;; esac
  [ $SECONDS -lt $until_ ] || { tail -n 20 "$LOG"/*.log >&2; fail "nodes not idle: '$states'"; }
  sleep 0.3
done
say "cluster up: n1=$NET.1 (${TAG}n1), n2=$NET.2 (${TAG}n2), $CPUS CPUs each; clients: ip netns exec $A ..."
