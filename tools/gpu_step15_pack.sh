#!/bin/bash
# gpu_step15_pack.sh: builds and packs what tools/gpu_step15_check.sh runs, into .gpu (carry it):
# the GPU tests and gpu_bench of this checkout, plus gpu_bench_base: this checkout's
# bench/gpu_bench.cc (for its fingerprint) on the engine of BASE_REV (default: where this
# branch left main), whose fingerprints the check compares with this build's (results bitwise
# unchanged by the kernel changes). The working tree's files are put back before the main
# build, whatever happens; run it on a clean tree.
#
#   tools/gpu_step15_pack.sh            # then: OUT=$OUT tools/gpu_step15_check.sh there
#   BASE_REV=381ad98 tools/gpu_step15_pack.sh   # on main: the engine to compare with
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
base_rev=${BASE_REV:-$(git merge-base HEAD main)}
if [ "$(git rev-parse "$base_rev")" = "$(git rev-parse HEAD)" ]; then
  echo "gpu_step15_pack.sh: the base is HEAD itself (on main?): give BASE_REV=<commit>" >&2
  exit 2
fi
mapfile -t files < <(git diff --name-only "$base_rev" HEAD -- engine bench/gpu_timing.h \
  bench/gpu_timing.cc)
tmp=$(mktemp -d)
tar -cf "$tmp/work.tar" "${files[@]}"
restore() { tar -xf "$tmp/work.tar"; rm -rf "$tmp"; }
trap restore EXIT
for f in "${files[@]}"; do
  if git cat-file -e "$base_rev:$f" 2>/dev/null; then git show "$base_rev:$f" > "$f"; fi
done
bazel build //bench:gpu_bench
mkdir -p "$tmp/base"
cp -L bazel-bin/bench/gpu_bench "$tmp/base/gpu_bench_base"
chmod u+w "$tmp/base/gpu_bench_base"
tar -xf "$tmp/work.tar"
bazel build //tests/gpu:cuda_backend_ops_test //tests/gpu:cuda_layer_test //bench:gpu_bench
tools/pack_gpu.sh .gpu bazel-bin/tests/gpu/cuda_backend_ops_test \
  bazel-bin/tests/gpu/cuda_layer_test bazel-bin/bench/gpu_bench "$tmp/base/gpu_bench_base"
