"""Worker memory under load (issue 41 item 7): moed with 2 embedded CPU workers, rounds of
concurrent callers (memory_load.py: 256-token forwards and training steps, 64 MiB forwards,
shared-memory clients SIGKILLed mid-call), and between rounds, once the calls have ended and
the workers finished the steps whose callers' deadlines passed (MemoryLoad.drain), the RSS
and descriptors of moed and each worker read from /proc. Checked for every process
after every round:

  - anonymous RSS at most its value before the load + --heap_retain_bytes + SLACK: the free
    heap glibc's arenas keep is bounded (server/heap_trim.h). Without the bound
    (SOAK_HEAP_RETAIN_BYTES=-1, what main did) every arena keeps the largest step it ran and
    the check fails;
  - shared RSS at most --shm_relay_max_bytes + SLACK (moed's relay buffers, which the workers
    map too: a pool with that bound, server/relay_pool.h);
  - open descriptors at most the count before the load + FD_SLACK (a mapped relay buffer or
    client region is one descriptor; a killed client's regions are dropped);
  - no worker was restarted, and round n's anonymous RSS is no higher than round 1's +
    ROUND_SLACK (flat after warm-up: nothing accumulates from round to round; each arena's free
    top is bounded, server/heap_trim.h BoundArenaTops. Without that bound the workers gained
    20-31 MiB from round 1 to 2 of 30 s, 2026-12-04).

Environment: SOAK_ROUNDS (1), SOAK_ROUND_S (15), SOAK_CALLERS (16), SOAK_HEAP_RETAIN_BYTES
(16 MiB; -1 turns the bound off). The CI form is one 15 s round;
//tests/chaos:memory_soak_long_test (manual) runs 8 rounds of 40 s. Prints one JSON line of the figures.
"""

import json
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from local_cluster import LocalCluster, binaries_from_argv  # noqa: E402
from memory_load import MemoryLoad, Sampler  # noqa: E402

MOED = WORKER = None
MIB = 1 << 20
SLACK = 96 * MIB
ROUND_SLACK = 20 * MIB
FD_SLACK = 48
RELAY_MAX = 256 * MIB
SETTLE_S = 10  # after a round: how long the trimmer (every 0.5 s) gets to bring RSS down


def env_int(name, default):
    return int(os.environ.get(name, default))


def rss(sample, key, field):
    return sample[key][field] * 1024  # /proc reports kB


class MemorySoakTest(unittest.TestCase):

    def test_memory_stays_bounded_under_load(self):
        rounds = env_int("SOAK_ROUNDS", 1)
        round_s = env_int("SOAK_ROUND_S", 15)
        callers = env_int("SOAK_CALLERS", 16)
        retain = env_int("SOAK_HEAP_RETAIN_BYTES", 16 * MIB)
        self.started = time.time()
        cluster = LocalCluster(MOED, WORKER, workers=2, extra_flags=[
            "--allow_client_shm", "--metrics_listen=off", "--heap_retain_bytes=%d" % retain,
            "--shm_relay_max_bytes=%d" % RELAY_MAX]).start()
        try:
            self.run_rounds(cluster, rounds, round_s, callers, retain)
        finally:
            cluster.stop()

    def settled(self, sampler, before, retain):
        """The sample once every process's anonymous RSS is within its bound (or the last one
        after SETTLE_S)."""
        deadline = time.time() + SETTLE_S
        while True:
            sample = sampler.sample()
            ok = all(v is not None and
                     rss(sample, k, "RssAnon") <= rss(before, k, "RssAnon") + max(retain, 0) + SLACK
                     for k, v in sample.items())
            if ok or time.time() > deadline:
                return sample
            time.sleep(0.5)

    def run_rounds(self, cluster, rounds, round_s, callers, retain):
        retain = max(retain, 0)  # -1: no bound to add (the check then shows what main did)
        load = MemoryLoad(cluster, callers=callers, big_every=12)
        sampler = Sampler(cluster.process.pid, interval=1.0)
        load.warm_up()
        time.sleep(2)
        before = sampler.sample()
        self.assertEqual(len(before), 3, "moed and 2 workers: %s" % before)
        figures = {"before": before, "rounds": []}
        first = None
        for n in range(rounds):
            load.start()
            time.sleep(round_s)
            load.stop()
            stopped = time.time()
            load.drain()  # the steps whose callers gave up, which the workers finish
            drained = time.time()
            after = self.settled(sampler, before, retain)
            figures["rounds"].append({"after": after, "calls": load.calls,
                                      "drain_s": round(drained - stopped, 1),
                                      "settle_s": round(time.time() - drained, 1),
                                      "errors": dict(load.errors),
                                      "shm_kills": load.shm_kills})
            print("round %d: %s" % (n + 1, "  ".join(
                "%s anon %d -> %d MiB, shm %d MiB, fds %d -> %d" % (
                    k, rss(before, k, "RssAnon") // MIB, rss(after, k, "RssAnon") // MIB,
                    rss(after, k, "RssShmem") // MIB, before[k]["fds"], after[k]["fds"])
                for k in before if after.get(k))), flush=True)
            for key in before:
                what = "round %d, %s" % (n + 1, key)
                self.assertIsNotNone(after.get(key), what + ": gone")
                if key != "moed":
                    self.assertEqual(after[key]["pid"], before[key]["pid"],
                                     what + ": the worker was restarted")
                self.assertLessEqual(
                    rss(after, key, "RssAnon"), rss(before, key, "RssAnon") + retain + SLACK,
                    "%s: anonymous RSS %d MiB, before the load %d MiB (bound: + %d MiB "
                    "retained + %d MiB)" % (what, rss(after, key, "RssAnon") // MIB,
                                            rss(before, key, "RssAnon") // MIB, retain // MIB,
                                            SLACK // MIB))
                self.assertLessEqual(rss(after, key, "RssShmem"), RELAY_MAX + SLACK,
                                     what + ": shared RSS")
                self.assertLessEqual(after[key]["fds"], before[key]["fds"] + FD_SLACK,
                                     what + ": descriptors")
                if first is not None:  # shared RSS: the relay's buffers, bounded above
                    self.assertLessEqual(rss(after, key, "RssAnon"),
                                         rss(first, key, "RssAnon") + ROUND_SLACK,
                                         what + ": anonymous RSS grew since round 1")
            first = first or after
        sampler.stop()
        load.close()
        figures["seconds"] = round(time.time() - self.started, 1)
        print(json.dumps({"memory_soak": figures, "calls": load.calls}))


if __name__ == "__main__":
    MOED, WORKER, argv = binaries_from_argv(sys.argv)
    unittest.main(argv=argv)
