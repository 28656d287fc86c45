#!/usr/bin/env bash
# Copies built binaries and the shared libraries they need into one folder, for the runtime
# stage of deploy/docker/Dockerfile (and for any machine without the build packages).
#
#   deploy/docker/collect_runtime.sh /opt/moed bazel-bin/server/moed bazel-bin/server/moe-worker
#
# Layout written: DEST/bin/<binary> and DEST/lib/<every library ldd resolves>, except the
# libraries the runtime base image already has: glibc, libstdc++/libgcc, the CUDA toolkit
# libraries, NCCL and the NVIDIA driver (injected by the container toolkit at run time).
# Copying those would pin the image to the build machine's driver or shadow the base's CUDA.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 DEST BINARY..." >&2
  exit 2
fi
dest=$1
shift
mkdir -p "$dest/bin" "$dest/lib"

# Libraries left to the runtime base image (regular expression on the file name).
system='linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libresolv|libutil|libstdc\+\+|libgcc_s'
cuda='libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia|libnvrtc|libnvJitLink'
skip="^(${system}|${cuda})\.so"

for bin in "$@"; do
  install -m 0755 "$bin" "$dest/bin/"
  # `ldd` prints "name => /path (addr)"; an unresolved library is "name => not found".
  if ldd "$bin" | grep -q 'not found'; then
    echo "collect_runtime: unresolved libraries for $bin:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if [[ "$name" =~ $skip ]]; then continue; fi
    cp -nL "$path" "$dest/lib/$name"
  done
done
echo "collect_runtime: $(ls "$dest/bin" | wc -l) binaries," \
  "$(ls "$dest/lib" | wc -l) libraries in $dest"
