"""RemoteMoE inside a trainer's model against a live 2-worker CPU cluster: state_dict() /
load_state_dict() (weights, or a server checkpoint reference), a parent's zero_grad()
reaching the server, torch.autocast(bfloat16), and data-parallel steps with explicit ranks
(two modules on one layer, one thread each)."""

import io
import sys
import threading
import unittest

import numpy as np
import torch

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client, InvalidArgument, RemoteMoE

CLUSTER = None
MOED = WORKER = None
CONFIG = dict(hidden=16, ffn=32, num_experts=4, top_k=2, init_seed=3)


def setUpModule():
    global CLUSTER
    CLUSTER = LocalCluster(MOED, WORKER, workers=2).start()


def tearDownModule():
    CLUSTER.stop()


class Parent(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.ffn = moe

    def forward(self, x):
        out, aux = self.ffn(self.proj(x))
        return out.sum() + aux


def inputs(seed, tokens=10):
    return torch.randn(tokens, 16, generator=torch.Generator().manual_seed(seed))


class RemoteMoETrainingTest(unittest.TestCase):

    def setUp(self):
        self.client = Client(CLUSTER.address)

    def tearDown(self):
        for info in self.client.list_layers():
            self.client.delete_layer(info.name)
        self.client.close()

    def test_state_dict_carries_the_server_weights(self):
        model = Parent(RemoteMoE(self.client, "sd", **CONFIG))
        state = model.state_dict()
        self.assertEqual(sorted(k for k in state if k.startswith("ffn.")),
                         ["ffn.gate", "ffn.wi", "ffn.wo"])  # no grad_marker
        for name, array in self.client.get_weights("sd").items():
            np.testing.assert_array_equal(state["ffn." + name].numpy(), array)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        model(inputs(1)).backward()
        model.ffn.step(sgd={"lr": 0.5})
        self.assertGreater(np.abs(self.client.get_weights("sd")["wi"] -
                                  state["ffn.wi"].numpy()).max(), 0)
        buffer.seek(0)
        model.load_state_dict(torch.load(buffer))
        for name, array in self.client.get_weights("sd").items():
            np.testing.assert_array_equal(array, state["ffn." + name].numpy())
        del state["ffn.wo"]
        with self.assertRaisesRegex(RuntimeError, "ffn.wo"):
            model.load_state_dict(state)
        state["ffn.wo"] = torch.zeros(3)
        with self.assertRaises(InvalidArgument):  # the server checks the shapes
            model.load_state_dict(state)

    def test_state_dict_as_a_checkpoint_reference(self):
        moe = RemoteMoE(self.client, "ref", checkpoint_state="refs/ffn", **CONFIG)
        model = Parent(moe)
        state = model.state_dict()
        self.assertEqual(state["ffn.checkpoint"], "refs/ffn")
        self.assertNotIn("ffn.wi", state)
        saved = self.client.get_weights("ref")
        model(inputs(2)).backward()
        moe.step(adamw={"lr": 0.1})
        model.load_state_dict(state)
        for name, array in self.client.get_weights("ref").items():
            np.testing.assert_array_equal(array, saved[name])

    def test_parent_zero_grad_reaches_the_server(self):
        model = Parent(RemoteMoE(self.client, "zero", **CONFIG))
        x = inputs(3)
        model(x).backward()
        once = model.ffn.gradients()
        model(x).backward()  # no zero_grad: the server sums
        np.testing.assert_allclose(model.ffn.gradients()["wi"], 2 * once["wi"], rtol=1e-5)
        for zero in (lambda: model.zero_grad(),  # set_to_none=False in PyTorch 1.13
                     lambda: model.zero_grad(set_to_none=True),
                     lambda: torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()):
            zero()
            model(x).backward()
            np.testing.assert_allclose(model.ffn.gradients()["wi"], once["wi"], rtol=1e-6)
        zero()
        self.assertEqual(np.abs(model.ffn.gradients()["wi"]).max(), 0)  # seen by gradients()

    def test_autocast_bfloat16_sends_bf16_and_returns_bf16(self):
        moe = RemoteMoE(self.client, "amp", **CONFIG)
        x = inputs(4).bfloat16().float().requires_grad_()  # bf16-exact values
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, aux = moe(x)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertEqual(aux.dtype, torch.float32)
        with torch.no_grad():
            out16, _ = moe(x.detach().bfloat16())  # the BF16 wire path, no autocast
            out32, _ = moe(x.detach())             # the FP32 one
        self.assertTrue(torch.equal(out.detach(), out16))
        self.assertFalse(torch.equal(out.detach().float(), out32))
        (out.float().sum() + aux).backward()
        self.assertEqual(x.grad.dtype, torch.float32)
        self.assertGreater(x.grad.abs().max().item(), 0)

    def test_explicit_ranks_step_once_per_step(self):
        ranks = [RemoteMoE(self.client, "ranks", **CONFIG),
                 RemoteMoE(Client(CLUSTER.address), "ranks", create=False)]
        for r, moe in enumerate(ranks):
            moe(inputs(10 + r))[0].sum().backward()
        answers = [None, None]

        def step(r):
            answers[r] = ranks[r].step(sgd={"lr": 0.1}, num_ranks=2, rank=r, run_id="t")
        threads = [threading.Thread(target=step, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual([a.optimizer_step for a in answers], [1, 1])
        self.assertEqual(self.client.get_layer("ranks").optimizer_step, 1)
        again = ranks[0].step(sgd={"lr": 0.1}, step=0, num_ranks=2, rank=0, run_id="t")
        self.assertTrue(again.already_applied)
        self.assertEqual(self.client.get_layer("ranks").optimizer_step, 1)
        # The gradients are shared by the ranks: a zero_grad() between a backward and step()
        # cannot take back one rank's share.
        x = inputs(12)
        ranks[0](x)[0].sum().backward()
        Parent(ranks[0]).zero_grad()  # resets grad_marker only (a parent's zero_grad)
        with self.assertRaisesRegex(RuntimeError, "data parallel"):
            ranks[0](x)[0].sum().backward()
        ranks[1].client.close()


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
