"""Zero-copy steps for callers on moed's host: POSIX shared memory (proto/moe.proto,
"Shared memory"; moed must run with --allow_client_shm).

    from moe_client import Client
    from moe_client.shared_memory import SharedMemoryRegion
    region = SharedMemoryRegion(client, 4 << 20)          # creates /psm_..., registers it
    region.array(0, "FP32", (T, H))[:] = x                # write x into the region
    r = client.forward_shm("l0", region.tensor(0, "FP32", (T, H)),
                           out=region.output(x_bytes, x_bytes))
    out = region.array(x_bytes, "FP32", (T, H))           # the workers wrote it there
    region.close()                                        # unregisters, unlinks

The object comes from multiprocessing.shared_memory: if this process dies, Python's resource
tracker unlinks it and moed then drops the registration by itself (it notices the unlinked
object), so nothing stays mapped on the server.
"""

import os
import threading
import weakref
from multiprocessing import shared_memory

import numpy as np

from moe_client import codec
from moe_client.errors import NotFound, PermissionDenied, Unimplemented
from moe_client.proto import moe_pb2


def _close(client, name, shm):
    try:
        client.unregister_system_shared_memory(name, timeout=5.0)
    except Exception:  # the server may be gone; it drops the region once it is unlinked
        pass
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class SharedMemoryRegion:
    """A shm object of this process registered with moed under `name` (whole object)."""

    def __init__(self, client, byte_size, name=None):
        self.shm = shared_memory.SharedMemory(create=True, size=byte_size)
        self.key = "/" + self.shm.name.lstrip("/")
        self.name = name or "py-%d-%s" % (os.getpid(), self.shm.name.lstrip("/"))
        self.byte_size = byte_size
        try:
            client.register_system_shared_memory(self.name, self.key, 0, byte_size)
        except BaseException:
            self.shm.close()
            self.shm.unlink()
            raise
        self._finalizer = weakref.finalize(self, _close, client, self.name, self.shm)

    def close(self):
        self._finalizer()

    def array(self, offset, datatype, shape):
        """A writable numpy view of the region (BF16 as its uint16 bit patterns)."""
        dtype = codec._NUMPY_OF[datatype]
        count = int(np.prod(shape)) if len(shape) else 1
        return np.ndarray(shape, dtype=dtype, buffer=self.shm.buf, offset=offset) if count else \
            np.empty(shape, dtype)

    def tensor(self, offset, datatype, shape):
        """moe_pb2.SharedMemoryTensor naming bytes of this region."""
        count = int(np.prod(shape)) if len(shape) else 1
        return moe_pb2.SharedMemoryTensor(datatype=datatype, shape=[int(d) for d in shape],
                                          region=self.name, offset=offset,
                                          byte_size=count * codec.element_size(datatype))

    def output(self, offset, byte_size):
        return moe_pb2.SharedMemoryOutput(region=self.name, offset=offset, byte_size=byte_size)


class ShmStepper:
    """RemoteMoE's shared-memory path: one region laid out [x | out | d_out | d_x] for the
    largest step seen so far (re-created larger when a step needs more), so each step costs
    one copy in and one copy out on this side and no tensor bytes on the socket.

    Steps of one module are serialised by a lock (the region is reused by every step).
    Returns None from create() when the server cannot use this host's shared memory
    (moed without --allow_client_shm, another host, a remote caller)."""

    def __init__(self, client):
        self.client = client
        self.region = None
        self.lock = threading.Lock()

    @classmethod
    def create(cls, client, probe_bytes=1 << 16):
        stepper = cls(client)
        try:
            stepper._ensure(probe_bytes)
        except (Unimplemented, PermissionDenied, NotFound):  # NotFound: our key is not there
            return None
        return stepper

    def _ensure(self, slot_bytes):
        if self.region is not None and self.region.byte_size >= 4 * slot_bytes:
            return
        size = 1 << 16
        while size < 4 * slot_bytes:
            size <<= 1
        if self.region is not None:
            self.region.close()
            self.region = None
        self.region = SharedMemoryRegion(self.client, size)

    def _put(self, offset, array):
        self.region.array(offset, "BF16" if array.dtype == np.uint16 else "FP32",
                          array.shape)[...] = array

    def forward(self, layer, x, datatype, keep):
        """x: numpy [T, H] (float32, or uint16 bf16 bits). Returns (ForwardResponse, out copy)."""
        with self.lock:
            n = x.nbytes
            self._ensure(n)
            self._put(0, x)
            r = self.client.forward_shm(layer, self.region.tensor(0, datatype, x.shape),
                                        out=self.region.output(n, n), keep_for_backward=keep)
            return r, self.region.array(n, datatype, x.shape).copy()

    def backward(self, layer, step_id, d_out, datatype, d_aux, d_z_loss):
        with self.lock:
            n = d_out.nbytes
            self._ensure(n)
            self._put(2 * n, d_out)
            self.client.backward_shm(layer, step_id, self.region.tensor(2 * n, datatype,
                                                                        d_out.shape),
                                     d_x=self.region.output(3 * n, n), d_aux=d_aux,
                                     d_z_loss=d_z_loss)
            return self.region.array(3 * n, datatype, d_out.shape).copy()

    def close(self):
        if self.region is not None:
            self.region.close()
            self.region = None
