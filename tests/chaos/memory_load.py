"""Load for the worker-memory soak (issue 41 item 7): concurrent callers against a live moed,
with the RSS and open descriptors of moed and each worker sampled from /proc.

    cluster = LocalCluster(moed, worker, workers=2, extra_flags=["--allow_client_shm"]).start()
    sampler = Sampler(cluster.process.pid)  # moed and its workers, from /proc
    load = MemoryLoad(cluster, callers=16, big_every=8)
    load.warm_up()
    load.start(); time.sleep(40); load.stop()     # stop() returns once every call ended
    print(sampler.sample()["worker0"]["RssAnon"]) # kB
    load.close()

The load is that of the report: `callers` threads each looping forwards of 256 tokens (a
training step every fourth: forward kept, backward, every eighth a 64 MiB forward instead),
and shared-memory clients (child processes) killed with SIGKILL in the middle of a call,
half of them with their whole process group (nothing unlinks their objects: a dead C++
client) and half alone (Python's resource tracker unlinks them).
"""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from moe_client import Client, DeadlineExceeded, MoeError, Unavailable

HIDDEN = 1024
CONFIG = dict(hidden=HIDDEN, ffn=32, num_experts=8, top_k=2, aux_loss_coeff=1e-2)
SMALL_TOKENS = 256
BIG_TOKENS = (64 << 20) // (4 * HIDDEN)  # a 64 MiB fp32 x
CALL_TIMEOUT_S = 20

# A client that registers a region, then loops shm forwards until it is killed. Prints the
# region's key first so the driver can unlink what a killed group leaves in /dev/shm.
SHM_CLIENT = r"""
import sys, numpy as np
from moe_client import Client
from moe_client.shared_memory import SharedMemoryRegion
address, layer, tokens, hidden = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = Client(address, timeout=20)
n = tokens * hidden * 4
region = SharedMemoryRegion(client, 2 * n)
print(region.key, flush=True)
region.array(0, "FP32", (tokens, hidden))[...] = np.random.default_rng(0).standard_normal(
    (tokens, hidden), dtype=np.float32)
while True:
    client.forward_shm(layer, region.tensor(0, "FP32", (tokens, hidden)),
                       out=region.output(n, n))
"""


def read_status(pid):
    """{VmRSS, RssAnon, RssShmem, Threads} of /proc/pid/status (kB, threads), or None."""
    fields = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"):
                    fields[key] = int(value.split()[0])
        fields["fds"] = len(os.listdir("/proc/%d/fd" % pid))
        with open("/proc/%d/maps" % pid) as f:
            fields["maps"] = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return fields


