"""Step channels from Python (moe_client.step_channel) against a live 2-worker CPU cluster
with --allow_client_shm: forward / backward / release_step through the ring bit-identical
to gRPC (inline fp32 and bf16, shared-memory tensors, RemoteMoE), the same error classes and
codes, and the fall-back to gRPC with one log line: when moed closes the channel, and when
moed runs without --allow_client_shm.
"""

import logging
import sys
import time
import unittest

import numpy as np
import torch

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client, FailedPrecondition, NotFound, RemoteMoE
from moe_client.proto import moe_pb2
from moe_client.ring import SERVER_CLOSED
from moe_client.shared_memory import SharedMemoryRegion

CLUSTER = None
MOED = WORKER = None
CONFIG = dict(hidden=32, ffn=64, num_experts=8, top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)


def setUpModule():
    global CLUSTER
    CLUSTER = LocalCluster(MOED, WORKER, workers=2, extra_flags=["--allow_client_shm"]).start()


def tearDownModule():
    CLUSTER.stop()


class StepChannelTest(unittest.TestCase):

    def setUp(self):
        self.ring = Client(CLUSTER.address)
        self.grpc = Client(CLUSTER.address, step_channel=False)

    def tearDown(self):
        self.ring.close()
        self.grpc.close()

    def test_inline_steps_bit_identical(self):
        self.grpc.create_layer("py-ring", **CONFIG)
        rng = np.random.default_rng(7)
        for datatype in ("FP32", "BF16"):
            x = rng.standard_normal((16, 32)).astype(np.float32)
            d_out = rng.standard_normal((16, 32)).astype(np.float32)
            results = []
            for client in (self.grpc, self.ring):
                f = client.forward("py-ring", x, keep_for_backward=True, datatype=datatype,
                                   raw=True)
                d_x = client.backward("py-ring", f.step_id, d_out, datatype=datatype, raw=True)
                kept = client.forward("py-ring", x, keep_for_backward=True, datatype=datatype)
                released = (client.release_step("py-ring", kept.step_id),
                            client.release_step("py-ring", kept.step_id))
                results.append((bytes(f.out.raw_data), f.aux_loss, f.z_loss,
                                list(f.tokens_per_expert), bytes(d_x.raw_data), released))
            self.assertEqual(results[0], results[1], datatype)
            self.assertEqual(results[0][5], (True, False))
        self.assertEqual(self.ring.steps_over_channel, 10)
        self.assertEqual(self.grpc.steps_over_channel, 0)

    def test_shared_memory_steps_bit_identical(self):
        self.grpc.create_layer("py-ring-shm", **CONFIG)
        x = np.random.default_rng(2).standard_normal((16, 32)).astype(np.float32)
        outs = []
        for client in (self.grpc, self.ring):
            region = SharedMemoryRegion(client, 1 << 16)
            region.array(0, "FP32", x.shape)[...] = x
            r = client.forward_shm("py-ring-shm", region.tensor(0, "FP32", x.shape),
                                   out=region.output(x.nbytes, x.nbytes), keep_for_backward=True)
            d = client.backward_shm("py-ring-shm", r.step_id, region.tensor(0, "FP32", x.shape),
                                    d_x=region.output(2 * x.nbytes, x.nbytes))
            self.assertEqual(d.d_x.raw_data, b"")
            outs.append((region.array(x.nbytes, "FP32", x.shape).tobytes(),
                         region.array(2 * x.nbytes, "FP32", x.shape).tobytes(), r.aux_loss))
            region.close()
        self.assertEqual(outs[0], outs[1])
        self.assertEqual(self.ring.steps_over_channel, 2)

    def test_remote_moe_bit_identical(self):
        results = []
        for client in (self.grpc, self.ring):
            moe = RemoteMoE(client, "py-ring-moe", **CONFIG)
            x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
            x.requires_grad_(True)
            out, aux = moe(x)
            (out.square().sum() + aux).backward()
            results.append((out.detach(), aux.detach(), x.grad))
        for a, b in zip(*results):
            self.assertTrue(torch.equal(a, b))
        self.assertGreaterEqual(self.ring.steps_over_channel, 2)

    def test_same_errors_as_grpc(self):
        self.grpc.create_layer("py-ring-err", **CONFIG)
        x = np.zeros((4, 32), np.float32)
        seen = []
        for client in (self.grpc, self.ring):
            with self.assertRaises(NotFound) as missing:
                client.forward("py-ring-no-such-layer", x)
            with self.assertRaises(FailedPrecondition) as used:
                client.backward("py-ring-err", 0, x)
            seen.append([(e.exception.code, e.exception.message, e.exception.rpc)
                         for e in (missing, used)])
        self.assertEqual(seen[0], seen[1])
        self.assertEqual(seen[1][0][2], "Forward")
        self.assertTrue(self.ring.step_channel_on)

    def test_closed_channel_falls_back_and_logs_once(self):
        self.grpc.create_layer("py-ring-close", **CONFIG)
        x = np.ones((4, 32), np.float32)
        expected = self.grpc.forward("py-ring-close", x).out
        np.testing.assert_array_equal(self.ring.forward("py-ring-close", x).out, expected)
        channel_id = self.ring._step_channel.channel_id
        self.assertNotEqual(channel_id, 0)
        ring = self.ring._step_channel._ring
        self.ring._stub.CloseStepChannel(moe_pb2.CloseStepChannelRequest(channel_id=channel_id))
        deadline = time.monotonic() + 10
        while ring._u32[SERVER_CLOSED // 4] == 0:  # moed's thread closes its side
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        with self.assertLogs("moe_client", logging.INFO) as logs:
            for _ in range(3):
                np.testing.assert_array_equal(self.ring.forward("py-ring-close", x).out, expected)
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertIn("over gRPC", logs.output[0])
        self.assertFalse(self.ring.step_channel_on)
        self.assertEqual(self.ring.steps_over_channel, 1)


class FlagOffTest(unittest.TestCase):

    def test_refused_falls_back_and_logs_once(self):
        cluster = LocalCluster(MOED, WORKER, workers=2).start()
        try:
            client = Client(cluster.address)
            client.create_layer("py-ring-off", **CONFIG)
            x = np.ones((3, 32), np.float32)
            with self.assertLogs("moe_client", logging.INFO) as logs:
                a = client.forward("py-ring-off", x).out
                b = client.forward("py-ring-off", x).out
            self.assertEqual(len(logs.records), 1, logs.output)
            self.assertIn("UNIMPLEMENTED", logs.output[0])
            np.testing.assert_array_equal(a, b)
            self.assertEqual(client.steps_over_channel, 0)
            client.close()
        finally:
            cluster.stop()


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
