"""Data-parallel training of the tiny model (train_tiny.py) with one shared remote MoE layer.

    deploy/local/cluster.sh start --workers=2 --device=cpu --port=50051
    /usr/bin/python3 -m torch.distributed.run --standalone --redirects=9:1 --tee=9:1 \\
        --nproc_per_node=2 client/python/examples/train_dp.py --server=localhost:50051
    (--redirects/--tee: Debian's PyTorch 1.13 on Python 3.11 crashes on their default 0,
    client/python/README.md)
    (PYTHONPATH as in client/python/README.md)

Every rank builds the same model: the embeddings, norm and head are local and replicated with
DistributedDataParallel over gloo (CPU); the FFN is the RemoteMoE layer --layer, one layer on
the server that every rank uses. Each step every rank draws the same global batch of --tokens
positions, trains on its 1/N slice (mean loss over the slice), and calls moe.step(): DDP
averages the local gradients over the ranks, and the server applies one optimizer step on the
mean of the ranks' gradients of the shared layer once every rank called it. So N ranks train
as one process on the global batch (--nproc_per_node=1), up to fp32 summation order, for
losses that are means over tokens: the load-balancing aux loss is a statistic of each rank's
batch (as under DDP with a local MoE), so the equality needs --aux_loss_coeff=0.

Rank 0 prints a JSON line: {"ranks", "steps", "seconds", "steps_per_s", "rank0_step_ms" (mean
time rank 0 spent in moe.step(): waiting for the other ranks' calls plus the optimizer step),
"final_loss", ...};
--save=PATH writes the whole model's state_dict() (the remote layer's weights included).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from moe_client import Client, RemoteMoE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny import TinyModel, batch  # noqa: E402

VOCAB, HIDDEN, FFN, EXPERTS, TOP_K = 11, 32, 64, 4, 2


def shared_layer(client, layer, rank, world, seed, aux_loss_coeff, keep_existing=False):
    """Rank 0 creates the layer afresh from `seed`; the others attach once it exists."""
    if rank == 0:
        if not keep_existing:
            try:
                client.delete_layer(layer)
            except Exception:
                pass
        moe = RemoteMoE(client, layer, create="if_missing", hidden=HIDDEN, ffn=FFN,
                        num_experts=EXPERTS, top_k=TOP_K, aux_loss_coeff=aux_loss_coeff,
                        init_seed=seed)
    if world > 1:
        dist.barrier()
    if rank != 0:
        moe = RemoteMoE(client, layer, create=False)
    return moe


def train(client, layer="train-dp", steps=50, tokens=256, lr=1e-2, optimizer="adamw",
          seed=0, aux_loss_coeff=1e-2, rank=0, world=1, timeout=120.0, log=None):
    """Trains; returns (model, per-step losses of the global batch, seconds of the steps after
    the first, seconds this rank spent in moe.step() in those steps). world > 1 needs
    torch.distributed initialised (gloo)."""
    if tokens % world:
        raise ValueError("--tokens=%d must be a multiple of the %d ranks" % (tokens, world))
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    moe = shared_layer(client, layer, rank, world, seed, aux_loss_coeff)
    model = TinyModel(VOCAB, HIDDEN, moe)
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    make = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    local_optimizer = make(model.parameters(), lr=lr)
    remote_optimizer = {optimizer: {"lr": lr}}
    share = tokens // world
    losses, start, in_step = [], None, 0.0
    for step in range(steps):
        if step == 1:
            start = time.time()  # the first step pays for connections and allocations
            in_step = 0.0
        cur, prev, target = (t[rank * share:(rank + 1) * share]
                             for t in batch(VOCAB, tokens, generator))
        logits, aux = trained(cur, prev)
        loss = torch.nn.functional.cross_entropy(logits, target)
        local_optimizer.zero_grad()
        (loss + aux).backward()
        local_optimizer.step()
        before = time.time()
        moe.step(timeout=timeout, **remote_optimizer)  # waits for every rank's call
        in_step += time.time() - before
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(global_loss.item())
        if log and (step % 25 == 0 or step == steps - 1):
            log("step %4d  loss %.4f" % (step, losses[-1]))
    seconds = time.time() - start if start is not None else 0.0
    return model, losses, seconds, in_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("MOED_SERVER", "localhost:50051"))
    parser.add_argument("--layer", default="train-dp")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=256, help="global batch per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--aux_loss_coeff", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="rank 0 writes model.state_dict() here (torch.save)")
    parser.add_argument("--keep_layer", action="store_true",
                        help="leave the layer on the server (default: rank 0 deletes it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    with Client(args.server) as client:
        model, losses, seconds, in_step = train(
            client, layer=args.layer, steps=args.steps, tokens=args.tokens, lr=args.lr,
            optimizer=args.optimizer, seed=args.seed, aux_loss_coeff=args.aux_loss_coeff,
            rank=rank, world=world, log=print if rank == 0 else None)
        if rank == 0 and args.save:
            torch.save(model.state_dict(), args.save)
        if world > 1:
            dist.barrier()  # every rank is done with the layer
        if rank == 0:
            if not args.keep_layer:
                client.delete_layer(args.layer)
            timed = max(args.steps - 1, 1)
            print(json.dumps({"ranks": world, "steps": args.steps, "tokens": args.tokens,
                              "seconds": round(seconds, 3),
                              "steps_per_s": round(timed / seconds, 2) if seconds else None,
                              "rank0_step_ms": round(1000 * in_step / timed, 2),
                              "first_loss": losses[0], "final_loss": losses[-1]}))
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
