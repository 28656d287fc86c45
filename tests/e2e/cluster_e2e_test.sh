#!/usr/bin/env bash
# End to end through deploy/local/cluster.sh: a 2-worker CPU cluster, driven only with moectl
# as a user would. Checks: the cluster comes up SERVING with 2 workers; layers are created,
# listed and deleted; forward/backward work through .npy files; bad requests come back with
# their gRPC codes (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION);
# `moectl bench` runs with one and with 3 callers at once; `moectl smoke` passes; a checkpoint round-trips trained weights bit for bit; stop leaves no
# process behind.
#
# Usage (from Bazel): cluster_e2e_test.sh CLUSTER_SH MOED MOE_WORKER MOECTL [--mode=join]
set -euo pipefail

CLUSTER_SH="$(readlink -f "$1")"
export MOED="$(readlink -f "$2")"
export MOE_WORKER="$(readlink -f "$3")"
MOECTL="$(readlink -f "$4")"
export MOECTL
MODE="${5:---mode=embedded}"

TMP="${TEST_TMPDIR:-$(mktemp -d)}"
export MOED_LOCAL_BASE="${TMP}/base"
RUN_DIR="${TMP}/run"
FAILURES=0

fail() { echo "FAIL: $*" >&2; FAILURES=$(( FAILURES + 1 )); }
pass() { echo "ok: $*"; }

dump_logs() {
  for f in "${RUN_DIR}"/*.log; do
    [ -f "${f}" ] || continue
    echo "---- ${f} (last 40 lines)" >&2
    tail -n 40 "${f}" >&2
  done
}

cleanup() {
  local status=$?
  if [ -f "${RUN_DIR}/pgid" ]; then
    "${CLUSTER_SH}" stop --run_dir="${RUN_DIR}" --grace=5 || true
  fi
  [ "${status}" -eq 0 ] && [ "${FAILURES}" -eq 0 ] || dump_logs
}
trap cleanup EXIT

# expect_code CODE DESCRIPTION -- moectl args...: the command must fail with CODE on stderr.
expect_code() {
  local code="$1" what="$2"
  shift 3
  local err rc=0
  err="$("${MOECTL}" "$@" --server="${ADDRESS}" 2>&1 >/dev/null)" || rc=$?
  if [ "${rc}" -ne 1 ] || ! grep -q ": ${code}: " <<< "${err}"; then
    fail "${what}: wanted ${code} (exit 1), got exit ${rc}: ${err}"
  else
    pass "${what} -> ${code}"
  fi
}

ctl() { "${MOECTL}" "$@" --server="${ADDRESS}"; }

# JSON field of a one-line moectl answer, e.g. json_field step_id '{"step_id": 3}'.
# Quoted values may contain commas ("[16, 32]"); numbers end at the next ',' or '}'.
json_field() {
  { grep -o "\"$1\": *\"[^\"]*\"" <<< "$2" || grep -o "\"$1\": *[^,}]*" <<< "$2"; } |
    head -n 1 | sed 's/^[^:]*: *//; s/"//g'
}

# ---- start -----------------------------------------------------------------------------------
ADDRESS="$("${CLUSTER_SH}" start --workers=2 --device=cpu --run_dir="${RUN_DIR}" --timeout=60 \
  "${MODE}")"
[[ "${ADDRESS}" =~ ^127\.0\.0\.1:[0-9]+$ ]] || { fail "start printed '${ADDRESS}'"; exit 1; }
pass "cluster SERVING on ${ADDRESS}"
ctl health > /dev/null && pass "health SERVING" || fail "health"
[ "$(ctl health --service=liveness)" = "SERVING" ] && pass "health --service=liveness" ||
  fail "health --service=liveness"
# Each worker answers grpc.health.v1 on its own port: set up, so SERVING.
for WORKER in $(ctl status | grep -o "127\.0\.0\.1:[0-9]*" | grep -v "^${ADDRESS}$"); do
  [ "$("${MOECTL}" health --server="${WORKER}")" = "SERVING" ] &&
    pass "worker ${WORKER} health SERVING" || fail "worker ${WORKER} health"
done

