"""CUDA tensors from Python by CUDA IPC (moe_client.cuda_ipc) against a live cluster.

Without a GPU (CI): CPU workers refuse a CUDA region (FAILED_PRECONDITION) and RemoteMoE with
CPU tensors never tries CUDA IPC. With a GPU (the GPU machine; tools/gpu_checks.sh python):
moed with one CUDA worker per GPU and --allow_client_shm; a malformed handle is
INVALID_ARGUMENT;
RemoteMoE's results over CUDA IPC bit-identical to gRPC and shared memory (fp32 and bf16,
forward, aux loss and input gradients), against the float64 reference, for non-contiguous
inputs; a freed allocation and a region longer than its allocation fail their step cleanly
(the worker stays up); a cluster of CPU workers makes RemoteMoE fall back with one log line.
MOED_REQUIRE_GPU=1 makes a missing GPU a failure instead of a skip.
"""

import logging
import os
import sys
import unittest

import torch

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client, FailedPrecondition, InvalidArgument, RemoteMoE
from moe_client.cuda_ipc import CudaSharedMemoryRegion, _Driver
from remote_moe_test import reference_moe, rel

CLUSTER = None
MOED = WORKER = None
CONFIG = dict(hidden=64, ffn=128, num_experts=8, top_k=2, aux_loss_coeff=1e-2,
              z_loss_coeff=1e-3)
HAVE_GPU = torch.cuda.is_available()
if not HAVE_GPU and os.environ.get("MOED_REQUIRE_GPU"):
    raise RuntimeError("MOED_REQUIRE_GPU is set but torch sees no CUDA device")


def setUpModule():
    global CLUSTER
    workers = torch.cuda.device_count() if HAVE_GPU else 2
    CLUSTER = LocalCluster(MOED, WORKER, workers=workers, device="cuda" if HAVE_GPU else "cpu",
                           extra_flags=["--allow_client_shm"]).start(timeout=120)


def tearDownModule():
    CLUSTER.stop()


class RefusedWithoutCudaWorkersTest(unittest.TestCase):

    @unittest.skipIf(HAVE_GPU, "the cluster has CUDA workers")
    def test_cpu_workers_refuse_a_cuda_region(self):
        client = Client(CLUSTER.address)
        with self.assertRaises(FailedPrecondition) as e:
            client.register_cuda_shared_memory("py-cuda-on-cpu", b"\1" * 64, 0, 1 << 20)
        self.assertIn("CUDA", e.exception.message)
        self.assertEqual(client.system_shared_memory_status(), [])

    @unittest.skipUnless(HAVE_GPU, "CPU workers refuse every CUDA region first")
    def test_malformed_handle_is_invalid_argument(self):
        client = Client(CLUSTER.address)
        for handle, size in ((b"\1" * 63, 1 << 20), (b"\1" * 65, 1 << 20), (b"\1" * 64, 0)):
            with self.assertRaises(InvalidArgument):
                client.register_cuda_shared_memory("py-cuda-bad", handle, 0, size)
        self.assertEqual(client.system_shared_memory_status(), [])

    def test_cpu_tensors_never_use_cuda_ipc(self):
        client = Client(CLUSTER.address)
        moe = RemoteMoE(client, "py-cuda-cpu-tensors", **CONFIG)
        out, _ = moe(torch.randn(5, 64))
        self.assertEqual(out.shape, (5, 64))
        self.assertFalse(moe.uses_cuda_ipc)
        self.assertEqual(moe._cuda, {})


def _training_step(moe, x, d_out):
    x = x.clone().requires_grad_(True)
    out, aux, z = moe(x, return_z_loss=True)
    ((out.float() * d_out).sum() + 3.0 * aux + 5.0 * z).backward()
    return out.detach(), aux.detach(), z.detach(), x.grad


