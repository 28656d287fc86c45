"""Steps per second of a whole data-parallel job (train_dp.py under torchrun) for N ranks.

    deploy/local/cluster.sh start --workers=2 --device=cpu --port=50051
    /usr/bin/python3 client/python/examples/bench_dp.py --server=localhost:50051 \\
        --ranks=1,2,4,8 --steps=40 --tokens=256
    (PYTHONPATH as in client/python/README.md)

For each N it launches `python3 -m torch.distributed.run --standalone --nproc_per_node=N
train_dp.py` (gloo, CPU) and reads rank 0's JSON line: the steps after the first, timed by
rank 0 (a step ends when the shared layer's data-parallel ApplyOptimizer answered, so every
rank finished it). --tokens is the global batch of a step (each rank trains on tokens/N:
strong scaling); --per_rank makes it each rank's batch (weak scaling: the job's tokens per
step grow with N). Prints one JSON object: {"steps", "per_rank", "results": [{"ranks": N,
"steps_per_s", "tokens_per_s", "rank0_step_ms" (rank 0's mean time in moe.step(): the wait
for the other ranks plus the optimizer step)}, ...]}.
"""

import argparse
import json
import os
import subprocess
import sys

EXAMPLES = os.path.dirname(os.path.abspath(__file__))
# --redirects/--tee: Debian's PyTorch 1.13 on Python 3.11 crashes on their default 0
# (client/python/README.md, "Training with several ranks").
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--redirects=9:1",
            "--tee=9:1"]


def run(server, ranks, steps, tokens, timeout):
    """Rank 0's JSON line of one train_dp.py job with `ranks` processes."""
    command = TORCHRUN + ["--nproc_per_node=%d" % ranks, os.path.join(EXAMPLES, "train_dp.py"),
                          "--server=" + server, "--layer=bench-dp-%d" % ranks,
                          "--steps=%d" % steps, "--tokens=%d" % tokens]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout)
    output = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        raise RuntimeError("train_dp.py with %d ranks failed:\n%s" % (ranks, output))
    lines = [line for line in output.splitlines() if line.startswith('{"ranks"')]
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.environ.get("MOED_SERVER", "localhost:50051"))
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--per_rank", action="store_true",
                        help="--tokens per rank (weak scaling) instead of per job")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    results = []
    for ranks in [int(n) for n in args.ranks.split(",")]:
        tokens = args.tokens * ranks if args.per_rank else args.tokens
        r = run(args.server, ranks, args.steps, tokens, args.timeout)
        results.append({"ranks": ranks, "global_tokens": tokens, "steps_per_s": r["steps_per_s"],
                        "tokens_per_s": round(r["steps_per_s"] * tokens, 1),
                        "rank0_step_ms": r["rank0_step_ms"]})
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"steps": args.steps, "per_rank": args.per_rank, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