STATUS="$(ctl status)"
grep -q "^workers: 2$" <<< "${STATUS}" || fail "status does not list 2 workers: ${STATUS}"
[ "$(grep -c "alive" <<< "${STATUS}")" -eq 2 ] || fail "status: not 2 live workers: ${STATUS}"
grep -q "^serving: yes" <<< "${STATUS}" && pass "status lists 2 live workers" ||
  fail "status not serving: ${STATUS}"
WORKER_PIDS="$(ctl status --json | grep -o '"pid": *"*[0-9]*' | grep -o '[0-9]*$' || true)"
[ "$(wc -w <<< "${WORKER_PIDS}")" -eq 2 ] || fail "status --json: worker pids '${WORKER_PIDS}'"
"${CLUSTER_SH}" status --run_dir="${RUN_DIR}" > /dev/null && pass "cluster.sh status" ||
  fail "cluster.sh status"

# ---- layers ----------------------------------------------------------------------------------
ctl create-layer --layer=e2e --hidden=32 --ffn=64 --experts=8 --top_k=2 --seed=3 > /dev/null &&
  pass "create-layer e2e" || fail "create-layer e2e"
ctl create-layer --layer=wide --hidden=48 --ffn=32 --experts=4 --top_k=1 > /dev/null ||
  fail "create-layer wide"
expect_code ALREADY_EXISTS "duplicate layer" -- create-layer --layer=e2e
expect_code INVALID_ARGUMENT "top_k > experts" -- create-layer --layer=bad --experts=4 --top_k=8
expect_code INVALID_ARGUMENT "experts not a multiple of workers" -- \
  create-layer --layer=bad --experts=3 --top_k=1
expect_code INVALID_ARGUMENT "expert bias with softmax" -- create-layer --layer=bad --expert_bias
LIST="$(ctl list-layers)"
grep -q "^layers: 2$" <<< "${LIST}" && grep -q "  e2e  " <<< "${LIST}" &&
  pass "list-layers" || fail "list-layers: ${LIST}"

# ---- steps -----------------------------------------------------------------------------------
FWD="$(ctl forward --layer=e2e --tokens=16 --keep_for_backward --output="${TMP}/out.npy")"
STEP="$(json_field step_id "${FWD}")"
[ -n "${STEP}" ] && [ "${STEP}" != 0 ] && pass "forward (step ${STEP})" || fail "forward: ${FWD}"
[ "$(json_field out_shape "${FWD}")" = "[16, 32]" ] || fail "forward out shape: ${FWD}"
[ -s "${TMP}/out.npy" ] || fail "forward wrote no out.npy"
BWD="$(ctl backward --layer=e2e --step_id="${STEP}" --tokens=16 --output="${TMP}/dx.npy")"
[ "$(json_field d_x_shape "${BWD}")" = "[16, 32]" ] && [ -s "${TMP}/dx.npy" ] &&
  pass "backward" || fail "backward: ${BWD}"
expect_code FAILED_PRECONDITION "backward twice" -- \
  backward --layer=e2e --step_id="${STEP}" --tokens=16
expect_code FAILED_PRECONDITION "backward of a step never issued" -- \
  backward --layer=e2e --step_id=987654321 --tokens=16
# An input of the wrong hidden size: a [16, 48] output of the wide layer fed to e2e (H=32).
ctl forward --layer=wide --tokens=16 --output="${TMP}/wide.npy" > /dev/null || fail "forward wide"
expect_code INVALID_ARGUMENT "wrong hidden size" -- forward --layer=e2e --input="${TMP}/wide.npy"
ctl forward --layer=e2e --input="${TMP}/out.npy" > /dev/null && pass "forward from .npy" ||
  fail "forward --input=out.npy"
expect_code NOT_FOUND "forward on an unknown layer" -- forward --layer=nope --input="${TMP}/out.npy"
expect_code NOT_FOUND "delete an unknown layer" -- delete-layer --layer=nope
ctl delete-layer --layer=wide > /dev/null && pass "delete-layer" || fail "delete-layer wide"
expect_code NOT_FOUND "forward on a deleted layer" -- forward --layer=wide --tokens=4

