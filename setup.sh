#!/usr/bin/env bash
# Installs everything moed needs to build and test, from the Debian archive only. Idempotent:
# packages already present are left alone, so a second run is a no-op. Run as root (or with
# sudo available). The Dockerfile (deploy/docker/) runs this same script: one source of truth.
#
#   ./setup.sh                # everything: build, tests, Python client, fuzzing, deploy checks
#   ./setup.sh --build-only   # what `bazel build` of the binaries needs (the image's build stage)
set -euo pipefail

# What `bazel build //server:moed //server:moe-worker //client:moectl` needs.
BUILD_PACKAGES=(
  # build
  bazel-bootstrap bazel-rules-java bazel-platforms g++ pkg-config
  # RPC and serialisation
  libgrpc++-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  # C++ libraries
  libabsl-dev libgtest-dev libgmock-dev libgloo-dev libopenblas-dev
  # TLS and token hashes (libcrypto); openssl makes the tests' throwaway certificates
  libssl-dev openssl
  # Prometheus metrics (registry, histograms, the pull exposer)
  prometheus-cpp-dev libcivetweb-dev
  # moectl's JSON output
  nlohmann-json3-dev
  # used by the local cluster scripts and tests
  procps iproute2
)

# The tests, the Python client, fuzzing and the deployment checks.
DEV_PACKAGES=(
  # Python client and its tests (Debian's /usr/bin/python3)
  python3 python3-grpcio python3-protobuf python3-numpy python3-torch python3-yaml
  # its install (pip from the checkout, no PyPI; client/python/README.md) and its venv
  python3-pip python3-setuptools python3-wheel python3-venv
  # fuzzing (tests/fuzz): clang with libFuzzer and AddressSanitizer runtimes
  clang libclang-rt-dev
  # deployment checks
  yamllint
)

case "${1:-}" in
  "") PACKAGES=("${BUILD_PACKAGES[@]}" "${DEV_PACKAGES[@]}") ;;
  --build-only) PACKAGES=("${BUILD_PACKAGES[@]}") ;;
  *) echo "usage: $0 [--build-only]" >&2; exit 2 ;;
esac

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${missing[@]}"
echo "setup: done"
