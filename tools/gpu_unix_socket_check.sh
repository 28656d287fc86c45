#!/bin/bash
# gpu_unix_socket_check.sh: on the GPU machine (carry .gpu packed with moed, moe-worker, moectl
# by tools/pack_gpu.sh), one call: the gRPC path of a caller on moed's host over loopback TCP
# ("tcp") and over moed's Unix-domain socket ("unix", moed --unix_socket), alternating ROUNDS
# times (default 2), moed + one CUDA worker with its defaults, bf16, gRPC only (SHM=0). Logs and
# JSON under $OUT; one line per shape, label and round: p50 fwd / fwd+bwd ms, the engine phase,
# the payload rate, and the client's phases.
#
#   here:  bazel build //server:moed //server:moe-worker //client:moectl &&
#          tools/pack_gpu.sh .gpu bazel-bin/server/moed bazel-bin/server/moe-worker \
#            bazel-bin/client/moectl
#   there: OUT=$OUT tools/gpu_unix_socket_check.sh [SHAPE...]    # device tool: carry [".gpu"]
set -uo pipefail
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0 MOED_REQUIRE_GPU=1
nvidia-smi -L
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(1024,4096,8,2,4096 1024,4096,8,2,16384 4096,14336,8,2,4096)
for r in $(seq 1 "${ROUNDS:-2}"); do
  for label in tcp unix; do
    socket=0
    [ "$label" = unix ] && socket=1
    OUT=$OUT STEPS=${STEPS:-10} WARMUP=${WARMUP:-2} SHM=0 UNIX_SOCKET=$socket LABEL="${label}_$r" \
      timeout 150 bench/service_bench.sh --device=cuda --workers=1 --dtype=bf16 "${shapes[@]}" \
      >/dev/null 2>>"$OUT/sb.err"
  done
done
python3 - <<'PY'
import glob, json, os
out = os.environ['OUT']
for path in sorted(glob.glob(f'{out}/service_bench_*.jsonl')):
    label = os.path.basename(path)[len('service_bench_'):-len('.jsonl')]
    for line in open(path):
        if not line.strip():
            continue
        d = json.loads(line)
        f, fb = d['breakdown']['forward'], d['breakdown']['forward_backward']
        print(label, d['config'][:32], d['tokens'], 'p50', d['forward']['latency_ms']['p50'],
              d['forward_backward']['latency_ms']['p50'], 'eng', f['engine_ms'], fb['engine_ms'],
              'GB/s', f['payload_gb_per_s'], fb['payload_gb_per_s'], 'client', f['client'])
PY
