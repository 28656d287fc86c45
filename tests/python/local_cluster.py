"""A moed front end with N embedded CPU workers, started from the built binaries for a test.

    cluster = LocalCluster(moed="server/moed", worker="server/moe-worker", workers=2)
    cluster.start()                 # waits until grpc.health.v1 says SERVING
    client = Client(cluster.address)
    ...
    cluster.stop()                  # SIGTERM (moed stops its workers), SIGKILL after 10 s

The port is chosen by moed itself (--port=0 --port_file), so parallel tests never collide.
Logs go to $TEST_UNDECLARED_OUTPUTS_DIR (Bazel keeps them) or a temporary folder.
"""

import argparse
import os
import signal
import subprocess
import tempfile
import time

from moe_client import Client, MoeError


def binaries_from_argv(argv):
    """(--moed, --worker, remaining argv) from a test's command line."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--moed", required=True)
    parser.add_argument("--worker", required=True)
    args, rest = parser.parse_known_args(argv[1:])
    return os.path.abspath(args.moed), os.path.abspath(args.worker), [argv[0]] + rest


class LocalCluster:

    def __init__(self, moed, worker, workers=2, extra_flags=(), client_kwargs=None,
                 device="cpu"):
        """client_kwargs: Client arguments the health polling needs (TLS files, token).
        device: moed's --device ("cpu", or "cuda": one worker per GPU, `workers` of them)."""
        self.moed, self.worker, self.workers, self.device = moed, worker, workers, device
        self.extra_flags = list(extra_flags)
        self.client_kwargs = dict(client_kwargs or {})
        self.process = None
        self.address = None
        self.dir = tempfile.mkdtemp(prefix="moed-test-")
        # moed's --checkpoint_root: checkpoints are named by paths inside it.
        self.checkpoint_root = os.path.join(self.dir, "checkpoints")
        self.log_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR", self.dir)

    def start(self, timeout=60.0):
        port_file = os.path.join(self.dir, "port")
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.log_path = os.path.join(self.log_dir, "moed-%d.log" % os.getpid())
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [self.moed, "--port=0", "--port_file=" + port_file, "--listen=127.0.0.1",
             "--checkpoint_root=" + self.checkpoint_root,
             "--workers=%d" % self.workers, "--device=" + self.device,
             "--worker_binary=" + self.worker]
            + self.extra_flags, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)  # its own process group: stop() can clean up the workers
        log.close()
        deadline = time.time() + timeout
        while not os.path.exists(port_file):
            self._check_alive()
            if time.time() > deadline:
                raise TimeoutError("moed wrote no port file in %.0f s; log: %s" %
                                   (timeout, self.log_tail()))
            time.sleep(0.05)
        with open(port_file) as f:
            self.address = "127.0.0.1:%d" % int(f.read())
        with Client(self.address, timeout=5, **self.client_kwargs) as client:
            while True:
                self._check_alive()
                try:
                    if client.health() == "SERVING":
                        return self
                except MoeError:
                    pass
                if time.time() > deadline:
                    raise TimeoutError("cluster not SERVING after %.0f s; log: %s" %
                                       (timeout, self.log_tail()))
                time.sleep(0.1)

    def _check_alive(self):
        if self.process.poll() is not None:
            raise RuntimeError("moed exited with %d; log: %s" % (self.process.returncode,
                                                                  self.log_tail()))

    def log_tail(self, lines=30):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group this cluster started
            self.process.wait()
