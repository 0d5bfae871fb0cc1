#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to try podium's torchrun backend on
# Slurm (and for podium's Slurm tests).
#
#   scripts/local-slurm.sh start    install what is missing, start the cluster
#   scripts/local-slurm.sh status   exit 0 when it is up and its node takes jobs
#   scripts/local-slurm.sh stop     cancel its jobs, stop every daemon it started
#
# After `start`, point Slurm's commands (and so torchx and podium) at it:
#   export SLURM_CONF=${PODIUM_SLURM_DIR:-/tmp/podium-slurm}/etc/slurm.conf
#
# What it runs, each in the foreground in a session of its own, its PID kept
# under $PODIUM_SLURM_DIR/run: a private munged (own key and socket), a private
# MariaDB (own data directory, unix socket only) behind slurmdbd -- torchx
# reads job states with `sacct`, which needs accounting -- then slurmctld and
# slurmd. `stop` ends only those PIDs, after checking each still is the
# daemon this script started. Nothing outside $PODIUM_SLURM_DIR is written
# except what `apt-get install` does.
#
# Needs root (Slurm daemons, munge and MariaDB run as their own users) and,
# when a package is missing, apt-get. Exit status 77 means "cannot run here"
# (not root, or packages missing and no apt-get), with the reason on stderr.
#
# Settings (environment):
#   PODIUM_SLURM_DIR    state, config, logs (default /tmp/podium-slurm)
#   PODIUM_SLURM_CPUS   CPUs the node offers (default: max(8, this machine's));
#                       more than the machine has lets several small jobs run
#                       at once, as CPU processes can share cores
#   PODIUM_SLURM_PORT   first of three TCP ports on 127.0.0.1 (slurmctld,
#                       slurmd, slurmdbd; default 6817)
# Partitions: `debug` (default) runs jobs; `queued` is down, so its jobs stay
# pending (for trying how a job that cannot start is reported).
set -euo pipefail

DIR=${PODIUM_SLURM_DIR:-/tmp/podium-slurm}
PORT=${PODIUM_SLURM_PORT:-6817}
PACKAGES=(slurm-wlm slurmctld slurmd slurmdbd munge mariadb-server)
CONF=$DIR/etc/slurm.conf
export SLURM_CONF=$CONF
# Marks every daemon's environment, so `stop` recognises its own.
export PODIUM_SLURM_DIR=$DIR
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)

say() { echo "local-slurm: $*" >&2; }
cannot() { say "$*"; exit 77; }

