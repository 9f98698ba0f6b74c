#!/usr/bin/env bash
# A real, local SLURM cluster on this one machine, for tests and for trying the sbatch script:
# one slurmctld and N slurmd "nodes" (`slurmd -N <name>`, each on its own port), all on 127.0.0.1.
# Run as root on Debian/Ubuntu (tested: Debian 12, slurm-wlm 22.05.8, munge 0.5.15).
#
#   scripts/slurm_local.sh install            # apt packages, munge key, node names resolvable
#   scripts/slurm_local.sh up   [STATE_DIR]   # install if needed, start, wait until nodes are idle
#   scripts/slurm_local.sh env  [STATE_DIR]   # print `export SLURM_CONF=...` for sbatch/squeue
#   scripts/slurm_local.sh down [STATE_DIR]   # cancel jobs, stop what `up` started (by PID)
#
# `up` is idempotent: when the cluster of STATE_DIR already runs with all nodes up it returns at
# once (its jobs keep running). Each start is clean (slurmctld -c: no jobs survive a restart). The config lives in
# STATE_DIR/slurm.conf and nothing is written under /etc/slurm: clients find it through
# SLURM_CONF (exported by `env`; jobs inherit it).
#
# Environment:
#   SLURM_LOCAL_DIR     state dir when none is given          (default /tmp/trainer-slurm)
#   SLURM_LOCAL_NODES   comma list of node names              (default "<hostname -s>,localhost")
#                       The names must resolve: torchrun uses them as rendezvous/master address.
#                       Never put "localhost" first (slurm special-cases a lone "localhost").
#   SLURM_LOCAL_PORT    slurmctld port; the slurmds use the next N ports  (default 16817)
#   SLURM_LOCAL_GPUS    fake GPUs (GRES gpu, no devices) per node, so that `--gpus-per-node`
#                       jobs schedule as on a GPU cluster  (default 2; 0 = no GRES)
#   SLURM_LOCAL_CPUS    CPUs advertised per node          (default: the machine's real count)
#   SLURM_LOCAL_EDIT_HOSTS=1  `install` adds "127.0.0.1 <name>" to /etc/hosts for names that
#                       do not resolve (CI sets it; otherwise a missing name is an error)
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"   # slurmctld, slurmd, munged

