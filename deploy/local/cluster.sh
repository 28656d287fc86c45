#!/usr/bin/env bash
# Runs a moed cluster (front end + workers) on this machine, in the background.
#
#   deploy/local/cluster.sh start [--workers=N] [--device=cpu|cuda] [--port=P] [--run_dir=DIR]
#                                 [--mode=embedded|join] [--timeout=S] [-- extra moed flags]
#   deploy/local/cluster.sh status [--port=P | --run_dir=DIR]
#   deploy/local/cluster.sh stop   [--port=P | --run_dir=DIR] [--grace=S]
#
# start  launches moed in its own process group (setsid) and waits until grpc.health reports
#        SERVING (`moectl health`), then prints the address (host:port) on stdout, alone, so
#        that `addr=$(cluster.sh start)` works. Progress and errors go to stderr.
#        --mode=embedded (default): `moed --workers=N` starts its workers itself.
#        --mode=join: `moed --expect_workers=N` plus N `moe-worker --frontend=...` processes
#        started here (how containers and several hosts run it).
#        --device=cuda gives worker i GPU i (embedded: moe-worker --device=cuda picks GPU
#        rank % visible GPUs; join: --device=cuda:i).
#        --port: default 0, i.e. moed binds a free port itself (no race with other programs)
#        and reports it. --timeout: seconds to wait for SERVING (default 60).
# stop   SIGTERM to moed (which stops its workers), then to the whole process group after
#        --grace seconds (default 30: moed's --shutdown_grace_s is 25), then SIGKILL; returns
#        once nothing of it is left.
# status prints the run directory, the processes and `moectl status`; exit 0 when serving,
#        1 when running but not serving, 3 when not running.
#
# Files: the run directory (default /tmp/moed-local/<port> for a given --port, else a new
# /tmp/moed-local/run.XXXXXX with /tmp/moed-local/<port> linking to it once the port is known)
# holds moed.log, worker-<rank>.log, moed.pid, pgid (the process group of everything started),
# port, address, cluster_secret (join mode, 0600), and supervisor.sh with the exact command
# lines. /tmp/moed-local/last points at the most recent run directory, which is what stop and
# status use without --port/--run_dir.
# moed listens on 127.0.0.1 only.
#
# Binaries: $MOED, $MOE_WORKER, $MOECTL (or --moed= --moe_worker= --moectl=), by default
# bazel-bin/server/moed, bazel-bin/server/moe-worker and bazel-bin/client/moectl of this
# checkout. Nothing here runs bazel (tests pass the binaries in).
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO_ROOT="$(cd "${SCRIPT_DIR}/../.." && pwd)"
readonly BASE_DIR="${MOED_LOCAL_BASE:-/tmp/moed-local}"

log() { echo "cluster.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# ---- argument parsing --------------------------------------------------------------------
COMMAND="${1:-}"
[ -n "${COMMAND}" ] || usage
shift
WORKERS=2
DEVICE=cpu
PORT=""
RUN_DIR=""
MODE=embedded
TIMEOUT=60
GRACE=30
MOED="${MOED:-${REPO_ROOT}/bazel-bin/server/moed}"
MOE_WORKER="${MOE_WORKER:-${REPO_ROOT}/bazel-bin/server/moe-worker}"
MOECTL="${MOECTL:-${REPO_ROOT}/bazel-bin/client/moectl}"
EXTRA_MOED_FLAGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workers=*) WORKERS="${1#*=}" ;;
    --device=*) DEVICE="${1#*=}" ;;
    --port=*) PORT="${1#*=}" ;;
    --run_dir=*) RUN_DIR="${1#*=}" ;;
    --mode=*) MODE="${1#*=}" ;;
    --timeout=*) TIMEOUT="${1#*=}" ;;
    --grace=*) GRACE="${1#*=}" ;;
    --moed=*) MOED="${1#*=}" ;;
    --moe_worker=*) MOE_WORKER="${1#*=}" ;;
    --moectl=*) MOECTL="${1#*=}" ;;
    -h|--help) usage ;;
    --) shift; EXTRA_MOED_FLAGS=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
