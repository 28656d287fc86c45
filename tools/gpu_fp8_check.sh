#!/bin/bash
# gpu_fp8_check.sh: the FP8 compute dtype on the GPU machine (one H200 is enough), one call, from
# the folder tools/pack_gpu.sh made (carry .gpu): the GPU tests (FP8 quantise/GEMM ops against
# the CPU emulation, the layer in FP8 against the CPU emulation and the fp64 reference, two runs
# bitwise equal; the fp32/bf16 cases of the same binaries run too; '*Fp8*' also takes the
# grouped transposed quantisation, the FP8 weight-gradient GEMMs, the activation amax and the
# delayed scaling's history), then gpu_bench for te_seed, qwen3, mixtral and dsv3 in bf16, FP8
# delayed and FP8 current back to back in the same process, with a table of the device and
# engine API times, the FP8 speed-ups and issue 40's targets. Logs and JSON go to $OUT.
#
#   here:  bazel build //tests/gpu:cuda_backend_ops_test //tests/gpu:cuda_layer_test \
#              //bench:gpu_bench && tools/pack_gpu.sh
#   there: OUT=$OUT tools/gpu_fp8_check.sh          # device tool: carry [".gpu"]
#   BENCH_CONFIGS=mixtral ITERS=3 FP8_RECIPES=DELAYED to shorten; SKIP_TESTS=1 / SKIP_BENCH=1 to
#   skip a half (the device tool allows 600 s per command: tests ~1 min, the twelve benchmark
#   runs not measured yet (six took ~4-6 min at 10 iterations); if one call is too tight, run
#   SKIP_BENCH=1 then SKIP_TESTS=1 on the same warm machine).
set -uo pipefail
step_width=24
source "$(dirname "${BASH_SOURCE[0]}")/gpu_step.sh"  # step, summary
gpu_check_begin fp8_tests.log
if [ -z "${SKIP_TESTS:-}" ]; then
  # The FP8 tests; FULL_TESTS=1 also runs the whole binaries (their fp32/bf16 cases).
  step ops_fp8 90 cuda_backend_ops_test --gtest_filter='*Fp8*'
  step layer_fp8 120 cuda_layer_test --gtest_filter='*fp8*:*Fp8*'
  if [ -n "${FULL_TESTS:-}" ]; then
    step ops_all 150 cuda_backend_ops_test
    step layer_all 240 cuda_layer_test
  fi
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|GPU FP8 vs fp64|Expected|actual|Which is" "$log" |
    tail -60
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
printf '%s\n' "${summary[@]}"
