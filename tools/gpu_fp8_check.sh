#!/bin/bash
# gpu_fp8_check.sh: the FP8 compute dtype on the GPU machine (one H200 is enough), one call, from
# the folder tools/pack_gpu.sh made (carry .gpu): the GPU tests (FP8 quantise/GEMM ops against
# the CPU emulation, the layer in FP8 against the CPU emulation and the fp64 reference, two runs
# bitwise equal; the fp32/bf16 cases of the same binaries run too; '*Fp8*' also takes the
# grouped transposed quantisation, the FP8 weight-gradient GEMMs and the activation amax), then
# gpu_bench for te_seed, mixtral and dsv3 in bf16 and FP8 back to back in the same process, with
# a summary table of the device times, the FP8 speed-up and the issue-16 targets. Logs and JSON
# go to $OUT.
#
#   here:  bazel build //tests/gpu:cuda_backend_ops_test //tests/gpu:cuda_layer_test \
#              //bench:gpu_bench && tools/pack_gpu.sh
#   there: OUT=$OUT tools/gpu_fp8_check.sh          # device tool: carry [".gpu"]
#   BENCH_CONFIGS=mixtral ITERS=5 to shorten; SKIP_TESTS=1 / SKIP_BENCH=1 to skip a half (the
#   device tool allows 600 s per command: tests ~1 min, the six benchmark runs ~4-6 min; if
#   one call is too tight, run SKIP_BENCH=1 then SKIP_TESTS=1 on the same warm machine).
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
  step bench_bf16_fp8 "${BENCH_TIMEOUT:-420}" gpu_bench --configs="${BENCH_CONFIGS:-te_seed,mixtral,dsv3}" \
    --compute_dtypes=bf16,fp8 --iters="${ITERS:-10}" --json="$out/bench_fp8.jsonl"
  python3 - "$out/bench_fp8.jsonl" <<'PY'
import json, os, sys
path = sys.argv[1]
if not os.path.exists(path):
    sys.exit("no benchmark output")
rows = {}
for line in open(path):
    r = json.loads(line)
    rows[(r["config"], r.get("compute_dtype", "BF16"))] = r
targets = {"mixtral": ("fwd <= 11 ms, fwd+bwd <= 36 ms", lambda f: f["fwd_device_ms"] <= 11 and f["fwdbwd_device_ms"] <= 36)}
print("%-8s %-5s %9s %9s %6s %6s %7s %7s  %s" % ("config", "dtype", "fwd ms", "f+b ms", "fwdTF", "f+bTF", "x fwd", "x f+b", "target"))
for config in dict.fromkeys(c for c, _ in rows):
    b = rows.get((config, "BF16"))
    for dtype in ("BF16", "FP8"):
        r = rows.get((config, dtype))
        if r is None:
            continue
        sf = sb = ""
        verdict = ""
        if dtype == "FP8" and b is not None:
            xf = b["fwd_device_ms"] / r["fwd_device_ms"]
            xb = b["fwdbwd_device_ms"] / r["fwdbwd_device_ms"]
            sf, sb = "%.2fx" % xf, "%.2fx" % xb
            if config in targets:
                text, ok = targets[config]
                verdict = "%s: %s" % (text, "met" if ok(r) else "NOT met")
            else:
                verdict = ">= 1.3x: %s" % ("met" if min(xf, xb) >= 1.3 else "NOT met")
        print("%-8s %-5s %9.2f %9.2f %6.0f %6.0f %7s %7s  %s" % (
            config, dtype, r["fwd_device_ms"], r["fwdbwd_device_ms"], r["fwd_tflops_device"],
            r["fwdbwd_tflops_device"], sf, sb, verdict))
for config in dict.fromkeys(c for c, _ in rows):
    r = rows.get((config, "FP8"))
    if r:
        top = sorted(r["breakdown_fwdbwd_ms"].items(), key=lambda kv: -kv[1])[:6]
        print("FP8 %s fwd+bwd breakdown (ms): %s" % (config, ", ".join("%s %.2f" % kv for kv in top)))
PY
fi
printf '%s\n' "${summary[@]}"
