"""Every Client method against a live 2-worker CPU cluster: layers, steps, gradients,
optimizers, expert bias, weights (chunked both ways), checkpoints, status and health."""

import os
import sys
import tempfile
import unittest

import numpy as np

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Aborted, Client, DataLoss, FailedPrecondition, NotFound
from moe_client import codec

CLUSTER = None
MOED = WORKER = None


def setUpModule():
    global CLUSTER
    CLUSTER = LocalCluster(MOED, WORKER, workers=2).start()


def tearDownModule():
    CLUSTER.stop()


class ClientTest(unittest.TestCase):

    def setUp(self):
        # Small chunks so that weights and gradients travel in many chunks.
        self.client = Client(CLUSTER.address, timeout=30, chunk_bytes=1000)
        for layer in self.client.list_layers():
            self.client.delete_layer(layer.name)

    def tearDown(self):
        self.client.close()

    def test_layers_and_status(self):
        self.assertEqual(self.client.health(), "SERVING")
        info = self.client.create_layer("b", hidden=8, ffn=16, num_experts=4, top_k=2,
                                        score_function="sigmoid", activation="gelu")
        self.client.create_layer("a", hidden=8, ffn=16, num_experts=2)
        self.assertEqual(info.config.top_k, 2)
        self.assertEqual(info.ep_ranks, 2)
        self.assertEqual([l.name for l in self.client.list_layers()], ["a", "b"])
        self.assertEqual(self.client.get_layer("a").config.top_k, 1)  # default filled in
        status = self.client.get_status()
        self.assertTrue(status.serving)
        self.assertEqual(status.world_size, 2)
        self.assertEqual(sorted(w.rank for w in status.workers), [0, 1])
        self.client.delete_layer("a")
        with self.assertRaises(NotFound):
            self.client.get_layer("a")

    def test_steps_gradients_and_optimizers(self):
        self.client.create_layer("s", hidden=8, ffn=16, num_experts=4, top_k=2, init_seed=7)
        x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
        fwd = self.client.forward("s", x, keep_for_backward=True)
        self.assertEqual(fwd.out.shape, (6, 8))
        self.assertEqual(sum(fwd.tokens_per_expert), 6 * 2)
        self.assertGreater(fwd.step_id, 0)
        self.assertEqual(self.client.forward("s", x).step_id, 0)  # inference keeps nothing
        d_x = self.client.backward("s", fwd.step_id, np.ones_like(x), d_aux=0.0, d_z_loss=0.0)
        self.assertEqual(d_x.shape, (6, 8))
        grads = self.client.get_gradients("s")
        self.assertEqual(sorted(grads), ["gate", "wi", "wo"])
        self.assertEqual(grads["wi"].shape, (4, 8, 32))
        self.assertGreater(np.abs(grads["wo"]).max(), 0)
        self.assertEqual(list(self.client.get_gradients("s", names=["gate"])), ["gate"])
        self.client.zero_gradients("s")
        self.assertEqual(np.abs(self.client.get_gradients("s")["wo"]).max(), 0)

        kept = self.client.forward("s", x, keep_for_backward=True).step_id
        self.assertTrue(self.client.release_step("s", kept))
        self.assertFalse(self.client.release_step("s", kept))  # idempotent
        with self.assertRaises(FailedPrecondition):
            self.client.backward("s", kept, np.ones_like(x))

        before = self.client.get_weights("s")
        fwd = self.client.forward("s", x, keep_for_backward=True)
        self.client.backward("s", fwd.step_id, np.ones_like(x))
        self.client.apply_optimizer("s", adamw={"lr": 1e-2, "weight_decay": 0.01})
        after = self.client.get_weights("s")
        self.assertGreater(np.abs(after["wo"] - before["wo"]).max(), 0)
        with self.assertRaises(TypeError):
            self.client.apply_optimizer("s")

    def test_conditional_step_refuses_another_step(self):
        # expected_optimizer_step: another step than the layer's is Aborted and changes nothing
        # (weights, gradients, optimizer_step); the layer's own step applies.
        self.client.create_layer("c", hidden=8, ffn=16, num_experts=4, top_k=2, init_seed=3)
        x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
        fwd = self.client.forward("c", x, keep_for_backward=True)
        self.client.backward("c", fwd.step_id, np.ones_like(x))
        before, grads = self.client.get_weights("c"), self.client.get_gradients("c")
        self.assertEqual(self.client.get_layer("c").optimizer_step, 0)
        for expected in (1, 7):
            with self.assertRaises(Aborted) as refused:
                self.client.apply_optimizer("c", sgd={"lr": 0.5}, expected_optimizer_step=expected)
            self.assertIn("nothing applied", str(refused.exception))
        for name, value in self.client.get_weights("c").items():
            np.testing.assert_array_equal(value, before[name])
        for name, value in self.client.get_gradients("c").items():
            np.testing.assert_array_equal(value, grads[name])
        self.assertEqual(self.client.get_layer("c").optimizer_step, 0)
        answer = self.client.apply_optimizer("c", sgd={"lr": 0.5}, expected_optimizer_step=0)
        self.assertEqual(answer.optimizer_step, 1)
        self.assertGreater(np.abs(self.client.get_weights("c")["wo"] - before["wo"]).max(), 0)

    def test_steps_larger_than_one_message_are_streamed(self):
        # A client limited to 64 KiB messages sends x / d_out (128 KB) through ForwardStream /
        # BackwardStream in pieces; the results equal the unary calls' bit for bit.
        self.client.create_layer("big", hidden=32, ffn=16, num_experts=4, top_k=2, init_seed=3)
        rng = np.random.default_rng(1)
        x = rng.standard_normal((1001, 32)).astype(np.float32)
        d_out = rng.standard_normal((1001, 32)).astype(np.float32)
        with Client(CLUSTER.address, timeout=30, max_message_bytes=1 << 16) as tiny:
            unary = self.client.forward("big", x, keep_for_backward=True)
            streamed = tiny.forward("big", x, keep_for_backward=True)
            self.assertEqual(streamed.out.tobytes(), unary.out.tobytes())
            self.assertEqual(streamed.aux_loss, unary.aux_loss)
            self.assertEqual(streamed.tokens_per_expert, unary.tokens_per_expert)
            d_x_unary = self.client.backward("big", unary.step_id, d_out)
            d_x_streamed = tiny.backward("big", streamed.step_id, d_out)
            self.assertEqual(d_x_streamed.tobytes(), d_x_unary.tobytes())
            out = np.full((1001, 32), np.nan, np.float32)  # out=: the pieces written into it
            self.assertIs(tiny.forward("big", x, out=out).out, out)
            self.assertEqual(out.tobytes(), unary.out.tobytes())
            with self.assertRaises(NotFound):
                tiny.forward("nope", x)

    def test_steps_over_lanes_equal_one_call(self):
        # A client with 4 lanes and no size threshold stages x / d_out in row ranges over 4
        # connections (StageTensor) and fetches out / d_x the same way (FetchStaged); the
        # results equal the one-call path's bit for bit, in FP32 and BF16.
        self.client.create_layer("lanes", hidden=32, ffn=16, num_experts=4, top_k=2, init_seed=5)
        rng = np.random.default_rng(4)
        x = rng.standard_normal((37, 32)).astype(np.float32)
        d_out = rng.standard_normal((37, 32)).astype(np.float32)
        with Client(CLUSTER.address, timeout=30, lanes=1) as one, \
                Client(CLUSTER.address, timeout=30, lanes=4, lane_min_bytes=0) as lanes:
            self.assertEqual(len(lanes._lanes), 4)
            for datatype in (None, "BF16"):
                a = one.forward("lanes", x, keep_for_backward=True, datatype=datatype)
                b = lanes.forward("lanes", x, keep_for_backward=True, datatype=datatype)
                self.assertEqual(b.out.tobytes(), a.out.tobytes())
                self.assertEqual(b.aux_loss, a.aux_loss)
                self.assertEqual(b.tokens_per_expert, a.tokens_per_expert)
                d_a = one.backward("lanes", a.step_id, d_out, datatype=datatype)
                d_b = lanes.backward("lanes", b.step_id, d_out, datatype=datatype)
                self.assertEqual(d_b.tobytes(), d_a.tobytes())
            self.assertEqual(lanes.steps_over_lanes, 4)
            self.assertEqual(one.steps_over_lanes, 0)
            with self.assertRaises(NotFound):
                lanes.forward("nope", x)

    def test_out_buffers_take_the_answer(self):
        # forward / backward with out= write out / d_x into the caller's array and return that
        # array, bytes identical to the calls without out=, over one call and over 4 lanes, in
        # FP32 and BF16 (fp32 values; with raw=True the bf16 bit patterns).
        self.client.create_layer("outbuf", hidden=32, ffn=16, num_experts=4, top_k=2,
                                 init_seed=6)
        rng = np.random.default_rng(6)
        x = rng.standard_normal((37, 32)).astype(np.float32)
        d_out = rng.standard_normal((37, 32)).astype(np.float32)
        with Client(CLUSTER.address, timeout=30, lanes=1) as one, \
                Client(CLUSTER.address, timeout=30, lanes=4, lane_min_bytes=0) as lanes:
            for client in (one, lanes):
                for datatype in (None, "BF16"):
                    plain = client.forward("outbuf", x, keep_for_backward=True,
                                           datatype=datatype)
                    out = np.full((37, 32), np.nan, np.float32)
                    into = client.forward("outbuf", x, keep_for_backward=True,
                                          datatype=datatype, out=out)
                    self.assertIs(into.out, out)
                    self.assertEqual(out.tobytes(), plain.out.tobytes())
                    self.assertEqual(into.tokens_per_expert, plain.tokens_per_expert)
                    d_x = np.full((37, 32), np.nan, np.float32)
                    self.assertIs(client.backward("outbuf", into.step_id, d_out,
                                                  datatype=datatype, out=d_x), d_x)
                    self.assertEqual(d_x.tobytes(), client.backward(
                        "outbuf", plain.step_id, d_out, datatype=datatype).tobytes())
                    bits = np.zeros((37, 32), np.uint16 if datatype else np.float32)
                    raw = client.forward("outbuf", x, datatype=datatype, raw=True, out=bits)
                    self.assertIs(raw.out.raw_data, bits)
                    self.assertEqual(raw.out.datatype, datatype or "FP32")
                    self.assertEqual(codec.to_numpy(raw.out).tobytes(), plain.out.tobytes())
            self.assertEqual(one.steps_over_lanes, 0)
            self.assertEqual(lanes.steps_over_lanes, 10)

    def test_wrong_out_buffers_are_refused_before_sending(self):
        # A buffer of another dtype or shape, not C-contiguous, read-only or not numpy is
        # refused (ValueError / TypeError) before any message leaves the client; the kept
        # step is still there for a backward afterwards.
        self.client.create_layer("outbad", hidden=8, ffn=16, num_experts=4, top_k=2,
                                 init_seed=2)
        rng = np.random.default_rng(7)
        x = rng.standard_normal((6, 8)).astype(np.float32)
        d_out = rng.standard_normal((6, 8)).astype(np.float32)
        read_only = np.zeros((6, 8), np.float32)
        read_only.flags.writeable = False
        bad = {"float64": np.zeros((6, 8), np.float64),
               "bf16 bits without raw": np.zeros((6, 8), np.uint16),
               "shape": np.zeros((8, 6), np.float32),
               "rows": np.zeros((5, 8), np.float32),
               "non-contiguous": np.zeros((8, 6), np.float32).T,
               "strided rows": np.zeros((12, 8), np.float32)[::2],
               "read-only": read_only}
        fwd = self.client.forward("outbad", x, keep_for_backward=True)
        with Client(CLUSTER.address, timeout=30, lanes=4, lane_min_bytes=0) as lanes:
            for client in (self.client, lanes):
                sent = []
                client._call = client._raw_call = lambda *args, **kwargs: sent.append(args)
                try:
                    for name, out in bad.items():
                        with self.subTest(name=name):
                            with self.assertRaises(ValueError):
                                client.forward("outbad", x, keep_for_backward=True, out=out)
                            with self.assertRaises(ValueError):
                                client.backward("outbad", fwd.step_id, d_out, out=out)
                    with self.assertRaisesRegex(ValueError, "needs uint16"):  # raw BF16: bits
                        client.forward("outbad", x, datatype="BF16", raw=True,
                                       out=np.zeros((6, 8), np.float32))
                    with self.assertRaisesRegex(TypeError, "numpy array"):
                        client.backward("outbad", fwd.step_id, d_out, out=[[0.0] * 8] * 6)
                finally:
                    del client._call, client._raw_call
                self.assertEqual(sent, [])
            self.assertEqual(lanes.steps_over_lanes, 0)
        self.assertEqual(self.client.backward("outbad", fwd.step_id, d_out).shape, (6, 8))

    def test_expert_bias(self):
        self.client.create_layer("eb", hidden=8, ffn=16, num_experts=4, top_k=2,
                                 score_function="sigmoid", use_expert_bias=True)
        x = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
        counts = self.client.forward("eb", x).tokens_per_expert
        bias = self.client.update_expert_bias("eb", 0.5)
        mean = sum(counts) / len(counts)
        expected = [0.5 * float(np.sign(mean - c)) for c in counts]
        self.assertEqual(bias, expected)

    def test_weights_round_trip_and_checkpoint(self):
        self.client.create_layer("w", hidden=8, ffn=16, num_experts=4, top_k=2)
        rng = np.random.default_rng(2)
        new = {"gate": rng.standard_normal((8, 4)).astype(np.float32),
               "wo": rng.standard_normal((4, 16, 8)).astype(np.float32)}
        self.assertEqual(self.client.set_weights("w", new), ["gate", "wo"])
        got = self.client.get_weights("w")
        np.testing.assert_array_equal(got["gate"], new["gate"])
        np.testing.assert_array_equal(got["wo"], new["wo"])

        directory = "py/w"  # a name inside moed's --checkpoint_root
        self.assertEqual(self.client.save_checkpoint("w", directory), directory)
        self.client.set_weights("w", {"gate": np.zeros((8, 4), np.float32)})
        self.client.load_checkpoint("w", directory)
        np.testing.assert_array_equal(self.client.get_weights("w")["gate"], new["gate"])
        with self.assertRaises(NotFound):
            self.client.load_checkpoint("w", directory + "-missing")
        os.remove(os.path.join(CLUSTER.checkpoint_root, directory, "COMPLETE"))  # as if the save had not finished
        with self.assertRaises(DataLoss) as cm:
            self.client.load_checkpoint("w", directory)
        self.assertIn("COMPLETE", cm.exception.message)


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