# ---- bench: one caller, then 3 callers at once (their outputs equal the one caller's) ------------
BENCH="$(ctl bench --tokens=64 --steps=3 --warmup=1 --concurrency=3 --progress=off \
  --hidden=32 --ffn=48 --experts=4 --top_k=2)" && rc=0 || rc=$?
if [ "${rc}" -eq 0 ] && grep -q '"output_buffers": *"reused"' <<< "${BENCH}" &&
   grep -q '"concurrency": *3' <<< "${BENCH}" &&
   grep -q '"identical_to_one_caller": *true' <<< "${BENCH}"; then
  pass "bench --concurrency=3"
else
  fail "bench --concurrency=3 (exit ${rc}): ${BENCH}"
fi
ctl bench --concurrency=0 > /dev/null 2>&1 && rc=0 || rc=$?
[ "${rc}" -eq 2 ] && pass "bench --concurrency=0 -> usage error" ||
  fail "bench --concurrency=0: exit ${rc}, wanted 2"

# ---- smoke: service vs in-process engine -----------------------------------------------------
SMOKE="$(ctl smoke --tokens=24 --aux_loss_coeff=0.01 --z_loss_coeff=0.001)" && rc=0 || rc=$?
if [ "${rc}" -eq 0 ] && grep -q "^verdict: PASS" <<< "${SMOKE}"; then
  pass "smoke PASS"
else
  fail "smoke (exit ${rc}): ${SMOKE}"
fi

# ---- checkpoint round trip -------------------------------------------------------------------
train_step() {
  local f step
  f="$(ctl forward --layer=e2e --tokens=16 --input_seed="$1" --keep_for_backward)"
  step="$(json_field step_id "${f}")"
  ctl backward --layer=e2e --step_id="${step}" --tokens=16 --input_seed="$1" > /dev/null
  ctl apply-optimizer --layer=e2e --optimizer=sgd --lr=0.5 > /dev/null
}
probe() { ctl forward --layer=e2e --tokens=16 --input_seed=99 --output="$1" > /dev/null; }
probe "${TMP}/before.npy"
train_step 1 || fail "train step 1"
probe "${TMP}/trained.npy"
cmp -s "${TMP}/before.npy" "${TMP}/trained.npy" && fail "an SGD step did not change the output"
ctl checkpoint save --layer=e2e --dir=e2e/ckpt > /dev/null || fail "checkpoint save"
train_step 2 || fail "train step 2"
probe "${TMP}/trained_more.npy"
cmp -s "${TMP}/trained.npy" "${TMP}/trained_more.npy" && fail "second SGD step changed nothing"
ctl checkpoint load --layer=e2e --dir=e2e/ckpt > /dev/null || fail "checkpoint load"
probe "${TMP}/restored.npy"
cmp -s "${TMP}/trained.npy" "${TMP}/restored.npy" &&
  pass "checkpoint restores the trained weights bit for bit" ||
  fail "checkpoint load did not restore the saved weights"
expect_code NOT_FOUND "checkpoint of an unknown layer" -- checkpoint save --layer=nope \
  --dir=e2e/ckpt2

# ---- stop ------------------------------------------------------------------------------------
PGID="$(cat "${RUN_DIR}/pgid")"
PORT="${ADDRESS##*:}"
"${CLUSTER_SH}" stop --run_dir="${RUN_DIR}" --grace=10 || fail "cluster.sh stop"
if kill -0 -- "-${PGID}" 2>/dev/null; then fail "processes of group ${PGID} survived stop"; fi
for pid in ${WORKER_PIDS}; do
  if kill -0 "${pid}" 2>/dev/null; then fail "worker pid ${pid} survived stop"; fi
done
if ss -Htln "sport = :${PORT}" | grep -q .; then fail "port ${PORT} still listening"; fi
"${CLUSTER_SH}" status --run_dir="${RUN_DIR}" > /dev/null 2>&1 && rc=0 || rc=$?
[ "${rc}" -eq 3 ] && pass "stopped cleanly, nothing left" || fail "status after stop: exit ${rc}"

if [ "${FAILURES}" -ne 0 ]; then
  echo "${FAILURES} check(s) failed" >&2
  exit 1
fi
echo "all checks passed"
