#!/usr/bin/env python3
"""The per-GEMM FP8 table of `tools/gpu_checks.sh fp8_gemms` from gpu_bench's JSON lines.

Per preset: device ms (fwd, fwd+bwd) of bf16 and of FP8 under each fp8_gemms policy, with the
ratio to bf16 (> 1: faster than bf16); whether `none` (no FP8 GEMM) computed bf16's bits
(fingerprints equal); per GEMM what running it alone in bf16 did to the all-FP8 step
(ALL-<gemm> over ALL: > 1 means bf16 was slower, so FP8 wins there); and a "table:" line,
the entry for engine/cuda/fp8_gemm_table.cc (FP8 for the GEMMs whose move to bf16 slowed the
fwd+bwd step by more than --noise).

  python3 tools/fp8_gemms_summary.py gpu_out/bench_fp8_gemms.jsonl --noise=0.01
"""
import argparse
import json
import sys

GEMMS = ["fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad"]
PRESETS = {  # name: (H, F, up, E, k), as bench/presets.h
    "te_seed": (1024, 4096, 8192, 8, 2),
    "mixtral": (4096, 14336, 28672, 8, 2),
    "dsv3": (7168, 2048, 4096, 256, 8),
    "qwen3": (2048, 768, 1536, 128, 8),
}


def variant(r):
    """bf16, AUTO, ALL, none, ALL-<gemm> (every GEMM but one in FP8) or the set."""
    if r.get("compute_dtype") != "FP8":
        return "bf16"
    policy = r.get("fp8_gemms") or "AUTO"
    missing = [g for g in GEMMS if g not in policy.split(",")]
    if policy not in ("AUTO", "ALL", "none") and len(missing) == 1:
        return "ALL-" + missing[0]
    return policy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--noise", type=float, default=0.01)
    args = ap.parse_args()
    runs = {}
    try:
        lines = open(args.jsonl).read().splitlines()
    except OSError as e:
        sys.exit("no benchmark output: %s" % e)
    for line in lines:
        if line.strip():
            r = json.loads(line)
            runs.setdefault(r["config"], {})[variant(r)] = r
    for config, by in runs.items():
        bf16 = by.get("bf16")
        print("%s (T %s)" % (config, (bf16 or next(iter(by.values())))["tokens"]))
        print("  %-44s %8s %8s  %7s %7s  %s" % ("variant (GEMMs that ran FP8)", "fwd dev", "f+b dev",
                                                "fwd x", "f+b x", "fingerprint"))
        for name, r in by.items():
            ran = r.get("fp8_gemms_run", "") if name != "bf16" else ""
            label = name if not ran or ran == name else "%s (%s)" % (name, ran)
            x = ("%6.2fx %6.2fx" % (bf16["fwd_device_ms"] / r["fwd_device_ms"],
                                    bf16["fwdbwd_device_ms"] / r["fwdbwd_device_ms"])
                 if bf16 else "")
            print("  %-44s %8.2f %8.2f  %s  %s" % (label[:44], r["fwd_device_ms"],
                                                   r["fwdbwd_device_ms"], x, r["fingerprint"][:16]))
        none = by.get("none")
        if none and bf16:
            same = none["fingerprint"] == bf16["fingerprint"] and none["fingerprint"] != "-"
            print("  none is bf16 bit for bit: %s" % ("yes" if same else "NO (or not hashed)"))
        full = by.get("ALL")
        if not full:
            continue
        fp8 = []
        for g in GEMMS:
            r = by.get("ALL-" + g)
            if r is None:
                continue
            fwd = r["fwd_device_ms"] / full["fwd_device_ms"]
            fb = r["fwdbwd_device_ms"] / full["fwdbwd_device_ms"]
            wins = fb > 1 + args.noise
            if wins:
                fp8.append(g)
            print("  %-10s alone in bf16: fwd %.3fx f+b %.3fx of ALL -> %s" % (
                g, fwd, fb, "FP8" if wins else "bf16 (FP8 not faster)"))
        shape = PRESETS.get(config)
        if shape:
            bits = "".join("1" if g in fp8 else "0" for g in reversed(GEMMS))
            print("  table: {%d, %d, %d, %d, %d, 0b%s},  // %s: FP8 %s" % (
                shape + (bits, config, ",".join(fp8) or "none")))


if __name__ == "__main__":
    main()