missing_packages() {
  local p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

install() {
  local missing
  missing=$(missing_packages)
  [ -z "$missing" ] && return 0
  command -v apt-get >/dev/null || cannot "missing packages ($(echo $missing)) and no apt-get to install them"
  say "installing $(echo $missing)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends $missing >"$DIR/log/apt.log" 2>&1; then
    apt-get update -q >>"$DIR/log/apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends $missing >>"$DIR/log/apt.log" 2>&1 ||
      { tail -20 "$DIR/log/apt.log" >&2; say "apt-get install failed (log: $DIR/log/apt.log)"; exit 1; }
  fi
}

# The PID this script recorded for daemon $1, if that process is still it.
alive() {
  local pidfile=$DIR/run/$1.pid pid
  [ -f "$pidfile" ] || return 1
  pid=$(cat "$pidfile")
  running "$pid" || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
  tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qx "PODIUM_SLURM_DIR=$DIR" || return 1
  echo "$pid"
}

# Whether process $1 exists and has not exited (a zombie has).
running() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

launch() {  # launch NAME COMMAND...: in the background, in its own session
  local name=$1; shift
  setsid "$@" >"$DIR/log/$name.out" 2>&1 </dev/null &
  echo $! >"$DIR/run/$name.pid"
}

wait_for() {  # wait_for SECONDS "DAEMON..." COMMAND...: until COMMAND succeeds (or a DAEMON ends)
  local until=$((SECONDS + $1)) what=$2 name; shift 2
  until "$@" >/dev/null 2>&1; do
    for name in $what; do  # (just launched, it may not have exec'd its program yet)
      running "$(cat "$DIR/run/$name.pid")" || { say "$name ended"; until=0; }
    done
    if [ $SECONDS -ge $until ]; then
      say "$what did not come up (log: $DIR/log); last log lines:"
      tail -n 15 "$DIR"/log/*.log "$DIR"/log/*.out 2>/dev/null >&2 || true
      return 1
    fi
    sleep 0.2
  done
}

write_config() {
  local host cpus mem
  host=$(hostname -s)
  cpus=${PODIUM_SLURM_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  cat >"$CONF" <<EOF
# Written by podium's scripts/local-slurm.sh: one node, this host.
ClusterName=podium
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge-run/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.daemon.pid
SlurmdPidFile=$DIR/run/slurmd.daemon.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$((PORT + 2))
# (the munge socket for slurmctld's connection to slurmdbd)
AccountingStoragePass=$DIR/munge-run/munge.socket
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=queued Nodes=ALL MaxTime=INFINITE State=DOWN
EOF
  local dbd=$DIR/etc/slurmdbd.conf
  (umask 077 && cat >"$dbd" <<EOF
AuthType=auth/munge
AuthInfo=socket=$DIR/munge-run/munge.socket
DbdHost=localhost
DbdPort=$((PORT + 2))
SlurmUser=root
PidFile=$DIR/run/slurmdbd.daemon.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=podium_slurm_acct
EOF
  )
}

start() {
  [ "$(id -u)" = 0 ] || cannot "needs root (it starts munged, MariaDB and Slurm's daemons)"
  mkdir -p "$DIR"/{etc,log,run,state,spool}
  chmod 755 "$DIR"
  install
  if status >/dev/null 2>&1; then
    say "already running"; echo "export SLURM_CONF=$CONF"; return 0
  fi
  stop_daemons  # what is left of an earlier start (a crashed daemon)
  write_config

  # munge: a private key and socket; it refuses to run as root.
  mkdir -p "$DIR/munge"
  [ -f "$DIR/munge/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=128 status=none
  mkdir -p "$DIR/munge-run"  # the socket's directory: every client must reach it
  chown -R munge:munge "$DIR/munge" "$DIR/munge-run"; chmod 700 "$DIR/munge"; chmod 755 "$DIR/munge-run"
  chmod 400 "$DIR/munge/munge.key"
  launch munged setpriv --reuid=munge --regid=munge --clear-groups \
    munged -F --key-file="$DIR/munge/munge.key" --socket="$DIR/munge-run/munge.socket" \
    --pid-file="$DIR/munge-run/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
  wait_for 20 munged test -S "$DIR/munge-run/munge.socket"

  # MariaDB for slurmdbd: own data directory, no network, root by unix socket.
  local fresh=0
  if [ ! -d "$DIR/db/mysql" ]; then
    fresh=1
    mkdir -p "$DIR/db"; chown mysql:mysql "$DIR/db"
    mariadb-install-db --user=mysql --datadir="$DIR/db" --skip-test-db \
      --auth-root-authentication-method=socket >"$DIR/log/mariadb-install.log" 2>&1 ||
      { tail -20 "$DIR/log/mariadb-install.log" >&2; exit 1; }
  fi
  mkdir -p "$DIR/mysql"; chown mysql:mysql "$DIR/mysql"
  launch mariadbd mariadbd --no-defaults --user=mysql --datadir="$DIR/db" \
    --socket="$DIR/mysql/mysql.sock" --skip-networking --pid-file="$DIR/mysql/mysqld.pid" \
    --log-error="$DIR/log/mariadb.log"
  wait_for 60 mariadbd mariadb --no-defaults -S "$DIR/mysql/mysql.sock" -e 'select 1'
  if [ $fresh = 1 ]; then
    rm -rf "$DIR/state"/*  # job ids restart with a fresh accounting database
  fi

  MYSQL_UNIX_PORT=$DIR/mysql/mysql.sock launch slurmdbd slurmdbd -D
  wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$((PORT + 2))"
  launch slurmctld slurmctld -D -i -f "$CONF"
  launch slurmd slurmd -D -f "$CONF"
  wait_for 60 "slurmctld slurmd" bash -c "sinfo -h -p debug -o %T | grep -qE '^(idle|mixed|allocated)'"
  say "up: $(sinfo -h -o '%P %D %c %T' | tr '\n' ';')"
  echo "export SLURM_CONF=$CONF"
}

stop_jobs() {
  alive slurmctld >/dev/null || return 0
  local jobs
  jobs=$(squeue -h -o %i 2>/dev/null || true)
  [ -z "$jobs" ] && return 0
  scancel $jobs 2>/dev/null || true
  local until=$((SECONDS + 20))
  while [ -n "$(squeue -h -o %i 2>/dev/null)" ] && [ $SECONDS -lt $until ]; do sleep 0.2; done
}

stop_daemons() {
  local i name pid until
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    name=${DAEMONS[i]}
    pid=$(alive "$name") || { rm -f "$DIR/run/$name.pid"; continue; }
    kill -TERM "$pid" 2>/dev/null || true
    until=$((SECONDS + 15))
    while alive "$name" >/dev/null && [ $SECONDS -lt $until ]; do sleep 0.1; done
    alive "$name" >/dev/null && kill -KILL "$pid" 2>/dev/null || true
    rm -f "$DIR/run/$name.pid"
  done
}

stop() {
  [ -d "$DIR/run" ] || return 0
  stop_jobs
  stop_daemons
  say "stopped"
}

status() {
  local name ok=0
  for name in "${DAEMONS[@]}"; do
    if pid=$(alive "$name"); then echo "$name: running (pid $pid)"; else echo "$name: not running"; ok=1; fi
  done
  [ $ok = 0 ] || return 1
  sinfo -h -o '%P %D %c %T' || return 1
  sinfo -h -p debug -o %T | grep -qE '^(idle|mixed|allocated)'
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
