#!/usr/bin/env python3
"""The summary of `tools/gpu_checks.sh service` (bench/service_bench.sh runs, one per label).

    python3 tools/service_bench_summary.py OUT [--output_buffers] LABEL...

Prints the engine's API time of te_seed from OUT/gb{128,4096,16384}.json (gpu_bench), where
present, then one line per shape of each OUT/service_bench_LABEL.jsonl (bench/service_bench.sh):
gRPC p50 fwd / fwd+bwd, the engine phase, the payload rate, the client's phases, and the
shared-memory and CUDA IPC p50s with their bitwise verdicts. --output_buffers adds the
moectl bench `output_buffers` column; labels starting with "tiny" also print each path's
forward breakdown (the fixed cost of a call); runs with moectl bench --concurrency=N also
print the N callers' tokens/s and p50s and whether each caller's answers were bitwise the one
caller's.
"""
import json
import os
import sys


def main(argv):
    out, labels = argv[1], argv[2:]
    with_buffers = "--output_buffers" in labels
    labels = [label for label in labels if label != "--output_buffers"]
    for t in (128, 4096, 16384):
        path = os.path.join(out, "gb%d.json" % t)
        if not os.path.exists(path):
            continue
        for line in open(path):
            print("gpu_bench te_seed", t, line.strip()[:900])
    for label in labels:
        path = os.path.join(out, "service_bench_%s.jsonl" % label)
        if not os.path.exists(path):
            continue
        for line in open(path):
            if not line.strip():
                continue
            d = json.loads(line)
            f, fb = d["breakdown"]["forward"], d["breakdown"]["forward_backward"]
            row = [label] + ([d.get("output_buffers")] if with_buffers else [])
            row += [d["config"][:32], d["tokens"], "grpc", d["forward"]["latency_ms"]["p50"],
                    d["forward_backward"]["latency_ms"]["p50"], "eng", f["engine_ms"],
                    fb["engine_ms"], "GB/s", f["payload_gb_per_s"], fb["payload_gb_per_s"],
                    "client", f["client"]]
            s, c = d.get("shm"), d.get("cuda_shm")
            for name, path_d in (("| shm", s), ("| ipc", c)):
                if path_d:
                    row += [name, path_d["forward"]["latency_ms"]["p50"],
                            path_d["forward_backward"]["latency_ms"]["p50"], "ident",
                            path_d.get("identical_to_grpc")]
            print(*row)
            conc = d.get("concurrent")
            if conc:
                print("   ", conc["concurrency"], "callers: tok/s", conc["forward"]["tokens_per_s"],
                      conc["forward_backward"]["tokens_per_s"], "(one caller",
                      d["forward"]["tokens_per_s"], d["forward_backward"]["tokens_per_s"],
                      ") p50", conc["forward"]["latency_ms"]["p50"],
                      conc["forward_backward"]["latency_ms"]["p50"], "ident",
                      conc.get("identical_to_one_caller"))
            if label.startswith("tiny"):
                for name, path_d in (("grpc", d), ("shm", s), ("ipc", c)):
                    if path_d:
                        print("   ", name, json.dumps(path_d["breakdown"]["forward"])[:600])


if __name__ == "__main__":
    main(sys.argv)
