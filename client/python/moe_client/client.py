"""Client: one method per moe.v1.MoeService RPC, plus the standard gRPC health check.

Every method blocks, runs under a deadline (the client's default unless `timeout=` is given)
and raises a moe_client.errors.MoeError subclass with the server's gRPC code and message on
failure; nothing is swallowed. Tensors go in as numpy arrays or torch tensors and come back as
numpy arrays (see codec.py for dtypes and copies); chunked streams are split and reassembled.

    from moe_client import Client
    c = Client("localhost:50051")
    c.create_layer("l0", hidden=1024, ffn=4096, num_experts=8, top_k=2)
    fwd = c.forward("l0", x, keep_for_backward=True)      # fwd.out, fwd.aux_loss, fwd.step_id
    d_x = c.backward("l0", fwd.step_id, d_out)
    c.apply_optimizer("l0", adamw={"lr": 1e-3})
"""

import collections
import concurrent.futures
import itertools
import math
import os
import secrets

import grpc
import numpy as np

from moe_client import codec, wire
from moe_client import step_channel as step_channel_module
from moe_client.errors import (Internal, ResourceExhausted, Unavailable, Unimplemented,
                               from_rpc_error)
from moe_client.proto import moe_pb2, moe_pb2_grpc

DEFAULT_ADDRESS = "localhost:50051"

ForwardResult = collections.namedtuple(
    "ForwardResult", ["out", "aux_loss", "z_loss", "tokens_per_expert", "step_id", "load"])
ForwardResult.__doc__ = """Forward's answer: `out` [T, H] in x's datatype (numpy; fp32 for
BF16; a wire.WireTensor with raw=True; the caller's array itself when forward's out= was given),
the losses as floats, tokens_per_expert [E], step_id (0 unless keep_for_backward) and the
ExpertLoad message."""

_SCORE_FUNCTIONS = {"softmax": moe_pb2.SCORE_FUNCTION_SOFTMAX,
                    "sigmoid": moe_pb2.SCORE_FUNCTION_SIGMOID}
_ACTIVATIONS = {"silu": moe_pb2.ACTIVATION_SILU, "gelu": moe_pb2.ACTIVATION_GELU,
                "relu": moe_pb2.ACTIVATION_RELU, "linear": moe_pb2.ACTIVATION_LINEAR}


def layer_config(**fields):
    """moe_pb2.LayerConfig from keyword arguments named as in proto/moe.proto.

    Strings are accepted for the enums ("softmax", "silu") and for compute_dtype ("fp32",
    "bf16", "fp8"); unknown names raise TypeError (caught here, not by the server).
    """
    fields = dict(fields)
    if isinstance(fields.get("score_function"), str):
        fields["score_function"] = _SCORE_FUNCTIONS[fields["score_function"].lower()]
    if isinstance(fields.get("activation"), str):
        fields["activation"] = _ACTIVATIONS[fields["activation"].lower()]
    if "compute_dtype" in fields:
        fields["compute_dtype"] = str(fields["compute_dtype"]).upper()
    try:
        return moe_pb2.LayerConfig(**fields)
    except ValueError as e:  # protobuf reports unknown fields as ValueError
        raise TypeError("layer_config: %s" % e) from None


class _Health:
    """grpc.health.v1.Health/Check without the grpcio-health-checking package.

    HealthCheckRequest is {string service = 1}; HealthCheckResponse is {enum status = 1}:
    both are encoded by hand (tag 0x0a + length + bytes; tag 0x08 + varint).
    """
    STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}

    @staticmethod
    def encode(service):
        data = service.encode()
        if len(data) > 127:
            raise ValueError("health service name too long")
        return (b"\x0a" + bytes([len(data)]) + data) if data else b""

    @staticmethod
    def decode(raw):
        if not raw:
            return "UNKNOWN"  # proto3 default: status 0 omitted
        if raw[0] != 0x08:
            raise ValueError("unexpected health response %r" % raw)
        value, shift = 0, 0
        for b in raw[1:]:
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        return _Health.STATUS_NAMES.get(value, str(value))