@unittest.skipUnless(HAVE_GPU, "needs a CUDA device")
class CudaIpcTest(unittest.TestCase):

    def setUp(self):
        torch.manual_seed(0)
        self.client = Client(CLUSTER.address, timeout=60)

    def test_bit_identical_to_grpc_and_shared_memory(self):
        for dtype in (torch.float32, torch.bfloat16):
            name = "py-cuda-%s" % str(dtype).split(".")[-1]
            config = dict(CONFIG, compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32")
            paths = {"grpc": RemoteMoE(self.client, name, cuda_ipc=False, **config),
                     "shm": RemoteMoE(self.client, name, cuda_ipc=False, shared_memory=True,
                                      **config),
                     "cuda": RemoteMoE(self.client, name, **config)}
            g = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(3, 37, 64, device="cuda", generator=g).to(dtype)
            d_out = torch.randn(3, 37, 64, device="cuda", generator=g)
            results = {path: _training_step(moe, x, d_out) for path, moe in paths.items()}
            self.assertTrue(paths["cuda"].uses_cuda_ipc)
            self.assertTrue(paths["shm"].uses_shared_memory)
            for path in ("grpc", "shm"):
                for a, b, what in zip(results["cuda"], results[path], ("out", "aux", "z", "d_x")):
                    self.assertEqual((a.dtype, a.device), (b.dtype, b.device), what)
                    self.assertTrue(torch.equal(a, b), "%s %s cuda vs %s" % (dtype, what, path))
            self.assertEqual(results["cuda"][0].device, x.device)

    def test_matches_float64_reference(self):
        cfg = dict(CONFIG, init_seed=3)
        self.client.create_layer("py-cuda-ref", compute_dtype="fp32", **cfg)
        moe = RemoteMoE(self.client, "py-cuda-ref", create=False)
        weights = {n: torch.from_numpy(v).double().requires_grad_()
                   for n, v in moe.weights().items()}
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 64, dtype=torch.float64, generator=g)
        d_out = torch.randn(64, 64, dtype=torch.float64, generator=g)
        out, aux, z, d_x = _training_step(moe, x.float().cuda(), d_out.float().cuda())
        self.assertTrue(moe.uses_cuda_ipc)
        x_ref = x.clone().requires_grad_(True)
        ref_out, ref_aux, ref_z = reference_moe(x_ref, weights, cfg)
        ((ref_out * d_out).sum() + 3.0 * ref_aux + 5.0 * ref_z).backward()
        errors = {"out": rel(out.cpu(), ref_out.detach()), "aux": rel(aux.cpu(), ref_aux.detach()),
                  "z_loss": rel(z.cpu(), ref_z.detach()), "d_x": rel(d_x.cpu(), x_ref.grad)}
        for name, grad in moe.gradients().items():
            errors["d_" + name] = rel(grad, weights[name].grad)
        print("CUDA IPC relative errors vs float64 reference:", errors)
        for name, error in errors.items():
            self.assertLessEqual(error, 1e-5, name)

    def test_non_contiguous_and_fp64_inputs(self):
        moe = RemoteMoE(self.client, "py-cuda-strides", **CONFIG)
        base = torch.randn(40, 64, device="cuda")
        strided = base[::2]
        self.assertFalse(strided.is_contiguous())
        with torch.no_grad():
            a, _ = moe(strided)
            b, _ = moe(strided.contiguous())
            c, _ = moe(strided.double())
        self.assertTrue(torch.equal(a, b))
        self.assertEqual(c.dtype, torch.float64)
        self.assertTrue(torch.equal(c.float(), a))

    def test_freed_allocation_and_short_region_fail_their_step(self):
        self.client.create_layer("py-cuda-raw", **CONFIG)
        driver = _Driver.get()
        device = torch.cuda.current_device()
        good = CudaSharedMemoryRegion(self.client, 1 << 20, device)
        good.view(0, torch.float32, (4, 64)).normal_()
        good.record()
        good.synchronize_for_step()
        # A freed allocation's handle. 32 MiB: the driver gives an allocation that large pages
        # of its own, which cuMemFree returns (a small one shares pages with others, which can
        # outlive it: its handle may still open, onto memory of this same process).
        ptr = driver.alloc(device, 32 << 20)
        handle = driver.ipc_handle(device, ptr)
        driver.free(device, ptr)
        self.client.register_cuda_shared_memory("py-cuda-freed", handle, device, 32 << 20)
        self.addCleanup(self.client.unregister_system_shared_memory, "py-cuda-freed")
        with self.assertRaises(FailedPrecondition) as e:
            self.client.forward_shm("py-cuda-raw",
                                    _named(good.tensor(0, "FP32", (4, 64)), "py-cuda-freed"))
        self.assertIn("CUDA", e.exception.message)
        # A region registered longer than its allocation.
        ptr = driver.alloc(device, 32 << 20)
        try:
            self.client.register_cuda_shared_memory(
                "py-cuda-short", driver.ipc_handle(device, ptr), device, 64 << 20)
            with self.assertRaises(FailedPrecondition):
                self.client.forward_shm("py-cuda-raw", _named(
                    good.tensor(48 << 20, "FP32", (4, 64)), "py-cuda-short"))
            self.client.unregister_system_shared_memory("py-cuda-short")
        finally:
            driver.free(device, ptr)
        # The worker is fine: a good step still runs, and equals the gRPC answer.
        self.assertEqual(self.client.health(), "SERVING")
        x = good.view(0, torch.float32, (4, 64)).cpu().numpy()
        r = self.client.forward_shm("py-cuda-raw", good.tensor(0, "FP32", (4, 64)),
                                    out=good.output(1 << 16, 4 * 64 * 4))
        self.assertEqual(r.out.raw_data, b"")
        expected = torch.from_numpy(self.client.forward("py-cuda-raw", x).out.copy())
        self.assertTrue(torch.equal(good.view(1 << 16, torch.float32, (4, 64)).cpu(), expected))
        good.close()

    def test_falls_back_with_one_log_line_on_cpu_workers(self):
        cluster = LocalCluster(MOED, WORKER, workers=2, extra_flags=["--allow_client_shm"])
        cluster.start()
        try:
            client = Client(cluster.address)
            moe = RemoteMoE(client, "py-cuda-fallback", **CONFIG)
            x = torch.randn(6, 64, device="cuda")
            with self.assertLogs("moe_client", logging.WARNING) as logs:
                for _ in range(3):
                    out, aux = moe(x)
                    (out.sum() + aux).backward()
            self.assertEqual(len(logs.records), 1, logs.output)
            self.assertIn("GPU memory", logs.output[0])
            self.assertFalse(moe.uses_cuda_ipc)
            self.assertEqual(out.device, x.device)
        finally:
            cluster.stop()


def _named(tensor, region):
    tensor.region = region
    return tensor


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv, verbosity=2)
