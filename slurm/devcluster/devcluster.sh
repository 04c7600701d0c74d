#!/usr/bin/env bash
# hpcrl single-machine Slurm dev cluster.
#
#   bash slurm/devcluster/devcluster.sh up       # start (idempotent), wait until usable
#   bash slurm/devcluster/devcluster.sh down     # cancel jobs, stop all daemons
#   bash slurm/devcluster/devcluster.sh status   # print state; non-zero exit if not fully up
#   eval "$(bash slurm/devcluster/devcluster.sh env)"   # point Slurm clients at it
#
# Everything (configs, munge key, MariaDB datadir, Slurm state, logs, pid files) lives in
# ${HPCRL_DEVCLUSTER_DIR:-<repo>/.devcluster}. Nothing in /etc is read or written.
# Ports: HPCRL_DEVCLUSTER_PORT_BASE (default 16810): mariadb +0, slurmctld +7,
# slurmd n1 +8, slurmdbd +9, slurmd n2 +10. See README.md.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)
STATE=$(realpath -m -- "${HPCRL_DEVCLUSTER_DIR:-$REPO_ROOT/.devcluster}")

CLUSTER=${HPCRL_DEVCLUSTER_CLUSTER:-hpcrldev}
ACCOUNT=${HPCRL_DEVCLUSTER_ACCOUNT:-hpcrl}
PORT_BASE=${HPCRL_DEVCLUSTER_PORT_BASE:-16810}
DB_PORT=$((PORT_BASE + 0))
CTLD_PORT=$((PORT_BASE + 7))
N1_PORT=$((PORT_BASE + 8))
DBD_PORT=$((PORT_BASE + 9))
N2_PORT=$((PORT_BASE + 10))
NODES=(n1 n2)

ETC=$STATE/etc
RUN=$STATE/run
LOG=$STATE/log
SPOOL=$STATE/spool
DEVDIR=$STATE/dev
MUNGE_DIR=$STATE/munge
MUNGE_SOCKDIR=$RUN/munge
MUNGE_SOCKET=$MUNGE_SOCKDIR/munge.socket
DB_DIR=$STATE/mariadb
DB_DATA=$DB_DIR/data
DB_SOCKET=$RUN/mariadb.sock
SLURM_CONF_FILE=$ETC/slurm.conf

# Roles in start order; stop order is the reverse.
ROLES=(munged mariadb slurmdbd slurmctld slurmd.n1 slurmd.n2)

DAEMON_PATH=/usr/sbin:/usr/bin:/sbin:/bin
LOCKED=0   # 1 once this process holds $STATE/.lock (only then does it write RUN/*.id records)

log() { printf 'devcluster: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------------------
# Per-role facts
# ---------------------------------------------------------------------------
exe_of() {
  case $1 in
    munged) echo munged ;;
    mariadb) echo mariadbd ;;
    slurmdbd) echo slurmdbd ;;
    slurmctld) echo slurmctld ;;
    slurmd.*) echo slurmd ;;
    *) die "unknown role $1" ;;
  esac
}
pidfile_of() { echo "$RUN/$1.pid"; }  # written (and removed on exit) by the daemon itself too
idfile_of() { echo "$RUN/$1.id"; }    # this script's own record: "PID STARTTIME"
logfile_of() { echo "$LOG/$1.log"; }
outfile_of() { echo "$LOG/$1.out"; }
tag_of() { echo "$STATE#$1"; }

