#!/bin/bash
# worker_ring_bench.sh: the moed -> worker hop on step rings (moed --worker_ring) against gRPC,
# side by side in one run: bench/service_bench.sh twice, moed with --worker_ring=false then
# --worker_ring=true (one moed after the other, same shapes, same client flags), and one JSON
# line per shape and path (gRPC, and with SHM=1 shared memory / CUDA IPC from the client too)
# with both p50s of forward and forward+backward, moed's fan-out (the hop plus the workers'
# own time) and the ratios off / on. Output: OUT/worker_ring_bench.jsonl (and the two runs'
# service_bench_worker_ring_{off,on}.jsonl, moed logs beside them).
#
#   bench/worker_ring_bench.sh [--device=cpu|cuda] [--workers=N] [--dtype=bf16|fp32] [SHAPE...]
#   SHAPE = H,F,E,k,T (default: 1024,4096,8,2,16 and 1024,4096,8,2,1024)
# Environment: as service_bench.sh (STEPS, WARMUP, MOED_FLAGS, MOECTL_FLAGS), SHM (default 0:
# the client over gRPC only; 1: also --shm / --cuda_shm).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-bench_out}
mkdir -p "$out"
args=("$@")
has_shape=0
for a in "${args[@]}"; do case "$a" in --*) ;; *) has_shape=1 ;; esac; done
[ $has_shape = 1 ] || args+=(1024,4096,8,2,16 1024,4096,8,2,1024)
rc=0
for mode in off on; do
  flag=$([ $mode = on ] && echo true || echo false)
  rm -f "$out/service_bench_worker_ring_$mode.jsonl"
  OUT=$out LABEL=worker_ring_$mode SHM=${SHM:-0} \
    MOED_FLAGS="--worker_ring=$flag ${MOED_FLAGS:-}" "$here/service_bench.sh" "${args[@]}" \
    >/dev/null || rc=1
done
/usr/bin/python3 - "$out" <<'PY' | tee "$out/worker_ring_bench.jsonl"
import json, sys
out = sys.argv[1]
def load(mode):
    rows = []
    for line in open(f"{out}/service_bench_worker_ring_{mode}.jsonl"):
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows
def p50(run, series):
    return run[series]["latency_ms"]["p50"]
def fanout(run, series):
    return run.get("breakdown", {}).get(series, {}).get("moed", {}).get("fanout_ms")
for off, on in zip(load("off"), load("on")):
    for path in ["grpc", "shm", "cuda_shm"]:
        a, b = (off, on) if path == "grpc" else (off.get(path), on.get(path))
        if not a or not b or "forward" not in a:
            continue
        row = {"bench": "worker_ring", "path": path, "tokens": off["tokens"],
               "config": off["config"], "datatype": off["datatype"], "ep_ranks": off["ep_ranks"]}
        for series in ["forward", "forward_backward"]:
            row[series] = {"p50_ms_ring_off": p50(a, series), "p50_ms_ring_on": p50(b, series),
                           "off_over_on": round(p50(a, series) / max(p50(b, series), 1e-9), 3)}
            fa, fb = fanout(a, series), fanout(b, series)
            if fa is not None and fb is not None:
                row[series]["fanout_ms_ring_off"] = fa
                row[series]["fanout_ms_ring_on"] = fb
        if "identical_to_grpc" in b:
            row["identical_to_grpc"] = b["identical_to_grpc"]
        print(json.dumps(row))
PY
exit $rc
