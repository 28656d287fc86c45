#!/bin/bash
# gpu_client_ab_check.sh: moectl and moed against their previous builds, on the GPU machine,
# alternating ROUNDS times (default 2) in one call: "base" = the binaries in .gpu/base
# (tools/build_base_binary.sh; first on PATH), "now" = .gpu/bin; moed + one CUDA worker with its
# defaults, bf16, gRPC only (SHM=0), STEPS steps after WARMUP (default 20 after 3). One summary
# line per shape and run (tools/service_bench_summary.py); JSON under $OUT.
#
#   here:  bazel build //client:moectl //server:moed //server:moe-worker
#          tools/pack_gpu.sh .gpu bazel-bin/client/moectl bazel-bin/server/moed \
#            bazel-bin/server/moe-worker
#          tools/build_base_binary.sh <rev> //client:moectl .gpu/base/moectl client
#          tools/build_base_binary.sh <rev> //server:moed .gpu/base/moed server   # and/or
#   there: OUT=$OUT tools/gpu_client_ab_check.sh [SHAPE...]   # device tool: carry [".gpu"]
set -uo pipefail
source .gpu/env.sh
export NCCL_NVLS_ENABLE=0
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(1024,4096,8,2,4096 1024,4096,8,2,16384 2048,768,128,8,4096)
# A base moed starts the moe-worker next to it: this build's, unless a base one was packed.
[ -x .gpu/base/moed ] && [ ! -e .gpu/base/moe-worker ] && ln -s ../bin/moe-worker .gpu/base/moe-worker
labels=()
sb() { OUT=$OUT SHM=0 STEPS=${STEPS:-20} WARMUP=${WARMUP:-3} timeout 200 \
         bench/service_bench.sh --device=cuda --workers=1 --dtype=bf16 "${shapes[@]}" \
         >/dev/null 2>>"$OUT/sb.err"; }
for r in $(seq 1 "${ROUNDS:-2}"); do
  PATH="$PWD/.gpu/base:$PATH" LABEL=base_$r sb
  LABEL=now_$r sb
  labels+=("base_$r" "now_$r")
done
python3 tools/service_bench_summary.py "$OUT" "${labels[@]}"