# A process is identified by "PID STARTTIME" (starttime: field 22 of /proc/PID/stat, in clock ticks since
# boot). PID and start time stay the same across exec (bash child -> env -> setsid -> daemon), and together
# they cannot be reused by another process.
# proc_start PID: print the start time of a live process, else return 1. A zombie counts as gone, unless
# only its main thread has exited and other threads still run (then it may still hold its ports).
proc_start() {
  local pid=$1 stat rest f
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  read -r stat 2>/dev/null </proc/"$pid"/stat || return 1
  rest=${stat##*) }            # the comm field may contain spaces and ')'
  read -r -a f <<<"$rest"      # f[0] = state (field 3), f[17] = num_threads (20), f[19] = starttime (22)
  [[ -n ${f[19]:-} ]] || return 1
  if [[ ${f[0]} == [ZX] ]] && ((${f[17]:-1} <= 1)); then return 1; fi
  echo "${f[19]}"
}

# proc_alive "PID STARTTIME": is exactly that process still alive (not exited, not a zombie)?
proc_alive() {
  local pid=${1% *} start=${1#* } now_start
  now_start=$(proc_start "$pid") || return 1
  [[ $now_start == "$start" ]]
}

# Is PID a live process of ROLE belonging to this state folder?
# (checks the executable and the HPCRL_DEVCLUSTER_TAG we put into its environment)
pid_is_role() {
  local pid=$1 role=$2 exe want
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ -d /proc/$pid ]] || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  exe=${exe% (deleted)}
  want=$(exe_of "$role"); exe=${exe##*/}
  # Debian installs e.g. slurmd as an alternative of /usr/sbin/slurmd-wlm.
  [[ $exe == "$want" || $exe == "$want"-* ]] || return 1
  grep -qzxF -- "HPCRL_DEVCLUSTER_TAG=$(tag_of "$role")" "/proc/$pid/environ" 2>/dev/null
}

# The process start_daemon forked is the daemon from its first instant: before its exec it is still
# bash/env/setsid (no daemon executable, maybe no tag yet). Accept those only for the recorded identity.
exe_is_role_or_launcher() {
  local pid=$1 role=$2 exe want
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  exe=${exe% (deleted)}; exe=${exe##*/}; want=$(exe_of "$role")
  [[ $exe == "$want" || $exe == "$want"-* || $exe == bash || $exe == env || $exe == setsid ]]
}

write_id() { # write_id ROLE "PID START" (atomically: readers never see a half-written file)
  local f
  [[ -d $RUN ]] || return 0
  f=$(idfile_of "$1")
  printf '%s\n' "$2" >"$f.tmp.$BASHPID" && mv -f "$f.tmp.$BASHPID" "$f"
}

# ident_of ROLE: print "PID STARTTIME" of ROLE's process if it runs (or is starting), else return 1.
# Sources, in order: our own record (RUN/ROLE.id), the daemon's pid file, a /proc scan for our tag.
# The daemons rewrite and remove their pid files themselves (at start, and at exit: possibly an old
# instance exiting while a new one starts), so the pid file alone decides nothing.
ident_of() {
  local role=$1 idf pid start rec f
  idf=$(idfile_of "$role")
  if [[ -f $idf ]] && read -r rec 2>/dev/null <"$idf" && [[ $rec =~ ^[0-9]+\ [0-9]+$ ]]; then
    if proc_alive "$rec" && exe_is_role_or_launcher "${rec% *}" "$role"; then echo "$rec"; return 0; fi
  fi
  pid=$(tr -dc '0-9' 2>/dev/null <"$(pidfile_of "$role")" || true)  # (2> first: the file may not exist)
  if pid_is_role "$pid" "$role" && start=$(proc_start "$pid"); then
    ((LOCKED)) && write_id "$role" "$pid $start"
    echo "$pid $start"; return 0
  fi
  # Pid file missing/stale (e.g. a daemon started by an older devcluster.sh): scan /proc.
  for f in $(grep -lzxF -- "HPCRL_DEVCLUSTER_TAG=$(tag_of "$role")" /proc/[0-9]*/environ 2>/dev/null || true); do
    pid=${f#/proc/}; pid=${pid%/environ}
    if pid_is_role "$pid" "$role" && start=$(proc_start "$pid"); then
      ((LOCKED)) && write_id "$role" "$pid $start"
      echo "$pid $start"; return 0
    fi
  done
  return 1
}

# Print the pid of ROLE if it runs, else return 1.
pid_of() {
  local ident
  ident=$(ident_of "$1") || return 1
  echo "${ident% *}"
}

is_running() { pid_of "$1" >/dev/null; }

# All processes carrying any tag of this state folder (daemons and their children, e.g. slurmstepd).
all_tagged_pids() {
  local f pid
  for f in $(grep -lzF -- "HPCRL_DEVCLUSTER_TAG=$STATE#" /proc/[0-9]*/environ 2>/dev/null || true); do
    pid=${f#/proc/}; pid=${pid%/environ}
    [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
    echo "$pid"
  done
}

tail_logs() {
  local role=$1 f
  f=$(logfile_of "$role")
  if [[ -s $f ]]; then
    printf -- '----- tail of %s -----\n' "$f" >&2
    tail -n 25 "$f" >&2
  fi
  # stdout/stderr of the last start only (fatal errors before the log file is opened land here).
  f=$(outfile_of "$role")
  if [[ -s $f ]]; then
    printf -- '----- tail of %s (last start) -----\n' "$f" >&2
    awk '/^===== .* start /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$f" | tail -n 15 >&2
  fi
}

die_daemon() {
  local role=$1; shift
  log "ERROR: $role failed: $*"
  tail_logs "$role"
  exit 1
}

# Start ROLE: CMD... detached (own session), clean environment, output to $LOG/ROLE.out.
# Records the child's identity "PID STARTTIME" in RUN/ROLE.id right away: $! is the daemon itself (bash
# forks once; env and setsid exec, and setsid does not fork as it is not a process group leader), but
# until its final exec it still runs as bash/env/setsid. The identity covers that window.
declare -A STARTED_PID=()
start_daemon() {
  local role=$1; shift
  local out pid start
  out=$(outfile_of "$role")
  printf '===== %s start %s: %s\n' "$(date -Is)" "$role" "$*" >>"$out"
  env -i PATH="$DAEMON_PATH" HOME="${HOME:-/root}" LANG=C.UTF-8 \
    SLURM_CONF="$SLURM_CONF_FILE" HPCRL_DEVCLUSTER_TAG="$(tag_of "$role")" \
    setsid "$@" </dev/null >>"$out" 2>&1 9>&- &
  pid=$!
  STARTED_PID[$role]=$pid
  start=$(proc_start "$pid") || start=0   # already gone: the liveness check reports it
  write_id "$role" "$pid $start"
}

# exit_note ROLE: set EXIT_NOTE to " (exit status N)" if this process started ROLE and it has exited.
# (Not in a $(...) subshell: only this shell can wait for its own children.)
EXIT_NOTE=
exit_note() {
  local pid=${STARTED_PID[$1]:-} rc=0
  EXIT_NOTE=
  [[ -n $pid ]] || return 0
  proc_start "$pid" >/dev/null && return 0
  wait "$pid" 2>/dev/null || rc=$?
  ((rc == 127)) || EXIT_NOTE=" (exit status $rc)"
}

# still_running ROLE IDENT: print IDENT if that process still lives; else, if ROLE runs as another process (a
# launcher that forked), print that identity. Never concludes "exited" from a pid file alone.
still_running() {
  local role=$1 ident=$2
  proc_alive "$ident" && { echo "$ident"; return 0; }
  ident_of "$role"
}

# wait_until ROLE TIMEOUT DESCRIPTION CMD... : poll CMD until success; fail if ROLE dies or timeout.
# Liveness is checked on the identity (PID + start time) of the process, not by re-reading pid files.
wait_until() {
  local role=$1 timeout=$2 desc=$3; shift 3
  local deadline ident
  if ! ident=$(ident_of "$role"); then
    exit_note "$role"; die_daemon "$role" "not running$EXIT_NOTE before waiting for: $desc"
  fi
  deadline=$(awk -v t="$(now)" -v d="$timeout" 'BEGIN { printf "%.3f", t + d }')
  while true; do
    if "$@" >/dev/null 2>&1; then return 0; fi
    if ! ident=$(still_running "$role" "$ident"); then
      exit_note "$role"; die_daemon "$role" "process exited$EXIT_NOTE while waiting for: $desc"
    fi
    if awk -v t="$(now)" -v d="$deadline" 'BEGIN { exit !(t > d) }'; then
      die_daemon "$role" "timed out after ${timeout}s waiting for: $desc"
    fi
    sleep 0.2
  done
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

check_port_free() {
  local port=$1 role=$2
  if port_in_use "$port"; then
    die "port $port (for $role) is already in use by another process; set HPCRL_DEVCLUSTER_PORT_BASE to another base (now $PORT_BASE)"
  fi
}

port_of() {
  case $1 in
    mariadb) echo "$DB_PORT" ;; slurmdbd) echo "$DBD_PORT" ;; slurmctld) echo "$CTLD_PORT" ;;
    slurmd.n1) echo "$N1_PORT" ;; slurmd.n2) echo "$N2_PORT" ;; *) echo "" ;;
  esac
}

