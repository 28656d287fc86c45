#!/bin/bash
# gpu_overlap_check.sh: the backward's data- and weight-gradient GEMMs side by side (issue 15),
# measured on the GPU machine against the engine it replaced, in one call, from the folder
# tools/gpu_step15_pack.sh made (carry .gpu; gpu_bench_base = this gpu_bench.cc on BASE_REV's
# engine):
#   1. unless SKIP_TESTS=1: cuda_backend_ops_test and cuda_layer_test, FP8 cases included;
#   2. gpu_bench for CONFIGS (default te_seed,qwen3,mixtral) and DTYPES (default bf16,fp8),
#      zeroed and accumulating fwd+bwd steps in one process, alternating ROUNDS times
#      (default 2) between the VARIANTS, each LABEL:BINARY[:ENV=VALUE...] (default: base =
#      gpu_bench_base, now = gpu_bench, serial = gpu_bench with GroupedGemm's old rule, large
#      GEMMs one at a time, MOED_GEMM_SERIAL_GFLOPS=60; SKIP_SERIAL=1 leaves serial out);
#      (ITERS steps of each kind, default 8; ACCUM_ITERS accumulating ones, default ITERS:
#      a multiple of the deferral groups, e.g. 60, makes the accumulating mean a steady state);
#   3. a table: medians per run, each variant / the first, and whether the fingerprints of
#      every run of a config and datatype are bitwise equal (gpu_bench's `fingerprint`: out, d_x and d_gate of
#      a step from zero gradients, then the wi and wo gradients after a second, accumulating
#      step).
#
#   here:  BASE_REV=<commit> tools/gpu_step15_pack.sh
#   there: OUT=$OUT tools/gpu_overlap_check.sh          # device tool: carry [".gpu"]
#          CONFIGS=dsv3 ROUNDS=1 SKIP_TESTS=1 SKIP_SERIAL=1 OUT=$OUT tools/gpu_overlap_check.sh
#          VARIANTS="s4:gpu_bench:MOED_GEMM_STREAMS=4 s8:gpu_bench:MOED_GEMM_STREAMS=8" \
#            DTYPES=bf16 OUT=$OUT tools/gpu_overlap_check.sh    # one build, two settings
set -uo pipefail
step_width=30
source "$(dirname "${BASH_SOURCE[0]}")/gpu_step.sh"  # step, summary
gpu_check_begin overlap.log
configs=${CONFIGS:-te_seed,qwen3,mixtral}
dtypes=${DTYPES:-bf16,fp8}
iters=${ITERS:-8}

if [ -z "${SKIP_TESTS:-}" ]; then
  step ops_test 300 cuda_backend_ops_test
  step layer_test 240 cuda_layer_test
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Expected|actual|Which is" "$log" | tail -40
fi

bench() {  # bench LABEL BINARY [ENV=VALUE...]
  local label=$1 binary=$2; shift 2
  step "bench_${label}_$r" 240 env "$@" "$binary" --configs="$configs" --compute_dtypes="$dtypes" \
    --iters="$iters" --zero_grads=true --accumulating_iters="${ACCUM_ITERS:-$iters}" \
    --json="$out/bench_${label}.jsonl"
}
variants=${VARIANTS:-"base:gpu_bench_base now:gpu_bench"}
[ -z "${VARIANTS:-}" ] && [ -z "${SKIP_SERIAL:-}" ] && \
  variants+=" serial:gpu_bench:MOED_GEMM_SERIAL_GFLOPS=60"
labels=()
for v in $variants; do labels+=("${v%%:*}"); done
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in $variants; do
    IFS=: read -r -a parts <<<"$v"
    bench "${parts[@]}"
  done
done

python3 - "$out" "${labels[@]}" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
runs = {}
for label in sys.argv[2:]:
    path = os.path.join(out, "bench_%s.jsonl" % label)
    if os.path.exists(path):
        runs[label] = [json.loads(l) for l in open(path)]
keys = sorted({(r["config"], r.get("compute_dtype", "bf16")) for rs in runs.values() for r in rs})
first = sys.argv[2]
def pick(label, cfg, dt):
    return [r for r in runs.get(label, []) if r["config"] == cfg and r.get("compute_dtype", "bf16") == dt]
fields = (("fwd", "fwd_device_ms"), ("f+b zeroed", "fwdbwd_device_ms"),
          ("f+b accum", "fwdbwd_accum_device_ms"),
          ("accum mean", "fwdbwd_accum_mean_device_ms"))
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
printf '%s\n' "${summary[@]}"
