"""Typed errors of the moe.v1 API: one exception class per gRPC status code.

Every failed call raises a MoeError subclass carrying the server's grpc.StatusCode and
message unchanged, so callers can branch on the class or on `.code`:

    try:
        client.forward("missing", x)
    except NotFound as e:          # e.code is grpc.StatusCode.NOT_FOUND
        print(e.message)
    except MoeError as e:          # anything else the server (or the channel) reported
        raise
"""

import grpc


class MoeError(Exception):
    """A failed moe.v1 call: `code` (grpc.StatusCode), `message` (the server's text), `rpc`."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, code, message, rpc=""):
        self.code = code
        self.message = message
        self.rpc = rpc
        super().__init__("%s%s: %s" % (rpc + " " if rpc else "", code.name, message))


class InvalidArgument(MoeError):
    """Malformed request or layer config (the message names the field and the rule)."""


class NotFound(MoeError):
    """Unknown layer."""


class AlreadyExists(MoeError):
    """A layer of that name exists."""


class FailedPrecondition(MoeError):
    """Step id unknown, released or already used; checkpoint of another config; ..."""


class ResourceExhausted(MoeError):
    """The layer's saved-step budget is full, or a message is over the size limit."""


class Unavailable(MoeError):
    """The server is unreachable, or a worker is gone and the cluster is not serving."""


class DeadlineExceeded(MoeError):
    """The call ran past its deadline."""


class Cancelled(MoeError):
    """The call was cancelled."""


class Aborted(MoeError):
    """The call was aborted (e.g. a concurrent membership change); it may be retried."""


class DataLoss(MoeError):
    """A checkpoint is incomplete or corrupted (the message names the file)."""


class Internal(MoeError):
    """A server bug or an unexpected failure inside the server."""


class Unimplemented(MoeError):
    """The server does not implement this call (an older server?), or has it switched off
    (shared memory without moed --allow_client_shm)."""


class Unauthenticated(MoeError):
    """No bearer token, or one the server does not know (moed --tokens_file)."""


class PermissionDenied(MoeError):
    """The token's role does not allow this call (read < infer < train < admin), or shared
    memory from a caller not on moed's host."""


_CLASS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def from_rpc_error(error, rpc=""):
    """grpc.RpcError -> the matching MoeError subclass (MoeError itself for other codes)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _CLASS_OF_CODE.get(code, MoeError)
    return cls(code, details or "", rpc)
