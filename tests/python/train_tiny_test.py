"""The training example (client/python/examples/train_tiny.py) against a live 2-worker CPU
cluster: with the RemoteMoE FFN the loss reaches a threshold that the same model without the
FFN cannot reach (its logits are a sum of per-token terms, which cannot express addition mod
V; it plateaus near 2.4, chance being ln 11 = 2.40). And issue 16's training check: the same
run with FP8 expert GEMMs (the CPU backend emulates the recipe of docs/SPEC.md "FP8" exactly)
reaches a loss within a few percent of BF16 after the same steps."""

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
# FP8 against BF16 after the same steps: the mean loss over the run (the area under the curve,
# which every step's rounding moves) within 5 %, and the last 20 steps' mean within 5 % or
# 0.02 (near zero loss a relative bound measures noise). Measured: see docs/PERFORMANCE.md
# "The engine on one H200" (FP8 training).
FP8_REL = 0.05
FP8_ABS_FINAL = 0.02


def mean(values):
    return sum(values) / len(values)


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

    def test_fp8_trains_like_bf16(self):
        cluster = LocalCluster(MOED, WORKER, workers=2).start()
        try:
            with Client(cluster.address) as client:
                curves = {dtype: train_tiny.train(client, steps=150, compute_dtype=dtype)
                          for dtype in ("bf16", "fp8")}
        finally:
            cluster.stop()
        for dtype, losses in curves.items():
            print("%s: mean %.4f, final %.4f, every 25th: %s" % (
                dtype, mean(losses), mean(losses[-20:]),
                " ".join("%.3f" % v for v in losses[::25])))
        bf16, fp8 = curves["bf16"], curves["fp8"]
        self.assertNotEqual(bf16, fp8)  # the FP8 recipe really ran
        self.assertLess(mean(bf16[-20:]), THRESHOLD)
        self.assertLess(abs(mean(fp8) - mean(bf16)), FP8_REL * mean(bf16))
        self.assertLess(abs(mean(fp8[-20:]) - mean(bf16[-20:])),
                        max(FP8_REL * mean(bf16[-20:]), FP8_ABS_FINAL))


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
