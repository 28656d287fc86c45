"""RemoteMoE against a live 2-worker CPU cluster (moed + 2 moe-worker, Gloo between them).

- Outputs, aux loss, z-loss, input gradients and the server's weight gradients equal a float64
  PyTorch implementation of docs/SPEC.md written below. The layer computes in fp32 (and x travels
  as fp32), so the bound is rel. 1e-6 (norm-wise); measured: about 2-3e-7.
- torch.autograd.gradcheck passes on a tiny layer with a finite-difference step suited to an
  fp32 server: eps=1e-3, atol=1e-4, rtol=1e-3 (the default eps=1e-6 drowns in fp32 rounding:
  asserted too, so the tolerance is a measured necessity, not a guess).
- Steps without a backward are released; a second backward through a retained graph works.
- bf16 inputs travel as bf16 and come back as bf16.
"""

import sys
import unittest

import numpy as np
import torch
import torch.nn.functional as F

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Aborted, Client, NotFound, RemoteMoE

CLUSTER = None
MOED = WORKER = None


def setUpModule():
    global CLUSTER
    CLUSTER = LocalCluster(MOED, WORKER, workers=2).start()


def tearDownModule():
    CLUSTER.stop()


def reference_moe(x, w, cfg):
    """docs/SPEC.md forward in float64: softmax router with selection on the logits (pre_softmax
    false), top-k, weights renormalised over the selected set and scaled, gated SiLU experts
    (wi = [wi_0 | wi_1]), combine; aux loss and z-loss over this step's T tokens."""
    ffn, experts, k = cfg["ffn"], cfg["num_experts"], cfg["top_k"]
    tokens = x.shape[0]
    z = x @ w["gate"]                                           # [T, E]
    selected = torch.topk(z.detach(), k, dim=-1).indices        # [T, k]
    p = torch.softmax(torch.gather(z, 1, selected), dim=-1) * cfg.get("scaling_factor", 1.0)
    h = torch.einsum("th,tjhu->tju", x, w["wi"][selected])      # [T, k, 2F]
    a = F.silu(h[..., :ffn]) * h[..., ffn:]                     # [T, k, F]
    y = torch.einsum("tjf,tjfh->tjh", a, w["wo"][selected])     # [T, k, H]
    out = (p.unsqueeze(-1) * y).sum(1)
    probs_all = torch.softmax(z, dim=-1)
    counts = torch.zeros(experts, dtype=x.dtype).index_add_(
        0, selected.reshape(-1), torch.ones(tokens * k, dtype=x.dtype))
    aux = (experts * cfg.get("aux_loss_coeff", 0.0) / (k * tokens * tokens) *
           (probs_all.sum(0) * counts).sum())
    z_loss = cfg.get("z_loss_coeff", 0.0) / tokens * (torch.logsumexp(z, -1) ** 2).sum()
    return out, aux, z_loss