def children(pid):
    """Pids whose parent is `pid`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            found.append(int(name))
    return sorted(found)


class Sampler:
    """Samples moed and its workers every `interval` s into self.samples:
    [(t, {"moed": fields, "worker<i>": fields})] (workers by pid order)."""

    def __init__(self, moed_pid, interval=0.5):
        self.moed_pid, self.interval = moed_pid, interval
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.start = time.time()
        self._thread.start()

    def sample(self):
        row = {"moed": read_status(self.moed_pid)}
        for i, pid in enumerate(children(self.moed_pid)):
            row["worker%d" % i] = read_status(pid)
            if row["worker%d" % i] is not None:
                row["worker%d" % i]["pid"] = pid
        return row

    def _loop(self):
        while not self._stop.is_set():
            self.samples.append((time.time() - self.start, self.sample()))
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        self._thread.join()


class MemoryLoad:

    def __init__(self, cluster, callers=16, big_every=8, shm_clients=2, layers=2):
        self.cluster, self.callers, self.big_every = cluster, callers, big_every
        self.shm_clients = shm_clients
        self.layers = ["soak%d" % i for i in range(layers)]
        self.errors = {}  # "rpc code" -> count (errors are expected: kills, deadlines)
        self.calls = 0
        self.shm_kills = 0
        self.keys = set()  # shm objects of killed groups, unlinked at stop()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        client = Client(cluster.address, timeout=60)
        for name in self.layers:
            try:
                client.create_layer(name, **CONFIG)
            except MoeError as e:
                if "exists" not in str(e):
                    raise
        client.close()
        rng = np.random.default_rng(1)
        self.small = rng.standard_normal((SMALL_TOKENS, HIDDEN), dtype=np.float32)
        self.big = rng.standard_normal((BIG_TOKENS, HIDDEN), dtype=np.float32)

    def _count(self, error=None):
        with self._lock:
            self.calls += 1
            if error is not None:
                key = "%s %s" % (type(error).__name__, getattr(error, "code", ""))
                self.errors[key] = self.errors.get(key, 0) + 1

    def _caller(self, index):
        client = Client(self.cluster.address, timeout=CALL_TIMEOUT_S, lanes=1)
        layer = self.layers[index % len(self.layers)]
        for i in range(1 << 62):
            if self._stop.is_set():
                break
            try:
                if self.big_every and (i + index) % self.big_every == self.big_every - 1:
                    client.forward(layer, self.big)
                elif i % 4 == 3:
                    r = client.forward(layer, self.small, keep_for_backward=True)
                    client.backward(layer, r.step_id, self.small)
                else:
                    client.forward(layer, self.small)
                self._count()
            except MoeError as e:
                self._count(e)
                time.sleep(0.05)
        client.close()

    def _shm_clients(self, index):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        layer = self.layers[index % len(self.layers)]
        for round_ in range(1 << 62):
            if self._stop.is_set():
                break
            child = subprocess.Popen(
                [sys.executable, "-c", SHM_CLIENT, self.cluster.address, layer,
                 str(SMALL_TOKENS * 4), str(HIDDEN)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                start_new_session=True)
            key = child.stdout.readline().decode().strip()
            # Mid-call: its loop is nothing but forwards.
            self._stop.wait(0.3 + 0.1 * (round_ % 5))
            whole_group = round_ % 2 == 0
            if whole_group and key:
                with self._lock:
                    self.keys.add(key)
            if whole_group:
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
            with self._lock:
                self.shm_kills += 1

    def warm_up(self):
        """One call of each kind on every layer, so that what the first calls set up once
        (connections, relay buffers, threads) is there before a baseline is taken."""
        client = Client(self.cluster.address, timeout=60, lanes=1)
        for layer in self.layers:
            client.forward(layer, self.small)
            r = client.forward(layer, self.small, keep_for_backward=True)
            client.backward(layer, r.step_id, self.small)
        client.close()

    def drain(self, timeout=300):
        """Returns once the workers finished every step, also those whose callers' deadlines
        passed (the workers finish them; a layer's next call waits for that): one small
        forward on each layer (again while the pool re-forms: under a heavy load the workers
        may miss pings and rejoin)."""
        client = Client(self.cluster.address, timeout=60, lanes=1)
        give_up = time.time() + timeout
        for layer in self.layers:
            while True:
                try:
                    client.forward(layer, self.small)
                    break
                except (Unavailable, DeadlineExceeded):  # re-forming, or still busy
                    if time.time() > give_up:
                        raise
                    time.sleep(0.5)
        client.close()

    def start(self):
        """Starts the callers and the shared-memory clients (again after stop())."""
        self._stop.clear()
        self._threads = [threading.Thread(target=self._caller, args=(i,), daemon=True)
                         for i in range(self.callers)]
        self._threads += [threading.Thread(target=self._shm_clients, args=(i,), daemon=True)
                          for i in range(self.shm_clients)]
        for t in self._threads:
            t.start()

    def stop(self):
        """Stops them and waits until every call has ended (each has a deadline)."""
        self._stop.set()
        for t in self._threads:
            t.join()

    def close(self):
        """Unlinks the objects killed clients left in /dev/shm."""
        for key in self.keys:
            try:
                os.unlink("/dev/shm" + key)
            except OSError:
                pass
