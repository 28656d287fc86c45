#!/bin/bash
# gpu_concurrency_check.sh: on the GPU machine (carry .gpu from tools/pack_gpu.sh with moed,
# moe-worker, moectl, gpu_bench), one call: the engine API time of the data-plane issue's
# shapes (gpu_bench, 4096 / 16384 tokens) and the service path with 1, 2 and 4 callers at once
# (moectl bench --concurrency), tokens/s next to the engine's. Logs and JSON under $OUT.
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0 MOED_REQUIRE_GPU=1
nvidia-smi -L
which perf strace 2>&1 | head -2
gb() { timeout 150 gpu_bench --configs=$1 --tokens=$2 >$OUT/gb_$1_$2.json 2>$OUT/gb_$1_$2.err; }
gb te_seed 4096; gb te_seed 16384; gb mixtral 4096; gb qwen3 4096
shapes=(1024,4096,8,2,4096 1024,4096,8,2,16384 4096,14336,8,2,4096 2048,768,128,8,4096)
sb() { OUT=$OUT STEPS=10 WARMUP=2 SHM=0 timeout ${1} bench/service_bench.sh --dtype=bf16 \
         --device=cuda --workers=1 "${@:2}" >/dev/null 2>>$OUT/sb.err; }
LABEL=c2 MOECTL_FLAGS=--concurrency=2 sb 200 "${shapes[@]}"
LABEL=c4 MOECTL_FLAGS=--concurrency=4 sb 200 "${shapes[@]}"
python3 - <<'PY'
import glob, json, os
out = os.environ['OUT']
for path in sorted(glob.glob(f'{out}/gb_*.json')):
    for line in open(path):
        d = json.loads(line)
        print('gpu_bench', d['config'], d['tokens'], 'API fwd', round(d['fwd_ms'], 3), 'f+b',
              round(d['fwdbwd_ms'], 3), 'device', round(d['fwd_device_ms'], 3),
              round(d['fwdbwd_device_ms'], 3), 'tok/s API fwd', round(d['tokens'] / d['fwd_ms'] * 1e3),
              'f+b', round(d['tokens'] / d['fwdbwd_ms'] * 1e3))
for label in ('c2', 'c4'):
    for line in open(f'{out}/service_bench_{label}.jsonl'):
        if not line.strip(): continue
        d = json.loads(line)
        c = d['concurrent']
        print(label, d['config'][:32], d['tokens'], '1 caller p50', d['forward']['latency_ms']['p50'],
              d['forward_backward']['latency_ms']['p50'], 'tok/s', d['forward']['tokens_per_s'],
              d['forward_backward']['tokens_per_s'], '|', c['concurrency'], 'callers tok/s',
              c['forward']['tokens_per_s'], c['forward_backward']['tokens_per_s'], 'p50',
              c['forward']['latency_ms']['p50'], c['forward_backward']['latency_ms']['p50'],
              'ident', c['identical_to_one_caller'])
PY