CMD=${1:-}
D=${2:-${SLURM_LOCAL_DIR:-/tmp/trainer-slurm}}
HOST=$(hostname -s)
NODES=${SLURM_LOCAL_NODES:-"$HOST,localhost"}
IFS=, read -r -a NODE_ARR <<<"$NODES"
N=${#NODE_ARR[@]}
PORT=${SLURM_LOCAL_PORT:-16817}
GPUS=${SLURM_LOCAL_GPUS:-2}
PACKAGES=(slurmctld slurmd slurm-client munge)
T0=$(date +%s%N)

log() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); echo "[slurm_local $((ms / 1000)).$((ms % 1000 / 100))s] $*"; }
die() { echo "slurm_local: $*" >&2; exit 1; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
export SLURM_CONF="$D/slurm.conf"

count_nodes() { sinfo -h -t "$1" -o '%D' 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
idle_nodes() { count_nodes idle; }

install() {
  [ "$(id -u)" = 0 ] || die "must run as root (slurmd runs jobs as any user)"
  local missing=()
  for exe in slurmctld slurmd sbatch munged; do command -v "$exe" >/dev/null || missing+=("$exe"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
    log "installed: $(slurmd -V)"
  fi
  if [ ! -s /etc/munge/munge.key ]; then  # Debian's postinst normally creates it
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey -c -k /etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  for n in "${NODE_ARR[@]}"; do
    getent hosts "$n" >/dev/null && continue
    [ "${SLURM_LOCAL_EDIT_HOSTS:-0}" = 1 ] || die "node name '$n' does not resolve; set SLURM_LOCAL_EDIT_HOSTS=1 (adds it to /etc/hosts as 127.0.0.1) or SLURM_LOCAL_NODES"
    [ -z "$(tail -c1 /etc/hosts 2>/dev/null)" ] || echo >>/etc/hosts   # end the last line
    echo "127.0.0.1 $n" >>/etc/hosts
    log "added '127.0.0.1 $n' to /etc/hosts"
  done
}

start_munge() {
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  mkdir -p /run/munge; chown munge:munge /run/munge; chmod 755 /run/munge
  runuser -u munge -- /usr/sbin/munged     # daemonizes; pid in /run/munge/munged.pid
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged does not answer"
  cp /run/munge/munged.pid "$D/munged.pid"  # "we started it": `down` stops it
}

write_conf() {
  # This box's topology, e.g. "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1"
  local hw mem extra="" gres="" i
  hw=$(slurmd -C | head -n1 | sed -E 's/^NodeName=[^ ]+ //; s/ RealMemory=[0-9]+//; s/ UpTime=.*//')
  mem=$(( $(slurmd -C | head -n1 | sed -E 's/.*RealMemory=([0-9]+).*/\1/') / N ))
  if [ -n "${SLURM_LOCAL_CPUS:-}" ]; then
    hw="CPUs=$SLURM_LOCAL_CPUS"; extra+=$'SlurmdParameters=config_overrides\n'
  fi
  rm -f "$D/gres.conf"
  if [ "$GPUS" -gt 0 ]; then
    # slurm 22.05 drops GPUs without File=, so point them at fake devices (links to /dev/null).
    # Jobs get CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE as on a GPU cluster; nothing else.
    mkdir -p "$D/dev"
    for i in $(seq 0 $((GPUS - 1))); do ln -sfn /dev/null "$D/dev/gpu$i"; done
    extra+=$'GresTypes=gpu\n'; gres="Gres=gpu:$GPUS"
    echo "NodeName=$NODES Name=gpu File=$D/dev/gpu[0-$((GPUS - 1))]" >"$D/gres.conf"
  fi
  cat >"$D/slurm.conf" <<EOF
# Written by scripts/slurm_local.sh: a local test cluster of $N nodes on 127.0.0.1.
ClusterName=trainer-local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Requeued jobs wait for the job credential to expire before they restart (default 120 s;
# 5 is the least slurm takes: below it, it says "invalid" and waits the 120 s).
AuthInfo=cred_expire=5
MailProg=/bin/true
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
${extra}NodeName=$NODES NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(seq -s, $((PORT + 1)) $((PORT + N))) $hw RealMemory=$mem $gres State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

up() {
  if alive "$D/slurmctld.pid" && [ "$(count_nodes idle,alloc,mix,comp)" = "$N" ]; then
    log "already up ($N nodes, SLURM_CONF=$SLURM_CONF)"; return 0   # running jobs live on
  fi
  install
  [ -e "$D/slurmctld.pid" ] && down >/dev/null   # a half-started cluster: start over
  mkdir -p "$D/state" "$D/log"
  for n in "${NODE_ARR[@]}"; do mkdir -p "$D/spool/$n"; done
  start_munge
  log "munge OK"
  # N + 1 free ports from PORT on; without SLURM_LOCAL_PORT, look further if they are taken
  local p tries=0
  while :; do
    for p in $(seq "$PORT" $((PORT + N))); do
      (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && break
      p=""
    done
    [ -z "$p" ] && break
    [ -z "${SLURM_LOCAL_PORT:-}" ] && [ $((tries += 1)) -lt 50 ] \
      || die "port $p on 127.0.0.1 is taken (another slurm?); set SLURM_LOCAL_PORT"
    PORT=$((PORT + 10))
  done
  write_conf
  slurmctld -c -f "$SLURM_CONF"                      # daemonizes; pid -> $D/slurmctld.pid
  for n in "${NODE_ARR[@]}"; do slurmd -c -f "$SLURM_CONF" -N "$n"; done
  for _ in $(seq 240); do
    [ "$(idle_nodes)" = "$N" ] && break; sleep 0.25
  done
  [ "$(idle_nodes)" = "$N" ] || { sinfo -N >&2 || true; die "nodes not idle after 60 s; see $D/log"; }
  log "up: $N idle nodes ($NODES), SLURM_CONF=$SLURM_CONF"
}

stop_pidfiles() {  # stop_pidfiles FILE...: TERM them all, KILL what is left after 10 s
  local f pid pids=() names=()
  for f in "$@"; do
    [ -s "$f" ] && pid=$(cat "$f") && kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" \
      && pids+=("$pid") && names+=("$(basename "$f" .pid) (pid $pid)")
    rm -f "$f"
  done
  for _ in $(seq 100); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && break; sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"; done
  [ ${#names[@]} -eq 0 ] || log "stopped ${names[*]}"
}

down() {
  if alive "$D/slurmctld.pid"; then  # cancel jobs first so that slurmstepds end cleanly
    local ids
    ids=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${ids// /}" ]; then
      # shellcheck disable=SC2086
      scancel $ids 2>/dev/null || true
      for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
      # shellcheck disable=SC2086
      [ -z "$(squeue -h 2>/dev/null)" ] || scancel --full --signal=KILL $ids 2>/dev/null || true
    fi
  fi
  local f slurmds=()
  for f in "$D"/slurmd-*.pid; do [ -e "$f" ] && slurmds+=("$f"); done
  stop_pidfiles "${slurmds[@]}" "$D/slurmctld.pid"
  stop_pidfiles "$D/munged.pid"   # only present when `up` started munged
  log "down"
}

case "$CMD" in
  install) install ;;
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
