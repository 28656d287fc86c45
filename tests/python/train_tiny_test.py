"""The training example (client/python/examples/train_tiny.py) against a live 2-worker CPU
cluster: with the RemoteMoE FFN the loss reaches a threshold that the same model without the
FFN cannot reach (its logits are a sum of per-token terms, which cannot express addition mod
V; it plateaus near 2.4, chance being ln 11 = 2.40)."""

import os
import sys
import unittest

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python", "examples"))
import train_tiny  # noqa: E402

MOED = WORKER = None
THRESHOLD = 0.5  # mean cross-entropy of the last 20 steps


class TrainTinyTest(unittest.TestCase):

    def test_moe_model_beats_threshold_the_baseline_cannot(self):
        baseline = train_tiny.train(None, steps=300)
        baseline_final = sum(baseline[-20:]) / 20
        cluster = LocalCluster(MOED, WORKER, workers=2).start()
        try:
            with Client(cluster.address) as client:
                losses = train_tiny.train(client, steps=300)
                self.assertEqual(client.list_layers(), [])  # the example cleans up
        finally:
            cluster.stop()
        final = sum(losses[-20:]) / 20
        print("first loss %.3f, final %.4f; baseline final %.3f" %
              (losses[0], final, baseline_final))
        self.assertGreater(losses[0], 2.0)
        self.assertLess(final, THRESHOLD)
        self.assertGreater(baseline_final, 4 * THRESHOLD)


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
