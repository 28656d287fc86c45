#!/bin/bash
# grpc_bandwidth.sh: the gRPC data path of a caller on another host (no shared memory, no CUDA
# IPC, no step channel: the tensors inline in the step, or in ForwardStream / BackwardStream
# pieces) under two or more builds in one run, as ratios (issue 37 §3). For each variant, path
# and round: bench/service_bench.sh with SHM=0, then one JSON line per shape and path with each
# variant's payload GB/s (fwd, fwd+bwd: moectl bench's payload_gb_per_s, the payload over the
# step's time less the engine's) and their ratios to the first variant's; then gRPC's own
# floor for the same bytes (grpc_loopback_bench: an echo over one connection).
#
#   bench/grpc_bandwidth.sh [--device=cpu|cuda] [--workers=N] [--dtype=fp32|bf16] [SHAPE...]
#   (defaults: cpu, 1 worker, fp32)
#   SHAPE = H,F,E,k,T (default 1024,16,2,1,4096: a 16 MiB fp32 x and a cheap engine)
# Environment: VARIANTS="LABEL:DIR ..." (DIR holds moed, moe-worker and moectl; an empty DIR:
# $PATH or bazel-bin; default "now:"), PATHS (default "unary stream"; unary: moectl's
# defaults, lanes included; stream: one connection and --max_message_bytes=
# $STREAM_MESSAGE_BYTES, default 4 MiB, so that every step is streamed),
# ROUNDS (default 2, alternating), MOECTL_FLAGS (e.g. --lanes=1), STEPS, WARMUP, OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-bench_out}/grpc_bandwidth
mkdir -p "$out"
args=(--device=cpu --workers=1 --dtype=fp32 "$@")  # later flags win
has_shape=0
for a in "$@"; do [[ $a == --* ]] || has_shape=1; done
[ $has_shape = 1 ] || args+=(1024,16,2,1,4096)
labels=()
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in ${VARIANTS:-now:}; do
    label=${v%%:*} dir=${v#*:}
    for p in ${PATHS:-unary stream}; do
      flags="--nostep_channel ${MOECTL_FLAGS:-}"  # as from another host
      [ "$p" = stream ] && flags="$flags --lanes=1 --max_message_bytes=${STREAM_MESSAGE_BYTES:-4194304}"
      echo "== round $r, $label ($p)" >&2
      PATH=${dir:+$(cd "$dir" && pwd):}$PATH OUT="$out" LABEL="${label}_${p}_$r" SHM=0 \
        MOECTL_FLAGS="$flags" STEPS=${STEPS:-10} WARMUP=${WARMUP:-2} \
        "$here/service_bench.sh" "${args[@]}" >/dev/null
      labels+=("${label}_${p}_$r")
    done
  done
done
loopback=$(command -v grpc_loopback_bench || echo bazel-bin/bench/grpc_loopback_bench)
python3 - "$out" "$loopback" "${VARIANTS:-now:}" "${PATHS:-unary stream}" "${ROUNDS:-2}" <<'PY'
import json, os, statistics, subprocess, sys
out, loopback, variants, paths, rounds = sys.argv[1:6]
variants = [v.split(":", 1)[0] for v in variants.split()]
rates = {}  # (shape, path) -> variant -> [(fwd, fwd+bwd) per round]
payload = {}
for r in range(1, int(rounds) + 1):
    for v in variants:
        for p in paths.split():
            name = os.path.join(out, "service_bench_%s_%s_%d.jsonl" % (v, p, r))
            for line in open(name) if os.path.exists(name) else []:
                if not line.strip():
                    continue
                d = json.loads(line)
                b = d["breakdown"]
                shape = "%s T=%d %s" % (d["config"].split(" score")[0], d["tokens"], d["datatype"])
                payload[shape] = b["forward"]["payload_bytes"]
                rates.setdefault((shape, p), {}).setdefault(v, []).append(
                    (b["forward"]["payload_gb_per_s"], b["forward_backward"]["payload_gb_per_s"]))
for (shape, p), by in sorted(rates.items()):
    med = {v: [round(statistics.median(x[i] for x in s), 3) for i in (0, 1)]
           for v, s in by.items()}
    base = med.get(variants[0])
    line = {"shape": shape, "path": p, "payload_bytes": payload[shape],
            "gb_per_s_fwd_fwdbwd": med, "rounds": by}
    if base:
        line["ratio_to_" + variants[0]] = {
            v: [round(m[i] / base[i], 3) if base[i] else None for i in (0, 1)]
            for v, m in med.items()}
    print(json.dumps(line))
if os.access(loopback, os.X_OK):
    for b in sorted(set(payload.values())):
        run = subprocess.run([loopback, "--bytes=%d" % (b // 2), "--iters=10", "--parts=1"],
                             capture_output=True, text=True)
        for l in run.stdout.splitlines():
            if '"channels"' in l:
                print(json.dumps({"floor": "grpc_loopback_bench one connection, both ways",
                                  "payload_bytes": b, **json.loads(l)}))
PY
