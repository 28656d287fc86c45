#!/bin/bash
# Smoke test of //bench:engine_bench: valid JSON with every promised field; clean errors.
set -euo pipefail
BENCH="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench/engine_bench"
OUT="${TEST_TMPDIR}/out.json"

"$BENCH" --tokens=37 --hidden=32 --ffn=64 --experts=8 --top_k=2 --dtype=fp32 \
  --warmup=1 --iters=3 >"$OUT"
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for key in ["shape", "config", "backend", "forward_ms", "forward_backward_ms", "tflops_forward",
            "tflops_forward_backward", "ffn_flops_forward", "peak_backend_memory_bytes"]:
    assert key in r, key
assert r["backend"] == "cpu", r["backend"]
assert r["shape"] == {"tokens": 37, "hidden": 32, "ffn": 64, "experts": 8, "top_k": 2}, r["shape"]
assert r["ffn_flops_forward"] == 2 * 37 * 2 * 32 * 3 * 64, r["ffn_flops_forward"]
assert r["forward_ms"]["n"] == 3 and r["forward_ms"]["p10"] <= r["forward_ms"]["p90"]
assert r["peak_backend_memory_bytes"] > 0
PY

# A preset with its token count overridden, bf16, no backward.
"$BENCH" --config=qwen3 --tokens=16 --hidden=64 --ffn=32 --iters=1 --warmup=0 \
  --backward=false >"$OUT"
/usr/bin/python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["dtype"]=="BF16"; assert r["shape"]["experts"]==128; assert "forward_backward_ms" not in r' "$OUT"

# Bad input: a clear message and exit code 2, never a crash.
for args in "--config=nope" "--tokens=8 --hidden=0 --ffn=8 --experts=4 --top_k=1" \
            "--config=te_seed --tokens=8 --device=tpu" "--config=te_seed --dtype=fp8"; do
  set +e
  # shellcheck disable=SC2086
  "$BENCH" $args >/dev/null 2>"${TEST_TMPDIR}/err"
  code=$?
  set -e
  if [[ $code -ne 2 ]]; then
    echo "engine_bench $args: exit $code, expected 2"; cat "${TEST_TMPDIR}/err"; exit 1
  fi
  grep -q "engine_bench:" "${TEST_TMPDIR}/err"
done
echo PASS
