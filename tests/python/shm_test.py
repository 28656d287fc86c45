"""Shared memory from Python against a live 2-worker CPU cluster started with
--allow_client_shm: region helpers (register, status, unregister), RemoteMoE(...,
shared_memory=True) bit-identical to the gRPC path (fp32 and bf16, forward and input
gradients), and the fall-back to gRPC when moed runs without the flag.
"""

import sys
import unittest

import numpy as np
import torch

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client, NotFound, RemoteMoE, Unimplemented
from moe_client.shared_memory import SharedMemoryRegion

CLUSTER = None
MOED = WORKER = None
CONFIG = dict(hidden=32, ffn=64, num_experts=8, top_k=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)


def setUpModule():
    global CLUSTER
    CLUSTER = LocalCluster(MOED, WORKER, workers=2, extra_flags=["--allow_client_shm"]).start()


def tearDownModule():
    CLUSTER.stop()


class SharedMemoryTest(unittest.TestCase):

    def test_region_helpers(self):
        client = Client(CLUSTER.address)
        region = SharedMemoryRegion(client, 1 << 16, name="py-helpers")
        [status] = client.system_shared_memory_status("py-helpers")
        self.assertEqual((status.key, status.byte_size), (region.key, 1 << 16))
        client.create_layer("py-shm-raw", **CONFIG)
        x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
        region.array(0, "FP32", x.shape)[...] = x
        r = client.forward_shm("py-shm-raw", region.tensor(0, "FP32", x.shape),
                               out=region.output(x.nbytes, x.nbytes))
        self.assertEqual(r.out.raw_data, b"")
        np.testing.assert_array_equal(region.array(x.nbytes, "FP32", x.shape),
                                      client.forward("py-shm-raw", x).out)
        region.close()
        with self.assertRaises(NotFound):
            client.system_shared_memory_status("py-helpers")

    def test_remote_moe_bit_identical(self):
        client = Client(CLUSTER.address)
        for dtype in (torch.float32, torch.bfloat16):
            name = "py-shm-%s" % str(dtype).split(".")[-1]
            grpc_moe = RemoteMoE(client, name, **CONFIG)
            shm_moe = RemoteMoE(client, name, shared_memory=True, **CONFIG)
            self.assertFalse(grpc_moe.uses_shared_memory)
            self.assertTrue(shm_moe.uses_shared_memory)
            results = []
            for moe in (grpc_moe, shm_moe):
                x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
                x.requires_grad_(True)
                out, aux = moe(x)
                (out.float().square().sum() + aux).backward()
                results.append((out.detach(), aux.detach(), x.grad))
            for a, b in zip(*results):
                self.assertEqual(a.dtype, b.dtype)
                self.assertTrue(torch.equal(a, b), (dtype, a, b))
            shm_moe._shm.close()


class FlagOffTest(unittest.TestCase):

    def test_falls_back_to_grpc(self):
        cluster = LocalCluster(MOED, WORKER, workers=2).start()
        try:
            client = Client(cluster.address)
            with self.assertRaises(Unimplemented):
                SharedMemoryRegion(client, 1 << 16)
            moe = RemoteMoE(client, "py-shm-off", shared_memory=True, **CONFIG)
            self.assertFalse(moe.uses_shared_memory)
            out, _ = moe(torch.randn(3, 32))
            self.assertEqual(out.shape, (3, 32))
        finally:
            cluster.stop()


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
