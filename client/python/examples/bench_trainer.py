"""What a PyTorch trainer sees: one training step of an MoE layer (forward, a loss on its output,
backward) with RemoteMoE against the same layer computed locally with torch._grouped_mm on the
same GPU, in one run, as ratios. JSON lines out (one per token count and path).

    PYTHONPATH=client/python python3 client/python/examples/bench_trainer.py \\
        --server=localhost:50051 --tokens=1024,4096,16384        # te_seed's shape by default

moed must run on this host with --allow_client_shm and CUDA workers for the cuda_ipc and shm
paths (a path the server refuses is reported with its fall-back, "path_used"). Paths:
  cuda_ipc  RemoteMoE's default for CUDA tensors: x / out / d_out / d_x stay on the GPU
  shm       RemoteMoE(cuda_ipc=False, shared_memory=True): through host shared memory
  grpc      RemoteMoE(cuda_ipc=False): tensors in the messages
  local     torch._grouped_mm: router, permute, gated SiLU expert FFN, combine, on this GPU
Each step: x [T, H] (requires grad), out, aux = layer(x), loss = (out * d_out).sum() + aux,
loss.backward(); timed from a synchronised start to the end of backward, synchronised.
Gradients are zeroed between steps outside the timed part (server: ZeroGradients), so every
timed backward writes fresh weight gradients on both sides. --profile=PATH prints a cProfile
of that path's steps (where a step's host time goes) to stderr.
"""

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
import uuid

import torch
import torch.nn.functional as F

from moe_client import Client, RemoteMoE


class LocalMoE(torch.nn.Module):
    """The layer computed in this process: softmax top-k router (fp32), tokens sorted by
    expert, two grouped GEMMs (wi [E, H, 2F] gated SiLU, wo [E, F, H]), weighted combine, and
    the Switch aux loss."""

    def __init__(self, hidden, ffn, experts, top_k, dtype, device, aux_loss_coeff=1e-2):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(0)
        self.ffn, self.experts, self.top_k, self.aux_loss_coeff = ffn, experts, top_k, \
            aux_loss_coeff
        self.gate = torch.nn.Parameter((torch.randn(hidden, experts, generator=g)
                                        * hidden ** -0.5).to(device))
        self.wi = torch.nn.Parameter((torch.randn(experts, hidden, 2 * ffn, generator=g)
                                      * hidden ** -0.5).to(device, dtype))
        self.wo = torch.nn.Parameter((torch.randn(experts, ffn, hidden, generator=g)
                                      * ffn ** -0.5).to(device, dtype))

    def forward(self, x):
        tokens, k = x.shape[0], self.top_k
        logits = x.float() @ self.gate
        top, selected = logits.topk(k, dim=-1)
        probs = top.softmax(-1)
        flat = selected.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts)
        offsets = counts.cumsum(0).to(torch.int32)
        token = order // k
        h = torch._grouped_mm(x[token], self.wi, offs=offsets)
        a = F.silu(h[:, :self.ffn]) * h[:, self.ffn:]
        y = torch._grouped_mm(a, self.wo, offs=offsets)
        y = y * probs.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y)
        density = counts.float() / (tokens * k)
        aux = self.aux_loss_coeff * self.experts * (density * logits.softmax(-1).mean(0)).sum()
        return out, aux


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def time_steps(layer, x, d_out, steps, warmup, zero, profile=None):
    """(fwd+bwd ms list, fwd-only ms list) over `steps` after `warmup`."""
    both, forward = [], []
    for i in range(warmup + steps):
        xi = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        if profile is not None and i >= warmup:
            profile.enable()
        start = time.perf_counter()
        out, aux = layer(xi)
        ((out * d_out).sum() + aux).backward()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if profile is not None and i >= warmup:
            profile.disable()
        zero()
        with torch.no_grad():
            torch.cuda.synchronize()
            start = time.perf_counter()
            layer(x)
            torch.cuda.synchronize()
            fwd = time.perf_counter() - start
        if i >= warmup:
            both.append(elapsed * 1e3)
            forward.append(fwd * 1e3)
    return both, forward


def call_breakdown(client, name, moe, x, steps):
    """p50 ms of the layers under one CUDA IPC forward (no grad), innermost first: the Python
    gRPC floor (a health check moed answers alone), the Forward RPC naming a filled region (no
    torch work), CudaStepper.forward (copies in and out, the wait, the RPC) and RemoteMoE."""
    from moe_client.cuda_ipc import CudaSharedMemoryRegion, CudaStepper
    device = x.device.index
    region = CudaSharedMemoryRegion(client, 4 * x.numel() * x.element_size() + (1 << 20), device)
    n = x.numel() * x.element_size()
    region.view(0, x.dtype, x.shape).copy_(x)
    torch.cuda.synchronize()
    stepper = CudaStepper(client, device)
    datatype = "BF16" if x.dtype == torch.bfloat16 else "FP32"

    def timed(fn):
        times = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e3)
        return round(percentile(times, 0.5), 3)

    import grpc
    plain = grpc.insecure_channel(client.address)  # no channel options: are ours the cost?
    plain_health = plain.unary_unary("/grpc.health.v1.Health/Check")
    with torch.no_grad():
        result = {
            "health_rpc": timed(client.health),
            "health_rpc_plain_channel": timed(lambda: plain_health(b"", timeout=10)),
            "forward_rpc_on_region": timed(lambda: client.forward_shm(
                name, region.tensor(0, datatype, x.shape), out=region.output(n, n))),
            "cuda_stepper_forward": timed(lambda: stepper.forward(name, x, datatype, False)),
            "remote_moe_forward": timed(lambda: moe(x)),
        }
    plain.close()
    stepper.close()
    region.close()
    return result


