#!/usr/bin/env bash
# slurm/local/start.sh - configure and start a real single-node SLURM cluster on localhost
# (slurmctld + slurmd + munge, optionally slurmdbd + MariaDB for `sacct`), installing the
# Debian packages first when they are missing (slurm/local/install.sh).
#
# Everything lives under one state directory; nothing system-wide is configured or started,
# so several clusters (say, one per test session) can run side by side on distinct ports.
# Idempotent: running it again only starts what is not running. Stop with stop.sh.
# Runs as root (the daemons' SlurmUser is root); no systemd or cgroups needed.
#
# Environment (all optional):
#   SLURM_LOCAL_DIR       state, config and logs              [${TMPDIR:-/tmp}/gpn-slurm]
#   SLURM_LOCAL_PORTBASE  slurmctld port; slurmd +1, slurmdbd +2, MariaDB +13   [6817]
#   SLURM_LOCAL_CPUS      CPUs the node advertises (may exceed the real ones)   [max(nproc, 4)]
#   SLURM_LOCAL_MEM_MB    node RealMemory                      [85% of MemTotal]
#   SLURM_LOCAL_MAXTIME   partition MaxTime                    [02:00:00]
#   SLURM_LOCAL_WITH_DBD  1: accounting through slurmdbd/MariaDB (sacct, submitit states) [1]
#   SLURM_LOCAL_NODENAME  node name       [short hostname if it resolves, else localhost]
#   SLURM_LOCAL_TIMEOUT   seconds to wait for the node to become usable      [90]
# Clients need SLURM_CONF: `source $SLURM_LOCAL_DIR/env.sh`.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BASE=${SLURM_LOCAL_DIR:-${TMPDIR:-/tmp}/gpn-slurm}
# a restart of an existing cluster keeps the ports it was first started with
if [ -z "${SLURM_LOCAL_PORTBASE:-}" ] && [ -s "$BASE/portbase" ]; then
  SLURM_LOCAL_PORTBASE=$(cat "$BASE/portbase")
fi
PORT=${SLURM_LOCAL_PORTBASE:-6817}
nproc_=$(nproc)
CPUS=${SLURM_LOCAL_CPUS:-$(( nproc_ > 4 ? nproc_ : 4 ))}
MEM_MB=${SLURM_LOCAL_MEM_MB:-$(awk '/MemTotal/ {print int($2 / 1024 * 0.85)}' /proc/meminfo)}
MAXTIME=${SLURM_LOCAL_MAXTIME:-02:00:00}
WITH_DBD=${SLURM_LOCAL_WITH_DBD:-1}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-90}
CLUSTER=gpnlocal
HOST=$(hostname -s 2>/dev/null || uname -n)
if [ -n "${SLURM_LOCAL_NODENAME:-}" ]; then NODE=$SLURM_LOCAL_NODENAME
elif getent hosts "$HOST" >/dev/null 2>&1; then NODE=$HOST
else NODE=localhost; fi

