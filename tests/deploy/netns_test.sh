#!/usr/bin/env bash
# Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge in a
# switch namespace, one namespace per host with its own 10.42.0.x address and nothing but the
# bridge between them (no route through loopback). moed runs in one (public and internal plane
# on its address, bearer tokens, the internal plane over mutual TLS with the cluster secret,
# --state_dir), two external
# `moe-worker --frontend=...` in two others (each on its own address; --socket_ifname=eth0, as
# deploy/k8s: NCCL_SOCKET_IFNAME and Gloo's interface), and moectl in a fourth:
#   0. the internal plane speaks TLS only: a plaintext call to moed's internal port fails;
#   1. smoke across hosts (forward + backward against the local engine, max rel err <= 1e-6),
#      then an optimizer step;
#   2. no same-host fast path across hosts: the remote client asking for shared memory is
#      PERMISSION_DENIED, a client on moed's host naming shared memory for workers on other
#      hosts FAILED_PRECONDITION, and moed creates no relay objects in /dev/shm (which these
#      namespaces share) for workers that are not on its host;
#   3. a durable restart: moed killed (SIGKILL) and started again, the workers rejoin, the
#      layer is back with its trained weights, bit for bit;
#   4. a cut link: an acknowledged (durable) AdamW step, then worker 2's veth set down during a
#      forward: the caller gets an error within --step_timeout_ms + 1 s (the deadline; no ping
#      of the silent worker on the caller's path), moed stays up NOT_SERVING and waits for the
#      worker (server/README.md, failure model); once the link is back the worker rejoins, the
#      pool re-forms with the same processes, smoke passes and the layer has the step
#      acknowledged before the cut, bit for bit.
# Everything the test creates (namespaces, veths, bridge, processes) lives in its own
# namespaces and is removed on exit, failed or not. No traffic leaves them.
#
# Needs root and `ip netns`; prints "SKIPPED: ..." and exits 0 without them.
# Usage (from Bazel): netns_test.sh MOED MOE_WORKER MOECTL
set -uo pipefail

MOED="$(readlink -f "$1")"
MOE_WORKER="$(readlink -f "$2")"
MOECTL="$(readlink -f "$3")"

skip() { echo "SKIPPED: $*"; exit 0; }
[ "$(id -u)" -eq 0 ] || skip "needs root (network namespaces); running as uid $(id -u)"
command -v ip > /dev/null || skip "needs iproute2's ip (ip netns)"
PROBE="mhprobe$$"
ip netns add "${PROBE}" 2> /dev/null || skip "ip netns add fails here (no CAP_SYS_ADMIN/NET_ADMIN?)"
ip netns del "${PROBE}"

TMP="${TEST_TMPDIR:-$(mktemp -d)}/netns"
rm -rf "${TMP}" && mkdir -p "${TMP}/state" "${TMP}/ckpt"
FAILURES=0
START_S=${SECONDS}
fail() { echo "FAIL: $*" >&2; FAILURES=$(( FAILURES + 1 )); }
pass() { echo "ok: $*"; }
die() { fail "$*"; exit 1; }

# ---- the hosts ---------------------------------------------------------------------------------
TAG="$$"
SW="mhsw${TAG}"        # the switch: a bridge, one veth per host
NS_MOED="mhmoed${TAG}"; IP_MOED=10.42.0.1
NS_W1="mhw1${TAG}";     IP_W1=10.42.0.2
NS_W2="mhw2${TAG}";     IP_W2=10.42.0.3
NS_CL="mhcl${TAG}";     IP_CL=10.42.0.4
HOSTS=("${NS_MOED}" "${NS_W1}" "${NS_W2}" "${NS_CL}")
PIDS=()

