"""CUDA tensors in place for callers on moed's host: GPU memory shared with the CUDA workers by
CUDA IPC (proto/moe.proto, "Shared memory", RegisterCudaSharedMemory; moed must run with
--allow_client_shm and CUDA workers on this host).

    from moe_client import Client
    from moe_client.cuda_ipc import CudaSharedMemoryRegion
    region = CudaSharedMemoryRegion(client, 64 << 20, device=0)  # allocates, registers
    region.view(0, torch.bfloat16, (T, H)).copy_(x)              # x into the region
    region.record(); region.synchronize_for_step()               # the copy done before the step
    r = client.forward_shm("l0", region.tensor(0, "BF16", (T, H)),
                           out=region.output(n, n))
    out = region.view(n, torch.bfloat16, (T, H))                  # the workers wrote it there
    region.close()                                                # unregisters, frees

The region is a plain allocation of its own (cuMemAlloc through the CUDA driver, libcuda, by
ctypes: no new dependency, and none of torch's caching-allocator blocks, whose IPC sharing
keeps reference-count files in /dev/shm), registered once and reused by every step, as Triton's
CUDA shared-memory extension does. The workers open it once (cudaIpcOpenMemHandle) and copy
rows device to device: no byte of a step crosses host memory.

Ordering: a step may only read what the caller's stream has finished writing, and the caller
may only read what the workers finished writing. synchronize_for_step() waits for the work the
caller queued on the region (its copies in, and the copies out of the previous step) before the
RPC; the workers synchronise their streams before they answer, so after the answer the region
holds the result for any stream of this process.
"""

import ctypes
import logging
import os
import threading
import weakref

import torch

from moe_client import codec
from moe_client.errors import FailedPrecondition, NotFound, PermissionDenied, Unimplemented
from moe_client.proto import moe_pb2

_log = logging.getLogger("moe_client")

_IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle) == sizeof(cudaIpcMemHandle_t)
_SLOT_ALIGN = 256  # slot offsets: as cudaMalloc's alignment


class CudaError(RuntimeError):
    """A CUDA driver call failed (its CUresult name in the message)."""


class _Driver:
    """The few CUDA driver calls a region needs, through ctypes (libcuda.so.1 comes with the
    NVIDIA driver wherever CUDA runs). Every call runs with the device's primary context,
    the one the CUDA runtime (and so torch) uses, pushed on the calling thread."""

    _lock = threading.Lock()
    _instance = None

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError("libcuda.so.1 (the CUDA driver) cannot be loaded: %s" % e) from None
        self._check(self.lib.cuInit(0), "cuInit")
        self._contexts = {}

    def _check(self, result, what):
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise CudaError("%s failed: %s (%d)" % (
                what, name.value.decode() if name.value else "unknown", result))

    def _context(self, device):
        ctx = self._contexts.get(device)
        if ctx is None:
            dev = ctypes.c_int()
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            ctx = ctypes.c_void_p()
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                        "cuDevicePrimaryCtxRetain")
            self._contexts[device] = ctx
        return ctx

    def _on(self, device, fn):
        self._check(self.lib.cuCtxPushCurrent_v2(self._context(device)), "cuCtxPushCurrent")
        try:
            return fn()
        finally:
            popped = ctypes.c_void_p()
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def alloc(self, device, nbytes):
        ptr = ctypes.c_uint64()
        self._on(device, lambda: self._check(
            self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc"))
        return ptr.value

    def free(self, device, ptr):
        self._on(device, lambda: self._check(self.lib.cuMemFree_v2(ctypes.c_uint64(ptr)),
                                             "cuMemFree"))

    def ipc_handle(self, device, ptr):
        handle = (ctypes.c_char * _IPC_HANDLE_BYTES)()
        self._on(device, lambda: self._check(
            self.lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(ptr)), "cuIpcGetMemHandle"))
        return bytes(handle)


class _Allocation:
    """`nbytes` of device memory at `ptr` (cuMemAlloc), shown to torch as a CUDA array
    (__cuda_array_interface__). torch.as_tensor keeps this object alive while any view of it
    exists, so the memory is freed (cuMemFree) only when the region is closed and the last
    view is gone."""

    def __init__(self, device, nbytes):
        self.device, self.nbytes = device, nbytes
        self.ptr = _Driver.get().alloc(device, nbytes)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (self.ptr, False), "version": 2,
                                         "strides": None}
        self._finalizer = weakref.finalize(self, _free, device, self.ptr)

    def free_now(self):
        self._finalizer()


