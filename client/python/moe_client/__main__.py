"""python3 -m moe_client health|status|smoke [--server=HOST:PORT]: a quick check from Python.

    python3 -m moe_client health --server=localhost:50051     # SERVING, exit 0 (else 1)
    python3 -m moe_client status                              # workers and layers
    python3 -m moe_client smoke                               # one training step, PASS/FAIL

--server defaults to $MOED_SERVER, else localhost:50051; a token comes from $MOED_TOKEN and TLS
roots from $MOED_TLS_CA_FILE (as Client). Exit status: 0 ok, 1 failed, 2 usage.
"""

import argparse
import sys
import uuid

from moe_client.client import Client
from moe_client.errors import MoeError


def health(client, args):
    state = client.health(timeout=args.timeout, wait_for_ready=args.wait)
    print(state)
    return 0 if state == "SERVING" else 1


def status(client, args):
    s = client.get_status(timeout=args.timeout)
    print("serving: %s  generation: %d  workers: %d" % (s.serving, s.generation, s.world_size))
    for w in s.workers:
        print("  rank %d  %s  %s  %s" % (w.rank, "alive" if w.alive else "DEAD", w.device,
                                         w.address))
    for layer in s.layers:
        print("  layer %s  saved steps: %d" % (layer.name, layer.saved_steps))
    if s.message:
        print(s.message)
    return 0 if s.serving else 1


def smoke(client, args):
    """One training step on a throwaway layer: forward (twice: same answer), backward, gradients.

    Checks the service end to end from Python (shapes, determinism, finite values, a step used
    once); moectl smoke checks the numbers against the engine run locally.
    """
    import numpy as np  # only here: health/status need no numpy

    name = "moe-client-smoke-" + uuid.uuid4().hex[:8]
    checks = []

    def check(what, ok):
        checks.append((what, bool(ok)))
        print("  %-44s %s" % (what, "ok" if ok else "FAILED"))

    client.create_layer(name, hidden=16, ffn=32, num_experts=4, top_k=2, init_seed=1,
                        timeout=args.timeout)
    try:
        x = np.random.default_rng(0).standard_normal((12, 16)).astype(np.float32)
        first = client.forward(name, x, timeout=args.timeout)
        kept = client.forward(name, x, keep_for_backward=True, timeout=args.timeout)
        check("forward: out [12, 16]", first.out.shape == (12, 16))
        check("forward: finite", np.isfinite(first.out).all())
        check("forward: same answer twice", np.array_equal(first.out, kept.out))
        check("forward: 12 x top_k routed", sum(first.tokens_per_expert) == 24)
        d_x = client.backward(name, kept.step_id, np.ones_like(x), timeout=args.timeout)
        check("backward: d_x [12, 16], finite", d_x.shape == (12, 16) and np.isfinite(d_x).all())
        grads = client.get_gradients(name, timeout=args.timeout)
        check("gradients: gate, wi, wo, some non-zero",
              sorted(grads) == ["gate", "wi", "wo"] and np.abs(grads["wo"]).max() > 0)
        try:
            client.backward(name, kept.step_id, np.ones_like(x), timeout=args.timeout)
            check("backward: a step is used once", False)
        except MoeError:
            check("backward: a step is used once", True)
    finally:
        client.delete_layer(name, timeout=args.timeout)
    passed = sum(ok for _, ok in checks)
    print("smoke: %s (%d/%d checks)" % ("PASS" if passed == len(checks) else "FAIL", passed,
                                         len(checks)))
    return 0 if passed == len(checks) else 1


COMMANDS = {"health": health, "status": status, "smoke": smoke}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m moe_client",
                                     description="Quick checks of a moed server from Python.")
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--server", default=None,
                        help="HOST:PORT (default $MOED_SERVER, else localhost:50051)")
    parser.add_argument("--timeout", type=float, default=60.0, help="per call, seconds")
    parser.add_argument("--wait", action="store_true",
                        help="health: wait for the server to come up (within --timeout)")
    args = parser.parse_args(argv)  # usage errors exit 2
    client = Client(args.server, timeout=args.timeout)
    try:
        return COMMANDS[args.command](client, args)
    except MoeError as e:
        print("%s: %s" % (args.command, e), file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