is_uint "${WORKERS}" && [ "${WORKERS}" -ge 1 ] || die "--workers must be a positive integer"
is_uint "${TIMEOUT}" || die "--timeout must be seconds"
is_uint "${GRACE}" || die "--grace must be seconds"
[ -z "${PORT}" ] || { is_uint "${PORT}" && [ "${PORT}" -ge 1 ] && [ "${PORT}" -le 65535 ]; } ||
  die "--port must be 1..65535"
case "${DEVICE}" in cpu|cuda) ;; *) die "--device must be cpu or cuda" ;; esac
case "${MODE}" in embedded|join) ;; *) die "--mode must be embedded or join" ;; esac

# ---- helpers -----------------------------------------------------------------------------
port_in_use() { ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }

# The run directory of an existing cluster for stop/status.
resolve_run_dir() {
  if [ -n "${RUN_DIR}" ]; then echo "${RUN_DIR}"; return; fi
  if [ -n "${PORT}" ]; then readlink -f "${BASE_DIR}/${PORT}"; return; fi
  if [ -e "${BASE_DIR}/last" ]; then readlink -f "${BASE_DIR}/last"; return; fi
  die "no cluster known: pass --port or --run_dir"
}

group_alive() { kill -0 -- "-$1" 2>/dev/null; }
pid_alive() { kill -0 "$1" 2>/dev/null; }

# Waits up to $2 seconds for process group $1 to be gone; returns 1 if it is still there.
wait_group_gone() {
  local deadline=$(( SECONDS + $2 ))
  while group_alive "$1"; do
    [ "${SECONDS}" -lt "${deadline}" ] || return 1
    sleep 0.1
  done
  return 0
}

stop_cluster() {
  local dir="$1" pgid moed_pid
  [ -f "${dir}/pgid" ] || { log "nothing to stop in ${dir}"; return 0; }
  pgid="$(cat "${dir}/pgid")"
  if ! group_alive "${pgid}"; then
    log "cluster in ${dir} is not running"
    rm -f "${dir}/pgid"
    return 0
  fi
  # moed first, so that it stops its workers in order and closes its port cleanly.
  moed_pid="$(cat "${dir}/moed.pid" 2>/dev/null || true)"
  if [ -n "${moed_pid}" ] && pid_alive "${moed_pid}"; then
    log "stopping: SIGTERM to moed (pid ${moed_pid})"
    kill -TERM "${moed_pid}" 2>/dev/null || true
    local deadline=$(( SECONDS + GRACE ))
    while pid_alive "${moed_pid}" && [ "${SECONDS}" -lt "${deadline}" ]; do sleep 0.1; done
    pid_alive "${moed_pid}" && log "moed still running after ${GRACE}s"
  fi
  # Then whatever is left of the group (join-mode workers, the supervisor shell).
  if ! wait_group_gone "${pgid}" 2; then
    kill -TERM -- "-${pgid}" 2>/dev/null || true
    if ! wait_group_gone "${pgid}" "${GRACE}"; then
      log "still running after SIGTERM: SIGKILL to process group ${pgid}"
      kill -KILL -- "-${pgid}" 2>/dev/null || true
      wait_group_gone "${pgid}" 5 || die "process group ${pgid} survived SIGKILL"
    fi
  fi
  rm -f "${dir}/pgid"
  log "stopped"
}

