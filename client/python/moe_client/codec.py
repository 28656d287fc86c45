"""Tensor codecs: numpy arrays and torch tensors <-> moe.v1.Tensor / TensorChunk.

Wire format (proto/moe.proto, KServe v2 style): a datatype name ("FP32", "BF16", "FP64",
"INT32", "INT64"), a row-major shape and the raw little-endian bytes. BF16 is the upper half
of an fp32 (no extra package needed: numpy sees it as uint16, torch as torch.bfloat16).

    t = to_proto(np.ones((4, 8), np.float32))          # FP32
    t = to_proto(torch.randn(4, 8).bfloat16())          # BF16
    t = to_proto(np.ones((4, 8), np.float32), "BF16")  # fp32 rounded to bf16 on the way
    a = to_numpy(t)          # zero-copy read-only view for FP32/FP64/INT*, fp32 for BF16
    decode_into(t, out)      # the same values written into a caller's array (one copy)
    x = to_torch(t)          # writable torch tensor (torch.bfloat16 for BF16)

Copies: to_proto makes one copy (protobuf's bytes fields only take `bytes`); to_wire makes
none (a view of the caller's memory, which the step path in client.py copies once into the
bytes gRPC sends: wire.py); decoding to numpy is zero-copy (np.frombuffer over the message's
bytes, hence read-only); decoding to torch makes one copy, because torch would otherwise hand
out a writable tensor over immutable memory. `to_torch(t, copy=False)` skips it for callers
that never write to the result.
"""

import sys
import warnings

import numpy as np

try:  # torch is optional for the numpy path
    import torch
except ImportError:  # pragma: no cover - torch is installed on the project's machines
    torch = None

from moe_client import wire
from moe_client.proto import moe_pb2

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("moe_client assumes a little-endian host (the wire format's order)")

# Wire datatype -> numpy dtype of the raw elements (BF16 travels as its 16-bit pattern).
_NUMPY_OF = {
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "BF16": np.dtype("<u2"),
}
_DATATYPE_OF_NUMPY = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
                      np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}


def _torch_datatypes():
    if torch is None:
        return {}
    return {torch.float32: "FP32", torch.float64: "FP64", torch.int32: "INT32",
            torch.int64: "INT64", torch.bfloat16: "BF16"}


def element_size(datatype):
    """Bytes per element of a wire datatype; ValueError for an unknown name."""
    try:
        return _NUMPY_OF[datatype].itemsize
    except KeyError:
        raise ValueError("unknown datatype %r (expected one of %s)" %
                         (datatype, ", ".join(sorted(_NUMPY_OF)))) from None


def fp32_to_bf16_bits(array):
    """fp32 array -> uint16 bf16 bit patterns; round to nearest even, NaN stays NaN.

    The same rounding as engine/dtype.h FloatToBf16, so the client and server agree bit for
    bit on every value.
    """
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet_nan = (bits >> 16) | np.uint32(0x40)
    return np.where(nan, quiet_nan, rounded).astype("<u2")


