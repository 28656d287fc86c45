#!/usr/bin/env bash
# The documented install of the Python client works: `pip install --no-build-isolation
# --no-deps --no-index ./client/python` into a fresh venv of Debian's /usr/bin/python3
# (--system-site-packages: grpcio, protobuf, numpy from Debian) builds the stubs from the proto,
# puts them inside the package, and `python3 -m moe_client health|status|smoke` then works
# against a local moed from another folder with an empty environment (no PYTHONPATH).
#
#   install_test.sh MOED MOE_WORKER   (Bazel passes the binaries' runfiles paths)
set -euo pipefail
moed=$(realpath "$1")
worker=$(realpath "$2")
root=${TEST_SRCDIR:+$TEST_SRCDIR/${TEST_WORKSPACE:-moed}}
root=${root:-$PWD}
tmp=${TEST_TMPDIR:-$(mktemp -d)}
logs=${TEST_UNDECLARED_OUTPUTS_DIR:-$tmp}

# A checkout's shape: client/python and proto/moe.proto, real files (pip builds in the tree).
src=$tmp/src
rm -rf "$src" "$tmp/venv"
mkdir -p "$src/client" "$src/proto"
cp -rL "$root/client/python" "$src/client/python"
cp -L "$root/proto/moe.proto" "$src/proto/moe.proto"
rm -f "$src"/client/python/moe_client/proto/moe_pb2*.py  # made by the install, not carried

/usr/bin/python3 -m venv --system-site-packages "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps --no-index \
  "$src/client/python" > "$logs/pip.log" 2>&1 || { cat "$logs/pip.log"; exit 1; }
rm -rf "$src"  # the installed package must not need the sources

# A new shell's environment: no PYTHONPATH, and a folder with nothing of the project.
run() { (cd / && env -i PATH=/usr/bin:/bin HOME="$tmp" "$tmp/venv/bin/python" "$@"); }
run -c 'import moe_client, moe_client.proto.moe_pb2; print(moe_client.__file__)' | grep -q "$tmp/venv/"

port_file=$tmp/port
rm -f "$port_file"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$moed" --port=0 --port_file="$port_file" \
  --listen=127.0.0.1 --workers=2 --device=cpu --worker_binary="$worker" \
  --checkpoint_root="$tmp/checkpoints" > "$logs/moed.log" 2>&1 &
moed_pid=$!
trap 'kill $moed_pid 2>/dev/null; wait $moed_pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do [ -s "$port_file" ] && break; sleep 0.1; done
[ -s "$port_file" ] || { echo "moed wrote no port file"; cat "$logs/moed.log"; exit 1; }
server=127.0.0.1:$(cat "$port_file")

health=$(run -m moe_client health --server="$server" --wait --timeout=60)
[ "$health" = SERVING ] || { echo "health said: $health"; exit 1; }
run -m moe_client status --server="$server" | grep -q "serving: True"
run -m moe_client smoke --server="$server" | tee "$logs/smoke.log" | grep -q "smoke: PASS"
# A usage error exits 2.
set +e
run -m moe_client frobnicate > /dev/null 2>&1
usage=$?
set -e
[ "$usage" = 2 ] || { echo "usage error exited $usage, not 2"; exit 1; }
echo "install_test: PASS"
