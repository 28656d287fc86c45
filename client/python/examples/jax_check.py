"""Checks moe_client.jax_layer.remote_moe against the plain Client on a running cluster.

UNTESTED here (no JAX on the build machine): meant for a machine with JAX, e.g.
    PYTHONPATH=client/python:<stubs> python3 client/python/examples/jax_check.py --server=H:P
It creates a layer, computes out/aux/z and d_x once through JAX (jax.value_and_grad over the
custom_vjp) and once through Client.forward/backward with the same d_out, d_aux and d_z_loss,
and prints the largest differences (both paths run the same server computation, so they
must agree to the bit for fp32). Exit status 0 when they agree.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_client import Client, NotFound
from moe_client.jax_layer import remote_moe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="localhost:50051")
    args = parser.parse_args()
    client = Client(args.server)
    try:
        client.delete_layer("jax-check")
    except NotFound:
        pass
    client.create_layer("jax-check", hidden=32, ffn=64, num_experts=8, top_k=2,
                        aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    x = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    moe = remote_moe(client, "jax-check")

    def loss(v):
        out, aux, z = moe(v)
        return jnp.sum(out) + 3.0 * aux + 5.0 * z, (out, aux, z)

    (_, (out, aux, z)), d_x = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(x))
    ref = client.forward("jax-check", x, keep_for_backward=True)
    ref_dx = client.backward("jax-check", ref.step_id, np.ones_like(x), d_aux=3.0, d_z_loss=5.0)
    diffs = {"out": float(np.abs(np.asarray(out) - ref.out).max()),
             "aux": abs(float(aux) - ref.aux_loss), "z": abs(float(z) - ref.z_loss),
             "d_x": float(np.abs(np.asarray(d_x) - ref_dx).max())}
    print(diffs, "pending steps released:", moe.release_pending())
    client.delete_layer("jax-check")
    ok = diffs["out"] == 0 and diffs["d_x"] == 0 and diffs["aux"] < 1e-7 and diffs["z"] < 1e-7
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
