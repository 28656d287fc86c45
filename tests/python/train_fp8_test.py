"""Issue 40's accuracy check on the CPU (client/python/examples/train_fp8.py) against a live
2-worker CPU cluster: 200 steps of a small teacher-student model through moed, its MoE layer
once in BF16 and once in FP8 (delayed scaling, the default recipe; the CPU backend emulates
the CUDA backend's recipe bit for bit, docs/SPEC.md "FP8"), same data, same initial weights.
The loss curves (trailing 10-step means) stay within 1 % of each other at every step, both
drop, and the FP8 run really ran FP8 (all six GEMMs, a different curve). Numbers:
docs/SPEC.md "FP8", "Training against BF16"."""

import os
import sys
import unittest

import torch

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python", "examples"))
import train_fp8  # noqa: E402

MOED = WORKER = None
ALL_GEMMS = "fc1_fprop,fc1_dgrad,fc1_wgrad,fc2_fprop,fc2_dgrad,fc2_wgrad"


class TrainFp8Test(unittest.TestCase):

    def test_fp8_loss_within_one_percent_of_bf16(self):
        torch.set_num_threads(1)  # as the example's main(): the same sums every run
        args = train_fp8.parse_args([])  # the example's defaults: 200 steps, bound 1 %
        self.assertEqual((args.steps, args.bound), (200, 0.01))
        cluster = LocalCluster(MOED, WORKER, workers=2).start()
        try:
            with Client(cluster.address) as client:
                bf16, fp8, s = train_fp8.run(client, args)
                self.assertEqual(client.list_layers(), [])  # the example cleans up
        finally:
            cluster.stop()
        smooth_b, smooth_f = (train_fp8.smooth(c, args.window) for c in (bf16, fp8))
        for i in range(0, args.steps, 10):
            print("step %3d  bf16 %.5f  fp8 %.5f  (smoothed %.5f %.5f, rel %.4f)" % (
                i, bf16[i], fp8[i], smooth_b[i], smooth_f[i],
                abs(smooth_f[i] - smooth_b[i]) / smooth_b[i]))
        print("max rel %.4f at step %d, final %.4f, raw per-step max %.4f" % (
            s["max_rel_diff"], s["max_rel_diff_step"], s["final_rel_diff"],
            s["max_raw_rel_diff"]))
        self.assertEqual(len(bf16), 200)
        self.assertEqual(len(fp8), 200)
        self.assertEqual(s["fp8_recipe"], "DELAYED")
        self.assertEqual(s["fp8_gemms"], ALL_GEMMS)  # every expert GEMM ran on FP8 operands
        self.assertNotEqual(bf16, fp8)  # ... and changed the numbers
        # Same initial weights: the first forward differs only by FP8 rounding.
        self.assertLess(abs(fp8[0] - bf16[0]), 0.01 * bf16[0])
        # Both curves drop: the last 10 steps' mean at least 30 % below the first 10's (measured
        # ~0.95 -> ~0.30, the noise floor being 0.2).
        for curve in (bf16, fp8):
            self.assertLess(sum(curve[-10:]) / 10, 0.7 * sum(curve[:10]) / 10)
        self.assertTrue(s["both_dropped"])
        # The 1 % bound, at every step of the smoothed curves.
        self.assertLessEqual(s["max_rel_diff"], 0.01)
        self.assertTrue(s["within_bound"])


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
