"""Latency of forward and forward+backward through the Python client (torch tensors in and out),
the number a Python trainer sees; compare with `moectl bench` (the C++ client) on the same shape.

    /usr/bin/python3 client/python/examples/bench_client.py --server=localhost:50051 \\
        --tokens=4096 --hidden=1024 --ffn=4096 --experts=8 --top_k=2 --dtype=bf16
    (PYTHONPATH as in client/python/README.md)

Creates a temporary layer, runs --warmup then --steps of each kind with the same x and d_out,
deletes the layer, and prints one JSON object: p50 / p90 ms of forward and forward+backward,
and the overall payload rate (x and out, plus d_out and d_x, over the whole p50 step time, the
engine's included: a lower bound on the transport's own rate).

out and d_x are written into one buffer each, reused by every step (Client.forward /
backward out=, as a trainer staging answers in place would); --fresh_output gives each step
fresh memory instead, as without out= (the JSON's "output" says which: "reused" or "fresh").
"""

import argparse
import json
import os
import sys
import time
import uuid

import numpy as np
import torch

from moe_client import Client


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("MOED_SERVER", "localhost:50051"))
    for name, default in (("tokens", 4096), ("hidden", 1024), ("ffn", 4096), ("experts", 8),
                          ("top_k", 2), ("steps", 10), ("warmup", 2), ("lanes", 0)):
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--transports", default="grpc",
                        help="comma-separated, one JSON line each, same run: grpc (the gRPC "
                             "calls), ring (a step channel: moed --allow_client_shm on this "
                             "host); each line's \"transport\" names it")
    parser.add_argument("--fresh_output", action="store_true",
                        help="a fresh out / d_x each step instead of one reused buffer each")
    parser.add_argument("--shm", action="store_true",
                        help="also time shared memory (moed --allow_client_shm on this host): "
                             "the RPCs on a region filled once, as moectl bench --shm, and "
                             "RemoteMoE's path (ShmStepper: torch copies in and out per step)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    layer = "bench-client-" + uuid.uuid4().hex[:8]
    x = torch.randn(args.tokens, args.hidden).to(dtype)
    d_out = torch.randn(args.tokens, args.hidden).to(dtype)
    out = d_x = None  # fresh answers
    if not args.fresh_output:  # the wire's elements (raw=True): bf16 as its uint16 bits
        def buffer():
            t = torch.zeros(args.tokens, args.hidden, dtype=dtype)
            if dtype == torch.bfloat16:
                return t.view(torch.int16).numpy().view(np.uint16)
            return t.numpy()
        out, d_x = buffer(), buffer()
    for transport in args.transports.split(","):
        if transport not in ("grpc", "ring"):
            parser.error("--transports: %r is not grpc or ring" % transport)
        print(json.dumps(run_one(args, transport, layer + "-" + transport, x, d_out, out, d_x)),
              flush=True)
    return 0


def run_one(args, transport, layer, x, d_out, out, d_x):
    """One transport's JSON object."""
    times = {"forward": [], "forward_backward": []}
    with Client(args.server, lanes=args.lanes, step_channel=transport == "ring") as client:
        client.create_layer(layer, hidden=args.hidden, ffn=args.ffn, num_experts=args.experts,
                            top_k=args.top_k, compute_dtype=args.dtype)
        try:
            for i in range(args.warmup + args.steps):
                start = time.perf_counter()
                client.forward(layer, x, raw=True, out=out)
                forward = time.perf_counter() - start
                start = time.perf_counter()
                fwd = client.forward(layer, x, keep_for_backward=True, raw=True, out=out)
                client.backward(layer, fwd.step_id, d_out, raw=True, out=d_x)
                both = time.perf_counter() - start
                if i >= args.warmup:
                    times["forward"].append(forward * 1e3)
                    times["forward_backward"].append(both * 1e3)
            shm = time_shm(client, layer, x, d_out, args) if args.shm else None
        finally:
            client.delete_layer(layer)
        lanes = len(client._lanes) or 1
        used = "ring" if client.step_channel_on and client.steps_over_channel > 0 else "grpc"
    if used != transport:
        print("bench_client: asked for %s, the steps went over %s" % (transport, used),
              file=sys.stderr)
    nbytes = x.numel() * x.element_size()
    result = {"bench": "bench_client", "tokens": args.tokens, "hidden": args.hidden,
              "ffn": args.ffn, "experts": args.experts, "top_k": args.top_k,
              "dtype": args.dtype.upper(), "lanes": lanes, "steps": args.steps,
              "output": "fresh" if args.fresh_output else "reused", "transport": used}
    for kind, payload in (("forward", 2 * nbytes), ("forward_backward", 4 * nbytes)):
        p50 = percentile(times[kind], 0.5)
        result[kind] = {"p50_ms": round(p50, 3), "p90_ms": round(percentile(times[kind], 0.9), 3),
                        "p99_ms": round(percentile(times[kind], 0.99), 3),
                        "payload_gb_per_s_overall": round(payload / p50 / 1e6, 3)}
    if shm is not None:
        result["shm"] = shm
    return result


def time_shm(client, layer, x, d_out, args):
    """p50 ms of forward and forward+backward over shared memory: "rpc" names a region filled
    once (no copies: moectl bench --shm's measure), "stepper" is RemoteMoE's ShmStepper (x and
    d_out copied in, out and d_x copied out each step)."""
    from moe_client.shared_memory import SharedMemoryRegion, ShmStepper
    datatype = "BF16" if x.dtype == torch.bfloat16 else "FP32"
    n = x.numel() * x.element_size()
    region = SharedMemoryRegion(client, 4 * n)
    region.view(0, datatype, x.shape).copy_(x)
    region.view(2 * n, datatype, x.shape).copy_(d_out)
    stepper = ShmStepper(client)

    def rpc_fwd(keep):
        return client.forward_shm(layer, region.tensor(0, datatype, x.shape),
                                  out=region.output(n, n), keep_for_backward=keep)

    def rpc_both():
        step = rpc_fwd(True).step_id
        client.backward_shm(layer, step, region.tensor(2 * n, datatype, x.shape),
                            d_x=region.output(3 * n, n))

    def stepper_both():
        r, _ = stepper.forward(layer, x, datatype, True)
        stepper.backward(layer, r.step_id, d_out, datatype, None, None)

    def p50(fn):
        times = []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
        return round(percentile(times, 0.5), 3)

    result = {"rpc": {"forward_p50_ms": p50(lambda: rpc_fwd(False)),
                      "forward_backward_p50_ms": p50(rpc_both)},
              "stepper": {"forward_p50_ms": p50(lambda: stepper.forward(layer, x, datatype,
                                                                        False)),
                          "forward_backward_p50_ms": p50(stepper_both)}}
    stepper.close()
    region.close()
    return result


if __name__ == "__main__":
    sys.exit(main())
