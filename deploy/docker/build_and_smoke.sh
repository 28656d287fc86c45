#!/usr/bin/env bash
# Builds the CPU variant of deploy/docker/Dockerfile for real and smoke-tests it: a local Debian 12
# base image made with mmdebstrap (from the Debian mirror, nothing else), `buildah bud` with both
# build arguments pointing at it, then `moed --workers=2` + `moectl health` + `moectl smoke`
# inside the image. Prints the time of each step and a one-line verdict.
#
#   deploy/docker/build_and_smoke.sh                  # as root, from anywhere in the checkout
#   deploy/docker/build_and_smoke.sh --install-tools  # apt-get install buildah mmdebstrap first
#   deploy/docker/build_and_smoke.sh --rebuild-base   # make the Debian base again
#
# Both steps use buildah's chroot isolation (`bud --isolation chroot`, `run --isolation chroot`):
# it needs no container runtime and works on machines where podman/docker run is not allowed.
# With chroot isolation the container shares the host's network, so moed takes free ports
# (--port=0) and nothing collides with other servers on the host.
#
# Needs: root, buildah, mmdebstrap (Debian packages; checked, installed with --install-tools),
# a reachable Debian mirror ($MOED_DEBIAN_MIRROR, default http://deb.debian.org/debian) and
# ~6 GB in /var/lib/containers. Exit status: 0 PASS, 1 FAIL, 2 usage, 77 tools missing (skip).
# Not run by CI (docs/DEPLOY.md, "Building the image"): a cold build takes longer than CI's
# budget on its 2 cores.
set -euo pipefail

install_tools=0
rebuild_base=0
for arg in "$@"; do
  case "$arg" in
    --install-tools) install_tools=1 ;;
    --rebuild-base) rebuild_base=1 ;;
    *) echo "usage: $0 [--install-tools] [--rebuild-base]" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/../.."
version=$(cat VERSION)
base=localhost/moed-debian:12
image=localhost/moed:${version}-cpu
mirror=${MOED_DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=$(mktemp -d)
container=""
cleanup() {
  [ -n "$container" ] && buildah rm "$container" > /dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

say() { echo "build_and_smoke: $*"; }
now() { date +%s; }

if [ "$(id -u)" -ne 0 ]; then
  say "run as root (buildah and mmdebstrap write system image storage)" >&2
  exit 2
fi
missing=()
for tool in buildah mmdebstrap; do command -v "$tool" > /dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$install_tools" -eq 0 ]; then
    say "SKIP: ${missing[*]} not installed (apt-get install ${missing[*]}, or pass --install-tools)"
    exit 77
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

start=$(now)

# 1. The base: a minimal Debian 12 (bookworm) root file system, imported as an image. passwd for
# the runtime stage's useradd; ca-certificates so apt can use an https mirror.
if [ "$rebuild_base" -eq 1 ] || ! buildah inspect --type image "$base" > /dev/null 2>&1; then
  say "base: mmdebstrap bookworm from $mirror"
  mmdebstrap --quiet --variant=minbase --include=passwd,ca-certificates --format=tar \
    bookworm "$work/rootfs.tar" "$mirror"
  scratch=$(buildah from scratch)
  buildah add --quiet "$scratch" "$work/rootfs.tar" / > /dev/null
  buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$scratch"
  buildah commit --quiet --rm "$scratch" "$base" > /dev/null
  rm -f "$work/rootfs.tar"
else
  say "base: $base exists (--rebuild-base makes it again)"
fi
base_done=$(now)

# 2. The image: the Dockerfile's two stages, CPU variant (both bases Debian 12).
say "image: buildah bud $image"
set +e
buildah bud --isolation chroot --layers --format docker \
  --ignorefile deploy/docker/Dockerfile.dockerignore -f deploy/docker/Dockerfile \
  --build-arg BUILD_BASE="$base" --build-arg RUNTIME_BASE="$base" -t "$image" . 2>&1 \
  | tee "$work/bud.log" \
  | grep --line-buffered -E '(STEP [0-9]|^COMMIT|^collect_runtime|^setup:|^INFO: (Elapsed|Build))'
bud_rc=${PIPESTATUS[0]}
set -e
if [ "$bud_rc" -ne 0 ]; then
  tail -40 "$work/bud.log"
  say "FAIL: the image did not build"
  exit 1
fi
image_done=$(now)
size=$(buildah images --format '{{.Size}}' "$image" | head -1)

# 3. Smoke: moed with 2 embedded CPU workers inside the image (as its user, from its PATH),
# then moectl health and smoke against it.
container=$(buildah from --pull=never "$image")
smoke='
set -u
cd /var/lib/moed
moed --workers=2 --device=cpu --port=0 --port_file=/tmp/moed.port --internal_listen=127.0.0.1:0 \
  --checkpoint_root=/tmp/checkpoints --worker_log_dir=/tmp/moed-logs > /tmp/moed.log 2>&1 &
pid=$!
i=0
while [ ! -s /tmp/moed.port ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
server=127.0.0.1:$(cat /tmp/moed.port 2>/dev/null)
rc=1
if moectl --server=$server health --wait_ms=120000; then
  moectl --server=$server smoke && rc=0
fi
moed --version
kill -TERM $pid
wait $pid
[ $rc -eq 0 ] || { echo "--- moed.log"; tail -30 /tmp/moed.log; cat /tmp/moed-logs/* 2>/dev/null | tail -30; }
exit $rc
'
set +e
buildah run --isolation chroot "$container" -- /bin/sh -c "$smoke" 2>&1 | tee "$work/smoke.log"
smoke_rc=${PIPESTATUS[0]}
set -e
end=$(now)

say "base $((base_done - start)) s, image build $((image_done - base_done)) s," \
  "smoke $((end - image_done)) s, total $((end - start)) s; image $image ($size)"
if [ "$smoke_rc" -ne 0 ]; then
  say "FAIL: smoke inside the image exited $smoke_rc"
  exit 1
fi
say "PASS"