def rel(a, b):
    """Norm-wise relative error ||a - b|| / ||b||."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


def fresh_layer(client, name, **cfg):
    try:
        client.delete_layer(name)
    except NotFound:
        pass
    return RemoteMoE(client, name, create=True, **cfg)


class RemoteMoETest(unittest.TestCase):

    def setUp(self):
        torch.manual_seed(0)  # every test draws the same inputs on every run
        self.client = Client(CLUSTER.address, timeout=30)

    def tearDown(self):
        self.client.close()

    def test_matches_float64_reference(self):
        cfg = dict(hidden=32, ffn=64, num_experts=8, top_k=2, aux_loss_coeff=1e-2,
                   z_loss_coeff=1e-3, init_seed=3)
        moe = fresh_layer(self.client, "ref", **cfg)
        self.assertEqual(moe.info.ep_ranks, 2)
        weights = {n: torch.from_numpy(v.astype(np.float64)).requires_grad_()
                   for n, v in moe.weights().items()}
        self.assertEqual(sorted(weights), ["gate", "wi", "wo"])
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 8, 32, dtype=torch.float64, generator=g)  # [..., H] is flattened
        d_out = torch.randn(4, 8, 32, dtype=torch.float64, generator=g)
        x_remote, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()

        out, aux, z_loss = moe(x_remote, return_z_loss=True)
        self.assertEqual((out.shape, out.dtype), (x.shape, torch.float64))
        ((out * d_out).sum() + 3.0 * aux + 5.0 * z_loss).backward()
        ref_out, ref_aux, ref_z = reference_moe(x_ref.reshape(-1, 32), weights, cfg)
        ((ref_out.reshape(x.shape) * d_out).sum() + 3.0 * ref_aux + 5.0 * ref_z).backward()

        errors = {
            "out": rel(out.detach(), ref_out.detach().reshape(x.shape)),
            "aux": rel(aux.detach(), ref_aux.detach()),
            "z_loss": rel(z_loss.detach(), ref_z.detach()),
            "d_x": rel(x_remote.grad, x_ref.grad),
        }
        for name, grad in moe.gradients().items():  # weight gradients stay on the server
            errors["d_" + name] = rel(grad, weights[name].grad)
        print("relative errors vs float64 reference:", errors)
        self.assertEqual(len(errors), 7)
        for name, error in errors.items():
            self.assertLessEqual(error, 1e-6, name)
        self.assertGreater(ref_aux.item(), 0)
        self.assertGreater(ref_z.item(), 0)

    def test_gradcheck(self):
        cfg = dict(hidden=8, ffn=16, num_experts=4, top_k=2, aux_loss_coeff=1e-1,
                   z_loss_coeff=1e-2, init_seed=5)
        moe = fresh_layer(self.client, "gradcheck", **cfg)
        gate = torch.from_numpy(moe.weights()["gate"].astype(np.float64))
        g = torch.Generator().manual_seed(0)
        # Top-k is piecewise: keep the finite differences inside one routing region by taking
        # an input whose k-th and (k+1)-th logits are well apart.
        while True:
            x = torch.randn(6, 8, dtype=torch.float64, generator=g)
            logits = (x @ gate).sort(-1, descending=True).values
            if (logits[:, 1] - logits[:, 2]).min() > 0.05:
                break
        x.requires_grad_()
        fn = lambda v: moe(v, return_z_loss=True)  # out, aux, z_loss: all three checked
        self.assertTrue(torch.autograd.gradcheck(fn, (x,), eps=1e-3, atol=1e-4, rtol=1e-3))
        with self.assertRaisesRegex(RuntimeError, "Jacobian mismatch"):
            torch.autograd.gradcheck(fn, (x,))  # eps=1e-6 on an fp32 server: noise
        self.assertEqual(self.client.get_layer("gradcheck").saved_steps, 0)

    def test_steps_without_backward_are_released(self):
        moe = fresh_layer(self.client, "release", hidden=16, ffn=32, num_experts=4, top_k=2)
        x = torch.randn(10, 16, requires_grad=True)
        out, aux = moe(x)
        self.assertEqual(self.client.get_layer("release").saved_steps, 1)
        del out, aux  # the graph (and with it the step) is gone
        self.assertEqual(self.client.get_layer("release").saved_steps, 0)

        def failing_training_step():
            out, _ = moe(x)
            raise KeyError("the trainer fails between forward and backward")
        with self.assertRaises(KeyError):
            failing_training_step()
        self.assertEqual(self.client.get_layer("release").saved_steps, 0)

        moe.eval()
        with torch.no_grad():  # inference keeps nothing on the server
            out, _ = moe(x)
        self.assertFalse(out.requires_grad)
        info = self.client.get_layer("release")
        self.assertEqual((info.saved_steps, info.forward_count), (0, 3))

    def test_step_is_conditional_on_the_layers_optimizer_step(self):
        # Another process steps the layer between this module's backward and its step(): the
        # module's gradients were computed on step 0, the layer is at step 1, so step() is
        # Aborted and applies nothing; the module resyncs (step 1, gradients zeroed) and the
        # batch run again steps normally.
        moe = fresh_layer(self.client, "cond", hidden=16, ffn=32, num_experts=4, top_k=2)
        x = torch.randn(10, 16)
        out, aux = moe(x)
        (out.square().sum() + aux).backward()
        other = Client(CLUSTER.address, timeout=30)
        self.assertEqual(other.apply_optimizer("cond", sgd={"lr": 0.1}).optimizer_step, 1)
        other.close()
        before = self.client.get_weights("cond")
        with self.assertRaises(Aborted):
            moe.step(sgd={"lr": 0.1})
        after = self.client.get_weights("cond")
        for name in before:
            np.testing.assert_array_equal(after[name], before[name])
        self.assertEqual(np.abs(self.client.get_gradients("cond")["wo"]).max(), 0)
        out, aux = moe(x)
        (out.square().sum() + aux).backward()
        self.assertEqual(moe.step(sgd={"lr": 0.1}).optimizer_step, 2)
        self.assertEqual(moe.step(sgd={"lr": 0.1}).optimizer_step, 3)  # no backward: still ok

    def test_backward_twice_through_a_retained_graph(self):
        moe = fresh_layer(self.client, "twice", hidden=16, ffn=32, num_experts=4, top_k=2)
        x = torch.randn(10, 16, requires_grad=True)
        out, aux = moe(x)
        loss = (out ** 2).sum() + aux
        (first,) = torch.autograd.grad(loss, x, retain_graph=True)
        (second,) = torch.autograd.grad(loss, x)  # re-runs Forward: the server is deterministic
        self.assertTrue(torch.equal(first, second))
        self.assertEqual(self.client.get_layer("twice").saved_steps, 0)

    def test_bf16_and_weights_without_input_gradient(self):
        moe = fresh_layer(self.client, "bf16", hidden=16, ffn=32, num_experts=4, top_k=1,
                          init_seed=1)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(12, 16, generator=g)
        # The fp32 call gets the bf16-rounded values, so both calls route every token alike
        # (with top_k=1, an unrounded x can flip a near-tie token to another expert and the
        # outputs then differ by far more than bf16 rounding); what is left is the output's
        # rounding to bf16 on the way back: <= 2^-8 per element.
        x16 = x.bfloat16()
        out32, _ = moe(x16.float())
        out16, _ = moe(x16)
        self.assertEqual(out16.dtype, torch.bfloat16)
        self.assertLess(rel(out16.float().detach(), out32.detach()), 2 ** -8)
        # x needs no gradient, but the layer's weights still get theirs from the backward.
        moe.zero_grad()
        out, aux = moe(x)
        (out.sum() + aux).backward()
        grads = moe.gradients()
        self.assertGreater(np.abs(grads["wo"]).max(), 0)
        before = moe.weights()["wo"]
        moe.step(sgd={"lr": 0.1})
        after = moe.weights()["wo"]
        np.testing.assert_allclose(after, before - 0.1 * grads["wo"], rtol=1e-5, atol=1e-7)
        self.assertEqual(np.abs(moe.gradients()["wo"]).max(), 0)  # ApplyOptimizer zeroes


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
