"""RemoteMoE: a moed layer as a torch.nn.Module, forward and backward.

    from moe_client import Client, RemoteMoE
    moe = RemoteMoE(Client("localhost:50051"), "ffn0", hidden=512, ffn=1024, num_experts=8,
                    top_k=2, aux_loss_coeff=1e-2)
    out, aux = moe(x)                  # x [..., 512]; out has x's shape and dtype
    (loss + aux).backward()            # Backward on the server returns d_x
    moe.step(adamw={"lr": 1e-3})       # ApplyOptimizer: the layer's weights live on the server

Contract:
- forward(x) returns (out, aux_loss); forward(x, return_z_loss=True) returns
  (out, aux_loss, z_loss). All three come from one autograd.Function, so gradients reaching
  aux_loss and z_loss are sent to the server as d_aux and d_z_loss (0 when the loss does not
  use them). `moe.last_z_loss` / `moe.last_tokens_per_expert` keep the latest values as plain
  numbers for logging (not tensors: holding an output would keep the step's graph, and so the
  server-side step, alive).
- With grad enabled, Forward runs with keep_for_backward=True and backward() calls Backward
  with that step id. Under torch.no_grad() (inference) nothing is kept.
- A kept step that never gets its backward (eval with grad on, an exception between forward
  and backward, a discarded output) is released with ReleaseStep as soon as its autograd graph
  is freed (a weakref.finalize on the step, which only the graph references).
- backward through the same graph more than once (retain_graph=True, gradcheck) works: the
  server supports one Backward per step, so later backwards re-run Forward on the saved input
  (the server is deterministic, so the answer is identical) and use the new step.
- The layer's own parameters (gate, wi, wo, biases) and their gradients stay on the server:
  the module has no local parameters. step() / zero_grad() map to ApplyOptimizer /
  ZeroGradients; a parent model's zero_grad() does not reach the server (ApplyOptimizer zeroes
  the server's gradients itself).
- The wire carries FP32 or BF16: fp64 inputs are sent as fp32 (the server computes in fp32)
  and the results cast back; bf16 inputs travel as bf16. Tensors on a GPU are copied to the
  host for the wire and the results copied back to x's device.
"""

import logging
import weakref

import numpy as np
import torch

from moe_client import codec
from moe_client.client import Client
from moe_client.errors import AlreadyExists
from moe_client.shared_memory import ShmStepper

_log = logging.getLogger("moe_client")

# How long a background ReleaseStep may take before it is abandoned (the server also frees
# steps of a deleted layer, and a lost release only costs server memory until then).
_RELEASE_TIMEOUT_S = 5.0


def _release(client, layer, step_id, state):
    """Finalizer of a kept step: ReleaseStep unless a Backward consumed it."""
    if state["consumed"]:
        return
    state["consumed"] = True
    try:
        client.release_step(layer, step_id, timeout=_RELEASE_TIMEOUT_S)
    except Exception as e:  # a finalizer must not raise; say so instead
        _log.warning("moe_client: ReleaseStep(%s, %d) failed: %s", layer, step_id, e)


class _Step:
    """A step kept on the server for backward. Only the autograd graph references it."""

    def __init__(self, client, layer, step_id):
        self.step_id = step_id
        self.state = {"consumed": False}
        finalizer = weakref.finalize(self, _release, client, layer, step_id, self.state)
        finalizer.atexit = False  # no RPCs while the interpreter shuts down

    def consume(self):
        """True the first time (the step may be used by a Backward), False afterwards."""
        if self.state["consumed"]:
            return False
        self.state["consumed"] = True
        return True


def _wire_datatype(dtype):
    return "BF16" if dtype == torch.bfloat16 else "FP32"


def _loss_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_wire(t, datatype):
    """t as a C-contiguous host numpy array of the wire type (BF16 as uint16 bit patterns)."""
    t = t.detach().to(device="cpu", dtype=torch.bfloat16 if datatype == "BF16"
                      else torch.float32).contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if datatype == "BF16" else t.numpy()


def _from_wire(array, datatype):
    if datatype == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _run_forward(module, x2d, keep):
    """Forward RPC; returns (out tensor in x's dtype, aux, z, step_id)."""
    datatype = _wire_datatype(x2d.dtype)
    if module._shm is not None:  # x and out through shared memory
        r, out = module._shm.forward(module.name, _to_wire(x2d, datatype), datatype, keep)
        out = _from_wire(out, datatype)
    else:
        r = module.client.forward(module.name, x2d, keep_for_backward=keep, datatype=datatype,
                                  raw=True)
        out = codec.to_torch(r.out)
    out = out.to(device=x2d.device, dtype=x2d.dtype)
    module.last_tokens_per_expert = r.tokens_per_expert
    return out, r.aux_loss, r.z_loss, r.step_id