def bf16_bits_to_fp32(bits):
    """uint16 bf16 bit patterns -> fp32 array (exact)."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def _array_of(value, datatype):
    """(datatype, shape, C-contiguous numpy array of the wire's element type) of a numpy array
    or torch tensor: a view of its memory when it needs no conversion, else the converted copy.
    """
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        source = _torch_datatypes().get(value.dtype)
        if source is None:
            raise TypeError("unsupported torch dtype %s" % value.dtype)
        value = value.contiguous()
        if datatype is None or datatype == source:
            if source == "BF16":
                return "BF16", tuple(value.shape), value.view(torch.int16).numpy()
            return source, tuple(value.shape), value.numpy()
        if datatype == "BF16":
            return "BF16", tuple(value.shape), value.to(torch.bfloat16).view(
                torch.int16).numpy()
        value = value.float().numpy() if source == "BF16" else value.numpy()
    array = np.asarray(value)
    if datatype is None:
        datatype = _DATATYPE_OF_NUMPY.get(array.dtype)
        if datatype is None:
            raise TypeError("unsupported numpy dtype %s (FP32, FP64, INT32, INT64; "
                            "pass datatype='BF16' to send fp32 values as bf16)" % array.dtype)
    if datatype == "BF16":
        return "BF16", array.shape, fp32_to_bf16_bits(array)
    element_size(datatype)
    return datatype, array.shape, np.ascontiguousarray(array, _NUMPY_OF[datatype])


def _raw_of(value, datatype):
    """(datatype, shape, little-endian bytes) of a numpy array or torch tensor."""
    datatype, shape, array = _array_of(value, datatype)
    return datatype, shape, array.tobytes()


def to_wire(value, datatype=None):
    """numpy array / torch tensor -> wire.WireTensor over its memory (no copy when no conversion
    is needed: the caller keeps the value alive and unchanged until the call returns)."""
    datatype, shape, array = _array_of(value, datatype)
    return wire.WireTensor(datatype, shape, array.reshape(-1).view(np.uint8))


def to_proto(value, datatype=None):
    """numpy array / torch tensor -> moe_pb2.Tensor. `datatype` converts ("BF16" rounds)."""
    datatype, shape, raw = _raw_of(value, datatype)
    return moe_pb2.Tensor(datatype=datatype, shape=[int(d) for d in shape], raw_data=raw)


def _check(datatype, shape, raw):
    count = 1
    for d in shape:
        if d < 0:
            raise ValueError("negative dimension in shape %s" % list(shape))
        count *= d
    if len(raw) != count * element_size(datatype):
        raise ValueError("tensor of %s %s needs %d bytes, got %d" %
                         (datatype, list(shape), count * element_size(datatype), len(raw)))


def to_numpy(tensor, keep_bf16_bits=False):
    """moe_pb2.Tensor or wire.WireTensor -> numpy array (read-only view of the message's bytes
    where possible).

    BF16 becomes fp32 (exact), or its uint16 bit patterns with keep_bf16_bits=True.
    """
    shape = tuple(tensor.shape)
    _check(tensor.datatype, shape, memoryview(tensor.raw_data).cast("B"))
    array = np.frombuffer(tensor.raw_data, dtype=_NUMPY_OF[tensor.datatype]).reshape(shape)
    if tensor.datatype == "BF16" and not keep_bf16_bits:
        return bf16_bits_to_fp32(array)
    return array


def output_dtype(datatype, keep_bf16_bits=False):
    """numpy dtype to_numpy returns for a tensor of wire `datatype`: fp32 for BF16 (its uint16
    bit patterns with keep_bf16_bits=True); ValueError for an unknown name."""
    element_size(datatype)
    if datatype == "BF16" and not keep_bf16_bits:
        return np.dtype("<f4")
    return _NUMPY_OF[datatype]


def check_output(out, datatype, shape, keep_bf16_bits=False, name="out"):
    """Refuses (TypeError, ValueError) a buffer `out` that decode_into could not fill with a
    tensor of `datatype` and `shape`: it must be a writeable, C-contiguous numpy array of
    exactly that shape and of output_dtype(datatype, keep_bf16_bits)."""
    want = "%s %s" % (datatype, list(shape))
    if not isinstance(out, np.ndarray):
        raise TypeError("%s must be a numpy array (for a CPU torch tensor pass t.numpy()), got "
                        "%s" % (name, type(out).__name__))
    dtype = output_dtype(datatype, keep_bf16_bits)
    if out.dtype != dtype:
        raise ValueError("%s has dtype %s; the answer (%s) needs %s" %
                         (name, out.dtype, want, dtype))
    if tuple(out.shape) != tuple(int(d) for d in shape):
        raise ValueError("%s has shape %s; the answer (%s) needs %s" %
                         (name, list(out.shape), want, list(shape)))
    if not out.flags.c_contiguous:
        raise ValueError("%s must be C-contiguous (np.ascontiguousarray, or a fresh np.empty)"
                         % name)
    if not out.flags.writeable:
        raise ValueError("%s is read-only" % name)


def decode_into(tensor, out, row_offset=0, keep_bf16_bits=False):
    """Writes moe_pb2.Tensor or wire.WireTensor `tensor` decoded as to_numpy would (BF16 as fp32,
    or as its bit patterns with keep_bf16_bits=True) into out[row_offset:row_offset + rows]:
    one pass over the bytes, no temporary. `out` is a C-contiguous array of
    output_dtype(tensor.datatype, keep_bf16_bits) whose other dimensions are the tensor's;
    ValueError otherwise."""
    shape = tuple(int(d) for d in tensor.shape)
    raw = memoryview(tensor.raw_data).cast("B")
    _check(tensor.datatype, shape, raw)
    dtype = output_dtype(tensor.datatype, keep_bf16_bits)
    if out.dtype != dtype:
        raise ValueError("cannot decode %s into an array of %s (needs %s)" %
                         (tensor.datatype, out.dtype, dtype))
    target = out[row_offset:row_offset + shape[0]] if shape else out
    if target.shape != shape:
        raise ValueError("cannot decode %s %s into rows %d.. of an array of shape %s" %
                         (tensor.datatype, list(shape), row_offset, list(out.shape)))
    source = np.frombuffer(raw, dtype=_NUMPY_OF[tensor.datatype]).reshape(shape)
    if tensor.datatype == "BF16" and not keep_bf16_bits:
        bits = target.view("<u4")
        bits[...] = source  # widened in place, then shifted: bf16_bits_to_fp32 into `out`
        np.left_shift(bits, 16, out=bits)
    else:
        np.copyto(target, source)


def to_torch(tensor, copy=True):
    """moe_pb2.Tensor or wire.WireTensor -> torch tensor of the wire's type (torch.bfloat16 for BF16).

    copy=False returns a tensor sharing the message's immutable bytes: never write to it.
    """
    if torch is None:  # pragma: no cover
        raise ImportError("torch is not installed")
    array = to_numpy(tensor, keep_bf16_bits=True)
    if tensor.datatype == "BF16":
        array = array.view("<i2")
    with warnings.catch_warnings():  # "non-writable array": deliberate, see copy
        warnings.simplefilter("ignore", UserWarning)
        out = torch.from_numpy(array)
    if tensor.datatype == "BF16":
        out = out.view(torch.bfloat16)
    return out.clone() if copy else out


def chunks_of(name, value, max_chunk_bytes=1 << 20):
    """Splits a whole tensor into TensorChunk messages (SetWeights); FP32 only on the wire."""
    datatype, shape, raw = _raw_of(value, "FP32")
    size = element_size(datatype)
    step = max(size, (max_chunk_bytes // size) * size)
    shape = [int(d) for d in shape]
    if not raw:
        yield moe_pb2.TensorChunk(name=name, datatype=datatype, shape=shape, element_offset=0)
        return
    for start in range(0, len(raw), step):
        yield moe_pb2.TensorChunk(name=name, datatype=datatype, shape=shape,
                                  element_offset=start // size, raw_data=raw[start:start + step])


def assemble_chunks(chunks):
    """TensorChunk stream -> {name: numpy array}, checking order and coverage."""
    out, parts, meta = {}, {}, {}
    for c in chunks:
        if c.name not in meta:
            meta[c.name] = (c.datatype, tuple(c.shape))
            parts[c.name] = []
        datatype, shape = meta[c.name]
        received = sum(len(p) for p in parts[c.name]) // element_size(datatype)
        if c.element_offset != received:
            raise ValueError("chunk of %r starts at element %d, expected %d" %
                             (c.name, c.element_offset, received))
        parts[c.name].append(c.raw_data)
    for name, (datatype, shape) in meta.items():
        raw = b"".join(parts[name])
        out[name] = to_numpy(moe_pb2.Tensor(datatype=datatype, shape=shape, raw_data=raw))
    return out
