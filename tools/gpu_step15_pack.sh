#!/bin/bash
# gpu_step15_pack.sh: builds and packs what tools/gpu_step15_check.sh runs, into .gpu (carry it):
# the GPU tests and gpu_bench of this checkout, plus gpu_bench_base, the same gpu_bench with
# the kernel files of BASE_REV (default main: the kernels before this branch's changes), whose
# fingerprints the check compares with this build's (bitwise-unchanged results). The working
# tree's kernel files are put back before the main build, whatever happens.
#
#   tools/gpu_step15_pack.sh            # then: OUT=$OUT tools/gpu_step15_check.sh there
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
base_rev=${BASE_REV:-main}
kernels=(engine/cuda/elementwise_kernels.cu engine/cuda/permute_kernels.cu)
tmp=$(mktemp -d)
cp "${kernels[@]}" "$tmp/"
restore() { for f in "${kernels[@]}"; do cp "$tmp/$(basename "$f")" "$f"; done; rm -rf "$tmp"; }
trap restore EXIT
for f in "${kernels[@]}"; do git show "$base_rev:$f" > "$f"; done
bazel build //bench:gpu_bench
mkdir -p "$tmp/base"
cp -L bazel-bin/bench/gpu_bench "$tmp/base/gpu_bench_base"
chmod u+w "$tmp/base/gpu_bench_base"
for f in "${kernels[@]}"; do cp "$tmp/$(basename "$f")" "$f"; done
bazel build //tests/gpu:cuda_backend_ops_test //tests/gpu:cuda_layer_test //bench:gpu_bench
tools/pack_gpu.sh .gpu bazel-bin/tests/gpu/cuda_backend_ops_test \
  bazel-bin/tests/gpu/cuda_layer_test bazel-bin/bench/gpu_bench "$tmp/base/gpu_bench_base"
git diff --quiet -- "${kernels[@]}" || echo "gpu_step15_pack.sh: kernel files differ from HEAD" >&2