# Room left in a step's message for the fields around its tensor (as the C++ client).
_STEP_HEADROOM = 64 << 10
_METHOD = "/moe.v1.MoeService/"
# Calls sent and answered as bytes around their tensor (wire.py), and their answer types.
_ANSWERS = {"Forward": moe_pb2.ForwardResponse, "Backward": moe_pb2.BackwardResponse,
            "StageTensor": moe_pb2.StageTensorResponse,
            "FetchStaged": moe_pb2.FetchStagedResponse}
_RAW_RPCS = tuple(_ANSWERS)
# Steps that may go through the step channel as whole messages, and their answer types.
_MESSAGE_ANSWERS = {"Forward": moe_pb2.ForwardResponse, "Backward": moe_pb2.BackwardResponse,
                    "ReleaseStep": moe_pb2.ReleaseStepResponse}


def _row_bytes(head):
    """Bytes of one row of a [rows, hidden] tensor head (datatype, shape)."""
    return head.shape[1] * codec.element_size(head.datatype)


def _check_answer(head, out, keep_bf16_bits, rpc):
    """ValueError unless the answer's tensor (head: datatype, shape) decodes into `out` (checked
    before the call against what the answer would be; only a backward whose forward ran in
    another datatype than d_out's, with raw=True, gets here)."""
    try:
        codec.check_output(out, head.datatype, head.shape, keep_bf16_bits)
    except ValueError as e:
        raise ValueError("%s answered %s %s, which does not fit out: %s" %
                         (rpc, head.datatype, list(head.shape), e)) from None


def _result(tensor, out, raw):
    """What forward / backward return for the answer's `tensor` (_step's): with `out`, out
    itself (raw: a WireTensor over it); else numpy, or the WireTensor with raw."""
    if out is not None:
        return wire.WireTensor(tensor.datatype, tensor.shape, out) if raw else out
    return tensor if raw else codec.to_numpy(tensor)


