#!/usr/bin/env bash
# What "every acknowledged step durable" costs (moed --durable_every_steps=1), and what a
# graceful stop (SIGTERM) costs with one changed layer. docs/PERFORMANCE.md, "Durability" ("Every
# step"; server/README.md, "Durability contract".
#
#   bazel build //server:moed //server:moe-worker //client:moectl
#   bench/durable_step_cost.sh [STEPS] [HIDDEN] [FFN] [EXPERTS]     # defaults 5 512 2048 8
#
# For --durable_every_steps=0 (no automatic checkpoint) and =1: an embedded moed with 2 CPU
# workers on a fresh --state_dir, one layer (top-2, AdamW: weights + m + v on disk), STEPS
# `moectl apply-optimizer` calls timed one by one (each includes moectl's own start, the same
# in both runs), then SIGTERM and the time until moed exited. Prints one line per run and the
# durable write times from moed's log.
set -euo pipefail
STEPS="${1:-5}" HIDDEN="${2:-512}" FFN="${3:-2048}" EXPERTS="${4:-8}"
BIN="$(cd "$(dirname "$0")/.." && pwd)/bazel-bin"
MOECTL="${BIN}/client/moectl"
ms() { echo $(( $(date +%s%N) / 1000000 )); }

for every in 0 1; do
  dir="$(mktemp -d /tmp/durable_step_cost.XXXXXX)"
  "${BIN}/server/moed" --workers=2 --device=cpu --port=0 --port_file="${dir}/port" \
    --metrics_listen=off --state_dir="${dir}/state" --durable_every_steps="${every}" \
    --durable_every_s=0 2> "${dir}/moed.log" &
  pid=$!
  while [ ! -s "${dir}/port" ]; do sleep 0.05; done
  server="--server=127.0.0.1:$(cat "${dir}/port")"
  "${MOECTL}" "${server}" health --wait_ms=60000 > /dev/null
  "${MOECTL}" "${server}" create-layer --layer=l --hidden="${HIDDEN}" --ffn="${FFN}" \
    --experts="${EXPERTS}" --top_k=2 > /dev/null
  times=()
  for _ in $(seq "${STEPS}"); do
    start=$(ms)
    "${MOECTL}" "${server}" --deadline_ms=120000 apply-optimizer --layer=l --optimizer=adamw \
      --lr=1e-4 > /dev/null
    times+=($(( $(ms) - start )))
  done
  start=$(ms)
  kill -TERM "${pid}"
  wait "${pid}" && status=0 || status=$?
  stop_ms=$(( $(ms) - start ))
  total=0
  for t in "${times[@]}"; do total=$(( total + t )); done
  on_disk="$(du -sm "${dir}/state/layers" | cut -f1)"
  echo "durable_every_steps=${every}: apply-optimizer ms ${times[*]} (mean $(( total / STEPS ))); SIGTERM -> exit ${stop_ms} ms (status ${status}); state dir ${on_disk} MB"
  grep -o "durable at optimizer step [0-9]* ([^)]*)" "${dir}/moed.log" | sed 's/^/  /' || true
  grep "moed: stop:" "${dir}/moed.log" | sed 's/^/  /'
  rm -rf "${dir}"
done
