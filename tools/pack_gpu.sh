#!/bin/bash
# pack_gpu.sh [OUTDIR [BINARY...]]
#
# Packs GPU binaries built here (Debian 12 toolchain, CUDA 13.0) for the GPU machine, which has
# glibc/libstdc++, CUDA (cudart, cuBLASLt) and NCCL but no gRPC/protobuf/Abseil/Gloo: copies
# the binaries into OUTDIR/bin and every shared library they need that the GPU machine lacks
# into OUTDIR/lib, and writes OUTDIR/env.sh to source there. Builds nothing itself: run
# `bazel build` first. OUTDIR defaults to .gpu (ignored by git); with no BINARY the GPU tests,
# the GPU benchmark and, when built, moed/moe-worker/moectl are packed.
#
#   bazel build //tests/gpu:cuda_backend_ops_test //tests/gpu:cuda_layer_test \
#       //tests/gpu:ep2_gpu_test //bench:gpu_bench
#   tools/pack_gpu.sh            # -> .gpu/{bin,lib,env.sh}
#   # on the GPU machine: source .gpu/env.sh && tools/gpu_checks.sh
set -euo pipefail
out=${1:-.gpu}
shift || true
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  for b in bazel-bin/tests/gpu/cuda_backend_ops_test bazel-bin/tests/gpu/cuda_layer_test \
           bazel-bin/tests/gpu/ep2_gpu_test bazel-bin/bench/gpu_bench bazel-bin/bench/engine_bench \
           bazel-bin/bench/train_bench \
           bazel-bin/server/moed bazel-bin/server/moe-worker bazel-bin/client/moectl \
           bazel-bin/bench/grpc_loopback_bench; do
    [ -x "$b" ] && bins+=("$b")
  done
fi
[ ${#bins[@]} -gt 0 ] || { echo "pack_gpu.sh: nothing to pack (bazel build first)" >&2; exit 2; }
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
# The GPU machine provides these: the C/C++ runtime, CUDA, NCCL and the driver.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+|libgcc_s|libcuda\.so|libcudart|libcublas|libcublasLt|libnccl|libnvidia|libnvrtc|libnvJitLink)'
for b in "${bins[@]}"; do
  cp -L "$b" "$out/bin/"
  ldd "$b" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    [[ $name =~ $skip ]] && continue
    [ -f "$path" ] && cp -Lu "$path" "$out/lib/"
  done
done
# The Python client with its stubs generated here (Debian's protoc; they import under the GPU
# machine's grpcio / protobuf): PYTHONPATH=OUTDIR/py there (tools/gpu_checks.sh python).
mkdir -p "$out/py"
cp -r client/python/moe_client "$out/py/"
rm -rf "$out/py/moe_client/proto/moe_pb2"*.py "$out/py/moe_client/__pycache__"
client/python/gen_stubs.sh "$out/py"
# The libraries travel compressed (OpenBLAS alone is 36 MB); env.sh unpacks them there.
tar -C "$out" -cf - lib | xz -6 -T0 > "$out/lib.tar.xz"
rm -rf "$out/lib"
cat > "$out/env.sh" <<'ENV'
# Source on the GPU machine: carried libraries first, then CUDA's and the system's (NCCL).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -d "$here/lib" ] || tar -C "$here" -xJf "$here/lib.tar.xz" 2>/dev/null ||
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$here/lib.tar.xz" "$here"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH="$here/bin:$PATH"
export NCCL_NVLS_ENABLE=0
ENV
size_kb=$(du -sk "$out" | cut -f1)
echo "packed ${#bins[@]} binaries, $((size_kb / 1024)) MiB into $out"
if [ "$size_kb" -gt $((60 * 1024)) ]; then
  echo "pack_gpu.sh: $out is over 60 MiB; the device tool carries at most 64 MiB" >&2
  exit 1
fi
