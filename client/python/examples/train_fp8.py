"""FP8 against BF16 in training (issue 40's accuracy check): the same small model trained twice
through moed, once with its MoE layer's expert GEMMs in bf16 and once in FP8 (e4m3, the default
recipe: delayed scaling, docs/SPEC.md "FP8"), on the same data from the same initial weights,
and the two loss curves compared.

Model: x [T, IN] -> Linear(IN, H) -> RemoteMoE(H, F, E, k) -> Linear(H, OUT). Task
(teacher-student regression, as bench/train_bench.cc): a fixed random teacher
t = tanh(x A) B (fp32, local) with label noise of --noise times its RMS drawn anew each step;
x is fresh normal data every step (one torch.Generator, so both runs see the same steps).
Loss = mean((y - t)^2) / P, P the targets' mean square (1 = predicting zero); with a perfect
fit it ends at the noise floor noise^2 / (1 + noise^2) (0.2 at --noise=0.5). The two Linears
train locally (torch AdamW), the MoE layer on the server (AdamW, same lr, aux loss 1e-2 in the
gradient, not in the recorded loss). The FP8 run starts from the BF16 run's initial weights
(model.state_dict() before its first step: the local layers and the server layer's fp32
masters, loaded with one SetWeights), so the two differ only by the compute datatype.

Comparison: each curve smoothed by a trailing mean over --window steps (the mean of the steps
so far for the first window - 1), then rel[i] = |fp8[i] - bf16[i]| / bf16[i]; the run passes
when max_i rel[i] <= --bound (1 %). The raw per-step maximum is reported too.

    deploy/local/cluster.sh start --workers=2 --device=cpu --port=50051
    PYTHONPATH=client/python /usr/bin/python3 client/python/examples/train_fp8.py \\
        --server=localhost:50051       # ~20 s on 2 CPU cores (OMP_NUM_THREADS=1: docs/SPEC.md)
    (--device=cuda: the local layers and tensors on the GPU; CUDA workers for moed's side.)

JSON lines out: one per run ({"run": "bf16"|"fp8", "losses": every step's loss, ...}), then
a summary ({"summary": true, "max_rel_diff": ..., "within_bound": ...}). Exit status 0 when
within the bound and both curves dropped, else 1.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

from moe_client import Client, RemoteMoE


class Model(torch.nn.Module):
    """Input projection -> remote MoE layer -> linear head."""

    def __init__(self, in_dim, hidden, out_dim, moe):
        super().__init__()
        self.proj = torch.nn.Linear(in_dim, hidden)
        self.moe = moe
        self.head = torch.nn.Linear(hidden, out_dim)

    def forward(self, x):
        y, aux = self.moe(self.proj(x))
        return self.head(y), aux


class Teacher:
    """t = tanh(x A) B, fixed random weights (fp32, CPU); P: the targets' mean square with
    the label noise included (measured on a large sample, so 1 = predicting zero)."""

    def __init__(self, in_dim, out_dim, width, noise, seed):
        g = torch.Generator().manual_seed(seed + 1000)
        self.a = torch.randn(in_dim, width, generator=g) * (2.0 / in_dim) ** 0.5
        self.b = torch.randn(width, out_dim, generator=g) * width ** -0.5
        self.noise = noise
        sample = self.clean(torch.randn(16384, in_dim, generator=g))
        self.rms = float(sample.pow(2).mean().sqrt())
        self.power = self.rms ** 2 * (1 + noise ** 2)

    def clean(self, x):
        return torch.tanh(x @ self.a) @ self.b

    def batch(self, tokens, generator):
        x = torch.randn(tokens, self.a.shape[0], generator=generator)
        t = self.clean(x) + self.noise * self.rms * torch.randn(
            tokens, self.b.shape[1], generator=generator)
        return x, t


def make_layer(client, name, args, compute_dtype):
    try:  # a leftover of an interrupted run
        client.delete_layer(name)
    except Exception:
        pass
    return RemoteMoE(client, name, create=True, hidden=args.hidden, ffn=args.ffn,
                     num_experts=args.experts, top_k=args.top_k, aux_loss_coeff=1e-2,
                     init_seed=args.seed, compute_dtype=compute_dtype,
                     optimizer={"adamw": {"lr": args.lr}})


def train(client, args, compute_dtype, initial_state=None, log=None):
    """Trains one model; returns (losses, initial state dict, layer info)."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    teacher = Teacher(args.in_dim, args.out_dim, args.teacher_width, args.noise, args.seed)
    generator = torch.Generator().manual_seed(args.seed + 7)  # the data: same for every run
    name = "%s-%s" % (args.layer, compute_dtype)
    moe = make_layer(client, name, args, compute_dtype)
    try:
        model = Model(args.in_dim, args.hidden, args.out_dim, moe).to(device)
        if initial_state is None:
            initial_state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(initial_state)  # local layers, and SetWeights on the server
        optimizer = torch.optim.AdamW([p for n, p in model.named_parameters()
                                       if not n.startswith("moe.")], lr=args.lr,
                                      weight_decay=0.0)
        losses = []
        for step in range(args.steps):
            x, t = teacher.batch(args.tokens, generator)
            x, t = x.to(device), t.to(device)
            y, aux = model(x)
            loss = (y - t).pow(2).mean() / teacher.power
            optimizer.zero_grad()
            (loss + aux).backward()
            optimizer.step()
            moe.step()  # ApplyOptimizer on the server (AdamW, args.lr)
            losses.append(loss.item())
            if log and (step % 50 == 0 or step == args.steps - 1):
                log("%s step %4d  loss %.5f  aux %.5f" % (compute_dtype, step, losses[-1],
                                                           float(aux)))
        info = client.get_layer(name)
    finally:
        client.delete_layer(name)
    return losses, initial_state, info


