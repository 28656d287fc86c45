# Source on the GPU machine: carried libraries first, then CUDA's and the system's (NCCL).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -d "$here/lib" ] || tar -C "$here" -xJf "$here/lib.tar.xz" 2>/dev/null ||
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$here/lib.tar.xz" "$here"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH="$here/bin:$PATH"
export NCCL_NVLS_ENABLE=0
