#!/bin/bash
# //bench:train_bench on the CPU (issue 16's training check, small): the students learn (loss
# falls below 60 % of the first step's), FP8's final loss is within 5 % of BF16's after the same
# steps (the CPU backend emulates the FP8 recipe of docs/SPEC.md exactly), the curves differ
# (FP8 really ran), and a bad datatype is a clean error.
set -euo pipefail
BENCH="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench/train_bench"
OUT="${TEST_TMPDIR}/out.jsonl"

"$BENCH" --device=cpu --compute_dtypes=bf16,fp8 --tokens=256 --hidden=64 --ffn=128 \
  --experts=4 --top_k=2 --steps=40 --log_every=5 >"$OUT"
cat "$OUT"
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
curves = {r["compute_dtype"]: r for r in rows if "compute_dtype" in r}
assert set(curves) == {"BF16", "FP8"}, curves.keys()
for r in curves.values():
    assert r["steps"] == 40 and len(r["losses"]) == 8, r
    assert r["loss_final"] < 0.6 * r["loss_first"], r
bf16, fp8 = curves["BF16"], curves["FP8"]
assert bf16["losses"] != fp8["losses"]
assert abs(fp8["loss_final"] - bf16["loss_final"]) < 0.05 * bf16["loss_final"], (bf16, fp8)
summary = rows[-1]
assert abs(summary["final_ratio"]["FP8"] - fp8["loss_final"] / bf16["loss_final"]) < 1e-4  # 6 digits
PY

set +e
"$BENCH" --compute_dtypes=fp16 --steps=1 2>"${TEST_TMPDIR}/err"
rc=$?
set -e
[ "$rc" -eq 2 ] || { echo "expected exit 2 for fp16, got $rc"; exit 1; }
grep -q "FP16" "${TEST_TMPDIR}/err" || { cat "${TEST_TMPDIR}/err"; exit 1; }
echo PASS
