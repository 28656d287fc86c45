"""moe_client: the Python client of moed (moe.v1.MoeService).

    from moe_client import Client, RemoteMoE
    client = Client("localhost:50051")
    moe = RemoteMoE(client, "ffn0", hidden=512, ffn=1024, num_experts=8, top_k=2)
    out, aux = moe(x)

Modules: client (Client, one method per RPC), errors (MoeError and one subclass per gRPC
code), codec (numpy/torch <-> wire tensors, fp32 and bf16), torch_layer (RemoteMoE),
shared_memory (SharedMemoryRegion: zero-copy steps on moed's host), ring (RingCaller: the
caller side of a same-host RingChannel, transport/README.md; moed does not serve one yet),
jax_layer (remote_moe, a jax.custom_vjp wrapper; UNTESTED, JAX is not on the build machine).
The generated stubs (moe_client.proto.moe_pb2) come with the install: client/python/README.md.
"""

import os

# gRPC's EventEngine client (the default of recent grpcio; 1.84 on the GPU machine) doubles a
# Python call's fixed cost: a health check p50 317 -> 149 us on the H200 host with it off
# (docs/DECISIONS.md, "the Python client's per-call floor"). It must be set before gRPC starts;
# a GRPC_EXPERIMENTS of the caller's own (even empty) is left alone.
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client")

from moe_client.client import Client, ForwardResult, layer_config  # noqa: E402
from moe_client.errors import (Aborted, AlreadyExists, Cancelled, DataLoss,  # noqa: E402
                               DeadlineExceeded,
                               FailedPrecondition, Internal, InvalidArgument, MoeError, NotFound,
                               PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable,
                               Unimplemented)

try:
    from moe_client.torch_layer import RemoteMoE
except ImportError:  # pragma: no cover - torch-less installs still get the Client
    RemoteMoE = None

__all__ = [
    "Client", "ForwardResult", "layer_config", "RemoteMoE", "MoeError", "InvalidArgument",
    "NotFound", "AlreadyExists", "FailedPrecondition", "ResourceExhausted", "Unavailable",
    "DeadlineExceeded", "Cancelled", "Aborted", "DataLoss", "Internal", "Unimplemented",
    "PermissionDenied",
]