class _RemoteMoEFunction(torch.autograd.Function):
    """(x2d, anchor) -> (out, aux_loss, z_loss). `anchor` is a scalar that requires grad so
    that backward runs even when x does not require grad (the server's weights still need
    their gradients)."""

    @staticmethod
    def forward(ctx, x2d, anchor, module):
        out, aux, z, step_id = _run_forward(module, x2d, keep=True)
        ctx.module = module
        ctx.step = _Step(module.client, module.name, step_id)
        ctx.save_for_backward(x2d)
        loss_dtype = _loss_dtype(x2d.dtype)
        return (out, torch.tensor(aux, dtype=loss_dtype, device=x2d.device),
                torch.tensor(z, dtype=loss_dtype, device=x2d.device))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_aux, d_z):
        module = ctx.module
        (x2d,) = ctx.saved_tensors
        step = ctx.step
        if not step.consume():  # a second backward through this graph: run Forward again
            _, _, _, step_id = _run_forward(module, x2d, keep=True)
            step = _Step(module.client, module.name, step_id)
            step.consume()
        datatype = _wire_datatype(x2d.dtype)
        d_out = d_out.to(x2d.dtype if x2d.dtype == torch.bfloat16 else torch.float32)
        if module._shm is not None:
            d_x = _from_wire(module._shm.backward(module.name, step.step_id,
                                                  _to_wire(d_out, datatype), datatype,
                                                  float(d_aux), float(d_z)), datatype)
        else:
            d_x = codec.to_torch(module.client.backward(
                module.name, step.step_id, d_out, d_aux=float(d_aux), d_z_loss=float(d_z),
                datatype=datatype, raw=True))
        return d_x.to(device=x2d.device, dtype=x2d.dtype), None, None


class RemoteMoE(torch.nn.Module):
    """A moed MoE layer used like a local module (see the module docstring)."""

    def __init__(self, client, name, create="if_missing", config=None, optimizer=None,
                 shared_memory=False, **config_fields):
        """client: a Client or an address. name: the layer's name on the server.

        create: True creates the layer (ALREADY_EXISTS if it exists), False attaches to an
        existing one (NOT_FOUND if absent), "if_missing" attaches when it exists and creates
        it otherwise; an existing layer's config must match the fields given (ValueError).
        config / config_fields: moe_pb2.LayerConfig or its fields (hidden, ffn, num_experts,
        top_k, score_function="softmax", activation="silu", aux_loss_coeff, ...).
        optimizer: default for step(), e.g. {"adamw": {"lr": 1e-3}}.
        shared_memory: pass x, out, d_out and d_x through a POSIX shared-memory region
        (moe_client.shared_memory) instead of the socket when the server can use it: moed on
        this host with --allow_client_shm. Otherwise (another host, the flag off) the module
        uses gRPC as usual; `module.uses_shared_memory` says which.
        """
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        self.name = name
        self.optimizer = optimizer
        self.last_z_loss = None
        self.last_tokens_per_expert = None
        if config is None and config_fields:
            from moe_client.client import layer_config
            config = layer_config(**config_fields)
        if create is True or (create == "if_missing" and config is not None):
            try:
                self.info = self.client.create_layer(name, config)
            except AlreadyExists:
                if create is True:
                    raise
                self.info = self._attach(config)
        else:
            self.info = self._attach(config)
        self.hidden = self.info.config.hidden
        self._shm = ShmStepper.create(self.client) if shared_memory else None
        if shared_memory and self._shm is None:
            _log.info("moe_client: %s: the server cannot use this host's shared memory; "
                      "using gRPC", self.name)

    @property
    def uses_shared_memory(self):
        return self._shm is not None

    def _attach(self, config):
        info = self.client.get_layer(self.name)
        if config is not None:
            for field, value in config.ListFields():
                have = getattr(info.config, field.name)
                if have != value:
                    raise ValueError("layer %r exists with %s=%r, asked for %r" %
                                     (self.name, field.name, have, value))
        return info

    def forward(self, x, return_z_loss=False):
        # A wrong last dimension goes to the server as is: it answers INVALID_ARGUMENT, raised
        # here as moe_client.InvalidArgument with the gRPC code.
        shape = x.shape
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x
        if torch.is_grad_enabled():
            anchor = torch.zeros((), requires_grad=True)
            out, aux, z = _RemoteMoEFunction.apply(x2d, anchor, self)
        else:
            out, aux, z, _ = _run_forward(self, x2d, keep=False)
            loss_dtype = _loss_dtype(x2d.dtype)
            aux = torch.tensor(aux, dtype=loss_dtype, device=x2d.device)
            z = torch.tensor(z, dtype=loss_dtype, device=x2d.device)
        out = out.reshape(shape)
        self.last_z_loss = float(z)
        return (out, aux, z) if return_z_loss else (out, aux)

    def step(self, sgd=None, adamw=None):
        """ApplyOptimizer with the given optimizer, or the constructor's default; zeroes the
        server's gradients afterwards."""
        if sgd is None and adamw is None:
            if not self.optimizer:
                raise TypeError("step() needs sgd= or adamw= (or optimizer= at construction)")
            sgd, adamw = self.optimizer.get("sgd"), self.optimizer.get("adamw")
        self.client.apply_optimizer(self.name, sgd=sgd, adamw=adamw)

    def zero_grad(self, set_to_none=True):
        """ZeroGradients on the server (and the usual zero_grad of local submodules)."""
        super().zero_grad(set_to_none=set_to_none)
        self.client.zero_gradients(self.name)

    def weights(self):
        """{name: fp32 numpy array} of the layer's parameters (GetWeights)."""
        return self.client.get_weights(self.name)

    def gradients(self):
        """{name: fp32 numpy array} of the accumulated gradients (GetGradients)."""
        return self.client.get_gradients(self.name)

    def extra_repr(self):
        c = self.info.config
        return "name=%r, hidden=%d, ffn=%d, experts=%d, top_k=%d, ep_ranks=%d, server=%s" % (
            self.name, c.hidden, c.ffn, c.num_experts, c.top_k, self.info.ep_ranks,
            self.client.address)
