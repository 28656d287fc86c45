#!/bin/bash
# gpu_tuned_check.sh: the expert GEMM table (engine/cuda/cublaslt_plans.cc, issue 15) on the GPU
# machine in one call, from a .gpu folder tools/pack_gpu.sh made with cuda_backend_ops_test,
# cuda_layer_test, gpu_bench and gemm_probe (device tool: carry [".gpu"]):
#   1. with PROBE="CONFIG:ROWS_SCALE ..." (e.g. "dsv3:routed te_seed:routed qwen3:0.875"),
#      gemm_probe for each: ROWS_SCALE "routed" is --routed_rows (every expert's rows as random
#      routing spreads them, the way to probe a many-expert preset), a number --rows_scale (the
#      same rows for every expert); ENUMERATE its --enumerate (default custom: the heuristic's
#      candidates with every custom option, cluster and swizzle; all: every tile, stages,
#      cluster and swizzle with custom option 0); PROBE_KINDS its --kinds (default all six).
#      The candidate table entries it finds are collected in $OUT/plans.txt, JSON in
#      $OUT/probe.jsonl;
#   2. tools/gpu_overlap_check.sh with and without the table (MOED_CUBLASLT_TUNED=0) for
#      CONFIGS (default te_seed,qwen3,mixtral), ROUNDS times (default 2), bf16: the GPU tests
#      first unless SKIP_TESTS=1 (TunedGemmPlansKeepResults among them), then the step's
#      medians side by side and whether the fingerprints are bitwise equal; gpu_bench's JSON
#      also counts the tuned plans taken and refused (`tuned_gemm_plans`, `tuned_gemm_refused`).
# A probed entry goes into the table only if step 2, run again with it, confirms the gain.
#
#   there: OUT=$OUT tools/gpu_tuned_check.sh
#          PROBE="dsv3:routed" CONFIGS=dsv3 ITERS=6 ROUNDS=1 OUT=$OUT tools/gpu_tuned_check.sh
set -uo pipefail
tools_dir=$(dirname "${BASH_SOURCE[0]}")
source "$tools_dir/gpu_step.sh"  # step, summary
gpu_check_begin probe.log
probe() {  # probe CONFIG ROWS_SCALE|routed: JSON lines to probe.jsonl, plan lines to plans.txt
  local rows="--rows_scale=$2"
  [ "$2" = routed ] && rows=--routed_rows
  timeout 300 gemm_probe --configs="$1" "$rows" --enumerate="${ENUMERATE:-custom}" \
    --kinds="${PROBE_KINDS:-up,down,dgrad_down,dgrad_up,wgrad_wo,wgrad_wi}" \
    >>"$out/probe.jsonl" 2>>"$out/plans.txt"
}
for p in ${PROBE:-}; do
  step "probe_${p%%:*}_${p#*:}" 300 probe "${p%%:*}" "${p#*:}"
done
[ -f "$out/plans.txt" ] && grep '^plan ' "$out/plans.txt"
printf '%s\n' "${summary[@]}"
VARIANTS="heur:gpu_bench:MOED_CUBLASLT_TUNED=0 tuned:gpu_bench" DTYPES=bf16 \
  "$tools_dir/gpu_overlap_check.sh"