def smooth(values, window):
    """Trailing mean over `window` values (over those so far at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare(bf16, fp8, window, bound, drop):
    """The summary of two loss curves (module docstring, "Comparison")."""
    sb, sf = smooth(bf16, window), smooth(fp8, window)
    rel = [abs(f - b) / b for b, f in zip(sb, sf)]
    raw = [abs(f - b) / b for b, f in zip(bf16, fp8)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    head = min(window, len(bf16))

    def dropped(curve):  # the last window's mean against the first window's
        return sum(curve[-head:]) / head < (1 - drop) * (sum(curve[:head]) / head)

    return {
        "summary": True, "metric": "|fp8 - bf16| / bf16 of the trailing-%d-step means" % window,
        "window": window, "bound": bound,
        "max_rel_diff": max(rel), "max_rel_diff_step": worst, "final_rel_diff": rel[-1],
        "mean_rel_diff": sum(rel) / len(rel), "max_raw_rel_diff": max(raw),
        "bf16_first": bf16[0], "fp8_first": fp8[0],
        "bf16_final": sb[-1], "fp8_final": sf[-1],
        "within_bound": max(rel) <= bound,
        "both_dropped": dropped(bf16) and dropped(fp8), "drop_required": drop,
        "table": {str(i): [bf16[i], fp8[i]] for i in sorted({0, 50, 100, 150, len(bf16) - 1})
                  if i < len(bf16)},
    }


def run(client, args, log=None):
    """Both trainings and their comparison: (bf16 losses, fp8 losses, summary dict)."""
    start = time.time()
    bf16, initial, info_b = train(client, args, "bf16", log=log)
    t_bf16 = time.time() - start
    fp8, _, info_f = train(client, args, "fp8", initial_state=initial, log=log)
    summary = compare(bf16, fp8, args.window, args.bound, args.drop)
    summary.update({
        "fp8_recipe": info_f.config.fp8_recipe, "fp8_gemms": info_f.fp8_gemms,
        "ep_ranks": info_f.ep_ranks, "bf16_seconds": round(t_bf16, 2),
        "fp8_seconds": round(time.time() - start - t_bf16, 2),
        "config": {k: getattr(args, k) for k in ("steps", "tokens", "hidden", "ffn", "experts",
                                                 "top_k", "in_dim", "out_dim", "noise", "lr",
                                                 "seed", "device")},
    })
    return bf16, fp8, summary


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("MOED_SERVER", "localhost:50051"))
    parser.add_argument("--device", default="cpu", help="torch device of the local layers "
                        "and tensors: cpu, cuda, cuda:N")
    parser.add_argument("--layer", default="train-fp8", help="server layer name prefix")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256, help="T, tokens per step")
    parser.add_argument("--hidden", type=int, default=64, help="H")
    parser.add_argument("--ffn", type=int, default=128, help="F")
    parser.add_argument("--experts", type=int, default=4, help="E")
    parser.add_argument("--top_k", type=int, default=2, help="k")
    parser.add_argument("--in_dim", type=int, default=32)
    parser.add_argument("--out_dim", type=int, default=16)
    parser.add_argument("--teacher_width", type=int, default=128)
    parser.add_argument("--noise", type=float, default=0.5,
                        help="label noise, times the teacher's RMS")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW, local and server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=10, help="smoothing window (steps)")
    parser.add_argument("--bound", type=float, default=0.01, help="max relative difference")
    parser.add_argument("--drop", type=float, default=0.3,
                        help="each curve's last window must be this fraction below its first")
    parser.add_argument("--json", default="", help="append the JSON lines to this file too")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    with Client(args.server) as client:
        bf16, fp8, summary = run(client, args, log=lambda s: print(s, file=sys.stderr))
    lines = [{"run": "bf16", "losses": bf16}, {"run": "fp8", "losses": fp8}, summary]
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    return 0 if summary["within_bound"] and summary["both_dropped"] else 1


if __name__ == "__main__":
    sys.exit(main())
