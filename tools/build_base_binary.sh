#!/bin/bash
# build_base_binary.sh REV TARGET DEST [PATH...]: builds Bazel TARGET with the folders PATH
# (default: client) as they were at REV, copies the binary to DEST, and puts this checkout's
# folders back, whatever happens. For A/B runs of a binary against its previous version in
# one GPU call (the GPU machine has no Bazel). Refuses when PATH has uncommitted changes;
# files git ignores under PATH (caches) are removed with the folders.
#
#   tools/build_base_binary.sh 0f6848a //client:moectl .gpu/base/moectl client
set -euo pipefail
rev=$1 target=$2 dest=$3
shift 3
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(client)
cd "$(git rev-parse --show-toplevel)"
[ -z "$(git status --porcelain --ignored=no -- "${paths[@]}")" ] || {
  echo "build_base_binary.sh: uncommitted changes under ${paths[*]}" >&2; exit 2; }
restore() { rm -rf "${paths[@]}"; git checkout -q HEAD -- "${paths[@]}"; }
trap restore EXIT
rm -rf "${paths[@]}"
git archive "$rev" -- "${paths[@]}" | tar -x
bazel build "$target"
pkg=${target#//}
mkdir -p "$(dirname "$dest")"
cp -L "bazel-bin/${pkg%%:*}/${pkg##*:}" "$dest"
chmod u+w "$dest"