# Before starting anything: every daemon that is not running yet needs a free port.
check_ports() {
  local r port
  for r in "${ROLES[@]}"; do
    port=$(port_of "$r")
    [[ -n $port ]] || continue
    is_running "$r" || check_port_free "$port" "$r"
  done
}

# ---------------------------------------------------------------------------
# Client environment for this script's own Slurm client calls
# ---------------------------------------------------------------------------
client_env() {
  export SLURM_CONF=$SLURM_CONF_FILE
  # Don't let a caller's output-format or cluster settings change what we parse.
  unset SINFO_FORMAT SQUEUE_FORMAT SQUEUE_FORMAT2 SLURM_CLUSTERS SQUEUE_SORT 2>/dev/null || true
}
q() { timeout 20 "$@"; }

sinfo_ok() { q sinfo -h -o %P >/dev/null 2>&1; }
sacctmgr_ok() { q sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; }

# Prints "node state" per node (long state names, e.g. idle, mixed, drained, idle*).
node_states() { q sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

node_state() { node_states | awk -v n="$1" '$1 == n { print $2; exit }'; }

node_healthy() {
  case $(node_state "$1") in
    idle | mixed | allocated | completing) return 0 ;;
    *) return 1 ;;
  esac
}

all_nodes_healthy() {
  local n
  for n in "${NODES[@]}"; do node_healthy "$n" || return 1; done
}

