#!/bin/bash
# gpu_checks.sh: the one entry point of the GPU checks and benchmarks, run on the GPU machine
# from the folder tools/pack_gpu.sh made (carry .gpu; the device tool allows 600 s a command:
# run one sub-command per call). Logs and JSON go to $OUT (default ./gpu_out); a summary table
# of the steps is printed last. Each step has its own time limit, so one hang does not cost the
# others.
#
#   source .gpu/env.sh && tools/gpu_checks.sh [SUBCOMMAND]      # default: all
#
#   tests    the GPU tests: cuda_backend_ops_test, cuda_layer_test, ep2_gpu_test
#   server   moed with WORKERS (default 2) CUDA workers, moectl smoke and a short bench
#   python   the Python client's tests, the trainer benchmark, the C++ service bench
#   bench    gpu_bench on one GPU and EP=2 (BENCH_CONFIGS), engine_bench's cross-check
#   worker_ring  moed's step rings to the workers on and off (bench/worker_ring_bench.sh)
#   batching 32 inference callers x 128 tokens, unbatched then batched (moectl bench --callers)
#   all      tests, server, python, worker_ring, batching, bench (not fp8, fp8_loss, ...)
#   trainer_profile  where a trainer's step through moed goes (C++ client breakdown, Python
#            trainer with a cProfile, the engine alone); not part of all
#   fp8      the FP8 tests, then gpu_bench bf16 and FP8 back to back, with the speed-up table
#   fp8_loss  issue 40's accuracy check on the GPU: examples/train_fp8.py (200 steps, BF16 then
#            FP8 delayed, same data and weights) with --device=cuda against one CUDA worker
#   fp8_gemms  per preset bf16 vs FP8 with every GEMM, AUTO, none and each GEMM alone in bf16
#            (the per-GEMM choice's measurements, engine/cuda/fp8_gemm_table.cc)
#   compare  gpu_bench VARIANTS side by side, alternating ROUNDS times, fingerprints compared
#   probe    bench/gemm_probe for each PROBE entry (expert GEMM configurations, issue 15)
#   service  the service path (bench/service_bench.sh) under SERVICE_VARIANTS, next to the
#            engine's API time (gpu_bench te_seed), and gRPC over loopback
#   grpc_bw  gRPC for callers on other hosts (bench/grpc_bandwidth.sh): inline and streamed
#            steps under GRPC_BW_VARIANTS, as ratios, with gRPC's echo floor
# Each sub-command's block below lists its environment knobs.
set -uo pipefail
[ -f .gpu/env.sh ] && source .gpu/env.sh  # the packed binaries on PATH (sourcing again is harmless)
out=${OUT:-gpu_out}
what=${1:-all}
mkdir -p "$out"
export MOED_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
log="$out/tests.log"
summary=()
step() {  # step NAME TIMEOUT_S COMMAND...: output into $log, a line into summary
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$log"
  local t0=$(date +%s)
  if [ "$(type -t "$1")" = function ]; then
    "$@" >>"$log" 2>&1  # shell functions cannot run under timeout; they bound themselves
  else
    timeout "$limit" "$@" >>"$log" 2>&1
  fi
  local rc=$?
  summary+=("$(printf "%-${step_width:-28}s rc=%-3s %4ss" "$name" "$rc" "$(( $(date +%s) - t0 ))")")
  return $rc
}
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
  for t in ${PY_TESTS:-codec_test cuda_ipc_test remote_moe_test shm_test step_channel_test errors_test client_test}; do
    if [ "$t" = codec_test ]; then step "py_$t" 60 python3 tests/python/$t.py; continue; fi
    step "py_$t" 150 python3 tests/python/$t.py "${bins[@]}"
  done
  trainer_bench() {
    local port_file=/tmp/moed_trainer.port
    rm -f "$port_file"
    # MOED_FLAGS: extra moed flags (e.g. --ring_spin_us=20; TRAINER_FLAGS=--ring_spin_us=20
    # for the trainer's side of the step channel).
    moed --device=cuda --workers=1 --port=0 --port_file="$port_file" --allow_client_shm \
      --max_layer_bytes=$((1 << 40)) ${MOED_FLAGS:-} >"$out/trainer_moed.log" 2>&1 &
    local moed_pid=$! rc=1
    for _ in $(seq 1 300); do [ -s "$port_file" ] && break; sleep 0.1; done
    local server="127.0.0.1:$(cat "$port_file")"
    if timeout 120 moectl --server="$server" health --wait_ms=120000; then
      # With the step channel (the default on this host) and without it (gRPC), same run.
      rc=0
      for channel in on off; do
        timeout 400 python3 client/python/examples/bench_trainer.py --server="$server" \
          --tokens="${TRAINER_TOKENS:-16,1024,4096,16384}" --json="$out/bench_trainer.jsonl" \
          --step_channel=$channel ${TRAINER_FLAGS:-} || rc=1
      done
      # The fixed cost of a small step, gRPC vs the step channel side by side (JSON lines).
      timeout 120 python3 client/python/examples/bench_client.py --server="$server" \
        --tokens=16 --steps=200 --warmup=20 --transports=grpc,ring \
        | tee -a "$out/bench_client.jsonl" || rc=1
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
if [ "$what" = all ] || [ "$what" = server ] || [ "$what" = worker_ring ]; then
  # The moed -> worker hop on step rings against gRPC, side by side (two moeds one after the
  # other): 16 and 1024 tokens, the client over gRPC, shared memory and CUDA IPC.
  OUT=$out SHM=1 step worker_ring_bench 400 bench/worker_ring_bench.sh \
    --device=cuda --workers=1 --dtype=bf16 1024,4096,8,2,16 1024,4096,8,2,1024
fi
if [ "$what" = trainer_profile ]; then
  # Where a trainer's step through moed goes (issue 37): one moed with one CUDA worker; the C++
  # client over CUDA IPC and the step channel with moed's per-phase breakdown (moectl bench),
  # then the Python trainer (bench_trainer.py --breakdown, a cProfile of the CUDA IPC path),
  # then the engine alone at the same token counts (gpu_bench, device and API time).
  # Knobs: PROFILE_TOKENS (default 16,4096), PROFILE_STEPS (30).
  export PYTHONPATH="$PWD/.gpu/py:$PWD/tests/python"
  trainer_profile() {
    local port_file=/tmp/moed_profile.port rc=0
    rm -f "$port_file"
    moed --device=cuda --workers=1 --port=0 --port_file="$port_file" --allow_client_shm \
      --max_layer_bytes=$((1 << 40)) ${MOED_FLAGS:-} >"$out/profile_moed.log" 2>&1 &
    local moed_pid=$!
    for _ in $(seq 1 300); do [ -s "$port_file" ] && break; sleep 0.1; done
    local server="127.0.0.1:$(cat "$port_file")"
    if timeout 120 moectl --server="$server" health --wait_ms=120000; then
      for t in $(echo "${PROFILE_TOKENS:-16,4096}" | tr , ' '); do
        timeout 120 moectl --server="$server" bench --hidden=1024 --ffn=4096 --experts=8 \
          --top_k=2 --dtype=bf16 --compute_dtype=bf16 --tokens=$t --steps=${PROFILE_STEPS:-30} --warmup=5 \
          --cuda_shm --step_channel --progress=off | tee -a "$out/profile_moectl.jsonl" || rc=1
      done
      timeout 300 python3 client/python/examples/bench_trainer.py --server="$server" \
        --tokens="${PROFILE_TOKENS:-16,4096}" --paths=cuda_ipc,local --breakdown \
        --steps=${PROFILE_STEPS:-30} --profile=cuda_ipc --json="$out/profile_trainer.jsonl" \
        2>"$out/profile_cprofile.txt" || rc=1
    else
      rc=1
    fi
    kill "$moed_pid" 2>/dev/null
    wait "$moed_pid" 2>/dev/null
    for t in $(echo "${PROFILE_TOKENS:-16,4096}" | tr , ' '); do
      timeout 120 gpu_bench --configs=te_seed --tokens=$t --iters=10 \
        --json="$out/profile_engine.jsonl" >/dev/null || rc=1
    done
    return $rc
  }
  step trainer_profile 560 trainer_profile
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
    step ep2_staging_diag 90 bash -c "export MALLOC_CHECK_=3; \
      gpu_bench --size=2 --rank=1 --store_dir=/tmp/moed_ep2_diag --configs=te_seed,qwen3 \
        --iters=5 --cuda_host_staging >/dev/null & \
      gpu_bench --size=2 --rank=0 --store_dir=/tmp/moed_ep2_diag --configs=te_seed,qwen3 \
        --iters=5 --cuda_host_staging >/dev/null; rc=\$?; wait \$!; rc1=\$?; echo diag rc0=\$rc rc1=\$rc1; exit \$((rc|rc1))"
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
if [ "$what" = fp8 ]; then
  # FULL_TESTS=1 also runs the whole test binaries (their fp32/bf16 cases); SKIP_TESTS=1 /
  # SKIP_BENCH=1 skip a half; BENCH_CONFIGS (default te_seed,qwen3,mixtral,dsv3), ITERS (5),
  # FP8_RECIPES (DELAYED,CURRENT): bf16, FP8 delayed and FP8 current in one process, with issue
  # 40's table (device and engine API time, speed-ups, targets).
  if [ -z "${SKIP_TESTS:-}" ]; then
    step ops_fp8 90 cuda_backend_ops_test --gtest_filter='*Fp8*'
    step layer_fp8 120 cuda_layer_test --gtest_filter='*fp8*:*Fp8*'
    if [ -n "${FULL_TESTS:-}" ]; then
      step ops_all 150 cuda_backend_ops_test
      step layer_all 240 cuda_layer_test
    fi
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|GPU FP8 vs fp64|Expected|actual|Which is" \
      "$log" | tail -60
  fi
  if [ -z "${SKIP_BENCH:-}" ]; then
    step bench_bf16_fp8 "${BENCH_TIMEOUT:-420}" gpu_bench \
      --configs="${BENCH_CONFIGS:-te_seed,qwen3,mixtral,dsv3}" --compute_dtypes=bf16,fp8 \
      --fp8_recipes="${FP8_RECIPES:-DELAYED,CURRENT}" --iters="${ITERS:-5}" \
      --json="$out/bench_fp8.jsonl"
    python3 - "$out/bench_fp8.jsonl" <<'PY'
# Issue 40's table: per preset bf16, FP8 delayed and FP8 current, device and engine API time
# (fwd, fwd+bwd), the speed-ups over bf16 and the targets.
import json, os, sys
path = sys.argv[1]
if not os.path.exists(path):
    sys.exit("no benchmark output")
rows = {}
for line in open(path):
    r = json.loads(line)
    kind = r.get("compute_dtype", "BF16")
    if kind == "FP8":
        kind = "FP8-" + (r.get("fp8_recipe") or "DELAYED")[:3]
    rows[(r["config"], kind)] = r
targets = {"mixtral": 1.6, "dsv3": 1.4, "te_seed": 1.3, "qwen3": 1.0}
keys = ("fwd_device_ms", "fwdbwd_device_ms", "fwd_ms", "fwdbwd_ms")
print("%-8s %-7s %8s %8s %8s %8s  %s" % ("config", "kind", "fwd dev", "f+b dev", "fwd api",
                                         "f+b api", "speed-up over bf16 (same order)"))
for config in dict.fromkeys(c for c, _ in rows):
    b = rows.get((config, "BF16"))
    for kind in ("BF16", "FP8-DEL", "FP8-CUR"):
        r = rows.get((config, kind))
        if r is None:
            continue
        line = "%-8s %-7s " % (config, kind) + " ".join("%8.2f" % r[k] for k in keys)
        if kind != "BF16" and b is not None:
            x = [b[k] / r[k] for k in keys]
            want = targets.get(config, 1.0)
            need = x if config == "mixtral" else [x[1], x[3]]  # mixtral: fwd too
            ok = min(x) >= 1.0 and min(need) >= want
            line += "  " + " ".join("%.2fx" % v for v in x)
            line += "  (>= %.1fx, none < 1x: %s)" % (want, "met" if ok else "NOT met")
        print(line)
PY
  fi
fi
if [ "$what" = fp8_loss ]; then
  # examples/train_fp8.py against moed with FP8_LOSS_WORKERS (default 1) CUDA workers and
  # --allow_client_shm (the torch side's CUDA tensors go by CUDA IPC): the same model trained
  # with its MoE layer in BF16 then FP8 (delayed scaling), the loss curves' max relative
  # difference against the 1 % bound (exit status 1 beyond it). FP8_LOSS_FLAGS: more flags for
  # the example (e.g. "--hidden=1024 --ffn=4096 --experts=8 --tokens=8192"). JSON lines in
  # $out/train_fp8.jsonl; the moed log in $out/fp8_loss_moed.log.
  export PYTHONPATH="$PWD/.gpu/py:$PWD/tests/python"
  fp8_loss() {
    local port_file=/tmp/moed_fp8_loss.port rc=1
    rm -f "$port_file"
    moed --device=cuda --workers="${FP8_LOSS_WORKERS:-1}" --port=0 --port_file="$port_file" \
      --allow_client_shm >"$out/fp8_loss_moed.log" 2>&1 &
    local moed_pid=$!
    for _ in $(seq 1 300); do [ -s "$port_file" ] && break; sleep 0.1; done
    local server="127.0.0.1:$(cat "$port_file")"
    if timeout 120 moectl --server="$server" health --wait_ms=120000; then
      timeout 400 python3 client/python/examples/train_fp8.py --server="$server" --device=cuda \
        --json="$out/train_fp8.jsonl" ${FP8_LOSS_FLAGS:-} | tail -1
      rc=${PIPESTATUS[0]}
    fi
    kill "$moed_pid" 2>/dev/null
    wait "$moed_pid" 2>/dev/null
    return $rc
  }
  step fp8_loss 560 fp8_loss
  tail -1 "$out/train_fp8.jsonl" 2>/dev/null
fi
if [ "$what" = fp8_gemms ]; then
  # The per-GEMM FP8 choice (docs/SPEC.md "Per-GEMM choice", engine/cuda/fp8_gemm_table.cc):
  # per preset of BENCH_CONFIGS (default te_seed,qwen3,mixtral) one gpu_bench process (FP8
  # delayed, ITERS=5) running bf16, then FP8 under each policy of FP8_GEMMS (default
  # "ALL;AUTO;none;each": each = every GEMM but one in FP8, for the six in turn), so every
  # variant of a preset is measured side by side. dsv3 (50 s a layer creation, 11 runs) needs
  # a call of its own, in two halves: BENCH_CONFIGS=dsv3 FP8_GEMMS="ALL;ALL-fc1_fprop;
  # ALL-fc1_dgrad;ALL-fc1_wgrad", then the fc2 half. Then the table below: per preset the
  # device ms fwd / fwd+bwd of each variant and its ratio to bf16, whether `none` was bit for
  # bit bf16 (fingerprints), and per GEMM what moving it alone to bf16 did to ALL; a "table:"
  # line gives the entry for engine/cuda/fp8_gemm_table.cc (FP8 for the GEMMs whose move to
  # bf16 made the fwd+bwd step slower by more than NOISE, default 1 %).
  for config in $(echo "${BENCH_CONFIGS:-te_seed,qwen3,mixtral}" | tr ',' ' '); do
    step "fp8_gemms_$config" "${BENCH_TIMEOUT:-560}" gpu_bench --configs="$config" \
      --compute_dtypes=bf16,fp8 --fp8_recipes=DELAYED --fp8_gemms="${FP8_GEMMS:-ALL;AUTO;none;each}" \
      --iters="${ITERS:-5}" --json="$out/bench_fp8_gemms.jsonl"
  done
  python3 tools/fp8_gemms_summary.py "$out/bench_fp8_gemms.jsonl" --noise="${NOISE:-0.01}" |
    tee "$out/fp8_gemms_summary.txt"
fi
if [ "$what" = compare ]; then
  # gpu_bench builds or settings side by side: VARIANTS = "LABEL:BINARY[:ARG...] ...", an ARG
  # being a gpu_bench flag (the engine flags of server/README.md, e.g. --gemm_streams=8,
  # --cublaslt_tuned=false) or ENV=VALUE. Default "base:gpu_bench_base now:gpu_bench": a base
  # build packed as gpu_bench_base (tools/build_base_binary.sh REV //bench:gpu_bench
  # .gpu/base/gpu_bench_base engine bench server, then tools/pack_gpu.sh ... with it). Each
  # variant runs CONFIGS (te_seed,qwen3,mixtral) x DTYPES (bf16,fp8), zeroed and accumulating
  # fwd+bwd steps in one process (ITERS 8, ACCUM_ITERS ITERS), ROUNDS (2) times alternating;
  # then medians, ratios to the first variant, and whether the fingerprints (out, d_x, d_gate of
  # a step, then wi and wo gradients after an accumulating one) of every run are bitwise equal.
  # SKIP_TESTS unset: the GPU tests first. Examples:
  #   VARIANTS="heur:gpu_bench:--cublaslt_tuned=false tuned:gpu_bench" DTYPES=bf16
  #   VARIANTS="s4:gpu_bench s8:gpu_bench:--gemm_streams=8" CONFIGS=dsv3 ROUNDS=1 SKIP_TESTS=1
  step_width=30
  configs=${CONFIGS:-te_seed,qwen3,mixtral}
  if [ -z "${SKIP_TESTS:-}" ]; then
    step ops_test 300 cuda_backend_ops_test
    step layer_test 240 cuda_layer_test
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Expected|actual|Which is" "$log" | tail -40
  fi
  compare_run() {  # compare_run ROUND LABEL BINARY [ARG...]
    local round=$1 label=$2 binary=$3 flags=() env=()
    shift 3
    for a in "$@"; do [[ $a == --* ]] && flags+=("$a") || env+=("$a"); done
    step "bench_${label}_$round" 240 env "${env[@]}" "$binary" --configs="$configs" \
      --compute_dtypes="${DTYPES:-bf16,fp8}" --iters="${ITERS:-8}" --zero_grads=true \
      --accumulating_iters="${ACCUM_ITERS:-${ITERS:-8}}" --json="$out/bench_${label}.jsonl" \
      "${flags[@]}"
  }
  variants=${VARIANTS:-"base:gpu_bench_base now:gpu_bench"}
  labels=()
  for v in $variants; do labels+=("${v%%:*}"); done
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in $variants; do
      IFS=: read -r -a parts <<<"$v"
      compare_run "$r" "${parts[@]}"
    done
  done
  python3 - "$out" "${labels[@]}" <<'PY'
import json, os, statistics, sys
out, labels = sys.argv[1], sys.argv[2:]
runs = {}
for label in labels:
    path = os.path.join(out, "bench_%s.jsonl" % label)
    if os.path.exists(path):
        runs[label] = [json.loads(l) for l in open(path)]
keys = sorted({(r["config"], r.get("compute_dtype", "bf16")) for rs in runs.values() for r in rs})
first = labels[0]
def pick(label, cfg, dt):
    return [r for r in runs.get(label, []) if r["config"] == cfg and r.get("compute_dtype", "bf16") == dt]
fields = (("fwd", "fwd_device_ms"), ("f+b zeroed", "fwdbwd_device_ms"),
          ("f+b accum", "fwdbwd_accum_device_ms"), ("accum mean", "fwdbwd_accum_mean_device_ms"))
print("device ms, median of each run's medians (runs listed); ratio = label / %s" % first)
for cfg, dt in keys:
    base = pick(first, cfg, dt)
    for label in runs:
        rs = pick(label, cfg, dt)
        if not rs:
            continue
        cells = []
        for name, key in fields:
            vals = [r.get(key, float("nan")) for r in rs]
            m = statistics.median(vals)
            b = statistics.median([r.get(key, float("nan")) for r in base]) if base else float("nan")
            cells.append("%s %6.2f (%s) x%.3f" % (name, m, "/".join("%.2f" % v for v in vals), m / b))
        gg = statistics.median([r["breakdown_fwdbwd_ms"].get("GroupedGemm", 0) for r in rs])
        print("%-8s %-4s %-5s %s | GroupedGemm f+b %.2f" % (cfg, dt, label, " | ".join(cells), gg))
    fps = {(label, i): r.get("fingerprint") for label in runs for i, r in enumerate(pick(label, cfg, dt))}
    same = len(set(fps.values())) == 1
    print("%-8s %-4s fingerprints of %d runs: %s" % (cfg, dt, len(fps),
          "bitwise equal" if same else "DIFFERENT " + repr(fps)))
PY
fi
if [ "$what" = probe ]; then
  # PROBE="CONFIG:ROWS_SCALE ..." (e.g. "dsv3:routed qwen3:0.875"): gemm_probe per entry,
  # ROWS_SCALE "routed" = --routed_rows (every expert's rows as random routing spreads them),
  # a number = --rows_scale; ENUMERATE its --enumerate (custom), PROBE_KINDS its --kinds (all
  # six). Candidate table entries go to $OUT/plans.txt, JSON to $OUT/probe.jsonl. An entry goes
  # into engine/cuda/cublaslt_plans.cc only if `compare` with
  # VARIANTS="heur:gpu_bench:--cublaslt_tuned=false tuned:gpu_bench", run again with it,
  # confirms the gain (and bitwise equal fingerprints).
  probe() {  # probe CONFIG ROWS_SCALE|routed
    local rows="--rows_scale=$2"
    [ "$2" = routed ] && rows=--routed_rows
    timeout 300 gemm_probe --configs="$1" "$rows" --enumerate="${ENUMERATE:-custom}" \
      --kinds="${PROBE_KINDS:-up,down,dgrad_down,dgrad_up,wgrad_wo,wgrad_wi}" \
      >>"$out/probe.jsonl" 2>>"$out/plans.txt"
  }
  for p in ${PROBE:?PROBE=\"CONFIG:ROWS_SCALE ...\" is required}; do
    step "probe_${p%%:*}_${p#*:}" 300 probe "${p%%:*}" "${p#*:}"
  done
  [ -f "$out/plans.txt" ] && grep '^plan ' "$out/plans.txt"
fi
if [ "$what" = service ]; then
  # The engine's API time (gpu_bench te_seed at 128 / 4096 / 16384 tokens), then
  # bench/service_bench.sh (gRPC, shared memory, CUDA IPC; WORKERS CUDA workers, default 1,
  # bf16) for SHAPES (H,F,E,k,T) under each of SERVICE_VARIANTS, ROUNDS (1) times alternating:
  # "LABEL[:VAR=VALUE...]", VAR one of service_bench.sh's (SHM, MOED_FLAGS, MOECTL_FLAGS, STEPS,
  # WARMUP) or bin=DIR (DIR's moed / moectl first on PATH: a base build from
  # tools/build_base_binary.sh). One summary line per shape and label
  # (tools/service_bench_summary.py); then grpc_loopback_bench (SKIP_LOOPBACK=1 skips it).
  # Examples (the default is "now": moed's and moectl's defaults):
  #   SERVICE_VARIANTS="now base:SHM=0:MOED_FLAGS=--shm_relay=false:MOECTL_FLAGS=--lanes=1"
  #   SERVICE_VARIANTS="c2:SHM=0:MOECTL_FLAGS=--concurrency=2 c4:SHM=0:MOECTL_FLAGS=--concurrency=4"
  #   SERVICE_VARIANTS="reused:SHM=0 new:SHM=0:MOECTL_FLAGS=--noreuse_outputs" ROUNDS=2
  #   SERVICE_VARIANTS="base:SHM=0:bin=.gpu/base now:SHM=0" ROUNDS=2   # this build vs a base one
  #   SHAPES=64,128,8,2,16 SERVICE_VARIANTS="tiny:STEPS=200"    # the fixed cost of a call
  for t in 128 4096 16384; do
    step "gpu_bench_te_seed_$t" 120 bash -c \
      "gpu_bench --configs=te_seed --tokens=$t >'$out/gb$t.json' 2>'$out/gb$t.err'"
  done
  read -r -a shapes <<<"${SHAPES:-1024,4096,8,2,128 1024,4096,8,2,4096 1024,4096,8,2,16384 4096,14336,8,2,4096 2048,768,128,8,4096}"
  service_run() {  # service_run ROUND LABEL [VAR=VALUE...]
    local round=$1 label=$2 env=() path=$PATH
    shift 2
    for a in "$@"; do
      case "$a" in
        bin=*)
          path="$PWD/${a#bin=}:$PATH"
          # A base moed starts the moe-worker next to it: this build's unless one was packed.
          [ -x "${a#bin=}/moed" ] && [ ! -e "${a#bin=}/moe-worker" ] &&
            ln -s "$(command -v moe-worker)" "${a#bin=}/moe-worker"
          ;;
        *) env+=("$a") ;;
      esac
    done
    local suffix=$([ "${ROUNDS:-1}" -gt 1 ] && echo "_$round")
    PATH=$path step "service_${label}$suffix" 400 env OUT="$out" LABEL="$label$suffix" \
      STEPS=10 WARMUP=2 "${env[@]}" bench/service_bench.sh --device=cuda \
      --workers="${WORKERS:-1}" --dtype=bf16 "${shapes[@]}"
    service_labels+=("$label$suffix")
  }
  service_labels=()
  for r in $(seq 1 "${ROUNDS:-1}"); do
    for v in ${SERVICE_VARIANTS:-now}; do
      IFS=: read -r -a parts <<<"$v"
      service_run "$r" "${parts[@]}"
    done
  done
  python3 tools/service_bench_summary.py "$out" --output_buffers "${service_labels[@]}"
  if [ -z "${SKIP_LOOPBACK:-}" ] && [ -x "$(command -v grpc_loopback_bench)" ]; then
    for t in tcp unix; do
      step "loopback_$t" 60 bash -c "grpc_loopback_bench --bytes=67108864 --iters=10 \
        --parts=1,2,4 --transport=$t | tee -a '$out/loopback.jsonl'"
    done
  fi
