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
import os

import grpc

from moe_client import codec
from moe_client.errors import from_rpc_error
from moe_client.proto import moe_pb2, moe_pb2_grpc

DEFAULT_ADDRESS = "localhost:50051"

ForwardResult = collections.namedtuple(
    "ForwardResult", ["out", "aux_loss", "z_loss", "tokens_per_expert", "step_id", "load"])
ForwardResult.__doc__ = """Forward's answer: `out` [T, H] in x's datatype (numpy; fp32 for
BF16 unless raw=True), the losses as floats, tokens_per_expert [E], step_id (0 unless
keep_for_backward) and the ExpertLoad message."""

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


class Client:
    """A connection to moed. Thread-safe (a gRPC channel and stub are)."""

    def __init__(self, address=None, timeout=60.0, max_message_bytes=256 << 20,
                 chunk_bytes=1 << 20, channel=None, token=None, tls_ca_file=None,
                 tls_cert_file=None, tls_key_file=None, tls_server_name=None):
        """address: host:port (default $MOED_SERVER, else localhost:50051). timeout: default
        deadline of every call, s. token: bearer token for moed --tokens_file (default
        $MOED_TOKEN). tls_ca_file: PEM roots that signed moed's certificate (default
        $MOED_TLS_CA_FILE); set, the channel is TLS, else plaintext. tls_cert_file and
        tls_key_file: a client certificate for mutual TLS. tls_server_name: the name checked
        against moed's certificate when it differs from the address's host. max_message_bytes:
        largest message sent, at most moed's --max_message_bytes (both default to 256 MiB);
        forward/backward whose tensor does not fit in one message go through
        ForwardStream/BackwardStream in pieces, so tensors of any size work."""
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
            channel = grpc.secure_channel(self.address, credentials, options=options)
        self._channel = channel or grpc.insecure_channel(self.address, options=options)
        self._stub = moe_pb2_grpc.MoeServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_Health.encode,
            response_deserializer=_Health.decode)

    def close(self):
        self._channel.close()

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

    def _stream(self, rpc, request, timeout=None):
        try:
            return list(getattr(self._stub, rpc)(request, timeout=timeout or self.timeout,
                                                 metadata=self._metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None

    def _step(self, rpc, request, field, answer_field, timeout):
        """Forward / Backward: unary when the request's tensor `field` fits in one message,
        else the streaming call (proto/moe.proto: ForwardStream) with the tensor's raw_data
        in pieces; the answer's `answer_field` raw_data pieces are joined."""
        raw = getattr(request, field).raw_data
        if len(raw) + _STEP_HEADROOM <= self.max_message_bytes:
            return self._call(rpc, request, timeout)
        piece = max(self.max_message_bytes - _STEP_HEADROOM, 4096)
        getattr(request, field).raw_data = raw[:piece]
        message_type = type(request)

        def pieces():
            yield request
            for offset in range(piece, len(raw), piece):
                more = message_type()
                getattr(more, field).raw_data = raw[offset:offset + piece]
                yield more

        try:
            answers = iter(getattr(self._stub, rpc + "Stream")(pieces(),
                                                               timeout=timeout or self.timeout,
                                                               metadata=self._metadata))
            first = next(answers)
            rest = [getattr(a, answer_field).raw_data for a in answers]
        except grpc.RpcError as e:
            raise from_rpc_error(e, rpc) from None
        if rest:
            tensor = getattr(first, answer_field)
            tensor.raw_data = b"".join([tensor.raw_data] + rest)
        return first

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
                timeout=None):
        """x [T, H] (numpy or torch; datatype="BF16" converts fp32 to bf16 on the wire).

        Returns ForwardResult; `out` is numpy (fp32 for a BF16 answer) or, with raw=True, the
        moe_pb2.Tensor itself (for callers that decode to torch without numpy's upcast).
        """
        request = moe_pb2.ForwardRequest(layer=layer, x=codec.to_proto(x, datatype),
                                         keep_for_backward=keep_for_backward)
        r = self._step("Forward", request, "x", "out", timeout)
        out = r.out if raw else codec.to_numpy(r.out)
        return ForwardResult(out, r.aux_loss, r.z_loss, list(r.tokens_per_expert), r.step_id,
                             r.load)

    def backward(self, layer, step_id, d_out, d_aux=None, d_z_loss=None, datatype=None,
                 raw=False, timeout=None):
        """d_out [T, H]; d_aux / d_z_loss default to 1.0 on the server. Returns d_x."""
        request = moe_pb2.BackwardRequest(layer=layer, step_id=step_id,
                                          d_out=codec.to_proto(d_out, datatype))
        if d_aux is not None:
            request.d_aux = float(d_aux)
        if d_z_loss is not None:
            request.d_z_loss = float(d_z_loss)
        r = self._step("Backward", request, "d_out", "d_x", timeout)
        return r.d_x if raw else codec.to_numpy(r.d_x)

    # ---- shared memory (moed on this host with --allow_client_shm; shared_memory.py) ----
    def register_system_shared_memory(self, name, key, offset, byte_size, timeout=None):
        self._call("RegisterSystemSharedMemory", moe_pb2.RegisterSystemSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

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
        return self._call("Forward", request, timeout)

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
        return self._call("Backward", request, timeout)

    def release_step(self, layer, step_id, timeout=None):
        """Frees a step kept for backward; True if it was held. Idempotent."""
        return self._call("ReleaseStep", moe_pb2.ReleaseStepRequest(layer=layer,
                                                                    step_id=step_id),
                          timeout).released

    # ---- training ----
    def get_gradients(self, layer, names=(), timeout=None):
        """{name: fp32 numpy array} of the accumulated whole-layer gradients."""
        return codec.assemble_chunks(self._stream("GetGradients", moe_pb2.GetGradientsRequest(
            layer=layer, names=list(names), max_chunk_bytes=self.chunk_bytes), timeout))

    def zero_gradients(self, layer, timeout=None):
        self._call("ZeroGradients", moe_pb2.ZeroGradientsRequest(layer=layer), timeout)

    def apply_optimizer(self, layer, sgd=None, adamw=None, timeout=None, num_ranks=0, rank=0,
                        step=0, run_id=""):
        """One optimizer step on the server, then gradients are zeroed. Exactly one of
        sgd={"lr":..., "momentum":..., "weight_decay":...} or
        adamw={"lr":..., "beta1":..., "beta2":..., "eps":..., "weight_decay":...}
        (dicts or the moe_pb2 messages). Returns the ApplyOptimizerResponse.

        num_ranks > 1: data-parallel step `step` of run `run_id`, called by every rank
        0..num_ranks-1; the server steps once, on the mean of the ranks' gradients, when all
        called, and every call waits until then (README "Training with several ranks")."""
        if (sgd is None) == (adamw is None):
            raise TypeError("apply_optimizer needs exactly one of sgd=, adamw=")
        request = moe_pb2.ApplyOptimizerRequest(layer=layer, num_ranks=num_ranks, rank=rank,
                                                step=step, run_id=run_id)
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
