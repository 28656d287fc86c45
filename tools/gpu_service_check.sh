#!/bin/bash
# gpu_service_check.sh: on the GPU machine (carry .gpu from tools/pack_gpu.sh), one call: the GPU
# tests, the engine API time (gpu_bench, te_seed at 128/4096/16384 tokens) and the service path
# (bench/service_bench.sh: gRPC, shared memory and CUDA IPC) with WORKERS CUDA workers (default
# 1), with a one-line summary per shape, and gRPC itself over TCP and Unix sockets
# (grpc_loopback_bench). Logs and JSON go to $OUT.
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0 MOED_REQUIRE_GPU=1
nvidia-smi -L
timeout 120 cuda_layer_test 2>&1 | tail -3
timeout 120 cuda_backend_ops_test 2>&1 | tail -3
for t in 128 4096 16384; do timeout 120 gpu_bench --configs=te_seed --tokens=$t > $OUT/gb$t.json 2>$OUT/gb$t.err; tail -c 1500 $OUT/gb$t.json; done
OUT=$OUT STEPS=10 WARMUP=2 timeout 400 bench/service_bench.sh --device=cuda --workers=${WORKERS:-1} --dtype=bf16 1024,4096,8,2,128 1024,4096,8,2,4096 1024,4096,8,2,16384 4096,14336,8,2,4096 2048,768,128,8,4096 > /dev/null 2>$OUT/sb.err
python3 - <<'PY'
import json,os
for line in open(os.environ['OUT']+'/service_bench.jsonl'):
    if not line.strip(): continue
    d=json.loads(line); s=d.get('shm',{}); c=d.get('cuda_shm',{})
    b=d['breakdown']['forward']; sb=s.get('breakdown',{}).get('forward',{}); sbb=s.get('breakdown',{}).get('forward_backward',{})
    print(d['config'][:60], d['tokens'], 'grpc', d['forward']['latency_ms']['p50'], d['forward_backward']['latency_ms']['p50'], 'eng', b['engine_ms'], 'gbps', b['payload_gb_per_s'],
      '| shm', s['forward']['latency_ms']['p50'], s['forward_backward']['latency_ms']['p50'], 'eng', sb.get('engine_ms'), sbb.get('engine_ms'), 'moed', sb.get('moed',{}).get('moed_ms'), 'wk', sb.get('workers'), 'ident', s.get('identical_to_grpc'))
    if c:
        cb=c['breakdown']['forward']; cbb=c['breakdown']['forward_backward']
        print('   cuda_ipc', c['forward']['latency_ms']['p50'], c['forward_backward']['latency_ms']['p50'], 'eng', cb.get('engine_ms'), cbb.get('engine_ms'), 'workers', cb.get('workers'), 'ident', c.get('identical_to_grpc'))
PY
for t in tcp unix; do timeout 60 grpc_loopback_bench --bytes=67108864 --iters=10 --parts=1,2,4 --transport=$t; done | tee $OUT/loopback.jsonl
