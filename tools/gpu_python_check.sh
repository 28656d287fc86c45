#!/bin/bash
# gpu_python_check.sh: the Python client on the GPU machine (issue 19), one call, from the folder
# `PYTHON_CLIENT=1 tools/pack_gpu.sh` made (carry .gpu): moed with WORKERS CUDA workers (default
# 1), then client/python/examples/compile_check.py (torch.compile around a model with a
# RemoteMoE: graph count, graph breaks, eager vs compiled), bench_client.py next to `moectl
# bench` (the Python client's step latency against the C++ client's, same shapes, same moed)
# and bench_dp.py (steps per second of a data-parallel job of N torchrun ranks sharing the
# layer, RANKS default 1,2,4,8). The
# carried gRPC/protobuf modules are Debian's for Python 3.11: on another Python the import check
# says so and the script stops. Logs and JSON go to $OUT.
#
#   here:  bazel build //server:moed //server:moe-worker //client:moectl && \
#              PYTHON_CLIENT=1 tools/pack_gpu.sh
#   there: OUT=$OUT tools/gpu_python_check.sh          # device tool: carry [".gpu"]
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
source .gpu/env.sh
export MOED_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
python3 --version
if ! python3 -c "import torch, grpc, numpy, moe_client; print('torch', torch.__version__, 'grpc', grpc.__version__)"; then
  echo "gpu_python_check: the carried client does not import on this Python (see above)"
  exit 1
fi
port_file="$out/moed.port"
moed --device=cuda --workers="${WORKERS:-1}" --port=0 --port_file="$port_file" \
  >"$out/moed.log" 2>&1 &
moed_pid=$!
trap 'kill $moed_pid 2>/dev/null; wait $moed_pid 2>/dev/null' EXIT
for _ in $(seq 120); do [ -s "$port_file" ] && break; sleep 1; done
server="localhost:$(cat "$port_file")"
moectl --server="$server" health --wait_ms=120000 >/dev/null || { tail "$out/moed.log"; exit 1; }
echo "== compile_check ($server)"
timeout 300 python3 client/python/examples/compile_check.py --server="$server" \
  2>"$out/compile_check.err" | tee "$out/compile_check.json"
echo "compile_check exit ${PIPESTATUS[0]}"
tail -5 "$out/compile_check.err"
echo "== bench_client (Python) vs moectl bench (C++), bf16"
for t in ${CLIENT_TOKENS:-4096 16384}; do
  timeout 120 python3 client/python/examples/bench_client.py --server="$server" --tokens="$t" \
    --hidden=1024 --ffn=4096 --experts=8 --top_k=2 --dtype=bf16 2>>"$out/bench_client.err" |
    tee -a "$out/bench_client.jsonl"
  timeout 120 moectl --server="$server" bench --steps=10 --warmup=2 --tokens="$t" --hidden=1024 \
    --ffn=4096 --experts=8 --top_k=2 --dtype=bf16 --compute_dtype=bf16 2>/dev/null |
    tee -a "$out/moectl_bench.jsonl" | python3 -c "import json, sys; d = json.load(sys.stdin); \
print('moectl', $t, 'fwd', d['forward']['latency_ms']['p50'], 'f+b', \
d['forward_backward']['latency_ms']['p50'])"
done
tail -3 "$out/bench_client.err"
echo "== bench_dp"
timeout 240 python3 client/python/examples/bench_dp.py --server="$server" \
  --ranks="${RANKS:-1,2,4,8}" --steps="${DP_STEPS:-30}" --tokens="${DP_TOKENS:-4096}" \
  2>"$out/bench_dp.err" | tee "$out/bench_dp.json"
tail -5 "$out/bench_dp.err"
