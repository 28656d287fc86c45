"""The caller side of a RingChannel (transport/ring_channel.h) in Python: a step's request
and response as records in a shared-memory ring with futex doorbells, for callers on the
same host as the server (issue 37 §2). Same layout and protocol as the C++ side
(transport/ring_layout.h, transport/README.md); Linux only (x86_64, aarch64).

    from moe_client.ring import RingCaller
    with RingCaller("/proc/1234/fd/7") as ring:     # or a POSIX name "/moed-ring-..."
        response = ring.call(request_bytes, timeout=1.0)

Errors are the client's typed errors (moe_client.errors) with the C++ side's codes:
DeadlineExceeded (no answer in time; the late answer is skipped by the next call),
ResourceExhausted (the request ring stayed full), Unavailable (the server closed the
channel or its process exited), DataLoss (the server wrote values no honest server
writes), InvalidArgument (a request larger than the ring, or a region that is not a ring).
Everything read from the region is validated before use and payloads are copied out.

Atomicity: every shared word has one writer (ring_layout.h). Loads and stores go through a
memoryview cast to 'Q' / 'I', i.e. single aligned machine loads and stores; on x86_64
(TSO) a store is not reordered before earlier stores, so a record's bytes are visible before
the head that publishes them. One call at a time per RingCaller (calls take a lock).
"""

import ctypes
import mmap
import os
import platform
import struct
import threading
import time

import grpc

from moe_client import errors

MAGIC = 0x474E4952  # "RING"
VERSION = 1
DATA_OFFSET = 4096
MIN_RING_BYTES = 4096
MAX_RING_BYTES = 1 << 30
RECORD_ALIGN = 16
RECORD_HEADER = struct.Struct("<IIQ")  # payload_bytes, status_code, sequence
REGION_HEADER = struct.Struct("<IIQQ")  # magic, version, region_bytes, ring_bytes
# Byte offsets (transport/ring_layout.h).
CALLER_PID, SERVER_PID, CALLER_CLOSED, SERVER_CLOSED = 24, 28, 32, 36
REQUEST_CONTROL, RESPONSE_CONTROL = 64, 192
HEAD, DATA_BELL, TAIL, SPACE_BELL = 0, 8, 64, 72

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 0x7FFFFFFF
_CODE_OF_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _error(code, message):
    return errors._CLASS_OF_CODE.get(code, errors.MoeError)(code, message, "ring")


