#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/moe.proto without Bazel: the same protoc command as
# the //client/python:stubs genrule. Writes DIR/proto/moe_pb2.py and DIR/proto/moe_pb2_grpc.py.
#
#   client/python/gen_stubs.sh /tmp/moe_stubs
#   export PYTHONPATH=$PWD/client/python:/tmp/moe_stubs
set -euo pipefail
out=${1:?usage: $0 OUTPUT_DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
plugin=$(command -v grpc_python_plugin) || {
  echo "gen_stubs: grpc_python_plugin not found (Debian package protobuf-compiler-grpc)" >&2
  exit 1
}
protoc --proto_path=. --python_out="$out" --plugin=protoc-gen-grpc_python="$plugin" \
  --grpc_python_out="$out" proto/moe.proto
echo "gen_stubs: wrote $out/proto/moe_pb2.py and moe_pb2_grpc.py"
