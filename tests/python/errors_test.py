"""Error paths of the Python client against a live 2-worker CPU cluster: every failure raises
a moe_client.MoeError subclass carrying the server's gRPC code and message."""

import sys
import unittest

import grpc
import numpy as np
import torch

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import (AlreadyExists, Client, FailedPrecondition, InvalidArgument, MoeError,
                        NotFound, RemoteMoE, Unavailable)

CLUSTER = None
MOED = WORKER = None


def setUpModule():
    global CLUSTER
    CLUSTER = LocalCluster(MOED, WORKER, workers=2).start()


def tearDownModule():
    CLUSTER.stop()


class ErrorsTest(unittest.TestCase):

    def setUp(self):
        torch.manual_seed(0)  # every test draws the same inputs on every run
        self.client = Client(CLUSTER.address, timeout=30)
        try:
            self.client.delete_layer("errors")
        except NotFound:
            pass
        self.moe = RemoteMoE(self.client, "errors", create=True, hidden=16, ffn=32,
                             num_experts=4, top_k=2)

    def tearDown(self):
        self.client.close()

    def test_wrong_hidden_size(self):
        with self.assertRaises(InvalidArgument) as cm:
            self.moe(torch.randn(5, 12, requires_grad=True))
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("16", cm.exception.message)  # the message names the expected size
        with self.assertRaises(InvalidArgument):
            self.client.forward("errors", np.zeros((5, 12), np.float32))
        self.assertEqual(self.client.get_layer("errors").saved_steps, 0)

    def test_unknown_layer(self):
        with self.assertRaises(NotFound) as cm:
            RemoteMoE(self.client, "no-such-layer", create=False)
        self.assertEqual(cm.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn("no-such-layer", cm.exception.message)
        with self.assertRaises(NotFound):
            self.client.forward("no-such-layer", np.zeros((2, 16), np.float32))
        with self.assertRaises(NotFound):
            self.client.apply_optimizer("no-such-layer", sgd={"lr": 0.1})

    def test_other_codes(self):
        with self.assertRaises(AlreadyExists):
            RemoteMoE(self.client, "errors", create=True, hidden=16, ffn=32, num_experts=4)
        with self.assertRaises(InvalidArgument) as cm:  # k > E: the config is validated
            self.client.create_layer("bad", hidden=16, ffn=32, num_experts=4, top_k=5)
        self.assertIn("top_k", cm.exception.message)
        with self.assertRaisesRegex(ValueError, "exists with ffn=32"):
            RemoteMoE(self.client, "errors", hidden=16, ffn=64, num_experts=4, top_k=2)
        fwd = self.client.forward("errors", np.ones((3, 16), np.float32),
                                  keep_for_backward=True)
        self.client.backward("errors", fwd.step_id, np.ones((3, 16), np.float32))
        with self.assertRaises(FailedPrecondition):  # one Backward per step
            self.client.backward("errors", fwd.step_id, np.ones((3, 16), np.float32))

    def test_dead_server(self):
        # A cluster of its own, stopped under a live RemoteMoE.
        cluster = LocalCluster(MOED, WORKER, workers=2).start()
        client = Client(cluster.address, timeout=10)
        moe = RemoteMoE(client, "doomed", hidden=16, ffn=32, num_experts=4, top_k=2)
        out, aux = moe(torch.randn(4, 16, requires_grad=True))
        cluster.stop()
        with self.assertRaises(Unavailable) as cm:
            moe(torch.randn(4, 16))
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        with self.assertRaises(Unavailable):
            (out.sum() + aux).backward()
        del out, aux  # the release of the step fails quietly (logged), it does not raise
        self.assertIsInstance(cm.exception, MoeError)
        with self.assertRaises(Unavailable):
            client.health()
        client.close()


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
