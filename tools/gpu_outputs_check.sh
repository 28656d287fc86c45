#!/bin/bash
# gpu_outputs_check.sh: on the GPU machine (carry .gpu from tools/pack_gpu.sh with moed,
# moe-worker, moectl, gpu_bench), one call: the engine API time (gpu_bench te_seed at 128 / 4096
# / 16384 tokens) and the service path with moectl bench writing into reused output buffers
# ("reused", the default) and into new tensors ("new", --noreuse_outputs), alternating twice,
# plus a tiny step (H 64, 16 tokens, 200 steps) on CUDA and CPU workers for the fixed cost of a
# call. Logs and JSON under $OUT; one summary line per shape and label.
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0 MOED_REQUIRE_GPU=1
nvidia-smi -L
for t in 128 4096 16384; do
  timeout 120 gpu_bench --configs=te_seed --tokens=$t >$OUT/gb$t.json 2>$OUT/gb$t.err
done
shapes=(1024,4096,8,2,128 1024,4096,8,2,4096 1024,4096,8,2,16384 4096,14336,8,2,4096
        2048,768,128,8,4096)
sb() { OUT=$OUT STEPS=${STEPS:-10} WARMUP=2 timeout ${1} bench/service_bench.sh --dtype=bf16 \
         "${@:2}" >/dev/null 2>>$OUT/sb.err; }
LABEL=reused1 sb 200 --device=cuda --workers=1 "${shapes[@]}"
LABEL=new1 SHM=0 MOECTL_FLAGS=--noreuse_outputs sb 100 --device=cuda --workers=1 "${shapes[@]}"
LABEL=reused2 SHM=0 sb 100 --device=cuda --workers=1 "${shapes[@]}"
LABEL=new2 SHM=0 MOECTL_FLAGS=--noreuse_outputs sb 100 --device=cuda --workers=1 "${shapes[@]}"
LABEL=tiny_cuda STEPS=200 sb 60 --device=cuda --workers=1 64,128,8,2,16
LABEL=tiny_cpu STEPS=200 SHM=1 sb 60 --device=cpu --workers=1 64,128,8,2,16
python3 tools/service_bench_summary.py "$OUT" --output_buffers reused1 new1 reused2 new2 \
  tiny_cuda tiny_cpu
