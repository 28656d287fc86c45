"""client/python/examples/train_dp.py launched by torchrun with 2 ranks (gloo, CPU) against a
live 2-worker cluster: after K steps the model (its local parameters and the shared remote
layer's weights, both from model.state_dict()) equals one process trained on the same global
batch, up to fp32 summation order, and the layer took exactly K optimizer steps.

Why a tolerance: the 2 ranks sum their half-batch gradients (DDP's all-reduce for the local
parameters, the server's accumulation for the remote layer) and divide by 2, where one process
sums the whole batch at once; fp32 rounds the two orders differently (~1e-7 relative per
gradient), and K SGD steps carry it along. SGD, not AdamW: AdamW divides by sqrt(v), which
turns a rounding difference of a near-zero gradient into a difference of order lr."""

import os
import subprocess
import sys
import tempfile
import unittest

import torch

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client",
                        "python", "examples")
sys.path.insert(0, EXAMPLES)
import train_dp  # noqa: E402

MOED = WORKER = None
# Debian's PyTorch 1.13 on Python 3.11: torch.distributed.run's default --redirects=0 / --tee=0
# parse to None (Std.from_str: 3.11's IntFlag no longer lists the 0 value) and the launcher
# crashes; a map that names only a rank beyond ours ("9:1") leaves every rank unredirected.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--redirects=9:1",
            "--tee=9:1"]
STEPS = 6
LR = 0.05
# max |dp - single| / max(1, |single|) over every tensor of the model; measured 1.0e-7.
TOLERANCE = 1e-6


class TrainDpTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.cluster = LocalCluster(MOED, WORKER, workers=2).start()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def run_torchrun(self, save):
        command = TORCHRUN + ["--nproc_per_node=2", os.path.join(EXAMPLES, "train_dp.py"),
                   "--server=" + self.cluster.address, "--layer=dp", "--steps=%d" % STEPS,
                   "--optimizer=sgd", "--lr=%g" % LR, "--aux_loss_coeff=0", "--keep_layer",
                   "--save=" + save]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=300)
        output = done.stdout.decode(errors="replace")
        self.assertEqual(done.returncode, 0, output)
        print(output.strip().splitlines()[-1])

    def test_two_ranks_train_as_one_process_on_the_global_batch(self):
        save = os.path.join(tempfile.mkdtemp(), "dp.pt")
        self.run_torchrun(save)
        dp = torch.load(save)
        with Client(self.cluster.address) as client:
            self.assertEqual(client.get_layer("dp").optimizer_step, STEPS)  # once per step
            model, _, _, _ = train_dp.train(client, layer="single", steps=STEPS, optimizer="sgd",
                                         lr=LR, aux_loss_coeff=0)
            single = model.state_dict()
            self.assertEqual(client.get_layer("single").optimizer_step, STEPS)
        self.assertEqual(sorted(dp), sorted(single))
        self.assertIn("ffn.wi", single)  # the remote layer's weights are in the state_dict
        worst = 0.0
        for name, expected in single.items():
            error = ((dp[name] - expected).abs() / expected.abs().clamp(min=1)).max().item()
            worst = max(worst, error)
            self.assertLess(error, TOLERANCE, name)
        # The ranks really trained: the model moved away from its initialisation.
        with Client(self.cluster.address) as client:
            fresh = client.create_layer("fresh", client.get_layer("single").config)
            self.assertTrue(fresh.name)
            initial = client.get_weights("fresh")["wi"]
        self.assertGreater(abs(single["ffn.wi"].numpy() - initial).max(), 1e-4)
        print("largest relative difference, 2 ranks vs 1 process: %.2e" % worst)


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
