#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/moe.proto as the package moe_client.proto, with
# Debian's protoc and grpc_python_plugin (protobuf-compiler, protobuf-compiler-grpc; the same
# protobuf 3.21 / gRPC 1.51 as python3-protobuf / python3-grpcio). The one place the stubs are
# made: the //client/python:stubs genrule, setup.py (pip install) and a source checkout use it.
#
#   client/python/gen_stubs.sh OUT_ROOT [PROTO]   # writes OUT_ROOT/moe_client/proto/moe_pb2*.py
#   client/python/gen_stubs.sh client/python      # stubs next to the sources (git ignores them)
#
# The proto is compiled as moe_client/proto/moe.proto (a staged copy), so the generated
# moe_pb2_grpc.py imports `from moe_client.proto import moe_pb2`: the stubs live inside the
# package and nothing named `proto` lands on sys.path.
set -euo pipefail
out=${1:?usage: $0 OUT_ROOT [PROTO]}
proto=${2:-$(dirname "$0")/../../proto/moe.proto}
[ -f "$proto" ] || { echo "gen_stubs: $proto not found" >&2; exit 1; }
plugin=$(command -v grpc_python_plugin) || {
  echo "gen_stubs: grpc_python_plugin not found (Debian package protobuf-compiler-grpc)" >&2
  exit 1
}
command -v protoc >/dev/null || {
  echo "gen_stubs: protoc not found (Debian package protobuf-compiler)" >&2
  exit 1
}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/moe_client/proto" "$out"
cp "$proto" "$stage/moe_client/proto/moe.proto"
protoc --proto_path="$stage" --python_out="$out" --plugin=protoc-gen-grpc_python="$plugin" \
  --grpc_python_out="$out" "$stage/moe_client/proto/moe.proto"