# ---- commands ----------------------------------------------------------------------------
cmd_start() {
  for bin in "${MOED}" "${MOE_WORKER}" "${MOECTL}"; do
    [ -x "${bin}" ] || die "${bin} not found or not executable (bazel build //server:moed //server:moe-worker //client:moectl)"
  done
  mkdir -p "${BASE_DIR}"
  if [ -n "${PORT}" ]; then
    port_in_use "${PORT}" && die "port ${PORT} is in use"
    [ -n "${RUN_DIR}" ] || RUN_DIR="${BASE_DIR}/${PORT}"
  else
    [ -n "${RUN_DIR}" ] || RUN_DIR="$(mktemp -d "${BASE_DIR}/run.XXXXXX")"
  fi
  # A link left by an earlier run whose directory is gone.
  [ -L "${RUN_DIR}" ] && [ ! -e "${RUN_DIR}" ] && rm -f "${RUN_DIR}"
  mkdir -p "${RUN_DIR}"
  RUN_DIR="$(cd "${RUN_DIR}" && pwd -P)"
  if [ -f "${RUN_DIR}/pgid" ] && group_alive "$(cat "${RUN_DIR}/pgid")"; then
    die "a cluster is already running in ${RUN_DIR} (cluster.sh stop --run_dir=${RUN_DIR})"
  fi
  rm -f "${RUN_DIR}"/*.log "${RUN_DIR}"/*.pid "${RUN_DIR}/address" "${RUN_DIR}/port" \
    "${RUN_DIR}/internal_port"

  # moed writes the port it bound to `port` once it listens (also when --port is given).
  # Checkpoints are named inside ${RUN_DIR}/state/checkpoints (moed --checkpoint_root).
  # --state_dir also makes layers durable: a restart on the same run dir restores them from
  # ${RUN_DIR}/state/layers (server/README.md, failure model).
  local moed_cmd=("${MOED}" "--listen=127.0.0.1" "--port=${PORT:-0}" "--port_file=${RUN_DIR}/port"
                  "--internal_port_file=${RUN_DIR}/internal_port" "--state_dir=${RUN_DIR}/state" "--device=${DEVICE}")
  if [ "${MODE}" = embedded ]; then
    # moed appends each worker's output to worker-<rank>.log (a worker it restarts keeps its
    # history); with --device=cuda each worker picks GPU <rank> % visible GPUs itself.
    moed_cmd+=("--workers=${WORKERS}" "--worker_binary=${MOE_WORKER}"
               "--worker_log_dir=${RUN_DIR}")
  else
    # The internal plane's secret (moed and workers read the same 0600 file; embedded moed
    # makes its own and hands it to its workers itself).
    ( umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "${RUN_DIR}/cluster_secret" )
    moed_cmd+=("--expect_workers=${WORKERS}" "--cluster_secret_file=${RUN_DIR}/cluster_secret")
  fi
  moed_cmd+=("${EXTRA_MOED_FLAGS[@]+"${EXTRA_MOED_FLAGS[@]}"}")

  # Everything of this cluster runs under one supervisor shell started with setsid: it leads a
  # new process group (pgid = its pid) holding moed, the workers moed starts (embedded) or the
  # workers started here (join), so stop can find every process by that one id.
  # Join-mode workers need moed's internal port (--internal_listen): the supervisor waits for
  # the port file first (moed writes internal_port before port).
  local worker_cmds=() i device
  if [ "${MODE}" = join ]; then
    for i in $(seq 0 $(( WORKERS - 1 ))); do
      device="${DEVICE}"
      [ "${DEVICE}" = cuda ] && device="cuda:${i}"
      worker_cmds+=("$(printf '%q ' "${MOE_WORKER}" "--device=${device}" "--rank=${i}" \
                       "--cluster_secret_file=${RUN_DIR}/cluster_secret")")
    done
  fi
  {
    echo 'cd "$1"'
    echo "$(printf '%q ' "${moed_cmd[@]}") > moed.log 2>&1 &"
    echo 'echo $! > moed.pid'
    if [ "${MODE}" = join ]; then
      echo 'for _ in $(seq 1 600); do [ -s port ] && break; sleep 0.1; done'
      echo '[ -s port ] || exit 1'
      for i in "${!worker_cmds[@]}"; do
        echo "${worker_cmds[${i}]} --frontend=127.0.0.1:\$(cat internal_port) > worker-${i}.log 2>&1 &"
        echo "echo \$! > worker-${i}.pid"
      done
    fi
    echo 'wait'
  } > "${RUN_DIR}/supervisor.sh"
  rm -f "${RUN_DIR}/moed.pid"
  setsid bash "${RUN_DIR}/supervisor.sh" "${RUN_DIR}" > "${RUN_DIR}/supervisor.log" 2>&1 < /dev/null &
  local pgid=$!
  echo "${pgid}" > "${RUN_DIR}/pgid"
  ln -sfn "${RUN_DIR}" "${BASE_DIR}/last"
  # Ctrl-C or a kill while starting takes the half-started cluster down with it.
  trap 'stop_cluster "${RUN_DIR}"; exit 130' INT TERM
  local waited=0
  while [ ! -s "${RUN_DIR}/moed.pid" ] && [ "${waited}" -lt 50 ]; do sleep 0.1; waited=$(( waited + 1 )); done
  local moed_pid
  moed_pid="$(cat "${RUN_DIR}/moed.pid" 2>/dev/null || true)"
  if [ -z "${moed_pid}" ]; then
    stop_cluster "${RUN_DIR}"
    die "moed did not start (see ${RUN_DIR})"
  fi

  # Wait for the port, then for SERVING, failing early when moed exits.
  local deadline=$(( SECONDS + TIMEOUT )) address=""
  while true; do
    if ! pid_alive "${moed_pid}"; then
      log "moed exited during start-up; last lines of ${RUN_DIR}/moed.log:"
      tail -n 30 "${RUN_DIR}/moed.log" >&2 || true
      stop_cluster "${RUN_DIR}" >/dev/null 2>&1 || true
      exit 1
    fi
    if [ -z "${address}" ] && [ -s "${RUN_DIR}/port" ]; then
      address="127.0.0.1:$(cat "${RUN_DIR}/port")"
      log "moed pid ${moed_pid} on ${address}, ${WORKERS} ${DEVICE} worker(s), ${MODE} mode; logs in ${RUN_DIR}"
    fi
    if [ -n "${address}" ] &&
       "${MOECTL}" health --server="${address}" --deadline_ms=2000 >/dev/null 2>&1; then
      break
    fi
    if [ "${SECONDS}" -ge "${deadline}" ]; then
      log "not SERVING after ${TIMEOUT}s; last lines of ${RUN_DIR}/moed.log:"
      tail -n 30 "${RUN_DIR}/moed.log" >&2 || true
      stop_cluster "${RUN_DIR}"
      exit 1
    fi
    sleep 0.2
  done
  trap - INT TERM
  echo "${address}" > "${RUN_DIR}/address"
  # stop/status --port=P find the run directory through BASE_DIR/<port>.
  [ "${RUN_DIR}" = "${BASE_DIR}/${address##*:}" ] || ln -sfn "${RUN_DIR}" "${BASE_DIR}/${address##*:}"
  log "SERVING on ${address}"
  echo "${address}"
}

cmd_status() {
  local dir pgid
  dir="$(resolve_run_dir)"
  echo "run dir: ${dir}"
  if [ ! -f "${dir}/pgid" ] || ! group_alive "$(cat "${dir}/pgid")"; then
    echo "not running"
    exit 3
  fi
  pgid="$(cat "${dir}/pgid")"
  echo "processes:"
  ps -o pid=,args= -g "${pgid}" | sed 's/^/  /' || true
  local address
  address="$(cat "${dir}/address" 2>/dev/null || echo "127.0.0.1:$(cat "${dir}/port" 2>/dev/null)")"
  "${MOECTL}" status --server="${address}" --deadline_ms=5000 || exit 1
  "${MOECTL}" health --server="${address}" --deadline_ms=5000 >/dev/null 2>&1 || exit 1
}

cmd_stop() {
  stop_cluster "$(resolve_run_dir)"
}

case "${COMMAND}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  -h|--help|help) usage ;;
  *) die "unknown command '${COMMAND}' (start, stop, status)" ;;
esac
