#!/usr/bin/env bash
# slurm/local/install.sh - apt-install what a single-node SLURM cluster on localhost needs,
# only the packages whose programs are missing (idempotent; a no-op when all are present).
#
#   SLURM_LOCAL_WITH_DBD=1 (default) also installs slurmdbd + MariaDB, which `sacct` and
#   submitit's job-state queries need; 0 installs only slurmctld/slurmd/client/munge.
#
# Debian 12 (bookworm) ships SLURM 22.05; needs root (or passwordless sudo) and apt.
set -euo pipefail
WITH_DBD=${SLURM_LOCAL_WITH_DBD:-1}
say() { echo "[slurm-local install] $*"; }
fail() { echo "[slurm-local install] ERROR: $*" >&2; exit 1; }

# program -> Debian package providing it
declare -A PKG_OF=(
  [slurmctld]=slurmctld [slurmd]=slurmd [sbatch]=slurm-client [srun]=slurm-client
  [munged]=munge [mungekey]=munge [munge]=munge
)
if [ "$WITH_DBD" = 1 ]; then
  PKG_OF+=([slurmdbd]=slurmdbd [mariadbd]=mariadb-server-core
           [mariadb-install-db]=mariadb-server-core [mariadb]=mariadb-client-core)
fi
want=()
for prog in "${!PKG_OF[@]}"; do
  PATH=$PATH:/usr/sbin:/sbin command -v "$prog" >/dev/null 2>&1 || want+=("${PKG_OF[$prog]}")
done
# the MySQL accounting plugin has no program of its own: look for its shared object
if [ "$WITH_DBD" = 1 ] && ! ls /usr/lib/*/slurm-wlm/accounting_storage_mysql.so >/dev/null 2>&1; then
  want+=(slurm-wlm-mysql-plugin)
fi
[ ${#want[@]} -eq 0 ] && { say "all SLURM packages present"; exit 0; }
pkgs=$(printf '%s\n' "${want[@]}" | sort -u | tr '\n' ' ')

SUDO=""
if [ "$(id -u)" != 0 ]; then
  sudo -n true 2>/dev/null && SUDO="sudo -n" || fail "need root or passwordless sudo to apt-get install: $pkgs"
fi
command -v apt-get >/dev/null || fail "apt-get not found; install by hand: $pkgs"

say "installing: $pkgs"
t0=$SECONDS
# keep the packages' postinst scripts from starting system-wide daemons
policy_made=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d; policy_made=1
fi
trap 'if [ $policy_made = 1 ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi' EXIT
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq || fail "apt-get update failed"
# shellcheck disable=SC2086
$SUDO apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends $pkgs >/dev/null \
  || fail "apt-get install failed for: $pkgs"
say "installed in $((SECONDS - t0))s"
