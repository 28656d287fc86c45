"""torch.compile around a model with a RemoteMoE (PyTorch >= 2.1; Debian's 1.13 has none).

    /usr/bin/python3 client/python/examples/compile_check.py --server=localhost:50051

Runs a small model (Linear -> RemoteMoE -> Linear) eagerly and under torch.compile, forward
and backward on the same input, and prints one JSON line: how Dynamo split the model
(graph count, graph breaks and their reasons, from torch._dynamo.explain), and the largest
differences between the eager and compiled loss, input gradient and local weight gradient.
The RemoteMoE forward is a graph break by design (torch.compiler.disable: its RPCs cannot be
traced); the Linear layers around it compile.

For the GPU machine's PyTorch 2.11 (tools/gpu_checks.sh python runs it there); this build
machine has PyTorch 1.13 without torch.compile. Exit status 0 when eager and compiled agree
within 1e-5 and Dynamo reports at most one graph break (the RemoteMoE call).
"""

import argparse
import json
import os
import sys

import torch

from moe_client import Client, RemoteMoE


class Model(torch.nn.Module):
    def __init__(self, moe, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.moe = moe
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        y, aux = self.moe(torch.tanh(self.proj(x)))
        return self.head(y).square().mean() + aux


def run(model, moe, x):
    """Loss, d_x, d_proj of one forward + backward; the server's gradients zeroed after."""
    x = x.clone().requires_grad_()
    loss = model(x)
    loss.backward()
    result = (loss.detach(), x.grad.clone(), moe_free_grad(model))
    model.zero_grad()
    moe.zero_grad()
    return result


def moe_free_grad(model):
    return model.proj.weight.grad.clone()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("MOED_SERVER", "localhost:50051"))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model and x live (cuda: RemoteMoE uses CUDA IPC "
                             "when moed can)")
    args = parser.parse_args()
    if not hasattr(torch, "compile"):
        print(json.dumps({"torch": torch.__version__, "error": "no torch.compile"}))
        return 1
    torch.manual_seed(0)
    with Client(args.server) as client:
        moe = RemoteMoE(client, "compile-check", create=True, hidden=32, ffn=64,
                        num_experts=4, top_k=2, aux_loss_coeff=1e-2, init_seed=1)
        try:
            model = Model(moe, 32).to(args.device)
            x = torch.randn(16, 32, device=args.device)
            eager = run(model, moe, x)
            compiled = run(torch.compile(model, backend=args.backend), moe, x)
            explained = torch._dynamo.explain(model)(x)
        finally:
            client.delete_layer("compile-check")
    diffs = [(a - b).abs().max().item() for a, b in zip(eager, compiled)]
    print(json.dumps({
        "torch": torch.__version__, "backend": args.backend, "device": args.device,
        "cuda_ipc": moe.uses_cuda_ipc,
        "graph_count": explained.graph_count, "graph_break_count": explained.graph_break_count,
        "break_reasons": sorted({str(r.reason)[:160] for r in explained.break_reasons}),
        "max_diff_loss": diffs[0], "max_diff_d_x": diffs[1], "max_diff_d_proj": diffs[2]}))
    return 0 if max(diffs) < 1e-5 and explained.graph_break_count <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
