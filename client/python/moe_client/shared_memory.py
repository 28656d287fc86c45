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

import ctypes
import os
import threading
import weakref
from multiprocessing import shared_memory

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover - the numpy helpers work without torch
    torch = None

from moe_client import codec
from moe_client.errors import NotFound, PermissionDenied, Unimplemented
from moe_client.proto import moe_pb2


def _close(client, name, shm):
    try:
        client.unregister_system_shared_memory(name, timeout=5.0)
    except Exception:  # the server may be gone; it drops the region once it is unlinked
        pass
    try:
        shm.close()
    except BufferError:  # a torch view still exports the mapping: it goes with the last one
        pass
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

    def view(self, offset, datatype, shape):
        """A writable torch tensor over the region's bytes (FP32 or BF16 elements)."""
        dtype = {"FP32": torch.float32, "BF16": torch.bfloat16}[datatype]
        count = 1
        for d in shape:
            count *= int(d)
        if not count:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(self.shm.buf, dtype=dtype, count=count,
                                offset=offset).view(tuple(int(d) for d in shape))

    def address(self):
        """The mapping's address in this process (for cudaHostRegister)."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self.shm.buf))

    def tensor(self, offset, datatype, shape):
        """moe_pb2.SharedMemoryTensor naming bytes of this region."""
        count = int(np.prod(shape)) if len(shape) else 1
        return moe_pb2.SharedMemoryTensor(datatype=datatype, shape=[int(d) for d in shape],
                                          region=self.name, offset=offset,
                                          byte_size=count * codec.element_size(datatype))

    def output(self, offset, byte_size):
        return moe_pb2.SharedMemoryOutput(region=self.name, offset=offset, byte_size=byte_size)


class ShmStepper:
    """RemoteMoE's shared-memory path: one region laid out [input | output] (x and out in a
    forward, d_out and d_x in a backward) for the largest step seen so far (re-created larger
    when a step needs more), so each step costs one copy in and one copy out on this side and
    no tensor bytes on the socket. Tensors are torch tensors: CPU ones are copied with torch
    (dtype and strides in the same pass); for CUDA ones the region is page-locked once
    (cudaHostRegister) and the copies are DMA on the caller's stream, waited for before the
    RPC and before the region is written again.

    Steps of one module are serialised by a lock (the region is reused by every step).
    Returns None from create() when the server cannot use this host's shared memory
    (moed without --allow_client_shm, another host, a remote caller)."""

    def __init__(self, client):
        self.client = client
        self.region = None
        self.lock = threading.Lock()
        self._cache = {}  # (datatype, shape) -> views and messages of self.region
        self._pinned = None  # the region's address while cudaHostRegister'ed
        self._pending = None  # a CUDA event after the last copy out of the region

    @classmethod
    def create(cls, client, probe_bytes=1 << 16):
        stepper = cls(client)
        try:
            stepper._ensure(probe_bytes // 2)
        except (Unimplemented, PermissionDenied, NotFound):  # NotFound: our key is not there
            return None
        return stepper

    def _ensure(self, slot_bytes):
        if self.region is not None and self.region.byte_size >= 2 * _slot(slot_bytes):
            return
        size = 1 << 16
        while size < 2 * _slot(slot_bytes):
            size <<= 1
        self.close()
        self.region = SharedMemoryRegion(self.client, size)

    def _slots(self, datatype, shape):
        key = (datatype, shape)
        slots = self._cache.get(key)
        if slots is None:
            n = codec.element_size(datatype)
            for d in shape:
                n *= d
            self._ensure(n)
            slot, region = _slot(n), self.region
            slots = (region.view(0, datatype, shape), region.view(slot, datatype, shape),
                     region.tensor(0, datatype, shape), region.output(slot, n))
            if len(self._cache) >= 64:
                self._cache.clear()
            self._cache[key] = slots
        return slots

    def _pin(self):
        """Page-locks the region for DMA (once per region); False where CUDA refuses."""
        if self._pinned is None:
            address = self.region.address()
            error = torch.cuda.cudart().cudaHostRegister(address, self.region.byte_size, 0)
            self._pinned = address if int(error) == 0 else False
        return bool(self._pinned)

    def _run(self, tensor, datatype, call):
        """Copies torch `tensor` into the input slot as `datatype`, runs call(input
        SharedMemoryTensor, output SharedMemoryOutput) and returns (its answer, the output slot
        copied into a new tensor on `tensor`'s device, of the wire's dtype)."""
        into, out_slot, message_in, message_out = self._slots(datatype, tuple(tensor.shape))
        cuda = tensor.is_cuda
        if self._pending is not None:  # the last step's copy out is done with the region
            self._pending.synchronize()
            self._pending = None
        if cuda:
            pinned = self._pin()
            into.copy_(tensor, non_blocking=pinned)
            torch.cuda.current_stream(tensor.device).synchronize()
        else:
            into.copy_(tensor)
        answer = call(message_in, message_out)
        if not cuda:
            return answer, out_slot.clone()
        out = torch.empty(out_slot.shape, dtype=out_slot.dtype, device=tensor.device)
        out.copy_(out_slot, non_blocking=bool(self._pinned))
        self._pending = torch.cuda.Event()
        self._pending.record(torch.cuda.current_stream(tensor.device))
        return answer, out

    def forward(self, layer, x, datatype, keep):
        """x: a torch tensor [T, H] (CPU or CUDA, any strides and float dtype: copied into the
        region as `datatype`). Returns (ForwardResponse, out on x's device, wire dtype)."""
        with self.lock:
            return self._run(x, datatype, lambda t, o: self.client.forward_shm(
                layer, t, out=o, keep_for_backward=keep))

    def backward(self, layer, step_id, d_out, datatype, d_aux, d_z_loss):
        """d_out: a torch tensor [T, H]; returns d_x on its device, of the wire's dtype."""
        with self.lock:
            return self._run(d_out, datatype, lambda t, o: self.client.backward_shm(
                layer, step_id, t, d_x=o, d_aux=d_aux, d_z_loss=d_z_loss))[1]

    def close(self):
        self._cache.clear()  # the views first: they hold the mapping
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
        if self.region is not None:
            if self._pinned:
                torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = None
            self.region.close()
            self.region = None


_SLOT_ALIGN = 256


def _slot(nbytes):
    return (nbytes + _SLOT_ALIGN - 1) // _SLOT_ALIGN * _SLOT_ALIGN