# ---------------------------------------------------------------------------
# Preparation: folders, munge key, fake GPUs, configs
# ---------------------------------------------------------------------------
need_binaries() {
  local b missing=()
  for b in munged munge mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd sacctmgr sinfo scontrol squeue scancel; do
    command -v "$b" >/dev/null 2>&1 || PATH="$PATH:$DAEMON_PATH" command -v "$b" >/dev/null 2>&1 || missing+=("$b")
  done
  ((${#missing[@]} == 0)) || die "missing programs: ${missing[*]} (apt-get install slurm-wlm slurmdbd mariadb-server munge)"
}

sed_escape() { printf '%s' "$1" | sed -e 's/[\\&|]/\\&/g'; }

render() { # render TEMPLATE OUT
  local tmpl=$1 out=$2 host db_pass
  host=$(hostname -s)
  db_pass=$(cat "$DB_DIR/slurm.pass")
  sed -e "s|@STATE@|$(sed_escape "$STATE")|g" \
      -e "s|@CLUSTER@|$(sed_escape "$CLUSTER")|g" \
      -e "s|@HOST@|$(sed_escape "$host")|g" \
      -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
      -e "s|@N1_PORT@|$N1_PORT|g" \
      -e "s|@N2_PORT@|$N2_PORT|g" \
      -e "s|@DBD_PORT@|$DBD_PORT|g" \
      -e "s|@DB_PORT@|$DB_PORT|g" \
      -e "s|@DB_PASS@|$(sed_escape "$db_pass")|g" \
      -e "s|@MUNGE_SOCKET@|$(sed_escape "$MUNGE_SOCKET")|g" \
      -e "s|@DEVDIR@|$(sed_escape "$DEVDIR")|g" \
      "$tmpl" >"$out"
  if grep -q '@[A-Z_]*@' "$out"; then die "unrendered variable in $out: $(grep -o '@[A-Z_]*@' "$out" | sort -u | tr '\n' ' ')"; fi
}

prepare() {
  umask 022
  mkdir -p "$STATE" "$ETC" "$RUN" "$LOG" "$SPOOL/slurmctld" "$DEVDIR" "$MUNGE_DIR" "$DB_DIR" "$DB_DIR/tmp"
  local n
  for n in "${NODES[@]}"; do mkdir -p "$SPOOL/slurmd.$n"; done
  # munged insists on safe permissions: key dir not writable by others; socket dir needs o+x.
  chmod 0755 "$STATE" "$RUN" "$LOG"
  chmod 0700 "$MUNGE_DIR"
  mkdir -p "$MUNGE_SOCKDIR"; chmod 0711 "$MUNGE_SOCKDIR"
  if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    (umask 077; head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key.tmp")
    mv "$MUNGE_DIR/munge.key.tmp" "$MUNGE_DIR/munge.key"
  fi
  chmod 0600 "$MUNGE_DIR/munge.key"
  # Fake GPU devices.
  local i
  for i in 0 1 2 3; do ln -sfn /dev/null "$DEVDIR/nvidia$i"; done
  # Private password for the slurm DB user.
  if [[ ! -s $DB_DIR/slurm.pass ]]; then
    (umask 077; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DB_DIR/slurm.pass")
  fi
  chmod 0600 "$DB_DIR/slurm.pass"

  local sock
  for sock in "$MUNGE_SOCKET" "$DB_SOCKET"; do
    ((${#sock} < 100)) || die "socket path too long (${#sock} chars, max 99): $sock; set HPCRL_DEVCLUSTER_DIR to a shorter folder"
  done

  # Render configs. If daemons run with a different config, keep theirs and warn.
  local any_running=0 r f changed=()
  for r in "${ROLES[@]}"; do is_running "$r" && any_running=1; done
  for f in slurm.conf gres.conf slurmdbd.conf cgroup.conf; do
    [[ -f $SCRIPT_DIR/$f.in ]] || continue
    (umask 077; render "$SCRIPT_DIR/$f.in" "$ETC/$f.new")
    if [[ -f $ETC/$f ]] && cmp -s "$ETC/$f" "$ETC/$f.new"; then
      rm -f "$ETC/$f.new"
    elif [[ -f $ETC/$f && $any_running == 1 ]]; then
      changed+=("$f")
      rm -f "$ETC/$f.new"
    else
      mv "$ETC/$f.new" "$ETC/$f"
    fi
  done
  chmod 0644 "$ETC/slurm.conf" "$ETC/gres.conf"
  [[ -f $ETC/cgroup.conf ]] && chmod 0644 "$ETC/cgroup.conf"
  chmod 0600 "$ETC/slurmdbd.conf"
  if ((${#changed[@]})); then
    log "WARNING: templates changed (${changed[*]}) but daemons are running with the old config; run 'down' then 'up' to apply"
  fi
}

# ---------------------------------------------------------------------------
# Daemons
# ---------------------------------------------------------------------------
munge_ok() { munge -S "$MUNGE_SOCKET" -n </dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null; }

up_munged() {
  if is_running munged && munge_ok >/dev/null 2>&1; then return 0; fi
  stop_role munged
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  start_daemon munged munged -F -S "$MUNGE_SOCKET" \
    --key-file="$MUNGE_DIR/munge.key" --pid-file="$(pidfile_of munged)" \
    --log-file="$(logfile_of munged)" --seed-file="$MUNGE_DIR/munged.seed" --num-threads=4
  wait_until munged 15 "munge socket $MUNGE_SOCKET to answer" munge_ok
}

MARIADB_OPTS=()
mariadb_opts() {
  MARIADB_OPTS=(
    --no-defaults --basedir=/usr --datadir="$DB_DATA" --tmpdir="$DB_DIR/tmp"
    --innodb-buffer-pool-size=512M --innodb-log-file-size=32M --innodb-lock-wait-timeout=900
    --innodb-flush-log-at-trx-commit=2 --innodb-use-native-aio=0 --max-allowed-packet=64M
  )
}

db_sql() { # run SQL as the DB root over the private socket
  mariadb --no-defaults --protocol=socket --socket="$DB_SOCKET" -uroot -N -B -e "$1"
}
db_ok() { db_sql 'SELECT 1' >/dev/null; }

up_mariadb() {
  mariadb_opts
  if ! is_running mariadb; then
    if [[ ! -f $DB_DIR/.initialized ]]; then
      log "initializing MariaDB datadir $DB_DATA"
      rm -rf "$DB_DATA"; mkdir -p "$DB_DATA"
      if ! mariadb-install-db "${MARIADB_OPTS[@]}" --user=root --auth-root-authentication-method=socket \
          --skip-test-db --skip-name-resolve >"$(outfile_of mariadb-install-db)" 2>&1; then
        log "ERROR: mariadb-install-db failed"; tail -n 30 "$(outfile_of mariadb-install-db)" >&2; exit 1
      fi
      touch "$DB_DIR/.initialized"
    fi
    check_port_free "$DB_PORT" mariadb
    rm -f "$DB_SOCKET"
    start_daemon mariadb mariadbd "${MARIADB_OPTS[@]}" --user=root \
      --socket="$DB_SOCKET" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
      --pid-file="$(pidfile_of mariadb)" --log-error="$(logfile_of mariadb)"
  fi
  wait_until mariadb 60 "MariaDB to answer on $DB_SOCKET" db_ok
  local pw
  pw=$(cat "$DB_DIR/slurm.pass")
  db_sql "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pw';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
    ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pw';
    GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
    FLUSH PRIVILEGES;" || die_daemon mariadb "could not create the slurm_acct_db database/user"
}

up_slurmdbd() {
  if ! is_running slurmdbd; then
    check_port_free "$DBD_PORT" slurmdbd
    start_daemon slurmdbd slurmdbd -D
  fi
  # First start creates the tables; that can take a while on a slow machine.
  wait_until slurmdbd 60 "slurmdbd to answer sacctmgr on port $DBD_PORT" sacctmgr_ok
}

register_cluster() {
  if ! q sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx -- "$CLUSTER"; then
    log "registering cluster $CLUSTER in accounting"
    q sacctmgr -i add cluster "$CLUSTER" >/dev/null || die_daemon slurmdbd "sacctmgr add cluster $CLUSTER failed"
  fi
}

register_account_user() {
  local user
  user=$(id -un)
  if ! q sacctmgr -n -P list account "$ACCOUNT" format=account 2>/dev/null | grep -qx -- "$ACCOUNT"; then
    q sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description="hpcrl dev" organization=hpcrl >/dev/null \
      || die_daemon slurmdbd "sacctmgr add account $ACCOUNT failed"
  fi
  if ! q sacctmgr -n -P list assoc cluster="$CLUSTER" account="$ACCOUNT" user="$user" format=user 2>/dev/null | grep -qx -- "$user"; then
    q sacctmgr -i add user "$user" account="$ACCOUNT" cluster="$CLUSTER" >/dev/null \
      || die_daemon slurmdbd "sacctmgr add user $user failed"
  fi
  if ! q sacctmgr -n -P list user "$user" format=defaultaccount 2>/dev/null | grep -qx -- "$ACCOUNT"; then
    q sacctmgr -i modify user where name="$user" set defaultaccount="$ACCOUNT" >/dev/null \
      || die_daemon slurmdbd "sacctmgr modify user $user defaultaccount failed"
  fi
}

up_slurmctld() {
  if ! is_running slurmctld; then
    check_port_free "$CTLD_PORT" slurmctld
    start_daemon slurmctld slurmctld -D -f "$SLURM_CONF_FILE"
  fi
  wait_until slurmctld 30 "slurmctld to answer sinfo on port $CTLD_PORT" sinfo_ok
}

up_slurmd() {
  local n=$1 port
  [[ $n == n1 ]] && port=$N1_PORT || port=$N2_PORT
  if ! is_running "slurmd.$n"; then
    check_port_free "$port" "slurmd.$n"
    start_daemon "slurmd.$n" slurmd -D -N "$n" -f "$SLURM_CONF_FILE"
  fi
}

resume_bad_nodes() {
  local n st
  for n in "${NODES[@]}"; do
    st=$(node_state "$n")
    case $st in
      *'*'*) ;; # not responding yet: wait for slurmd to register
      *drain* | *down* | *fail* | *maint* | *reboot* | *inval*)
        log "node $n is '$st': resuming"
        q scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true ;;
    esac
  done
}

wait_nodes() {
  local deadline=$((SECONDS + 40)) n
  local last_resume=-10
  local -A ident=()
  for n in "${NODES[@]}"; do
    if ! ident[$n]=$(ident_of "slurmd.$n"); then exit_note "slurmd.$n"; die_daemon "slurmd.$n" "not running$EXIT_NOTE"; fi
  done
  while true; do
    all_nodes_healthy && return 0
    for n in "${NODES[@]}"; do
      if ! ident[$n]=$(still_running "slurmd.$n" "${ident[$n]}"); then
        exit_note "slurmd.$n"; die_daemon "slurmd.$n" "process exited$EXIT_NOTE while waiting for node $n to become idle"
      fi
    done
    if ((SECONDS - last_resume >= 3)); then resume_bad_nodes; last_resume=$SECONDS; fi
    if ((SECONDS > deadline)); then
      log "ERROR: nodes did not become idle in 40s:"; node_states >&2 || true
      for n in "${NODES[@]}"; do
        if ! node_healthy "$n"; then
          q scontrol show node "$n" 2>/dev/null | grep -E 'State=|Reason=' >&2 || true
          tail_logs "slurmd.$n"
        fi
      done
      tail_logs slurmctld
      exit 1
    fi
    sleep 0.3
  done
}

fully_up() {
  local r
  for r in "${ROLES[@]}"; do is_running "$r" || return 1; done
  sinfo_ok && all_nodes_healthy && sacctmgr_ok
}

# ---------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------
# stop_role ROLE [TIMEOUT]: SIGTERM, wait, SIGKILL.
# Waits on the identity (PID + start time): the daemon removes its pid file before it is gone.
stop_role() {
  local role=$1 timeout=${2:-15} ident pid
  if ident=$(ident_of "$role"); then
    pid=${ident% *}
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + timeout))
    while proc_alive "$ident" && ((SECONDS < deadline)); do sleep 0.1; done
    if proc_alive "$ident"; then
      log "$role (pid $pid) did not stop after ${timeout}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      deadline=$((SECONDS + 10))
      while proc_alive "$ident" && ((SECONDS < deadline)); do sleep 0.1; done
      proc_alive "$ident" && log "WARNING: $role (pid $pid) still there after SIGKILL"
    fi
  fi
  rm -f "$(pidfile_of "$role")" "$(idfile_of "$role")"
}

cancel_all_jobs() {
  local ids
  sinfo_ok || return 0
  ids=$(q squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ') || true
  [[ -n ${ids// /} ]] || return 0
  log "cancelling jobs: $ids"
  # shellcheck disable=SC2086
  q scancel $ids >/dev/null 2>&1 || true
  local deadline=$((SECONDS + 15))
  while ((SECONDS < deadline)); do
    [[ -z $(q squeue -h -o %A 2>/dev/null) ]] && return 0
    sleep 0.3
  done
  log "WARNING: jobs still listed after 15s:"; q squeue >&2 || true
}

cmd_down() {
  local t0 n pids=() pid
  t0=$(now)
  client_env
  [[ -d $STATE ]] || { log "nothing to stop ($STATE does not exist)"; return 0; }
  exec 9>"$STATE/.lock"; flock -w 120 9 || die "another devcluster.sh holds $STATE/.lock"
  LOCKED=1
  if is_running slurmctld; then cancel_all_jobs; fi
  # slurmd's in parallel, then the rest in reverse start order.
  for n in "${NODES[@]}"; do stop_role "slurmd.$n" & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  stop_role slurmctld 20
  stop_role slurmdbd 20
  stop_role mariadb 60
  stop_role munged 10
  # Leftovers of this state folder (e.g. a stuck slurmstepd).
  local left
  left=$(all_tagged_pids | tr '\n' ' ')
  if [[ -n ${left// /} ]]; then
    log "killing leftover processes of this cluster: $left"
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
  fi
  rm -f "$MUNGE_SOCKET" "$DB_SOCKET"
  log "down in $(elapsed "$t0")s"
}

# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------
cmd_up() {
  local t0 n
  t0=$(now)
  [[ $EUID -eq 0 ]] || die "must run as root (SlurmUser=root, mariadbd --user=root)"
  need_binaries
  export PATH="$PATH:$DAEMON_PATH"
  client_env
  mkdir -p "$STATE"
  exec 9>"$STATE/.lock"; flock -w 120 9 || die "another devcluster.sh holds $STATE/.lock"
  LOCKED=1
  prepare
  if fully_up; then
    register_account_user
    log "already up ($(elapsed "$t0")s): cluster $CLUSTER, SLURM_CONF=$SLURM_CONF_FILE"
    return 0
  fi
  check_ports
  up_munged
  up_mariadb
  up_slurmdbd
  register_cluster
  up_slurmctld
  register_account_user
  for n in "${NODES[@]}"; do up_slurmd "$n"; done
  wait_nodes
  log "up in $(elapsed "$t0")s: cluster $CLUSTER, SLURM_CONF=$SLURM_CONF_FILE"
  local hint="bash $SCRIPT_DIR/devcluster.sh env"
  [[ -n ${HPCRL_DEVCLUSTER_DIR:-} ]] && hint="HPCRL_DEVCLUSTER_DIR=$(shquote "$STATE") $hint"
  log "use: eval \"\$($hint)\""
  node_states | sed 's/^/devcluster:   /' >&2 || true
}

cmd_status() {
  client_env
  local r pid rc=0
  echo "state folder: $STATE"
  echo "cluster: $CLUSTER  ports: mariadb=$DB_PORT slurmctld=$CTLD_PORT slurmdbd=$DBD_PORT slurmd n1=$N1_PORT n2=$N2_PORT"
  for r in "${ROLES[@]}"; do
    if pid=$(pid_of "$r"); then
      printf '  %-10s running (pid %s)\n' "$r" "$pid"
    else
      printf '  %-10s STOPPED\n' "$r"; rc=1
    fi
  done
  if [[ -f $SLURM_CONF_FILE ]] && is_running slurmctld && sinfo_ok; then
    q sinfo || true
    if ! all_nodes_healthy; then echo "nodes not all usable:"; node_states || true; rc=1; fi
    if is_running slurmdbd && ! sacctmgr_ok; then echo "sacctmgr does not answer"; rc=1; fi
  else
    echo "slurmctld does not answer"; rc=1
  fi
  if ((rc == 0)); then echo "status: UP"; else echo "status: NOT UP"; fi
  return $rc
}

shquote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

cmd_env() {
  printf 'export SLURM_CONF=%s\n' "$(shquote "$SLURM_CONF_FILE")"
  printf 'export HPCRL_DEVCLUSTER_DIR=%s\n' "$(shquote "$STATE")"
}

usage() {
  cat >&2 <<EOF
usage: $0 {up|down|status|env}
  up      start munged, MariaDB, slurmdbd, slurmctld, slurmd n1+n2 (idempotent)
  down    cancel all jobs and stop every daemon
  status  show daemons and sinfo; exit 1 unless fully up
  env     print 'export SLURM_CONF=...' for: eval "\$(bash $0 env)"
state folder: $STATE
EOF
  exit 2
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) usage ;;
esac
