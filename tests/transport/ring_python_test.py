"""The Python caller of a RingChannel (moe_client.ring) against the C++ server
(tests/transport/ring_echo_server): round trips that wrap the ring, the server's error
codes, a late answer skipped, a full request ring, a server killed mid-call (Unavailable
within the deadline), a region that is not a ring, and the caller's close ending Serve.
"""

import os
import subprocess
import sys
import tempfile
import time
import unittest

from moe_client.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted,
                        Unavailable)
from moe_client.ring import RingCaller

SERVER = None


class EchoServer:

    def __init__(self, ring_bytes=4096):
        self.process = subprocess.Popen([SERVER, "--ring_bytes=%d" % ring_bytes],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.path = self.process.stdout.readline().decode().strip()
        assert self.path.startswith("/proc/"), self.process.stderr.read()

    def wait(self):
        return self.process.wait(timeout=10)

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.process.stdout.close()
        self.process.stderr.close()


class RingPythonTest(unittest.TestCase):

    def test_round_trips_wrap_and_close_ends_serve(self):
        server = EchoServer()
        try:
            ring = RingCaller(server.path)
            self.assertEqual(ring.max_request_bytes, 4096 - 16)
            for round_ in range(30):
                for size in (0, 1, 15, 16, 17, 256, 1000, 4080):
                    request = os.urandom(size)
                    if size >= 6:
                        request = b"x" + request[1:]
                    self.assertEqual(ring.call(request, timeout=10), request, size)
            with self.assertRaises(InvalidArgument) as error:
                ring.call(b"error:bad shape", timeout=10)
            self.assertEqual(error.exception.message, "bad shape")
            with self.assertRaises(InvalidArgument):
                ring.call(bytes(4081), timeout=10)  # never fits
            self.assertEqual(ring.call(b"still fine", timeout=10), b"still fine")
            ring.close()
            self.assertEqual(server.wait(), 0)  # Serve returned OK on the caller's close
            with self.assertRaises(FailedPrecondition):
                ring.call(b"closed", timeout=1)
        finally:
            server.kill()

    def test_second_caller_is_refused(self):
        server = EchoServer()
        try:
            with RingCaller(server.path) as ring:
                with self.assertRaises(FailedPrecondition):
                    RingCaller(server.path)
                self.assertEqual(ring.call(b"a", timeout=10), b"a")
        finally:
            server.kill()

    def test_late_answer_is_skipped(self):
        server = EchoServer()
        try:
            with RingCaller(server.path) as ring:
                start = time.monotonic()
                with self.assertRaises(DeadlineExceeded):
                    ring.call(b"sleep:300", timeout=0.05)
                self.assertLess(time.monotonic() - start, 0.25)
                self.assertEqual(ring.call(b"fast", timeout=10), b"fast")  # not "slept"
        finally:
            server.kill()

    def test_full_ring_is_resource_exhausted(self):
        server = EchoServer()
        try:
            with RingCaller(server.path) as ring:
                # The server sleeps on the first; three more 1120-byte records fill the ring.
                with self.assertRaises(DeadlineExceeded):
                    ring.call(b"sleep:1500", timeout=0.02)
                for _ in range(3):
                    with self.assertRaises(DeadlineExceeded):
                        ring.call(bytes(1100), timeout=0.02)
                start = time.monotonic()
                with self.assertRaises(ResourceExhausted):
                    ring.call(bytes(1100), timeout=0.1)
                self.assertGreaterEqual(time.monotonic() - start, 0.1)
                self.assertEqual(ring.call(b"after", timeout=10), b"after")
        finally:
            server.kill()

    def test_server_killed_mid_call_is_unavailable(self):
        server = EchoServer()
        try:
            with RingCaller(server.path) as ring:
                self.assertEqual(ring.call(b"ping", timeout=10), b"ping")
                start = time.monotonic()
                with self.assertRaises(Unavailable) as error:
                    ring.call(b"die", timeout=10)
                self.assertLess(time.monotonic() - start, 2.0)
                self.assertIn("exited", error.exception.message)
                with self.assertRaises(Unavailable):
                    ring.call(b"again", timeout=10)
        finally:
            server.kill()

    def test_not_a_ring_is_invalid_argument(self):
        with tempfile.NamedTemporaryFile() as f:
            f.write(os.urandom(4096 + 2 * 4096))
            f.flush()
            with self.assertRaises(InvalidArgument):
                RingCaller(f.name)
            f.truncate(100)
            with self.assertRaises(InvalidArgument):
                RingCaller(f.name)


if __name__ == "__main__":
    for arg in list(sys.argv[1:]):
        if arg.startswith("--server="):
            SERVER = arg.split("=", 1)[1]
            sys.argv.remove(arg)
    unittest.main()
