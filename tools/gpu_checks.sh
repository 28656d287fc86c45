#!/bin/bash
# gpu_checks.sh: every GPU test and benchmark in one go, on the GPU machine (2 GPUs), from the
# folder tools/pack_gpu.sh made. Logs and JSON go to $OUT (default ./gpu_out); a summary table
# is printed last. Each step has its own time limit, so one hang does not cost the others.
# WORKERS (default 2): the server smoke's moe-workers, one per GPU (1 on a one-GPU machine).
#
#   source .gpu/env.sh && tools/gpu_checks.sh [tests|server|python|bench|batching|all]
set -uo pipefail
out=${OUT:-gpu_out}
what=${1:-all}
mkdir -p "$out"
export MOED_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
log="$out/tests.log"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_step.sh"  # step, summary
{ date -u; nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5; } >>"$log" 2>&1
if [ "$what" = all ] || [ "$what" = tests ]; then
  step ops_test 300 cuda_backend_ops_test ||
    step ops_test_memcheck 600 compute-sanitizer --tool memcheck cuda_backend_ops_test
  step layer_test 120 cuda_layer_test
  step ep2_test 120 ep2_gpu_test
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|error|ok \(rank" "$log" | tail -40
fi
if [ "$what" = all ] || [ "$what" = server ]; then
  # moed with one moe-worker per GPU (NCCL between them), then moectl smoke against it.
  server_smoke() {
    local port_file=/tmp/moed_gpu.port
    rm -f "$port_file"
    moed --device=cuda --workers="${WORKERS:-2}" --port=0 --port_file="$port_file" \
      >"$out/server.log" 2>&1 &
    local moed_pid=$!
    for _ in $(seq 1 100); do [ -s "$port_file" ] && break; sleep 0.2; done
    local rc=1
    if [ -s "$port_file" ]; then
      local server="127.0.0.1:$(cat "$port_file")"
      # The workers join (CUDA + NCCL setup) after moed listens: retry while it is not serving.
      for _ in $(seq 1 60); do
        timeout 60 moectl smoke --server="$server" --tokens=4 >/tmp/moectl_wait.log 2>&1 && break
        grep -q "not serving" /tmp/moectl_wait.log || break
        sleep 1
      done
      cat /tmp/moectl_wait.log
      timeout 60 moectl smoke --server="$server" --hidden=64 --ffn=128 --experts=8 --top_k=2 &&
        timeout 60 moectl smoke --server="$server" --hidden=128 --ffn=256 --experts=16 --top_k=4 \
          --score_function=sigmoid --num_groups=4 --group_topk=2 --align_size=8 \
          --compute_dtype=bf16 --tokens=256 &&
        timeout 60 moectl bench --server="$server" --hidden=1024 --ffn=4096 --experts=8 --top_k=2 \
          --compute_dtype=bf16 --dtype=bf16 --tokens=4096 --steps=10 --warmup=2
      rc=$?
    fi
    kill "$moed_pid" 2>/dev/null
    wait "$moed_pid" 2>/dev/null
    return $rc
  }
  if [ -x "$(command -v moed)" ] && [ -x "$(command -v moectl)" ]; then
    step server_smoke 150 server_smoke
  fi
fi
if [ "$what" = all ] || [ "$what" = python ]; then
  # The Python client's own tests with the GPU machine's python3 (grpcio, protobuf, torch with
  # CUDA) and the stubs tools/pack_gpu.sh generated here (.gpu/py); cuda_ipc_test runs its GPU
  # cases there. Then the trainer benchmark (RemoteMoE over CUDA IPC / shared memory / gRPC
  # against torch._grouped_mm on the same GPU) and the C++ client on the same shapes.
  export PYTHONPATH="$PWD/.gpu/py:$PWD/tests/python"
  bins=(--moed="$(command -v moed)" --worker="$(command -v moe-worker)")
  for t in ${PY_TESTS:-codec_test cuda_ipc_test remote_moe_test shm_test errors_test client_test}; do
    if [ "$t" = codec_test ]; then step "py_$t" 60 python3 tests/python/$t.py; continue; fi
    step "py_$t" 150 python3 tests/python/$t.py "${bins[@]}"
  done
  trainer_bench() {
    local port_file=/tmp/moed_trainer.port
    rm -f "$port_file"
    moed --device=cuda --workers=1 --port=0 --port_file="$port_file" --allow_client_shm \
      --max_layer_bytes=$((1 << 40)) >"$out/trainer_moed.log" 2>&1 &
    local moed_pid=$! rc=1
    for _ in $(seq 1 300); do [ -s "$port_file" ] && break; sleep 0.1; done
    local server="127.0.0.1:$(cat "$port_file")"
    if timeout 120 moectl --server="$server" health --wait_ms=120000; then
      timeout 400 python3 client/python/examples/bench_trainer.py --server="$server" \
        --tokens="${TRAINER_TOKENS:-16,1024,4096,16384}" --json="$out/bench_trainer.jsonl" \
        ${TRAINER_FLAGS:-}
      rc=$?
      # torch.compile around a RemoteMoE on the GPU: one graph break at most, eager == compiled.
      timeout 120 python3 client/python/examples/compile_check.py --server="$server" || rc=1
      # The Python client over shared memory with CPU tensors (as moectl bench --shm measures).
      for t in 4096 16384; do
        timeout 120 python3 client/python/examples/bench_client.py --server="$server" \
          --tokens=$t --shm --steps=10 | tee -a "$out/bench_client.jsonl" || rc=1
      done
    fi
    kill "$moed_pid" 2>/dev/null
    wait "$moed_pid" 2>/dev/null
    return $rc
  }
  step trainer_bench 450 trainer_bench
  [ -n "${SKIP_SERVICE_BENCH:-}" ] || OUT=$out step service_bench 300 bench/service_bench.sh \
    --device=cuda --workers=1 --dtype=bf16 1024,4096,8,2,16 1024,4096,8,2,4096 1024,4096,8,2,16384
fi
if [ "$what" = all ] || [ "$what" = batching ]; then
  # Cross-caller batching (issue 39): CALLERS (32) inference callers of CALLER_TOKENS (128)
  # tokens on one te_seed-shaped layer (H 1024, F 4096, E 8, k 2, bf16), unbatched then batched
  # in one run (moectl bench --callers; JSON: tokens_per_s_ratio, p99_ratio,
  # identical_to_unbatched), then the engine alone at the merged size for the ratio to it.
  batching_bench() {
    local port_file=/tmp/moed_batching.port
    rm -f "$port_file"
    moed --device=cuda --workers=1 --port=0 --port_file="$port_file" --forward_batching \
      >"$out/batching_moed.log" 2>&1 &
    local moed_pid=$! rc=1
    for _ in $(seq 1 300); do [ -s "$port_file" ] && break; sleep 0.1; done
    local server="127.0.0.1:$(cat "$port_file")"
    if timeout 120 moectl --server="$server" health --wait_ms=120000; then
      timeout 200 moectl bench --server="$server" --callers="${CALLERS:-32}" \
        --tokens="${CALLER_TOKENS:-128}" --hidden=1024 --ffn=4096 --experts=8 --top_k=2 \
        --compute_dtype=bf16 --dtype=bf16 --steps=30 --warmup=3 | tee "$out/bench_callers.json"
      rc=$?
    fi
    kill "$moed_pid" 2>/dev/null
    wait "$moed_pid" 2>/dev/null
    return $rc
  }
  step batching_bench 250 batching_bench
  [ -x "$(command -v engine_bench)" ] && step engine_bench_merged 60 engine_bench --device=cuda:0 \
    --config=te_seed --tokens=$((${CALLERS:-32} * ${CALLER_TOKENS:-128})) --iters=10
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  [ -n "${SKIP_1GPU:-}" ] || step bench_1gpu 250 gpu_bench --configs="${BENCH_CONFIGS:-te_seed,qwen3,mixtral,dsv3}" \
    --json="$out/bench_1gpu.jsonl"
  # Cross-check with the engine benchmark's own timing (API time, te_seed only).
  [ -z "${SKIP_1GPU:-}" ] && [ -x "$(command -v engine_bench)" ] &&
    step engine_bench_te_seed 60 engine_bench --device=cuda:0 --config=te_seed --iters=5
  rm -rf /tmp/moed_ep2_store
  step bench_ep2 200 bash -c "gpu_bench --size=2 --rank=1 --store_dir=/tmp/moed_ep2_store \
      --configs=${BENCH_CONFIGS:-te_seed,qwen3,mixtral,dsv3} --json=$out/bench_ep2_r1.jsonl \
      >$out/bench_ep2_r1.log 2>&1 & \
    gpu_bench --size=2 --rank=0 --store_dir=/tmp/moed_ep2_store \
      --configs=${BENCH_CONFIGS:-te_seed,qwen3,mixtral,dsv3} --json=$out/bench_ep2_r0.jsonl; \
    rc=\$?; wait; exit \$rc"
  if [ -n "${EP2_STAGING_DIAG:-}" ]; then
    # Diagnosis: EP=2 with the opt-in pinned staging and glibc's heap checks.
    rm -rf /tmp/moed_ep2_diag
    step ep2_staging_diag 90 bash -c "export MOED_CUDA_HOST_STAGING=1 MALLOC_CHECK_=3; \
      gpu_bench --size=2 --rank=1 --store_dir=/tmp/moed_ep2_diag --configs=te_seed,qwen3 \
        --iters=5 >/dev/null & \
      gpu_bench --size=2 --rank=0 --store_dir=/tmp/moed_ep2_diag --configs=te_seed,qwen3 \
        --iters=5 >/dev/null; rc=\$?; wait \$!; rc1=\$?; echo diag rc0=\$rc rc1=\$rc1; exit \$((rc|rc1))"
  fi
  python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
for f in ("bench_1gpu.jsonl", "bench_ep2_r0.jsonl"):
    p = os.path.join(out, f)
    if not os.path.exists(p): continue
    print(f)
    for line in open(p):
        r = json.loads(line)
        extra = ""
        if r.get("size", 1) > 1:
            extra = " a2a %.1f GB/s bus (standalone %.1f)" % (r["a2a_busbw_GBps"], r["standalone_a2a_busbw_GBps"])
        print("  %-8s fwd %6.2f ms (dev %6.2f span %6.2f, %4.0f TF)  fwd+bwd %6.2f ms (dev %6.2f span %6.2f, %4.0f TF)  peak %.1f GB init %.0fs%s" % (
            r["config"], r["fwd_ms"], r["fwd_device_ms"], r["fwd_span_ms"], r["fwd_tflops_device"], r["fwdbwd_ms"],
            r["fwdbwd_device_ms"], r["fwdbwd_span_ms"], r["fwdbwd_tflops_device"], r["peak_bytes"] / 1e9, r["init_s"], extra))
PY
fi
printf '%s\n' "${summary[@]}"
