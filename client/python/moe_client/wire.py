"""Step messages written and read around their tensor's bytes (the C++ side's proto/tensor_wire.h).

A Forward/Backward request or answer (and a StageTensor request, a FetchStaged answer) is a few
dozen bytes of fields plus one big moe.v1.Tensor. Through protobuf's Python classes its bytes
are copied five or six times per direction (numpy -> bytes, into the Tensor, into the request,
reading the field back, serialising; on the way back parsing and reading the field). Here:

- encode_with_tensor() writes the message's other fields with protobuf, then the tensor field
  by hand (tag, length, datatype and shape through protobuf, raw_data's tag and length) and the
  caller's buffer: one copy, into the bytes gRPC sends. The result is exactly the protobuf
  encoding of the message; a parser cannot tell the difference.
- decode_with_tensor() walks the answer's top-level fields, parses everything but the tensor's
  raw_data with protobuf (a copy of a few header bytes) and returns raw_data as a memoryview of
  the received bytes: no copy (numpy reads it in place, read-only).

    data = encode_with_tensor(moe_pb2.ForwardRequest(layer="l0"), "x",
                              WireTensor("FP32", [4, 8], array))
    answer, out = decode_with_tensor(reply_bytes, moe_pb2.ForwardResponse, "out")
    codec.to_numpy(out)   # a view of reply_bytes
"""

from moe_client.proto import moe_pb2

_LENGTH_DELIMITED = 2
_RAW_DATA = moe_pb2.Tensor.DESCRIPTOR.fields_by_name["raw_data"].number


class WireTensor:
    """A tensor as the wire carries it: datatype name, shape, raw little-endian bytes (any
    buffer: bytes, a memoryview, a contiguous numpy array). Reads like a moe_pb2.Tensor
    (codec.to_numpy / to_torch take either)."""

    __slots__ = ("datatype", "shape", "raw_data")

    def __init__(self, datatype, shape, raw_data):
        self.datatype = datatype
        self.shape = [int(d) for d in shape]
        self.raw_data = raw_data

    def __repr__(self):
        return "WireTensor(%s, %s, %d bytes)" % (self.datatype, self.shape, self.nbytes)

    @property
    def nbytes(self):
        return memoryview(self.raw_data).nbytes

    def rows(self, begin, end):
        """Rows [begin, end) of a [rows, ...] tensor, a view of the same bytes."""
        row = self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0
        view = memoryview(self.raw_data).cast("B")
        return WireTensor(self.datatype, [end - begin] + self.shape[1:],
                          view[begin * row:end * row])


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number):
    return _varint(number << 3 | _LENGTH_DELIMITED)


def encode_with_tensor(message, field, tensor):
    """`message` (its `field` unset) with `field` = `tensor`, serialised: bytes."""
    head = moe_pb2.Tensor(datatype=tensor.datatype, shape=tensor.shape).SerializeToString()
    data = memoryview(tensor.raw_data).cast("B")
    raw_head = _key(_RAW_DATA) + _varint(data.nbytes)
    number = message.DESCRIPTOR.fields_by_name[field].number
    length = len(head) + len(raw_head) + data.nbytes
    return b"".join([message.SerializeToString(), _key(number), _varint(length), head, raw_head,
                     data])


def _read_varint(buf, pos):
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("malformed message: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, pos, end):
    """(start, number, wire_type, value_start, value_end) of each field in buf[pos:end]."""
    while pos < end:
        start = pos
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, value_end = _read_varint(buf, pos)
        elif wire_type == 1:
            value_end = pos + 8
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(buf, pos)
            value_end = pos + length
        elif wire_type == 5:
            value_end = pos + 4
        else:
            raise ValueError("malformed message: wire type %d" % wire_type)
        if value_end > end:
            raise ValueError("malformed message: field %d runs past the end" % number)
        yield start, number, wire_type, pos, value_end
        pos = value_end


def decode_with_tensor(data, message_type, field):
    """(message without `field`, WireTensor of `field` whose raw_data is a view of `data`).

    A message that repeats the tensor field (protobuf would merge the occurrences; no server
    writes that) is parsed whole instead, with one copy."""
    number = message_type.DESCRIPTOR.fields_by_name[field].number
    view = memoryview(data)
    rest, spans = [], []
    for start, n, wire_type, begin, end in _fields(view, 0, len(view)):
        if n == number and wire_type == _LENGTH_DELIMITED:
            spans.append((begin, end))
        else:
            rest.append(view[start:end])
    if len(spans) > 1:
        message = message_type.FromString(bytes(data))
        t = getattr(message, field)
        return message, WireTensor(t.datatype, t.shape, t.raw_data)
    message = message_type.FromString(b"".join(rest))
    if not spans:
        return message, WireTensor("", [], b"")
    head, raw = [], view[0:0]
    begin, end = spans[0]
    for start, n, wire_type, value_begin, value_end in _fields(view, begin, end):
        if n == _RAW_DATA and wire_type == _LENGTH_DELIMITED:
            raw = view[value_begin:value_end]
        else:
            head.append(view[start:value_end])
    tensor = moe_pb2.Tensor.FromString(b"".join(head))
    return message, WireTensor(tensor.datatype, tensor.shape, raw)
