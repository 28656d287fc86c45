#!/usr/bin/env bash
# The README's main command: build, start a local cluster (moed + 2 CPU workers), run one
# forward and backward step through the service and check it against the engine run
# in-process (`moectl smoke`), run a short benchmark (`moectl bench`), print a summary and
# stop the cluster (also on failure or Ctrl-C).
#
#   deploy/local/demo.sh [--workers=N] [--tokens=T] [--no_build]
#
# Exit status: 0 when the smoke check passes, 1 otherwise.
set -euo pipefail

readonly REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${REPO_ROOT}"

WORKERS=2
TOKENS=64
BUILD=1
for arg in "$@"; do
  case "${arg}" in
    --workers=*) WORKERS="${arg#*=}" ;;
    --tokens=*) TOKENS="${arg#*=}" ;;
    --no_build) BUILD=0 ;;
    -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "demo.sh: unknown argument '${arg}' (see --help)" >&2; exit 2 ;;
  esac
done

section() { printf '\n==== %s ====\n' "$*"; }

if [ "${BUILD}" = 1 ]; then
  section "build (bazel build //server:moed //server:moe-worker //client:moectl)"
  bazel build //server:moed //server:moe-worker //client:moectl
fi
BIN="$(bazel info bazel-bin 2>/dev/null || echo "${REPO_ROOT}/bazel-bin")"
export MOED="${MOED:-${BIN}/server/moed}"
export MOE_WORKER="${MOE_WORKER:-${BIN}/server/moe-worker}"
export MOECTL="${MOECTL:-${BIN}/client/moectl}"

section "start a local cluster: moed + ${WORKERS} CPU workers"
RUN_DIR="$(mktemp -d /tmp/moed-demo.XXXXXX)"
stop_cluster() {
  section "stop the cluster"
  deploy/local/cluster.sh stop --run_dir="${RUN_DIR}" || true
  echo "logs kept in ${RUN_DIR}"
}
trap stop_cluster EXIT
trap 'exit 130' INT TERM
ADDRESS="$(deploy/local/cluster.sh start --workers="${WORKERS}" --device=cpu --run_dir="${RUN_DIR}")"
"${MOECTL}" status --server="${ADDRESS}"

# A small layer with every loss on, so that out, aux and z-loss are all exercised.
LAYER_FLAGS=(--hidden=64 --ffn=128 --experts=8 --top_k=2 --aux_loss_coeff=0.01
             --z_loss_coeff=0.001 --seed=7)

section "smoke: forward + backward through the service vs the engine in-process"
set +e
"${MOECTL}" smoke --server="${ADDRESS}" --tokens="${TOKENS}" "${LAYER_FLAGS[@]}" \
  | tee "${RUN_DIR}/smoke.txt"
SMOKE_STATUS=${PIPESTATUS[0]}
set -e

section "bench: 20 steps of forward and of forward+backward"
BENCH_JSON="$("${MOECTL}" bench --server="${ADDRESS}" --tokens=256 --steps=20 --warmup=2 \
  "${LAYER_FLAGS[@]}")"
echo "${BENCH_JSON}" | tee "${RUN_DIR}/bench.json"

# Numbers out of bench's one-line JSON: "steps_per_s" and "p50"/"p99" appear first for
# forward, then for forward_backward.
field() { echo "${BENCH_JSON}" | grep -o "\"$1\": *[0-9.e+-]*" | sed -n "$2p" | sed 's/.*: *//'; }

section "summary"
echo "cluster   ${ADDRESS}: moed + ${WORKERS} CPU workers (logs in ${RUN_DIR})"
grep -E '^  config' "${RUN_DIR}/smoke.txt" | sed 's/^  config  /layer     /' || true
grep -E '^  input' "${RUN_DIR}/smoke.txt" | sed 's/^  input   /step      /' || true
grep -E '^  (check|out|aux_loss|z_loss|tokens_per_expert|d_x|grad) ' "${RUN_DIR}/smoke.txt" || true
printf 'bench     forward: %s steps/s (p50 %s ms, p99 %s ms); forward+backward: %s steps/s (p50 %s ms, p99 %s ms); 256 tokens\n' \
  "$(field steps_per_s 1)" "$(field p50 1)" "$(field p99 1)" \
  "$(field steps_per_s 2)" "$(field p50 2)" "$(field p99 2)"
grep -E '^verdict' "${RUN_DIR}/smoke.txt" || echo "verdict: FAIL (smoke did not finish)"
exit $(( SMOKE_STATUS == 0 ? 0 : 1 ))
