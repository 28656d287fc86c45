"""Steps over a step channel: Forward, Backward and ReleaseStep as records in a shared-memory
ring (moe_client.ring) instead of one gRPC call each, for a client on moed's host (issue 37
§2; proto/moe.proto "Step channels"). moed must run with --allow_client_shm.

A record is an 8-byte envelope (u8 kind, 3 zero bytes, u32 little-endian: the call's
remaining deadline in ms; transport/step_envelope.h) and the request's bytes exactly as the
gRPC call sends them; the answer is the response's bytes, or the status a gRPC call gets
(the same moe_client.errors class and code).

Client uses one by itself (Client(step_channel="auto")): opened at the first step; refused
at open (UNIMPLEMENTED: moed without --allow_client_shm; PERMISSION_DENIED: not on moed's
host; any other error) or failing later (UNAVAILABLE: moed closed it or exited), the client
goes back to gRPC for good with one log line. A step whose request or answer may not fit the
ring, or that finds the channel busy with another thread's step, goes over gRPC.
"""

import ipaddress
import logging
import os
import struct
import threading

import grpc

from moe_client import errors
from moe_client.proto import moe_pb2

_log = logging.getLogger("moe_client")

KINDS = {"Forward": 1, "Backward": 2, "ReleaseStep": 3}
_ENVELOPE = struct.Struct("<B3xI")
_MAX_DEADLINE_MS = 0x7FFFFFFF
DEFAULT_RING_BYTES = 8 << 20


def envelope(kind, timeout, body):
    """The record of one step: kind (KINDS), `timeout` seconds left, the request's bytes."""
    ms = min(max(int(timeout * 1000), 1), _MAX_DEADLINE_MS)
    return _ENVELOPE.pack(kind, ms) + bytes(body)


def is_local_address(address):
    """Whether a gRPC target names this host: unix:, localhost, a loopback IP."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return True
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or "]" in address else address
    host = host.strip("[]")
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StepChannel:
    """One Client's channel; opened at the first call(). Thread-safe."""

    def __init__(self, stub, metadata, ring_bytes=DEFAULT_RING_BYTES, open_timeout=10.0,
                 max_spin=0.0):
        self._stub = stub
        self._max_spin = max_spin
        self._metadata = metadata
        self._ring_bytes = ring_bytes
        self._open_timeout = open_timeout
        self._open_lock = threading.Lock()
        self._busy = threading.Lock()  # one step on the ring at a time; others take gRPC
        self._ring = None
        self.channel_id = 0  # moed's id of the open channel (CloseStepChannel)
        self._off = False  # refused or failed: gRPC from now on
        self.steps = 0  # steps answered through the ring

    @property
    def off(self):
        return self._off

    def _turn_off(self, why, level=logging.WARNING):
        self._off = True
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
        _log.log(level, "moe_client: steps go over gRPC: %s", why)

    def _open(self):
        with self._open_lock:
            if self._ring is not None or self._off:
                return self._ring
            from moe_client.ring import RingCaller
            try:
                opened = self._stub.OpenStepChannel(
                    moe_pb2.OpenStepChannelRequest(ring_bytes=self._ring_bytes,
                                                   caller_pid=os.getpid()),
                    timeout=self._open_timeout, metadata=self._metadata)
                self._ring = RingCaller(opened.name, max_spin=self._max_spin)
                self.channel_id = opened.channel_id
            except grpc.RpcError as e:
                refused = e.code() in (grpc.StatusCode.UNIMPLEMENTED,
                                       grpc.StatusCode.PERMISSION_DENIED)
                self._turn_off("moed refused a step channel (%s: %s)" % (
                    e.code().name, e.details()), logging.INFO if refused else logging.WARNING)
            except (OSError, errors.MoeError) as e:
                self._turn_off("could not attach the step channel (%s)" % e)
            return self._ring

    def fits(self, request_bytes, answer_bytes):
        """Whether a record of request_bytes and an answer of about answer_bytes fit."""
        return (not self._off and request_bytes + 64 <= self._ring_bytes // 2
                and answer_bytes + 4096 <= self._ring_bytes // 2)

    def call(self, rpc, data, timeout):
        """The answer's bytes of `rpc` (KINDS) for the request bytes `data`, or None when the
        step is to go over gRPC (the channel is off, refused, busy or just failed). A status
        moed answered raises its moe_client.errors class with `rpc`."""
        if self._off or not self._busy.acquire(blocking=False):
            return None
        try:
            ring = self._ring or self._open()
            if ring is None:
                return None
            try:
                answer = ring.call(envelope(KINDS[rpc], timeout, data), timeout + 1.0)
            except errors.MoeError as e:
                if getattr(e, "from_server", False):
                    raise type(e)(e.code, e.message, rpc) from None
                if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS):
                    self._turn_off("the step channel failed (%s)" % e)
                    return None
                raise type(e)(e.code, e.message, rpc) from None
            self.steps += 1
            return answer
        finally:
            self._busy.release()

    def close(self):
        with self._open_lock:
            ring, self._ring = self._ring, None
            self._off = True
        if ring is not None:
            ring.close()
