#!/bin/bash
# gpu_create_e128.sh: on the GPU machine (carry .gpu): times CreateLayer and two forwards of the
# 128-expert shape (H 2048, F 768, k 8) with one CUDA worker, then moectl bench --shm on it.
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0
P=$(mktemp -u)
moed --device=cuda --workers=1 --port=0 --port_file=$P --max_layer_bytes=$((1<<40)) --step_timeout_ms=300000 --allow_client_shm > $OUT/moed.log 2>&1 &
for i in $(seq 1 100); do [ -s $P ] && break; sleep 0.2; done
S=--server=127.0.0.1:$(cat $P)
moectl $S health --wait_ms=60000; T0=$(date +%s.%N)
L="--hidden=2048 --ffn=768 --experts=128 --top_k=8 --compute_dtype=bf16"
/usr/bin/time -f "create %e s" moectl $S --deadline_ms=300000 create-layer --layer=e128 $L > /dev/null
/usr/bin/time -f "forward1 %e s" moectl $S --deadline_ms=300000 forward --layer=e128 --tokens=4096 --dtype=bf16 | head -c 300; echo
/usr/bin/time -f "forward2 %e s" moectl $S --deadline_ms=300000 forward --layer=e128 --tokens=4096 --dtype=bf16 | head -c 100; echo
timeout 200 moectl $S --deadline_ms=120000 bench --layer=e128 --shm --progress=off --tokens=4096 --dtype=bf16 --steps=10 --warmup=2 > $OUT/b.json; python3 -c "
import json; d=json.load(open('$OUT/b.json')); s=d['shm']; print('grpc', d['forward']['latency_ms']['p50'], d['forward_backward']['latency_ms']['p50'], 'shm', s['forward']['latency_ms']['p50'], s['forward_backward']['latency_ms']['p50'], 'eng', s['breakdown']['forward']['engine_ms'], s['breakdown']['forward_backward']['engine_ms'], s['identical_to_grpc'])"
kill %1; tail -5 $OUT/moed.log
