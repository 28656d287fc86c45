"""remote_moe: a moed layer as a JAX function with a custom VJP (same contract as RemoteMoE).

UNTESTED: JAX is not installed on the build machine, and no test in this repository runs
this file. It is written against the documented jax.custom_vjp / jax.pure_callback /
jax.experimental.io_callback API (JAX >= 0.4.26); treat it as a starting point and check it
against RemoteMoE (torch) before relying on it.

    from moe_client import Client
    from moe_client.jax_layer import remote_moe
    moe = remote_moe(Client("localhost:50051"), "ffn0")        # layer created beforehand
    def loss_fn(x):
        out, aux, z = moe(x)                                    # x [T, H] float32 or bfloat16
        return jnp.mean(out ** 2) + aux + z
    loss, d_x = jax.value_and_grad(loss_fn)(x)                  # Forward + Backward on moed
    client.apply_optimizer("ffn0", adamw={"lr": 1e-3})          # weights live on the server

Contract (as RemoteMoE):
- Primal evaluation (no differentiation) calls Forward with keep_for_backward=False.
- Under jax.grad / jax.vjp the forward rule calls Forward(keep_for_backward=True); the step id
  travels as a residual (two uint32 words, so it works without jax_enable_x64) and the
  backward rule calls Backward with d_out and the cotangents of aux and z as d_aux / d_z_loss.
- The server's parameter gradients accumulate on the server; apply them with
  Client.apply_optimizer.
- Steps whose backward never runs (jax.vjp without calling the vjp function) stay on the
  server until `release_pending()` (or the layer's saved-step budget is hit): JAX gives no hook
  for a dropped residual.
- The callbacks are side-effecting host calls: do not jit-compile a function that vmaps over
  this layer, and expect one RPC per call, not per traced use.
- jit: ordered io_callback is allowed under jax.jit. pmap / vmap (and shard_map): JAX refuses
  ordered effects there with its own error; this file adds no check of its own. Data parallel:
  one process per rank, each calling Client.apply_optimizer(..., num_ranks=N, rank=r, step=s,
  run_id=...) (client/python/README.md "Training with several ranks").
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from moe_client import codec


def remote_moe(client, layer):
    """Returns f(x) -> (out, aux_loss, z_loss) for the existing server layer `layer`."""
    pending = set()  # step ids kept by a forward rule and not yet used by a backward
    lock = threading.Lock()

    def _wire(x):
        x = np.asarray(x)
        if x.dtype == jnp.bfloat16:  # ml_dtypes bfloat16: reinterpret the 16-bit patterns
            bits = x.view(np.uint16)
            return codec.bf16_bits_to_fp32(bits), "BF16"
        return x.astype(np.float32, copy=False), "FP32"

    def _forward_host(x, keep):
        values, datatype = _wire(x)
        r = client.forward(layer, values, keep_for_backward=bool(keep), datatype=datatype)
        out = np.asarray(r.out, dtype=np.float32).astype(x.dtype)
        if keep:
            with lock:
                pending.add(r.step_id)
        step = np.array([r.step_id >> 32, r.step_id & 0xFFFFFFFF], dtype=np.uint32)
        return out, np.float32(r.aux_loss), np.float32(r.z_loss), step

    def _backward_host(step, d_out, d_aux, d_z):
        step_id = (int(step[0]) << 32) | int(step[1])
        with lock:
            pending.discard(step_id)
        values, datatype = _wire(d_out)
        d_x = client.backward(layer, step_id, values, d_aux=float(d_aux), d_z_loss=float(d_z),
                              datatype=datatype)
        return np.asarray(d_x, dtype=np.float32).astype(np.asarray(d_out).dtype)

    def _shapes(x):
        return (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.float32),
                jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32))

    @jax.custom_vjp
    def f(x):
        out, aux, z, _ = io_callback(lambda v: _forward_host(v, False), _shapes(x), x,
                                     ordered=True)
        return out, aux, z

    def f_fwd(x):
        out, aux, z, step = io_callback(lambda v: _forward_host(v, True), _shapes(x), x,
                                        ordered=True)
        return (out, aux, z), step

    def f_bwd(step, cotangents):
        # d_out has x's shape and dtype (out = x's shape and dtype), and so has d_x.
        d_out, d_aux, d_z = cotangents
        d_x = io_callback(_backward_host, jax.ShapeDtypeStruct(d_out.shape, d_out.dtype), step,
                          d_out, d_aux, d_z, ordered=True)
        return (d_x,)

    f.defvjp(f_fwd, f_bwd)

    def release_pending():
        """ReleaseStep for every step kept by a forward rule whose backward never ran."""
        with lock:
            ids = list(pending)
            pending.clear()
        for step_id in ids:
            client.release_step(layer, step_id)
        return len(ids)

    f.release_pending = release_pending
    return f