def _free(device, ptr):
    try:
        _Driver.get().free(device, ptr)
    except CudaError as e:  # a finalizer must not raise
        _log.warning("moe_client: freeing CUDA memory at %#x: %s", ptr, e)


def _unregister(client, name):
    try:
        client.unregister_system_shared_memory(name, timeout=5.0)
    except Exception:  # the server may be gone; its workers close the handle then
        pass


def _device_index(device):
    device = torch.device(device if not isinstance(device, int) else "cuda:%d" % device)
    if device.type != "cuda":
        raise ValueError("a CUDA region needs a CUDA device, not %s" % device)
    return device.index if device.index is not None else torch.cuda.current_device()


class CudaSharedMemoryRegion:
    """`byte_size` bytes of GPU memory on `device`, registered with moed as region `name`."""

    _counter = 0

    def __init__(self, client, byte_size, device=None, name=None):
        if byte_size <= 0:
            raise ValueError("byte_size must be > 0, got %d" % byte_size)
        self.device = _device_index(device if device is not None else "cuda")
        torch.cuda.init()
        memory = _Allocation(self.device, byte_size)
        self.byte_size = byte_size
        CudaSharedMemoryRegion._counter += 1
        self.name = name or "pycuda-%d-%d" % (os.getpid(), CudaSharedMemoryRegion._counter)
        try:
            client.register_cuda_shared_memory(
                self.name, _Driver.get().ipc_handle(self.device, memory.ptr), self.device,
                byte_size)
        except BaseException:
            memory.free_now()
            raise
        self.bytes = torch.as_tensor(memory, device="cuda:%d" % self.device)
        self._events = []  # record(): the caller's work on the region not yet waited for
        self._finalizer = weakref.finalize(self, _unregister, client, self.name)

    def close(self):
        """Unregisters the region; its memory is freed once no view of it is left."""
        self.bytes = None
        self._finalizer()

    def view(self, offset, dtype, shape):
        """A torch tensor of `dtype` and `shape` over the region's bytes [offset, ...)."""
        if self.bytes is None:
            raise ValueError("region %s is closed" % self.name)
        count = 1
        for d in shape:
            count *= int(d)
        itemsize = getattr(dtype, "itemsize", 0) or torch.empty((), dtype=dtype).element_size()
        nbytes = count * itemsize
        if offset < 0 or offset % 16 or offset + nbytes > self.byte_size:
            raise ValueError("view [%d, +%d) does not fit region %s of %d bytes (offsets "
                             "16-byte aligned)" % (offset, nbytes, self.name, self.byte_size))
        return self.bytes[offset:offset + nbytes].view(dtype).view(tuple(int(d) for d in shape))

    def tensor(self, offset, datatype, shape):
        """moe_pb2.SharedMemoryTensor naming a [shape] tensor of `datatype` at `offset`."""
        nbytes = codec.element_size(datatype)
        for d in shape:
            nbytes *= int(d)
        return moe_pb2.SharedMemoryTensor(datatype=datatype, shape=[int(d) for d in shape],
                                          region=self.name, offset=offset, byte_size=nbytes)

    def output(self, offset, byte_size):
        return moe_pb2.SharedMemoryOutput(region=self.name, offset=offset, byte_size=byte_size)

    def record(self):
        """Marks the caller's current stream: the work it queued on the region so far (copies
        in, copies out) must be done before the next step (synchronize_for_step)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._events.append(event)

    def synchronize_for_step(self):
        """Waits until the work recorded on the region (record()) is done, on every stream it
        was recorded on."""
        for event in self._events:
            event.synchronize()
        self._events.clear()


_TORCH_OF = {"FP32": torch.float32, "BF16": torch.bfloat16}


def _slot(nbytes):
    return (nbytes + _SLOT_ALIGN - 1) // _SLOT_ALIGN * _SLOT_ALIGN


class CudaStepper:
    """RemoteMoE's CUDA IPC path: one region on a GPU laid out [input | output] (x and out in a
    forward, d_out and d_x in a backward) for the largest step seen so far (re-created larger
    when a step needs more). A step costs a device-to-device copy in and one out on the
    caller's stream, a wait for them, and one RPC with no tensor bytes. Steps of one module
    are serialised by a lock (the region is reused).

    create() returns the error instead of a stepper when the server cannot use this process's
    GPU memory: moed without
    --allow_client_shm (UNIMPLEMENTED), a remote caller (PERMISSION_DENIED), CPU workers
    (FAILED_PRECONDITION). A handle the workers cannot open (another host, another GPU set)
    fails the first step with FAILED_PRECONDITION: RemoteMoE then falls back (torch_layer.py)."""

    def __init__(self, client, device):
        self.client = client
        self.device = device
        self.region = None
        self.lock = threading.Lock()
        self._cache = {}  # _slots(): (datatype, shape) -> views and messages of self.region
        self.steps = 0  # steps answered over CUDA IPC

    @classmethod
    def create(cls, client, device, probe_bytes=1 << 20):
        stepper = cls(client, _device_index(device))
        try:
            stepper._ensure(probe_bytes // 2)
        except (Unimplemented, PermissionDenied, NotFound, FailedPrecondition, CudaError) as e:
            return e
        return stepper

    def _ensure(self, slot_bytes):
        need = 2 * _slot(slot_bytes)
        if self.region is not None and self.region.byte_size >= need:
            return
        size = 1 << 20
        while size < need:
            size <<= 1
        self.close()
        self.region = CudaSharedMemoryRegion(self.client, size, self.device)

    def _slots(self, datatype, shape):
        """(input view, output view, SharedMemoryTensor, SharedMemoryOutput) of a step of
        `datatype` and `shape`, made once per shape and region (a trainer repeats its shapes,
        and each view or message made anew costs tens of microseconds of Python)."""
        key = (datatype, shape)
        slots = self._cache.get(key)
        if slots is None:
            n = codec.element_size(datatype)
            for d in shape:
                n *= d
            self._ensure(n)
            dtype, slot, region = _TORCH_OF[datatype], _slot(n), self.region
            slots = (region.view(0, dtype, shape), region.view(slot, dtype, shape),
                     region.tensor(0, datatype, shape), region.output(slot, n))
            if len(self._cache) >= 64:
                self._cache.clear()
            self._cache[key] = slots
        return slots

    def _run(self, tensor, datatype, call):
        """Copies `tensor` into the input slot as `datatype` ("FP32" or "BF16"), runs
        call(SharedMemoryTensor of the input, SharedMemoryOutput of the output slot) and
        returns (its answer, the output slot copied into a new tensor of that dtype)."""
        into, out_slot, message_in, message_out = self._slots(datatype, tuple(tensor.shape))
        into.copy_(tensor)  # any strides, dtype and device
        region = self.region
        region.record()
        region.synchronize_for_step()
        answer = call(message_in, message_out)
        out = out_slot.clone()
        region.record()
        self.steps += 1
        return answer, out

    def forward(self, layer, x, datatype, keep):
        """x: a CUDA tensor [T, H] (any strides and float dtype: copied into the region as
        `datatype`). Returns (ForwardResponse, out: a new tensor of the wire's dtype on the
        region's device)."""
        with self.lock, torch.cuda.device(self.device):
            return self._run(x, datatype, lambda t, o: self.client.forward_shm(
                layer, t, out=o, keep_for_backward=keep))

    def backward(self, layer, step_id, d_out, datatype, d_aux, d_z_loss):
        """d_out: a CUDA tensor [T, H] (copied as `datatype`); returns d_x (a new tensor)."""
        with self.lock, torch.cuda.device(self.device):
            return self._run(d_out, datatype, lambda t, o: self.client.backward_shm(
                layer, step_id, t, d_x=o, d_aux=d_aux, d_z_loss=d_z_loss))[1]

    def close(self):
        self._cache.clear()
        if self.region is not None:
            self.region.close()
            self.region = None