say() { echo "[slurm-local start $(date +%T)] $*"; }
fail() { echo "[slurm-local start] ERROR: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root: the local cluster's daemons run as SlurmUser=root"
[ ${#BASE} -le 70 ] || fail "SLURM_LOCAL_DIR '$BASE' is too long for a unix socket path; use a shorter one"

SLURM_LOCAL_WITH_DBD=$WITH_DBD "$HERE/install.sh"
export PATH=$PATH:/usr/sbin:/sbin
export SLURM_CONF=$BASE/etc/slurm.conf
MUNGE_SOCKET=$BASE/munge/munge.socket
RUN=$BASE/run LOG=$BASE/log

# is_up PIDFILE COMM: the pid file names a live, non-zombie process called COMM
is_up() {
  local pid; pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$2" ] &&
    [ "$(awk '{print $3}' /proc/"$pid"/stat 2>/dev/null)" != Z ]
}
# retry SECONDS CMD...: run CMD every 0.2 s until it succeeds or time runs out
retry() {
  local until=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do [ $SECONDS -lt "$until" ] || return 1; sleep 0.2; done
}

mkdir -p "$BASE"/{etc,state,spool,munge,key} "$RUN" "$LOG"
echo "$PORT" >"$BASE/portbase"
chmod 700 "$BASE/key"; chmod 755 "$BASE/munge"

# --- munge: a private key and socket, so nothing system-wide is touched
[ -s "$BASE/key/munge.key" ] || mungekey --create --keyfile="$BASE/key/munge.key"
chmod 600 "$BASE/key/munge.key"
if ! is_up "$RUN/munged.pid" munged; then
  say "munged"
  munged --socket="$MUNGE_SOCKET" --key-file="$BASE/key/munge.key" --pid-file="$RUN/munged.pid" \
         --log-file="$LOG/munged.log" --seed-file="$BASE/key/munged.seed" --num-threads=2 \
         --force   # state dirs such as pytest's tmp are mode 0700: only root uses this socket
  retry 10 sh -c "munge -S '$MUNGE_SOCKET' -n | unmunge -S '$MUNGE_SOCKET'" \
    || fail "munged does not answer; see $LOG/munged.log"
fi

# --- slurm.conf
if [ "$WITH_DBD" = 1 ]; then
  ACCOUNTING="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
AccountingStoragePass=$MUNGE_SOCKET"
else
  ACCOUNTING="AccountingStorageType=accounting_storage/none"
fi
CONF_TEXT=$(cat <<CONF
# written by slurm/local/start.sh; edits are overwritten
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups in containers
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
$ACCOUNTING
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.log
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# believe the CPUs/RealMemory below whatever the hardware says
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=300
MessageTimeout=10
# without a default, one job would claim all the node's memory
DefMemPerCPU=$((MEM_MB / CPUS))
NodeName=$NODE NodeHostname=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=$MAXTIME State=UP
CONF
)
conf_changed=0
if [ "$(cat "$SLURM_CONF" 2>/dev/null)" != "$CONF_TEXT" ]; then
  printf '%s\n' "$CONF_TEXT" >"$SLURM_CONF"; conf_changed=1
fi
printf 'export SLURM_CONF=%q\nexport PATH="$PATH:/usr/sbin"\n' "$SLURM_CONF" >"$BASE/env.sh"

# --- accounting: MariaDB + slurmdbd
if [ "$WITH_DBD" = 1 ]; then
  DB_SOCKET=$BASE/mysql/mysqld.sock
  if [ ! -d "$BASE/mysql/data/mysql" ]; then
    say "MariaDB datadir"; mkdir -p "$BASE/mysql"
    mariadb-install-db --no-defaults --user=root --datadir="$BASE/mysql/data" \
      --auth-root-authentication-method=normal --skip-test-db >"$LOG/mariadb-install.log" 2>&1 \
      || fail "mariadb-install-db failed; see $LOG/mariadb-install.log"
  fi
  if ! is_up "$RUN/mariadbd.pid" mariadbd; then
    say "mariadbd on 127.0.0.1:$((PORT + 13))"
    setsid /usr/sbin/mariadbd --no-defaults --user=root --datadir="$BASE/mysql/data" \
      --bind-address=127.0.0.1 --port=$((PORT + 13)) --socket="$DB_SOCKET" \
      --pid-file="$RUN/mariadbd.pid" --log-error="$LOG/mariadb.log" \
      --innodb-buffer-pool-size=32M --skip-name-resolve </dev/null >/dev/null 2>&1 &
    retry 60 mariadb --no-defaults -S "$DB_SOCKET" -uroot -e 'select 1' \
      || fail "mariadbd did not come up; see $LOG/mariadb.log"
    mariadb --no-defaults -S "$DB_SOCKET" -uroot -e "
      CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm-local';
      CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm-local';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
      FLUSH PRIVILEGES;"
  fi
  cat >"$BASE/etc/slurmdbd.conf" <<DBD
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 13))
StorageUser=slurm
StoragePass=slurm-local
StorageLoc=slurm_acct_db
DBD
  chmod 600 "$BASE/etc/slurmdbd.conf"
  if ! is_up "$RUN/slurmdbd.pid" slurmdbd; then
    say "slurmdbd"; slurmdbd   # finds slurmdbd.conf beside \$SLURM_CONF
    retry 60 sacctmgr -n show cluster || fail "slurmdbd does not answer; see $LOG/slurmdbd.log"
  fi
  sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" \
    || sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# --- controller and node daemon
if ! is_up "$RUN/slurmctld.pid" slurmctld; then
  say "slurmctld on 127.0.0.1:$PORT"; slurmctld
  retry 30 scontrol ping || fail "slurmctld does not answer; see $LOG/slurmctld.log"
elif [ $conf_changed = 1 ]; then
  say "slurm.conf changed: scontrol reconfigure"; scontrol reconfigure
fi
if ! is_up "$RUN/slurmd.pid" slurmd; then
  say "slurmd for node $NODE"; slurmd -N "$NODE"
fi

# --- wait until the node takes jobs
until_=$((SECONDS + TIMEOUT)); state=""
while :; do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    *drain*|down*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
  esac
  if [ $SECONDS -ge $until_ ]; then
    tail -n 20 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2 || true
    fail "node $NODE not usable after ${TIMEOUT}s (state '$state')"
  fi
  sleep 0.2
done
say "cluster $CLUSTER up: node $NODE ($CPUS CPUs, ${MEM_MB} MB) is $state; accounting: $([ "$WITH_DBD" = 1 ] && echo slurmdbd || echo none)"
echo "clients: source $BASE/env.sh    logs: $LOG    stop: SLURM_LOCAL_DIR=$BASE $HERE/stop.sh"
