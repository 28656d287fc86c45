#!/bin/bash
# gpu_dataplane_check.sh: on the GPU machine (carry .gpu from tools/pack_gpu.sh), one call: the
# engine API time (gpu_bench te_seed at 128/4096/16384 tokens) and the service path in the same
# run, as ratios: "now" = moed's defaults (shared-memory relay to the local worker, the C++
# client's 4 lanes) with shared memory and CUDA IPC, next to "base" = the gRPC path without
# them (moed --shm_relay=false, moectl --lanes=1), "relay" = relay without lanes and "lanes8".
# Logs and JSON under $OUT; one summary line per shape and label.
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0 MOED_REQUIRE_GPU=1
nvidia-smi -L
for t in 128 4096 16384; do
  timeout 120 gpu_bench --configs=te_seed --tokens=$t >$OUT/gb$t.json 2>$OUT/gb$t.err
done
shapes=(1024,4096,8,2,128 1024,4096,8,2,4096 1024,4096,8,2,16384 4096,14336,8,2,4096
        2048,768,128,8,4096)
sb() { OUT=$OUT STEPS=10 WARMUP=2 timeout ${1} bench/service_bench.sh --device=cuda --workers=1 \
         --dtype=bf16 "${@:2}" >/dev/null 2>>$OUT/sb.err; }
LABEL=now sb 240 "${shapes[@]}"
LABEL=base SHM=0 MOED_FLAGS=--shm_relay=false MOECTL_FLAGS=--lanes=1 sb 150 "${shapes[@]}"
LABEL=relay SHM=0 MOECTL_FLAGS=--lanes=1 sb 60 1024,4096,8,2,4096 1024,4096,8,2,16384
LABEL=lanes8 SHM=0 MOECTL_FLAGS=--lanes=8 sb 60 1024,4096,8,2,4096 1024,4096,8,2,16384
python3 tools/service_bench_summary.py "$OUT" now base relay lanes8