dump_logs() {
  for f in "${TMP}"/*.log; do
    [ -f "${f}" ] || continue
    echo "---- ${f} (last 30 lines)" >&2
    tail -n 30 "${f}" >&2
  done
}

cleanup() {
  local status=$?
  for pid in "${PIDS[@]}"; do kill -KILL "${pid}" 2> /dev/null; done
  for ns in "${HOSTS[@]}" "${SW}"; do
    # Whatever still runs inside our namespaces was started by this test.
    for pid in $(ip netns pids "${ns}" 2> /dev/null); do kill -KILL "${pid}" 2> /dev/null; done
  done
  for pid in "${PIDS[@]}"; do wait "${pid}" 2> /dev/null; done
  for ns in "${HOSTS[@]}" "${SW}"; do ip netns del "${ns}" 2> /dev/null; done  # veths go too
  [ "${status}" -eq 0 ] && [ "${FAILURES}" -eq 0 ] || dump_logs
  local left
  left="$(ip netns list | grep -c "${TAG}" || true)"
  [ "${left}" -eq 0 ] || echo "FAIL: ${left} namespace(s) left behind" >&2
}
trap cleanup EXIT
trap 'exit 1' INT TERM

ip netns add "${SW}" || die "ip netns add ${SW}"
ip -n "${SW}" link add br0 type bridge && ip -n "${SW}" link set br0 up || die "bridge"
N=0
for ns in "${HOSTS[@]}"; do
  N=$(( N + 1 ))
  ip netns add "${ns}" || die "ip netns add ${ns}"
  # Each host sees one interface, eth0, as a pod or a machine would.
  ip -n "${SW}" link add "p${N}" type veth peer name eth0 netns "${ns}" || die "veth p${N}"
  ip -n "${SW}" link set "p${N}" master br0 up
  ip -n "${ns}" link set lo up
  ip -n "${ns}" addr add "10.42.0.${N}/24" dev eth0
  ip -n "${ns}" link set eth0 up
done
pass "4 hosts: ${IP_MOED} (moed) ${IP_W1} ${IP_W2} (workers) ${IP_CL} (client)"

# ---- secrets -----------------------------------------------------------------------------------
openssl rand -hex 32 > "${TMP}/secret" && chmod 600 "${TMP}/secret"
TOKEN="$(openssl rand -hex 16)"
printf '%s\n' "${TOKEN}" > "${TMP}/token"
printf '%s admin netns-test\n' "$(printf '%s' "${TOKEN}" | sha256sum | cut -d' ' -f1)" \
  > "${TMP}/tokens"
# The internal plane's certificates as docs/SECURITY.md makes them: a CA and one member
# certificate for the name moe-internal, presented by moed and every worker (workers are
# dialled by address, so every member checks peers against that name).
( cd "${TMP}" && ec='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes' &&
  openssl req -x509 ${ec} -keyout ca.key -out ca.pem -days 1 -subj /CN=moe-internal-ca &&
  openssl req ${ec} -keyout member.key -out member.csr -subj /CN=moe-internal &&
  printf 'subjectAltName=DNS:moe-internal' > san.ext &&
  openssl x509 -req -in member.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
    -extfile san.ext -out member.pem ) > "${TMP}/openssl.log" 2>&1 || die "openssl: $(cat "${TMP}/openssl.log")"

# ---- processes ---------------------------------------------------------------------------------
STEP_TIMEOUT_MS=2000
MOED_PID=""
start_moed() {
  # --listen=0.0.0.0 as in deploy/k8s/common/frontend.yaml: remote clients on 10.42.0.1, and
  # a client on moed's own host on 127.0.0.1 (allowed shared memory, as far as moed goes).
  ip netns exec "${NS_MOED}" "${MOED}" --listen=0.0.0.0 --port=50051 \
    --internal_listen="${IP_MOED}:50053" --expect_workers=2 \
    --cluster_secret_file="${TMP}/secret" --tokens_file="${TMP}/tokens" \
    --internal_tls_cert_file="${TMP}/member.pem" --internal_tls_key_file="${TMP}/member.key" \
    --internal_tls_ca_file="${TMP}/ca.pem" --internal_tls_server_name=moe-internal \
    --state_dir="${TMP}/state" --durable_every_steps=1 --checkpoint_root="${TMP}/ckpt" \
    --metrics_listen="${IP_MOED}:9090" --allow_client_shm --step_timeout_ms="${STEP_TIMEOUT_MS}" \
    --ping_timeout_ms=500 \
    >> "${TMP}/moed.log" 2>&1 &
  MOED_PID=$!
  PIDS+=("${MOED_PID}")
}
# start_worker NS IP RANK [FLAG...]
start_worker() {
  local ns="$1" addr="$2" rank="$3"
  shift 3
  ip netns exec "${ns}" "${MOE_WORKER}" --frontend="${IP_MOED}:50053" \
    --cluster_secret_file="${TMP}/secret" --device=cpu --listen="${addr}:50052" \
    --internal_tls_cert_file="${TMP}/member.pem" --internal_tls_key_file="${TMP}/member.key" \
    --internal_tls_ca_file="${TMP}/ca.pem" --internal_tls_server_name=moe-internal \
    --advertise_host="${addr}" --rank="${rank}" --rejoin_after_s=1 --socket_ifname=eth0 "$@" \
    >> "${TMP}/worker${rank}.log" 2>&1 &
  PIDS+=($!)
}
# The client's namespace; every moectl call goes from there to moed's address.
ctl() {
  ip netns exec "${NS_CL}" "${MOECTL}" --server="${IP_MOED}:50051" --token_file="${TMP}/token" "$@"
}

start_moed
start_worker "${NS_W1}" "${IP_W1}" 0
start_worker "${NS_W2}" "${IP_W2}" 1
ctl health --wait_ms=60000 > /dev/null || die "cluster not SERVING within 60 s"
pass "cluster SERVING across namespaces after $(( SECONDS - START_S )) s"
STATUS="$(ctl status)"
grep -q "${IP_W1}:50052" <<< "${STATUS}" && grep -q "${IP_W2}:50052" <<< "${STATUS}" &&
  pass "status lists the workers at their own addresses" || fail "status: ${STATUS}"
grep -q "socket_ifname=eth0: NCCL_SOCKET_IFNAME=eth0, Gloo on eth0" "${TMP}/worker0.log" &&
  grep -q "socket_ifname=eth0: NCCL_SOCKET_IFNAME=eth0, Gloo on eth0" "${TMP}/worker1.log" &&
  pass "--socket_ifname=eth0: NCCL_SOCKET_IFNAME and Gloo's interface on both workers" ||
  fail "--socket_ifname: $(grep -h socket_ifname "${TMP}"/worker*.log)"

# ---- 0. the internal plane is TLS ------------------------------------------------------------------
# The workers joined over mutual TLS (they are SERVING above); plaintext to moed's internal
# port, from another host, gets no answer (grpc.health.v1 is served there too, so a plaintext
# port would answer it).
internal_health() {
  ip netns exec "${NS_CL}" "${MOECTL}" --server="${IP_MOED}:50053" --deadline_ms=3000 "$@" health 2>&1
}
ERR="$(internal_health)" && rc=0 || rc=$?
[ "${rc}" -ne 0 ] && grep -q "UNAVAILABLE" <<< "${ERR}" &&
  pass "internal plane: plaintext gets no answer" ||
  fail "internal plane answered plaintext (exit ${rc}): ${ERR}"
# With the members' certificate the handshake succeeds (whatever health then says).
ERR="$(internal_health --tls_ca_file="${TMP}/ca.pem" --tls_cert_file="${TMP}/member.pem" \
  --tls_key_file="${TMP}/member.key" --tls_server_name=moe-internal)" && rc=0 || rc=$?
[ "${rc}" -eq 0 ] || ! grep -q "UNAVAILABLE" <<< "${ERR}" &&
  pass "internal plane: mutual TLS with the members' certificate answers" ||
  fail "internal plane: no answer over mutual TLS (exit ${rc}): ${ERR}"

# ---- 1. smoke across hosts ---------------------------------------------------------------------
SMOKE="$(ctl smoke --tokens=48 --hidden=32 --ffn=64 --experts=8 --top_k=2 \
  --aux_loss_coeff=0.01 --z_loss_coeff=0.001 --json)" && rc=0 || rc=$?
WORST="$(grep -o '"max_rel_error": *[^,}]*' <<< "${SMOKE}" | tail -n 1 | sed 's/.*: *//')"
if [ "${rc}" -eq 0 ] && grep -q '"verdict": *"PASS"' <<< "${SMOKE}" &&
   awk -v e="${WORST}" 'BEGIN { exit !(e != "" && e <= 1e-6) }'; then
  pass "smoke across hosts PASS (max rel error ${WORST})"
else
  fail "smoke across hosts (exit ${rc}): ${SMOKE}"
fi

json_field() { grep -o "\"$1\": *[^,}]*" <<< "$2" | head -n 1 | sed 's/^[^:]*: *//; s/"//g'; }
ctl create-layer --layer=durable --hidden=32 --ffn=64 --experts=8 --top_k=2 --seed=5 \
  > /dev/null || fail "create-layer durable"
F="$(ctl forward --layer=durable --tokens=16 --input_seed=1 --keep_for_backward)"
ctl backward --layer=durable --step_id="$(json_field step_id "${F}")" --tokens=16 \
  --input_seed=1 > /dev/null || fail "backward"
ctl apply-optimizer --layer=durable --optimizer=adamw --lr=0.01 > /dev/null &&
  pass "forward + backward + AdamW step across hosts" || fail "apply-optimizer"
ctl forward --layer=durable --tokens=16 --input_seed=9 --output="${TMP}/trained.npy" \
  > /dev/null || fail "probe forward"

# ---- 2. no same-host fast path across hosts ----------------------------------------------------
ERR="$(ctl bench --shm --steps=1 --warmup=0 --tokens=8 --hidden=32 --ffn=32 --experts=2 \
  --top_k=1 --progress=off 2>&1)" && rc=0 || rc=$?
if [ "${rc}" -ne 0 ] && grep -q "PERMISSION_DENIED" <<< "${ERR}"; then
  pass "shared memory from another host: PERMISSION_DENIED"
else
  fail "shared memory from another host: wanted PERMISSION_DENIED, exit ${rc}: ${ERR}"
fi
# A client on moed's host may use shared memory, but these workers are on other hosts: it
# must not reach them (their /dev/shm is only the same one because namespaces share it here).
ERR="$(ip netns exec "${NS_MOED}" "${MOECTL}" --server=127.0.0.1:50051 --token_file="${TMP}/token" \
  bench --shm --steps=1 --warmup=0 --tokens=8 --hidden=32 --ffn=32 --experts=2 --top_k=1 \
  --progress=off 2>&1)" && rc=0 || rc=$?
if [ "${rc}" -ne 0 ] &&
   grep -q "FAILED_PRECONDITION: shared memory: the workers are not on" <<< "${ERR}"; then
  pass "shared memory from moed's host to workers on other hosts: FAILED_PRECONDITION"
else
  fail "shared memory to workers on other hosts: wanted FAILED_PRECONDITION, exit ${rc}: ${ERR}"
fi
RELAY="$(ls /dev/shm 2> /dev/null | grep -c "^moed-relay-${MOED_PID}-" || true)"
[ "${RELAY}" -eq 0 ] && pass "no relay objects in /dev/shm for workers on other hosts" ||
  fail "moed ${MOED_PID} made ${RELAY} relay object(s) for workers on other hosts"

# ---- 3. durable restart ------------------------------------------------------------------------
kill -KILL "${MOED_PID}"; wait "${MOED_PID}" 2> /dev/null
RESTART_S=${SECONDS}
start_moed
ctl health --wait_ms=60000 > /dev/null || die "restarted moed not SERVING within 60 s"
pass "moed restarted, workers rejoined in $(( SECONDS - RESTART_S )) s"
ctl forward --layer=durable --tokens=16 --input_seed=9 --output="${TMP}/restored.npy" \
  > /dev/null && cmp -s "${TMP}/trained.npy" "${TMP}/restored.npy" &&
  pass "durable layer back after the restart, output bit for bit" ||
  fail "durable layer after the restart: $(ctl get-layer --layer=durable 2>&1)"

# ---- 4. a cut link during a step ---------------------------------------------------------------
# First an acknowledged step on the durable layer (--durable_every_steps=1: on disk before its
# answer); after the cut and the recovery the layer must have it (server/README.md, durability
# contract: nothing acknowledged is lost).
F="$(ctl forward --layer=durable --tokens=16 --input_seed=2 --keep_for_backward)"
ctl backward --layer=durable --step_id="$(json_field step_id "${F}")" --tokens=16 \
  --input_seed=2 > /dev/null || fail "backward before the cut"
ACK="$(ctl apply-optimizer --layer=durable --optimizer=adamw --lr=0.01)" || fail "AdamW: ${ACK}"
ACK_STEP="$(sed -n 's/.*optimizer step \([0-9]*\) (durable: \([0-9]*\)).*/\1 \2/p' <<< "${ACK}")"
read -r ACK_STEP ACK_DURABLE <<< "${ACK_STEP}"
[ -n "${ACK_STEP}" ] && [ "${ACK_DURABLE:-0}" -ge "${ACK_STEP}" ] &&
  pass "AdamW step ${ACK_STEP} acknowledged, durable" || fail "step not durable: ${ACK}"
ctl forward --layer=durable --tokens=16 --input_seed=9 --output="${TMP}/acked.npy" \
  > /dev/null || fail "probe forward before the cut"
cmp -s "${TMP}/trained.npy" "${TMP}/acked.npy" && fail "the AdamW step changed no output"

ctl create-layer --layer=big --hidden=256 --ffn=1024 --experts=8 --top_k=2 > /dev/null ||
  fail "create-layer big"
# The cut comes once moed serves the forward (its metric moed_inflight_requests{method=
# "Forward"} is 1), so the step's deadline has begun and the cut falls inside it, however
# loaded the machine (a guess from timed forwards did not: under load they either ended
# before the cut or had not reached moed yet). Read over bash's /dev/tcp from the client's
# host, no process per poll, at most $1 s.
forward_in_flight() {
  ip netns exec "${NS_CL}" bash -c '
    end=$(( SECONDS + $1 ))
    while [ "${SECONDS}" -lt "${end}" ]; do
      exec 3<> "/dev/tcp/$2/9090" || { sleep 0.05; continue; }
      printf "GET /metrics HTTP/1.0\r\nHost: moed\r\n\r\n" >&3
      while IFS= read -r line <&3; do
        case "${line}" in
          moed_inflight_requests*\"Forward\"*)
            v="${line##* }"; v="${v%%.*}"; [ "${v}" -ge 1 ] 2> /dev/null && exit 0 ;;
        esac
      done
      exec 3<&-
    done
    exit 1' _ "$1" "${IP_MOED}"
}
# A forward of 4096 tokens (13 GFLOP) takes a few hundred ms on the workers, far more than the
# few ms from seeing it in flight to the cut (on a machine so loaded that it passes the step
# timeout uncut, its error comes by the deadline all the same); should one be over by the cut,
# the link is still up and the next attempt has twice the tokens.
TOKENS=4096
CUT=0
for attempt in 1 2 3; do
  # The client's own deadline well past the bound: a hang fails here, not at moectl's 60 s.
  ctl --deadline_ms=$(( STEP_TIMEOUT_MS + 5000 )) forward --layer=big --tokens="${TOKENS}" \
    --input_seed=3 > "${TMP}/cut.out" 2> "${TMP}/cut.err" &
  CALL=$!
  PIDS+=("${CALL}")
  if forward_in_flight 20 && kill -0 "${CALL}" 2> /dev/null; then
    CUT_NS=$(date +%s%N)
    ip -n "${SW}" link set p3 down   # worker 2's cable, in the middle of the forward
    CUT=1
    break
  fi
  wait "${CALL}"
  echo "attempt ${attempt}: the forward of ${TOKENS} tokens ended before the cut (exit $?)"
  TOKENS=$(( TOKENS * 2 ))
done
if [ "${CUT}" -eq 1 ]; then
  wait "${CALL}"; rc=$?
  ERR_MS=$(( ($(date +%s%N) - CUT_NS) / 1000000 ))
  if [ "${rc}" -ne 0 ] && grep -Eq "DEADLINE_EXCEEDED|UNAVAILABLE" "${TMP}/cut.err" &&
     [ "${ERR_MS}" -le $(( STEP_TIMEOUT_MS + 1000 )) ]; then
    pass "cut link: the caller's error ${ERR_MS} ms after the cut (step timeout \
${STEP_TIMEOUT_MS} ms, a forward of ${TOKENS} tokens): $(
      grep -Eo "(DEADLINE_EXCEEDED|UNAVAILABLE).*" "${TMP}/cut.err" | head -n 1 | cut -c1-100)"
  else
    fail "cut link: exit ${rc} ${ERR_MS} ms after the cut (${TOKENS} tokens): $(
      tail -n 3 "${TMP}/cut.err")"
  fi
  # server/README.md's failure model: the unreachable worker is dead after
  # --worker_dead_after_ms (3 s) of silence; moed stays up NOT_SERVING and waits for it (a
  # worker that rejoins takes its rank back). Asked until then, at most 10 s after the cut.
  HEALTH=""
  while [ $(( ($(date +%s%N) - CUT_NS) / 1000000 )) -lt 10000 ]; do
    HEALTH="$(ctl --deadline_ms=2000 health 2>&1)" && rc=0 || rc=$?
    [ "${rc}" -ne 0 ] && grep -q "NOT_SERVING" <<< "${HEALTH}" && break
    sleep 0.5
  done
  [ "${rc}" -ne 0 ] && grep -q "NOT_SERVING" <<< "${HEALTH}" &&
    pass "during the cut: moed up, health NOT_SERVING after $(( ($(date +%s%N) - CUT_NS) / 1000000 )) ms" ||
    fail "health during the cut: ${HEALTH}"
  ERR="$(ctl forward --layer=durable --tokens=16 --input_seed=9 2>&1)" && rc=0 || rc=$?
  [ "${rc}" -ne 0 ] && grep -q "UNAVAILABLE" <<< "${ERR}" &&
    pass "during the cut: a step is UNAVAILABLE at once" ||
    fail "a step during the cut (exit ${rc}): ${ERR}"
  ip -n "${SW}" link set p3 up
  UP_S=${SECONDS}
  # SERVING again within seconds. Until moed cancelled the other workers' Setup when one
  # failed, about 1 run in 4 took 60 s here: worker 2's first Gloo connect after the link came
  # back failed (No route to host: its neighbour entry for worker 1 had failed during the cut)
  # and worker 1's Setup then waited in the rendezvous for moed's whole setup timeout.
  ctl health --wait_ms=30000 > /dev/null ||
    fail "not SERVING within 30 s of the link coming back: $(ctl status 2>&1 | head -n 40)"
  SMOKE="$(ctl smoke --tokens=24 --hidden=32 --ffn=64 --experts=8 --top_k=2)" && rc=0 || rc=$?
  [ "${rc}" -eq 0 ] && grep -q "^verdict: PASS" <<< "${SMOKE}" &&
    pass "link back: serving again after $(( SECONDS - UP_S )) s, smoke PASS" ||
    fail "smoke after the link came back (exit ${rc}): ${SMOKE}"
  grep -q "rejoined as rank 1" "${TMP}/worker1.log" &&
    pass "worker 2 rejoined (same process)" || fail "worker 2 did not rejoin: $(tail -n 5 "${TMP}/worker1.log")"
  ctl forward --layer=durable --tokens=16 --input_seed=9 --output="${TMP}/after_cut.npy" \
    > /dev/null && cmp -s "${TMP}/acked.npy" "${TMP}/after_cut.npy" &&
    pass "the durable layer has the step acknowledged before the cut, bit for bit" ||
    fail "durable layer after the cut: $(ctl get-layer --layer=durable 2>&1)"
  LAYER="$(ctl get-layer --layer=durable 2>&1)"
  [ "$(json_field optimizer_step "${LAYER}")" = "${ACK_STEP}" ] &&
    ! grep -q '"weights_reset": *true' <<< "${LAYER}" &&
    pass "its optimizer step still ${ACK_STEP}, weights not reset" ||
    fail "optimizer step after the cut: ${LAYER}"
else
  fail "cut link: every forward ended before its cut (${TOKENS} tokens)"
fi

echo "elapsed: $(( SECONDS - START_S )) s"
if [ "${FAILURES}" -ne 0 ]; then
  echo "${FAILURES} check(s) failed" >&2
  exit 1
fi
echo "all checks passed"