def record_bytes(payload_bytes):
    return (RECORD_HEADER.size + payload_bytes + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def process_alive(pid):
    """False once `pid` exited (gone, or a zombie not yet reaped)."""
    if pid == 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except OSError:
        return True
    state = stat[stat.rfind(")") + 2:stat.rfind(")") + 3]
    return state not in ("Z", "X")


class RingCaller:
    """The caller's end of a RingChannel a C++ server created (or attached to)."""

    def __init__(self, path, peer_check_interval=0.02, max_spin=0.0):
        """path: the region (a POSIX name or a file path). peer_check_interval: s between
        checks that the server lives while a call waits. max_spin: s a wait spins (checking the
        bell, the GIL released each turn) before it sleeps on the futex; 0: no spin."""
        if _SYS_FUTEX is None:
            raise _error(grpc.StatusCode.UNIMPLEMENTED,
                         "ring channels need Linux on x86_64 or aarch64, not " +
                         platform.machine())
        if path.startswith("/") and path.count("/") == 1:
            path = "/dev/shm" + path  # a POSIX shm name
        self._check_interval = peer_check_interval
        self._max_spin = max_spin
        self._lock = threading.Lock()
        self._closed = False
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < DATA_OFFSET:
                raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                             "%s: %d bytes is too small for a ring channel" % (path, size))
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            self._attach(path, size)
        except BaseException:
            self._release()
            raise

    def _attach(self, path, size):
        magic, version, region_bytes, ring_bytes = REGION_HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         "%s: not a ring channel (magic 0x%x)" % (path, magic))
        if version != VERSION:
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         "%s: ring channel version %d, this client speaks %d" %
                         (path, version, VERSION))
        if (ring_bytes & (ring_bytes - 1) or not MIN_RING_BYTES <= ring_bytes <= MAX_RING_BYTES
                or region_bytes != DATA_OFFSET + 2 * ring_bytes or size != region_bytes):
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         "%s: header says %d bytes for rings of %d, the object has %d" %
                         (path, region_bytes, ring_bytes, size))
        self._ring = ring_bytes
        self._view = memoryview(self._mm)
        self._u64 = self._view.cast("Q")
        self._u32 = self._view.cast("I")
        # The region's address, for the futex syscall (released before the mmap closes).
        self._anchor = (ctypes.c_char * size).from_buffer(self._mm)
        self._base = ctypes.addressof(self._anchor)
        if self._u32[CALLER_PID // 4] != 0:
            raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                         "%s: the channel already has a caller (pid %d)" %
                         (path, self._u32[CALLER_PID // 4]))
        self._u32[CALLER_PID // 4] = os.getpid()
        self._req = REQUEST_CONTROL
        self._resp = RESPONSE_CONTROL
        self._req_data = DATA_OFFSET
        self._resp_data = DATA_OFFSET + ring_bytes
        # Private copies: the producer's own head, the consumer's own tail.
        self._head = self._load64(self._req + HEAD)
        self._seen_tail = self._load64(self._req + TAIL)
        self._tail = self._load64(self._resp + TAIL)
        self._seen_head = self._load64(self._resp + HEAD)
        for head, tail in ((self._head, self._seen_tail), (self._seen_head, self._tail)):
            if head < tail or head - tail > ring_bytes or head % RECORD_ALIGN or tail % RECORD_ALIGN:
                self._broken = "head %d and tail %d are not a ring of %d bytes" % (head, tail,
                                                                                   ring_bytes)
                raise self._data_loss()
        self._broken = None
        self._server_pid = 0
        self._sequence = 1

    # -- shared words -------------------------------------------------------------------------
    def _load64(self, offset):
        return self._u64[offset // 8]

    def _store64(self, offset, value):
        self._u64[offset // 8] = value

    def _load32(self, offset):
        return self._u32[offset // 4]

    def _ring_bell(self, offset):
        self._u32[offset // 4] = (self._u32[offset // 4] + 1) & 0xFFFFFFFF  # we are its writer
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._base + offset), _FUTEX_WAKE, _INT_MAX,
                      None, None, 0)

    def _wait_bell(self, offset, seen, until):
        """Sleeps until the bell differs from `seen` or `until` (time.monotonic()); True if rung."""
        index = offset // 4
        if self._max_spin > 0:
            # Each turn gives the GIL up (os.sched_yield releases it around the syscall), so
            # the process's other Python threads are not held off for the spin; on an idle
            # core the yield returns at once (~1 us a turn).
            spin_end = min(until, time.monotonic() + self._max_spin)
            while self._u32[index] == seen:
                if time.monotonic() >= spin_end:
                    break
                os.sched_yield()
            else:
                return True
        while self._u32[index] == seen:
            left = until - time.monotonic()
            if left <= 0:
                return False
            ts = _Timespec(int(left), int((left - int(left)) * 1e9))
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._base + offset), _FUTEX_WAIT,
                          ctypes.c_uint(seen), ctypes.byref(ts), None, 0)
        return True

    def _data_loss(self):
        return _error(grpc.StatusCode.DATA_LOSS, "step ring corrupt: " + self._broken)

    def _fail(self, message):
        if self._broken is None:
            self._broken = message
        return self._data_loss()

    def _check_peer(self, timed_out):
        if self._load32(SERVER_CLOSED) != 0:
            raise _error(grpc.StatusCode.UNAVAILABLE, "ring channel: the server closed the channel")
        if self._server_pid == 0:
            self._server_pid = self._load32(SERVER_PID)
        if timed_out and not process_alive(self._server_pid):
            raise _error(grpc.StatusCode.UNAVAILABLE,
                         "ring channel: the server process (pid %d) exited" % self._server_pid)

    def _wait(self, bell, seen, deadline):
        now = time.monotonic()
        if now >= deadline:
            return False
        rung = self._wait_bell(bell, seen, min(deadline, now + self._check_interval))
        self._check_peer(not rung)
        return True

    # -- the two rings ------------------------------------------------------------------------
    def _copy_in(self, position, data):
        offset = position & (self._ring - 1)
        first = min(len(data), self._ring - offset)
        start = self._req_data + offset
        self._mm[start:start + first] = data[:first]
        if first < len(data):
            self._mm[self._req_data:self._req_data + len(data) - first] = data[first:]

    def _copy_out(self, position, n):
        offset = position & (self._ring - 1)
        first = min(n, self._ring - offset)
        start = self._resp_data + offset
        out = self._mm[start:start + first]
        if first < n:
            out += self._mm[self._resp_data:self._resp_data + n - first]
        return out

    def _push(self, sequence, payload, deadline):
        need = record_bytes(len(payload))
        while True:
            seen = self._load32(self._req + SPACE_BELL)
            tail = self._load64(self._req + TAIL)
            if tail < self._seen_tail or tail > self._head or tail % RECORD_ALIGN:
                raise self._fail("tail %d outside [%d, %d]" % (tail, self._seen_tail, self._head))
            self._seen_tail = tail
            if self._ring - (self._head - tail) >= need:
                break
            if not self._wait(self._req + SPACE_BELL, seen, deadline):
                raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "step ring full: no room for %d bytes before the deadline" % need)
        self._copy_in(self._head, RECORD_HEADER.pack(len(payload), 0, sequence))
        self._copy_in(self._head + RECORD_HEADER.size, payload)
        self._head += need
        self._store64(self._req + HEAD, self._head)  # publishes the whole record
        self._ring_bell(self._req + DATA_BELL)

    def _pop(self, deadline, sequence):
        while True:
            seen = self._load32(self._resp + DATA_BELL)
            head = self._load64(self._resp + HEAD)
            if head < self._seen_head or head - self._tail > self._ring or head % RECORD_ALIGN:
                raise self._fail("head %d outside [%d, %d]" %
                                 (head, self._seen_head, self._tail + self._ring))
            self._seen_head = head
            if head != self._tail:
                break
            if not self._wait(self._resp + DATA_BELL, seen, deadline):
                raise _error(grpc.StatusCode.DEADLINE_EXCEEDED,
                             "ring channel: no response to call %d before the deadline" % sequence)
        available = self._seen_head - self._tail
        n, code, got = RECORD_HEADER.unpack(self._copy_out(self._tail, RECORD_HEADER.size))
        need = record_bytes(n)
        if n > self._ring - RECORD_HEADER.size or need > available:
            raise self._fail("a record of %d bytes with %d bytes published" % (n, available))
        payload = self._copy_out(self._tail + RECORD_HEADER.size, n)
        self._tail += need
        self._store64(self._resp + TAIL, self._tail)  # the bytes may be reused now
        self._ring_bell(self._resp + SPACE_BELL)
        return got, code, payload

    # -- the API ------------------------------------------------------------------------------
    @property
    def max_request_bytes(self):
        return self._ring - RECORD_HEADER.size

    def call(self, request, timeout):
        """Sends `request` (bytes-like) and returns the server's response bytes."""
        with self._lock:
            if self._closed:
                raise _error(grpc.StatusCode.FAILED_PRECONDITION, "ring channel closed")
            if self._broken is not None:
                raise self._data_loss()
            if len(request) > self.max_request_bytes:
                raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                             "a record of %d bytes never fits a ring of %d bytes (at most %d)" %
                             (len(request), self._ring, self.max_request_bytes))
            deadline = time.monotonic() + timeout
            self._check_peer(False)
            sequence = self._sequence
            self._sequence += 1
            self._push(sequence, bytes(request), deadline)
            while True:
                got, code, payload = self._pop(deadline, sequence)
                if got < sequence:
                    continue  # the late answer of a call that timed out
                if got > sequence:
                    raise self._fail("response %d to call %d" % (got, sequence))
                if code > 16:
                    raise self._fail("status code %d" % code)
                if code != 0:  # the server's answer, not the channel's failure
                    error = _error(_CODE_OF_NUMBER[code], payload.decode("utf-8", "replace"))
                    error.from_server = True
                    raise error
                return payload

    def close(self):
        """Marks the caller closed (the server's Serve returns) and unmaps the region."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if hasattr(self, "_base"):
                self._u32[CALLER_CLOSED // 4] = 1
                self._ring_bell(self._req + DATA_BELL)
            self._release()

    def _release(self):
        for name in ("_u64", "_u32", "_view"):
            view = self.__dict__.pop(name, None)
            if view is not None:
                view.release()
        self.__dict__.pop("_anchor", None)
        mm = self.__dict__.pop("_mm", None)
        if mm is not None:
            mm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _bench(path, size, iters, warmup, spin_us=0):
    """Round trips of `size` bytes; one JSON line (the C++ bench runs this, bench/ring_bench.cc)."""
    import json
    request = bytes(range(256)) * (size // 256) + bytes(size % 256)
    with RingCaller(path, max_spin=spin_us * 1e-6) as ring:
        for _ in range(warmup):
            ring.call(request, 10.0)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            response = ring.call(request, 10.0)
            times.append(time.perf_counter() - start)
            if len(response) != size:
                raise RuntimeError("echo of %d bytes came back as %d" % (size, len(response)))
    times.sort()
    print(json.dumps({"case": "ring_python", "spin_us": spin_us, "bytes": size, "iters": iters,
                      "p50_us": round(times[len(times) // 2] * 1e6, 2),
                      "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 2)}), flush=True)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="RingChannel caller round-trip benchmark")
    parser.add_argument("--path", required=True)
    parser.add_argument("--bytes", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--spin_us", type=int, default=0)
    args = parser.parse_args()
    _bench(args.path, args.bytes, args.iters, args.warmup, args.spin_us)