class Client:
    """A connection to moed. Thread-safe (a gRPC channel and stub are)."""

    def __init__(self, address=None, timeout=60.0, max_message_bytes=256 << 20,
                 chunk_bytes=1 << 20, channel=None, token=None, tls_ca_file=None,
                 tls_cert_file=None, tls_key_file=None, tls_server_name=None, lanes=0,
                 lane_min_bytes=4 << 20, step_channel="auto",
                 step_channel_bytes=step_channel_module.DEFAULT_RING_BYTES,
                 step_channel_max_inline=64 << 10, step_channel_spin=0.0):
        """address: host:port (default $MOED_SERVER, else localhost:50051). timeout: default
        deadline of every call, s. token: bearer token for moed --tokens_file (default
        $MOED_TOKEN). tls_ca_file: PEM roots that signed moed's certificate (default
        $MOED_TLS_CA_FILE); set, the channel is TLS, else plaintext. tls_cert_file and
        tls_key_file: a client certificate for mutual TLS. tls_server_name: the name checked
        against moed's certificate when it differs from the address's host. max_message_bytes:
        largest message sent, at most moed's --max_message_bytes (both default to 256 MiB);
        forward/backward whose tensor does not fit in one message go through
        ForwardStream/BackwardStream in pieces, so tensors of any size work. lanes,
        lane_min_bytes: a forward/backward tensor of lane_min_bytes or more goes, and its answer
        comes back, as row ranges over `lanes` connections at once (StageTensor / FetchStaged,
        proto/moe.proto "Staged tensors"; as the C++ client); 0: half this host's cores, 1 to
        8; 1: one connection. A server that refuses staging gets the tensor in the step.
        step_channel: "auto" (default): Forward, Backward and ReleaseStep go through a step
        channel (shared-memory ring, moe_client.step_channel) when the address names this
        host, else gRPC; True: try it whatever the address; False: always gRPC. A moed that
        refuses it (no --allow_client_shm, another host) or a channel that fails sends the
        steps over gRPC from then on, with one log line. step_channel_bytes: each of its two
        rings' bytes (a power of two; requests and answers larger than half go over gRPC).
        step_channel_max_inline: a step whose tensor travels in the request (not in shared
        memory) uses the channel only up to this many bytes (larger ones were slower through
        the ring than over gRPC on the 2-core build machine; docs/DECISIONS.md).
        step_channel_spin: seconds the channel's wait for moed's answer spins before it sleeps
        on the futex (e.g. 20e-6; the GIL is released while it spins, a core is busy); 0
        (default): no spin (docs/DECISIONS.md "ring doorbell spin"; moed's side is its
        --ring_spin_us)."""
        self.address = address or os.environ.get("MOED_SERVER") or DEFAULT_ADDRESS
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        token = token or os.environ.get("MOED_TOKEN")
        self._metadata = (("authorization", "Bearer " + token),) if token else None
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", -1),  # moed's pieces fit its limit
                   ("grpc.http2.max_frame_size", (16 << 20) - 1),  # server/bulk_transport.h
                   ("grpc.http2.lookahead_bytes", 64 << 20)]
        tls_ca_file = tls_ca_file or os.environ.get("MOED_TLS_CA_FILE")
        own_channel = channel is None  # lanes need channels of our own
        credentials = None
        if channel is None and tls_ca_file:
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            if bool(tls_cert_file) != bool(tls_key_file):
                raise ValueError("give both tls_cert_file and tls_key_file, or neither")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=read(tls_ca_file),
                private_key=read(tls_key_file) if tls_key_file else None,
                certificate_chain=read(tls_cert_file) if tls_cert_file else None)
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))

        def make_channel(extra):
            if credentials is not None:
                return grpc.secure_channel(self.address, credentials, options=options + extra)
            return grpc.insecure_channel(self.address, options=options + extra)
        self._channel = channel or make_channel([])
        self._stub = moe_pb2_grpc.MoeServiceStub(self._channel)
        if lanes <= 0:
            lanes = min(8, max(1, (os.cpu_count() or 2) // 2))
        # One connection per lane (a distinct channel argument); none with a caller's channel.
        self._lane_channels = [] if not own_channel or lanes <= 1 else [
            make_channel([("moed.client.lane", i)]) for i in range(lanes)]
        self._lanes = [moe_pb2_grpc.MoeServiceStub(c) for c in self._lane_channels]
        # Steps, staging and fetching as bytes written and read around the tensor (wire.py).
        self._raw = {rpc: self._channel.unary_unary(_METHOD + rpc) for rpc in _RAW_RPCS}
        self._raw_lanes = [{rpc: c.unary_unary(_METHOD + rpc) for rpc in _RAW_RPCS}
                           for c in self._lane_channels]
        self._lane_pool = (concurrent.futures.ThreadPoolExecutor(len(self._lanes))
                           if self._lanes else None)
        self.lane_min_bytes = lane_min_bytes
        self._staged_prefix = "p" + secrets.token_hex(8)
        self._staged_counter = itertools.count()
        self._lanes_refused = False
        self.steps_over_lanes = 0  # steps whose tensors went over the lanes
        use_ring = (step_channel is True or
                    (step_channel == "auto" and step_channel_module.is_local_address(self.address)))
        self.step_channel_max_inline = step_channel_max_inline
        self._step_channel = (step_channel_module.StepChannel(
            self._stub, self._metadata, step_channel_bytes, max_spin=step_channel_spin)
            if use_ring else None)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_Health.encode,
            response_deserializer=_Health.decode)

    @property
    def steps_over_channel(self):
        """Steps answered through the step channel so far."""
        return self._step_channel.steps if self._step_channel is not None else 0

    @property
    def step_channel_on(self):
        """Whether steps may still go through the step channel (not off, refused or failed)."""
        return self._step_channel is not None and not self._step_channel.off

    def close(self):
        if self._step_channel is not None:
            self._step_channel.close()
        self._channel.close()
        for lane in self._lane_channels:
            lane.close()
        if self._lane_pool is not None:
            self._lane_pool.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- plumbing ----
    def _call(self, rpc, request, timeout=None, wait_for_ready=None):
        try:
            return getattr(self._stub, rpc)(request, timeout=timeout or self.timeout,
                                            wait_for_ready=wait_for_ready,
                                            metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None

    def _raw_call(self, method, rpc, data, timeout=None, wait_for_ready=None):
        """One call of `method` (a bytes-in, bytes-out callable of self._raw or a lane)."""
        try:
            return method(data, timeout=timeout or self.timeout, wait_for_ready=wait_for_ready,
                          metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None

    def _message_step(self, rpc, request, answered_in, timeout):
        """Forward / Backward / ReleaseStep of a whole `request` message: on the step channel
        when there is one and the answer fits (answered_in: the SharedMemoryTensor whose
        shape the answer's tensor has when it comes in the answer, else None), else the gRPC
        call. Returns the response message."""
        ring = self._step_channel
        answer_bytes = 4 * math.prod(answered_in.shape) if answered_in is not None else 0
        if ring is not None and ring.fits(request.ByteSize(), answer_bytes):
            data = ring.call(rpc, request.SerializeToString(), timeout or self.timeout)
            if data is not None:
                return _MESSAGE_ANSWERS[rpc].FromString(data)
        return self._call(rpc, request, timeout)

    def _stream(self, rpc, request, timeout=None):
        try:
            return list(getattr(self._stub, rpc)(request, timeout=timeout or self.timeout,
                                                 metadata=self._metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None

    def _step(self, rpc, request, field, tensor, answer_field, timeout, out=None,
              keep_bf16_bits=False):
        """Forward / Backward of `request` (its tensor `field` unset) with `tensor`
        (wire.WireTensor): over lanes for a tensor of lane_min_bytes or more (_step_staged);
        one message when it fits, written around the tensor's bytes (wire.py); else the
        streaming call (proto/moe.proto: ForwardStream) with raw_data in pieces. Returns (the
        answer without its tensor, the answer's `answer_field` as a WireTensor).

        out (numpy, codec.check_output'ed by the caller): the answer's tensor is decoded into it
        (codec.decode_into; BF16 as fp32 unless keep_bf16_bits), each lane its rows, or one
        copy from the received bytes (streamed: from its pieces joined); the WireTensor
        returned then has `out` as raw_data."""
        size = tensor.nbytes
        # On moed's host: one record on the step channel (its answer is at most twice x:
        # a BF16 d_out may answer an FP32 d_x).
        data = None
        ring = self._step_channel
        if (ring is not None and size <= self.step_channel_max_inline
                and ring.fits(size + 4096, 2 * size)):
            data = ring.call(rpc, wire.encode_with_tensor(request, field, tensor),
                             timeout or self.timeout)
        if data is None and (self._lanes and not self._lanes_refused and size > 0
                             and size >= self.lane_min_bytes and len(tensor.shape) == 2):
            answer = self._step_staged(rpc, request, field, tensor, answer_field, timeout, out,
                                       keep_bf16_bits)
            if answer is not None:
                return answer
        if data is not None:
            answer, result = wire.decode_with_tensor(data, _ANSWERS[rpc], answer_field)
        elif size + _STEP_HEADROOM <= self.max_message_bytes:
            data = self._raw_call(self._raw[rpc], rpc,
                                  wire.encode_with_tensor(request, field, tensor), timeout)
            answer, result = wire.decode_with_tensor(data, _ANSWERS[rpc], answer_field)
        else:
            answer, result = self._step_stream(rpc, request, field, tensor, answer_field,
                                               timeout)
        if out is not None:
            _check_answer(result, out, keep_bf16_bits, rpc)
            codec.decode_into(result, out, keep_bf16_bits=keep_bf16_bits)
            result = wire.WireTensor(result.datatype, result.shape, out)
        return answer, result

    def _step_stream(self, rpc, request, field, tensor, answer_field, timeout):
        """The streaming call of _step (a tensor larger than one message)."""
        piece = max(self.max_message_bytes - _STEP_HEADROOM, 4096)
        raw = memoryview(tensor.raw_data).cast("B")
        first = type(request)()
        first.CopyFrom(request)
        getattr(first, field).CopyFrom(moe_pb2.Tensor(
            datatype=tensor.datatype, shape=tensor.shape, raw_data=bytes(raw[:piece])))
        message_type = type(request)

        def pieces():
            yield first
            for offset in range(piece, len(raw), piece):
                more = message_type()
                getattr(more, field).raw_data = bytes(raw[offset:offset + piece])
                yield more

        try:
            answers = iter(getattr(self._stub, rpc + "Stream")(pieces(),
                                                               timeout=timeout or self.timeout,
                                                               metadata=self._metadata))
            answer = next(answers)
            rest = [getattr(a, answer_field).raw_data for a in answers]
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None
        head = getattr(answer, answer_field)
        out = wire.WireTensor(head.datatype, head.shape, b"".join([head.raw_data] + rest))
        answer.ClearField(answer_field)
        return answer, out

    # ---- over several connections (proto/moe.proto "Staged tensors") ----
    def _parts(self, rows, row_bytes):
        """Row ranges: one per lane at least, none above a message."""
        per_part = max(1, (self.max_message_bytes - _STEP_HEADROOM) // max(row_bytes, 1))
        n = max(1, min(rows, max(len(self._lanes), -(-rows // per_part))))
        bounds = [rows * i // n for i in range(n + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def _on_lanes(self, rpc, messages, timeout, each=None):
        """Sends messages[i] (bytes) on lane i % lanes, concurrently; the answers (bytes) in
        order, or, with `each`, each(i, answer) run on the lane's thread instead."""
        def call(i):
            answer = self._raw_call(self._raw_lanes[i % len(self._lanes)][rpc], rpc,
                                    messages[i], timeout, wait_for_ready=rpc == "FetchStaged")
            return answer if each is None else each(i, answer)
        return list(self._lane_pool.map(call, range(len(messages))))

    def _step_staged(self, rpc, request, field, tensor, answer_field, timeout, out=None,
                     keep_bf16_bits=False):
        """Stages the tensor in row ranges over the lanes, runs the step on it with its
        output kept, fetches the output the same way, each range straight into the result
        (`out` when given, decoded as in _step). None when the server asks for the tensor in
        the step instead (staging off or full, a lane not connecting)."""
        rows = tensor.shape[0]
        name_in = "%s-%d" % (self._staged_prefix, next(self._staged_counter))
        name_out = "%s-%d" % (self._staged_prefix, next(self._staged_counter))
        stage = [wire.encode_with_tensor(
            moe_pb2.StageTensorRequest(name=name_in, total_rows=rows, row_offset=a), "rows",
            tensor.rows(a, b)) for a, b in self._parts(rows, _row_bytes(tensor))]
        try:
            self._on_lanes("StageTensor", stage, timeout)
        except (Unimplemented, ResourceExhausted, Unavailable) as e:
            if isinstance(e, Unimplemented):
                self._lanes_refused = True
            return None
        staged = type(request)()
        staged.CopyFrom(request)
        setattr(staged, field + "_staged", name_in)
        setattr(staged, answer_field + "_staged", name_out)
        answer = self._call(rpc, staged, timeout)
        head = getattr(answer, answer_field)
        if out is None:  # fresh memory of the wire's elements (BF16 decoded by the caller)
            out = np.empty(tuple(head.shape), codec.output_dtype(head.datatype, True))
            keep_bf16_bits = True
        else:
            _check_answer(head, out, keep_bf16_bits, rpc)
        row_bytes = _row_bytes(head)
        ranges = self._parts(head.shape[0], row_bytes)
        fetch = [moe_pb2.FetchStagedRequest(name=name_out, row_offset=a,
                                            rows=b - a).SerializeToString() for a, b in ranges]

        def copy_rows(i, data):  # each range straight into the result, on its lane's thread
            _, rows_i = wire.decode_with_tensor(data, moe_pb2.FetchStagedResponse, "rows")
            a, b = ranges[i]
            nbytes = memoryview(rows_i.raw_data).nbytes
            if (nbytes != (b - a) * row_bytes or rows_i.datatype != head.datatype
                    or rows_i.shape[:1] != [b - a]):
                raise Internal(grpc.StatusCode.INTERNAL, "FetchStaged returned %s %s, %d bytes "
                               "for rows %d..%d" % (rows_i.datatype, rows_i.shape, nbytes, a, b),
                               "FetchStaged")
            codec.decode_into(rows_i, out, a, keep_bf16_bits)

        self._on_lanes("FetchStaged", fetch, timeout, each=copy_rows)
        self.steps_over_lanes += 1
        result = wire.WireTensor(head.datatype, head.shape, out)
        answer.ClearField(answer_field)
        return answer, result

    # ---- layers ----
    def create_layer(self, name, config=None, timeout=None, **fields):
        """Creates a layer from a LayerConfig or keyword fields; returns its LayerInfo."""
        if config is None:
            config = layer_config(**fields)
        elif fields:
            raise TypeError("pass either config or keyword fields, not both")
        return self._call("CreateLayer", moe_pb2.CreateLayerRequest(name=name, config=config),
                          timeout).layer

    def delete_layer(self, name, timeout=None):
        self._call("DeleteLayer", moe_pb2.DeleteLayerRequest(name=name), timeout)

    def list_layers(self, timeout=None):
        return list(self._call("ListLayers", moe_pb2.ListLayersRequest(), timeout).layers)

    def get_layer(self, name, timeout=None):
        return self._call("GetLayer", moe_pb2.GetLayerRequest(name=name), timeout).layer

    # ---- steps ----
    def forward(self, layer, x, keep_for_backward=False, datatype=None, raw=False,
                timeout=None, out=None):
        """x [T, H] (numpy or torch; datatype="BF16" converts fp32 to bf16 on the wire).

        Returns ForwardResult; `out` is numpy (fp32 for a BF16 answer; a read-only view of
        the received bytes where no conversion is needed) or, with raw=True, the
        wire.WireTensor itself (for callers that decode to torch without numpy's upcast).

        out: a numpy array the answer is written into instead of fresh memory (reused across
        steps it saves the first-touch page faults of a new buffer each step); the result's
        `out` is then this array (raw=True: a WireTensor whose raw_data is it). It must be
        writeable, C-contiguous, of x's shape [T, H] and of the dtype the call returns:
        float32 for FP32 and for BF16 (the bf16 values converted to fp32, exactly, as
        without out=); with raw=True the wire's elements: float32 for FP32, uint16 bit
        patterns for BF16 (e.g. a torch.bfloat16 tensor's t.view(torch.int16).numpy()).
        Anything else raises TypeError / ValueError before anything is sent. Each lane
        writes its own rows into it; on one connection it is one copy from the received
        bytes. Its contents are unspecified if the call fails.
        """
        tensor = codec.to_wire(x, datatype)
        if out is not None:
            codec.check_output(out, tensor.datatype, tensor.shape, keep_bf16_bits=raw)
        request = moe_pb2.ForwardRequest(layer=layer, keep_for_backward=keep_for_backward)
        r, answer = self._step("Forward", request, "x", tensor, "out", timeout, out, raw)
        return ForwardResult(_result(answer, out, raw), r.aux_loss, r.z_loss,
                             list(r.tokens_per_expert), r.step_id, r.load)

    def backward(self, layer, step_id, d_out, d_aux=None, d_z_loss=None, datatype=None,
                 raw=False, timeout=None, out=None):
        """d_out [T, H]; d_aux / d_z_loss default to 1.0 on the server. Returns d_x (numpy,
        or a wire.WireTensor with raw=True).

        out: a numpy array d_x is written into, returned itself (raw=True: a WireTensor over
        it); as forward's out=, of d_out's shape and of the dtype for d_out's wire datatype
        (float32 without raw=True). d_x comes in the forward x's datatype: with raw=True and
        a forward in another datatype than d_out's, ValueError after the call (the step is
        used)."""
        tensor = codec.to_wire(d_out, datatype)
        if out is not None:
            codec.check_output(out, tensor.datatype, tensor.shape, keep_bf16_bits=raw)
        request = moe_pb2.BackwardRequest(layer=layer, step_id=step_id)
        if d_aux is not None:
            request.d_aux = float(d_aux)
        if d_z_loss is not None:
            request.d_z_loss = float(d_z_loss)
        _, d_x = self._step("Backward", request, "d_out", tensor, "d_x", timeout, out, raw)
        return _result(d_x, out, raw)

    # ---- shared memory (moed on this host with --allow_client_shm; shared_memory.py) ----
    def register_system_shared_memory(self, name, key, offset, byte_size, timeout=None):
        self._call("RegisterSystemSharedMemory", moe_pb2.RegisterSystemSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

    def register_cuda_shared_memory(self, name, raw_handle, device_id, byte_size, timeout=None):
        """A region of this process's GPU memory (moe_client.cuda_ipc): raw_handle is the 64
        bytes of cuIpcGetMemHandle / cudaIpcGetMemHandle of an allocation of at least byte_size
        bytes on device `device_id` (this process's numbering). FAILED_PRECONDITION unless the
        workers are CUDA workers; a handle they cannot open fails the first step using it."""
        self._call("RegisterCudaSharedMemory", moe_pb2.RegisterCudaSharedMemoryRequest(
            name=name, raw_handle=bytes(raw_handle), device_id=int(device_id),
            byte_size=int(byte_size)), timeout)

    def system_shared_memory_status(self, name="", timeout=None):
        """[RegionStatus] of `name` (empty: all regions)."""
        return list(self._call("SystemSharedMemoryStatus",
                               moe_pb2.SystemSharedMemoryStatusRequest(name=name),
                               timeout).regions)

    def unregister_system_shared_memory(self, name="", timeout=None):
        """Unregisters `name` (empty: every region)."""
        self._call("UnregisterSystemSharedMemory",
                   moe_pb2.UnregisterSystemSharedMemoryRequest(name=name), timeout)

    def forward_shm(self, layer, x, out=None, keep_for_backward=False, timeout=None):
        """Forward with x a moe_pb2.SharedMemoryTensor and out (optional) a
        moe_pb2.SharedMemoryOutput; returns the ForwardResponse (out has no bytes when the
        workers wrote it into the region)."""
        request = moe_pb2.ForwardRequest(layer=layer, x_shm=x, keep_for_backward=keep_for_backward)
        if out is not None:
            request.out_shm.CopyFrom(out)
        return self._message_step("Forward", request, None if out is not None else x, timeout)

    def backward_shm(self, layer, step_id, d_out, d_x=None, d_aux=None, d_z_loss=None,
                     timeout=None):
        """Backward with d_out a SharedMemoryTensor and d_x (optional) a SharedMemoryOutput;
        returns the BackwardResponse."""
        request = moe_pb2.BackwardRequest(layer=layer, step_id=step_id, d_out_shm=d_out)
        if d_x is not None:
            request.d_x_shm.CopyFrom(d_x)
        if d_aux is not None:
            request.d_aux = float(d_aux)
        if d_z_loss is not None:
            request.d_z_loss = float(d_z_loss)
        return self._message_step("Backward", request, None if d_x is not None else d_out,
                                  timeout)

    def release_step(self, layer, step_id, timeout=None):
        """Frees a step kept for backward; True if it was held. Idempotent."""
        return self._message_step("ReleaseStep", moe_pb2.ReleaseStepRequest(
            layer=layer, step_id=step_id), None, timeout).released

    # ---- training ----
    def get_gradients(self, layer, names=(), timeout=None):
        """{name: fp32 numpy array} of the accumulated whole-layer gradients."""
        return codec.assemble_chunks(self._stream("GetGradients", moe_pb2.GetGradientsRequest(
            layer=layer, names=list(names), max_chunk_bytes=self.chunk_bytes), timeout))

    def zero_gradients(self, layer, timeout=None):
        self._call("ZeroGradients", moe_pb2.ZeroGradientsRequest(layer=layer), timeout)

    def apply_optimizer(self, layer, sgd=None, adamw=None, timeout=None, num_ranks=0, rank=0,
                        step=0, run_id="", expected_optimizer_step=None):
        """One optimizer step on the server, then gradients are zeroed. Exactly one of
        sgd={"lr":..., "momentum":..., "weight_decay":...} or
        adamw={"lr":..., "beta1":..., "beta2":..., "eps":..., "weight_decay":...}
        (dicts or the moe_pb2 messages). Returns the ApplyOptimizerResponse.

        num_ranks > 1: data-parallel step `step` of run `run_id`, called by every rank
        0..num_ranks-1; the server steps once, on the mean of the ranks' gradients, when all
        called, and every call waits until then (README "Training with several ranks").

        expected_optimizer_step (int, optional): apply only if the layer is at this optimizer
        step (LayerInfo.optimizer_step; each answer's optimizer_step after it) and no
        re-formation or moed restart dropped its gradients since the last zero_gradients or
        optimizer step; otherwise moe_client.Aborted and nothing changes. Pass the step the
        gradients were computed on, so gradients lost in a re-formation are never applied;
        after Aborted: get_layer, zero_gradients, run the batch again."""
        if (sgd is None) == (adamw is None):
            raise TypeError("apply_optimizer needs exactly one of sgd=, adamw=")
        request = moe_pb2.ApplyOptimizerRequest(layer=layer, num_ranks=num_ranks, rank=rank,
                                                step=step, run_id=run_id)
        if expected_optimizer_step is not None:
            request.expected_optimizer_step = int(expected_optimizer_step)
        if sgd is not None:
            request.sgd.CopyFrom(sgd if isinstance(sgd, moe_pb2.SgdOptimizer)
                                 else moe_pb2.SgdOptimizer(**sgd))
        else:
            request.adamw.CopyFrom(adamw if isinstance(adamw, moe_pb2.AdamWOptimizer)
                                   else moe_pb2.AdamWOptimizer(**adamw))
        return self._call("ApplyOptimizer", request, timeout)

    def update_expert_bias(self, layer, rate, timeout=None):
        """Aux-loss-free balancing step; returns the new expert bias [E] (list of floats)."""
        return list(self._call("UpdateExpertBias", moe_pb2.UpdateExpertBiasRequest(
            layer=layer, rate=rate), timeout).expert_bias)

    # ---- weights and checkpoints ----
    def get_weights(self, layer, names=(), timeout=None):
        """{name: fp32 numpy array} of whole-layer parameters."""
        return codec.assemble_chunks(self._stream("GetWeights", moe_pb2.GetWeightsRequest(
            layer=layer, names=list(names), max_chunk_bytes=self.chunk_bytes), timeout))

    def set_weights(self, layer, tensors, timeout=None):
        """tensors: {name: array} with whole-layer shapes; sent as fp32 chunks. Returns the
        names the server replaced (all or nothing)."""
        def requests():
            first = True
            for name, value in tensors.items():
                for chunk in codec.chunks_of(name, value, self.chunk_bytes):
                    yield moe_pb2.SetWeightsRequest(layer=layer if first else "", chunk=chunk)
                    first = False
        try:
            r = self._stub.SetWeights(requests(), timeout=timeout or self.timeout,
                                      metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "SetWeights") from None
        return list(r.updated)

    def save_checkpoint(self, layer, directory, timeout=None):
        """Writes the layer as checkpoint `directory`, a relative name inside the server's
        --checkpoint_root (e.g. "run7/layer0"); returns the name written."""
        return self._call("SaveCheckpoint", moe_pb2.SaveCheckpointRequest(
            layer=layer, directory=directory), timeout).directory

    def load_checkpoint(self, layer, directory, timeout=None):
        """Loads checkpoint `directory` (a name inside the server's --checkpoint_root)."""
        self._call("LoadCheckpoint", moe_pb2.LoadCheckpointRequest(
            layer=layer, directory=directory), timeout)

    # ---- operations ----
    def get_status(self, timeout=None):
        return self._call("GetStatus", moe_pb2.GetStatusRequest(), timeout)

    def health(self, service="", timeout=None, wait_for_ready=False):
        """grpc.health.v1 status name for `service` ("" = the whole server): "SERVING", ..."""
        try:
            return self._health(service, timeout=timeout or self.timeout,
                                wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health") from None
