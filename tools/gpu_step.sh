# gpu_step.sh: the step runner of the GPU check scripts (gpu_checks.sh, gpu_fp8_check.sh,
# gpu_step15_check.sh, gpu_overlap_check.sh); sourced, not run. Set `log` (the log file) first,
# or call gpu_check_begin, and `step_width` for a summary column other than 28 characters.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/gpu_step.sh"
#   gpu_check_begin tests.log             # out, log, the packed binaries' environment
#   step layer_test 120 cuda_layer_test   # output into $log, a line into summary
#   printf '%s\n' "${summary[@]}"
summary=()
gpu_check_begin() {  # gpu_check_begin LOG_NAME: out=$OUT (default gpu_out), log=$out/LOG_NAME
  out=${OUT:-gpu_out}
  mkdir -p "$out"
  source .gpu/env.sh  # the binaries of tools/pack_gpu.sh on PATH
  export MOED_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
  log="$out/$1"
  { date -u; nvidia-smi -L; } >>"$log" 2>&1
}
step() {  # step NAME TIMEOUT_S COMMAND...
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
