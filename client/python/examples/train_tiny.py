"""Trains a tiny next-token model whose FFN is a remote moed MoE layer.

Task (synthetic, deterministic): sequences follow x[t+1] = (x[t] + x[t-1]) mod V. The model
sees the last two tokens through two embedding tables, adds them (x = E_cur[x_t] +
E_prev[x_{t-1}]), runs the FFN with a residual, and predicts the next token with a linear
head. Without the FFN the logits are a sum of a function of x_t and a function of x_{t-1}, which
cannot express addition mod V, so its loss stays high; with the MoE FFN the loss falls towards
zero. The embeddings and head train locally (torch AdamW); the MoE layer's router and experts
train on the server (RemoteMoE.step -> ApplyOptimizer).

    deploy/local/cluster.sh start --workers=2 --device=cpu --port=50051
    /usr/bin/python3 client/python/examples/train_tiny.py --server=localhost:50051
    (PYTHONPATH as in client/python/README.md)

Prints one line per 25 steps and a final JSON line {"final_loss": ..., ...}.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

from moe_client import Client, RemoteMoE


class TinyModel(torch.nn.Module):
    """Two-token context -> hidden -> (MoE FFN + residual) -> vocab logits."""

    def __init__(self, vocab, hidden, ffn_layer=None):
        super().__init__()
        self.embed_cur = torch.nn.Embedding(vocab, hidden)
        self.embed_prev = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.ffn = ffn_layer  # RemoteMoE, or None for the baseline without an FFN
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, cur, prev):
        x = self.embed_cur(cur) + self.embed_prev(prev)
        aux = torch.zeros(())
        if self.ffn is not None:
            y, aux = self.ffn(self.norm(x))
            x = x + y
        return self.head(x), aux


def batch(vocab, tokens, generator):
    """(cur, prev, target) of `tokens` independent positions of the sequence."""
    prev = torch.randint(vocab, (tokens,), generator=generator)
    cur = torch.randint(vocab, (tokens,), generator=generator)
    return cur, prev, (cur + prev) % vocab


def train(client=None, layer="train-tiny", steps=300, vocab=11, hidden=32, ffn=64,
          experts=4, top_k=2, tokens=256, lr=1e-2, moe_lr=1e-2, seed=0, log=None,
          compute_dtype="fp32"):
    """Trains and returns the list of per-step losses (cross-entropy, without aux).

    client=None trains the baseline without the FFN (no server involved).
    """
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    moe = None
    if client is not None:
        try:  # start from the seed's initialisation every run
            client.delete_layer(layer)
        except Exception:
            pass
        moe = RemoteMoE(client, layer, create=True, hidden=hidden, ffn=ffn,
                        num_experts=experts, top_k=top_k, aux_loss_coeff=1e-2,
                        init_seed=seed, compute_dtype=compute_dtype,
                        optimizer={"adamw": {"lr": moe_lr}})
    model = TinyModel(vocab, hidden, moe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    try:
        for step in range(steps):
            cur, prev, target = batch(vocab, tokens, generator)
            logits, aux = model(cur, prev)
            loss = torch.nn.functional.cross_entropy(logits, target)
            optimizer.zero_grad()
            (loss + aux).backward()
            optimizer.step()
            if moe is not None:
                moe.step()  # ApplyOptimizer on the server (also zeroes its gradients)
            losses.append(loss.item())
            if log and (step % 25 == 0 or step == steps - 1):
                log("step %4d  loss %.4f  aux %.4f" % (step, loss.item(), float(aux)))
    finally:
        if moe is not None:
            client.delete_layer(layer)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("MOED_SERVER", "localhost:50051"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute_dtype", default="fp32", choices=("fp32", "bf16", "fp8"),
                        help="the layer's expert GEMM datatype (docs/SPEC.md)")
    parser.add_argument("--baseline", action="store_true",
                        help="also train the same model without the FFN, for comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    with Client(args.server) as client:
        losses = train(client, steps=args.steps, seed=args.seed, log=print,
                       compute_dtype=args.compute_dtype)
    result = {"final_loss": sum(losses[-20:]) / 20, "first_loss": losses[0],
              "chance_loss": math.log(11), "steps": args.steps,
              "compute_dtype": args.compute_dtype,
              "seconds": round(time.time() - start, 2)}
    if args.baseline:
        base = train(None, steps=args.steps, seed=args.seed)
        result["baseline_final_loss"] = sum(base[-20:]) / 20
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