def summary(times):
    return {"p50_ms": round(percentile(times, 0.5), 3), "p90_ms": round(percentile(times, 0.9), 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("MOED_SERVER", "localhost:50051"))
    parser.add_argument("--tokens", default="1024,4096,16384")
    for name, default in (("hidden", 1024), ("ffn", 4096), ("experts", 8), ("top_k", 2),
                          ("steps", 20), ("warmup", 5)):
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--paths", default="cuda_ipc,shm,grpc,local")
    parser.add_argument("--profile", default="", help="a path whose steps are profiled")
    parser.add_argument("--json", default="", help="append the JSON lines to this file too")
    parser.add_argument("--step_channel", default="auto", choices=("auto", "on", "off"),
                        help="steps through a step channel (shared-memory ring; moed "
                             "--allow_client_shm on this host): auto (when local), on, off")
    parser.add_argument("--ring_spin_us", type=int, default=0,
                        help="the step channel's wait for moed's answer spins up to this many "
                             "us before it sleeps (Client(step_channel_spin=)); moed's side is "
                             "its own --ring_spin_us")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the layers under one CUDA IPC forward (call_breakdown)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = torch.device("cuda", torch.cuda.current_device())
    paths = args.paths.split(",")
    client = Client(args.server, timeout=120,
                    step_channel={"auto": "auto", "on": True, "off": False}[args.step_channel],
                    step_channel_spin=args.ring_spin_us * 1e-6)
    name = "bench-trainer-" + uuid.uuid4().hex[:8]
    shape = dict(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts, top_k=args.top_k)
    client.create_layer(name, compute_dtype=args.dtype, aux_loss_coeff=1e-2, **shape)
    modules = {
        "cuda_ipc": lambda: RemoteMoE(client, name, create=False),
        "shm": lambda: RemoteMoE(client, name, create=False, cuda_ipc=False,
                                 shared_memory=True),
        "grpc": lambda: RemoteMoE(client, name, create=False, cuda_ipc=False),
    }
    lines = []
    try:
        local = LocalMoE(args.hidden, args.ffn, args.experts, args.top_k, dtype, device)
        remote = {p: modules[p]() for p in paths if p in modules}
        for tokens in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator(device=device).manual_seed(tokens)
            x = torch.randn(tokens, args.hidden, device=device, generator=g).to(dtype)
            d_out = torch.randn(tokens, args.hidden, device=device, generator=g).to(dtype)
            results = {}
            for path in paths:
                profile = cProfile.Profile() if path == args.profile else None
                if path == "local":
                    zero = lambda: local.zero_grad(set_to_none=True)  # noqa: E731
                    layer = local
                else:
                    layer = remote[path]
                    zero = lambda layer=layer: layer.client.zero_gradients(name)  # noqa: E731
                both, fwd = time_steps(layer, x, d_out, args.steps, args.warmup, zero, profile)
                results[path] = {"forward_backward": summary(both), "forward": summary(fwd)}
                if path != "local":
                    results[path]["path_used"] = (
                        "cuda_ipc" if layer.uses_cuda_ipc else
                        "shm" if layer.uses_shared_memory else "grpc")
                if profile is not None:
                    print("== profile of %s, %d tokens, %d steps" % (path, tokens, args.steps),
                          file=sys.stderr)
                    stats = pstats.Stats(profile, stream=sys.stderr)
                    stats.sort_stats("cumulative").print_stats(30)
                    stats.sort_stats("tottime").print_stats(20)
            if args.breakdown and "cuda_ipc" in remote:
                line = {"bench": "bench_trainer_breakdown", "tokens": tokens,
                        "dtype": args.dtype.upper(), **shape,
                        **call_breakdown(client, name, remote["cuda_ipc"], x, args.steps)}
                lines.append(line)
                print(json.dumps(line), flush=True)
            for path, result in results.items():
                line = {"bench": "bench_trainer", "tokens": tokens, "dtype": args.dtype.upper(),
                        "path": path, **shape, "steps": args.steps, **result}
                if path != "local":  # how the steps' requests travel: step channel or gRPC
                    line["transport"] = "ring" if client.step_channel_on else "grpc"
                    line["client_ring_spin_us"] = args.ring_spin_us
                if "local" in results and path != "local":
                    local_ms = results["local"]
                    line["ratio_to_local"] = {
                        kind: round(result[kind]["p50_ms"] / local_ms[kind]["p50_ms"], 3)
                        for kind in ("forward_backward", "forward")}
                lines.append(line)
                print(json.dumps(line), flush=True)
    finally:
        client.delete_layer(name)
    if args.json:
        with open(args.json, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