fi
if [ "$what" = grpc_bw ]; then
  # bench/grpc_bandwidth.sh --device=cuda --workers=1 --dtype=bf16 for GRPC_BW_SHAPES (default
  # te_seed at 4096 and 16384 tokens: x 8 / 32 MiB), moectl without step channel or shared
  # memory, under GRPC_BW_VARIANTS ("LABEL:DIR ...", DIR holding moed, moe-worker and moectl;
  # default "now:" = the packed ones), ROUNDS (default 1) alternating; paths "unary" (moectl's
  # defaults: 16 lanes on 16 cores) and "stream" (one connection, ForwardStream /
  # BackwardStream in 4 MiB pieces). One JSON line per shape and path in
  # $out/grpc_bandwidth.jsonl. Example, this build against main's binaries in .gpu/base:
  #   GRPC_BW_VARIANTS="base:.gpu/base now:" ROUNDS=2 tools/gpu_checks.sh grpc_bw
  read -r -a bw_shapes <<<"${GRPC_BW_SHAPES:-1024,4096,8,2,4096 1024,4096,8,2,16384}"
  step grpc_bandwidth 580 bash -c "OUT='$out' VARIANTS='${GRPC_BW_VARIANTS:-now:}' \
    ROUNDS=${ROUNDS:-1} bench/grpc_bandwidth.sh --device=cuda --workers=1 --dtype=bf16 \
    ${bw_shapes[*]} | tee '$out/grpc_bandwidth.jsonl'"
  cat "$out/grpc_bandwidth.jsonl"
fi
printf '%s\n' "${summary[@]}"
