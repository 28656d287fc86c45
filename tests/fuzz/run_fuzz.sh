#!/usr/bin/env bash
# Builds one libFuzzer target with clang (-fsanitize=fuzzer,address) from the workspace's
# sources and Debian's libraries, then fuzzes it for FUZZ_SECONDS (default 20) starting from
# its seed corpus tests/fuzz/corpus/<target>/, after replaying tests/fuzz/regressions/<target>/.
# A crash fails the test and leaves the input under $TEST_UNDECLARED_OUTPUTS_DIR: check it in
# under tests/fuzz/regressions/<target>/ once fixed (the *_replay tests run it on every build).
#
#   run_fuzz.sh TARGET FUZZ_SOURCE [SOURCES...]    (a .proto among SOURCES is compiled by protoc)
# Without clang++ (setup.sh installs it) the test says so and passes: the gcc-built
# <target>_replay tests still replay the corpus and the regressions.
set -euo pipefail
target=$1
shift
if ! command -v clang++ > /dev/null; then
  echo "run_fuzz: SKIPPED: no clang++ on this machine (./setup.sh installs clang)"
  exit 0
fi
work=${TEST_TMPDIR:-$(mktemp -d)}/fuzz_$target
mkdir -p "$work/gen" "$work/corpus"
sources=()
for f in "$@"; do
  case $f in
    *.proto)
      protoc --cpp_out="$work/gen" -I. "$f"
      sources+=("$work/gen/${f%.proto}.pb.cc")
      ;;
    *) sources+=("$f") ;;
  esac
done
modules="protobuf absl_status absl_statusor absl_strings absl_str_format"
# shellcheck disable=SC2046
clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address \
  -I. -I"$work/gen" \
  $(pkg-config --cflags $modules) "${sources[@]}" \
  $(pkg-config --libs $modules) -o "$work/fuzzer" 2> "$work/build.log" || {
  cat "$work/build.log"
  exit 1
}
out=${TEST_UNDECLARED_OUTPUTS_DIR:-$work}
cp tests/fuzz/corpus/"$target"/* "$work/corpus/"
if [ -d tests/fuzz/regressions/"$target" ]; then
  "$work/fuzzer" -runs=0 tests/fuzz/regressions/"$target"/
fi
"$work/fuzzer" -max_total_time="${FUZZ_SECONDS:-20}" -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$out/" "$work/corpus"
