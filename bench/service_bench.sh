#!/bin/bash
# service_bench.sh: the service path next to the engine, in one run. Starts moed with embedded
# workers (--allow_client_shm), runs `moectl bench --shm` (with --device=cuda also --cuda_shm:
# the tensors in GPU memory shared by CUDA IPC) for each shape and writes one JSON object per
# shape (gRPC, shared-memory and CUDA IPC latencies, the per-phase breakdown,
# service_over_engine, payload_gb_per_s, identical_to_grpc) to OUT/service_bench.jsonl.
#
#   bench/service_bench.sh [--device=cpu|cuda] [--workers=N] [--dtype=bf16|fp32] [SHAPE...]
#   SHAPE = H,F,E,k,T   (default: the data-plane issue's table)
# Environment: MOED_FLAGS / MOECTL_FLAGS (extra flags, e.g. MOED_FLAGS=--shm_relay=false
# MOECTL_FLAGS=--lanes=1 for the gRPC path without the relay and lanes), SHM=0 (gRPC only),
# LABEL (output file service_bench_LABEL.jsonl).
# Binaries come from $PATH (moed, moectl) or bazel-bin.
set -uo pipefail
device=cpu workers=2 dtype=bf16 steps=${STEPS:-10} warmup=${WARMUP:-2}
shapes=()
for a in "$@"; do
  case "$a" in
    --device=*) device=${a#*=} ;;
    --workers=*) workers=${a#*=} ;;
    --dtype=*) dtype=${a#*=} ;;
    *) shapes+=("$a") ;;
  esac
done
[ ${#shapes[@]} -gt 0 ] || shapes=(1024,4096,8,2,128 1024,4096,8,2,4096 1024,4096,8,2,16384
                                   4096,14336,8,2,4096 2048,768,128,8,4096)
out=${OUT:-bench_out}
mkdir -p "$out"
moed=$(command -v moed || echo bazel-bin/server/moed)
moectl=$(command -v moectl || echo bazel-bin/client/moectl)
port_file=$(mktemp -u)
"$moed" --device="$device" --workers="$workers" --port=0 --port_file="$port_file" \
  --allow_client_shm --max_layer_bytes=$((1 << 40)) ${MOED_FLAGS:-} >"$out/moed${LABEL:+_$LABEL}.log" 2>&1 &
moed_pid=$!
trap 'kill $moed_pid 2>/dev/null; wait $moed_pid 2>/dev/null' EXIT
for _ in $(seq 1 300); do [ -s "$port_file" ] && break; sleep 0.1; done
server="127.0.0.1:$(cat "$port_file")"
"$moectl" --server="$server" health --wait_ms=120000 >/dev/null || { tail "$out/moed${LABEL:+_$LABEL}.log"; exit 1; }
compute=$([ "$dtype" = bf16 ] && echo bf16 || echo fp32)
cuda_shm=$([ "${device%%:*}" = cuda ] && echo --cuda_shm || echo --nocuda_shm)
shm=--shm
[ "${SHM:-1}" = 0 ] && shm=--noshm cuda_shm=--nocuda_shm
jsonl="$out/service_bench${LABEL:+_$LABEL}.jsonl"
for s in "${shapes[@]}"; do
  IFS=, read -r h f e k t <<<"$s"
  echo "== H=$h F=$f E=$e k=$k T=$t ($device x$workers, $dtype)" >&2
  timeout 300 "$moectl" --server="$server" --deadline_ms=120000 ${MOECTL_FLAGS:-} bench "$shm" "$cuda_shm" --progress=off \
    --hidden="$h" --ffn="$f" --experts="$e" --top_k="$k" --tokens="$t" \
    --dtype="$dtype" --compute_dtype="$compute" --steps="$steps" --warmup="$warmup" \
    | tr -d '\n' >>"$jsonl"
  echo >>"$jsonl"
done
cat "$jsonl"
