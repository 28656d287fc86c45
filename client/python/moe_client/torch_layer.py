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
- The layer's own parameters (gate, wi, wo, biases) and their gradients stay on the server.
  step() / zero_grad() map to ApplyOptimizer / ZeroGradients. The module's one local
  parameter, `grad_marker` (a scalar used for nothing else), tells when a parent's zero_grad()
  or a torch optimizer's zero_grad() ran: every backward gives it a gradient of 2**-64 (too
  small to matter to gradient clipping or an optimizer), and when the next backward or step()
  finds that gradient reset (None or 0) while the server holds gradients of this process'
  backwards since its last step, it sends ZeroGradients first. So a parent's zero_grad()
  reaches the server, lazily. With several data-parallel ranks that is an error instead
  (RuntimeError): the server's gradients are shared by every rank.
- state_dict() / load_state_dict() carry the layer's weights (GetWeights / SetWeights, in
  chunks), under the module's prefix and the server's parameter names ("ffn.gate",
  "ffn.wi", ...), as fp32 CPU tensors; the optimizer state stays on the server. With
  checkpoint_state="NAME" they carry a reference instead: state_dict() saves the layer
  (weights and optimizer state) as server checkpoint NAME inside moed's --checkpoint_root and
  holds the string under "<prefix>checkpoint"; load_state_dict() loads that checkpoint.
- torch.autocast: an fp32/fp16/bf16 x is cast to autocast's dtype first, so under
  autocast(dtype=torch.bfloat16) the wire carries BF16 and out is bf16, as autocast expects
  of a linear layer (fp16: sent as FP32, out fp16). aux_loss / z_loss stay fp32.
- torch.compile (PyTorch >= 2.1): forward is wrapped in torch.compiler.disable, so the layer
  is meant to be one explicit graph break that runs eagerly while the model's other parts
  compile. Untested: Debian's PyTorch 1.13 has no torch.compile (the wrapper is then a no-op),
  and examples/compile_check.py, which checks it, has not been run on a PyTorch 2 machine.
- The wire carries FP32 or BF16: fp64 inputs are sent as fp32 (the server computes in fp32)
  and the results cast back; bf16 inputs travel as bf16. Tensors on a GPU go to the workers
  by CUDA IPC where the server can open this process's GPU memory (cuda_ipc=True, the
  default; moe_client.cuda_ipc), else they are copied to the host for the wire and the
  results copied back to x's device.
- Conditional steps (conditional_steps=True, the default): a plain step() sends the layer's
  optimizer step its gradients were computed on (ApplyOptimizer's expected_optimizer_step:
  LayerInfo.optimizer_step when the module attached, then each step's answer). If the layer
  moved on meanwhile (another process stepped it, a restart rolled it back to its durable
  step) or a re-formation dropped the gradients, step() raises moe_client.Aborted and nothing
  was applied; the module has then re-read the layer's step and zeroed its gradients on the
  server, so running the batch again and calling step() again trains on whole gradients.
  Data-parallel steps are not conditional (the server's step numbers order them).
- Data parallel: under torch.distributed with a world of N > 1 processes (torchrun), step()
  is the data-parallel ApplyOptimizer of step number 0, 1, 2, ... (counted by the module) for
  N ranks: the server steps once, on the mean of the ranks' gradients, when every rank called
  (README "Training with several ranks").
"""

import logging
import weakref

import torch

from moe_client import codec
from moe_client.client import Client
from moe_client.data_parallel import DataParallelRanks
from moe_client.cuda_ipc import CudaStepper
from moe_client.errors import AlreadyExists, Aborted, FailedPrecondition
from moe_client.shared_memory import ShmStepper

_log = logging.getLogger("moe_client")

# How long a background ReleaseStep may take before it is abandoned (the server also frees
# steps of a deleted layer, and a lost release only costs server memory until then).
_RELEASE_TIMEOUT_S = 5.0

# The gradient each backward gives grad_marker: non-zero, so a reset is seen, and negligible
# in a gradient norm (clipping) or an fp16 GradScaler's unscaling.
_MARKER_GRAD = 2.0 ** -64


def _eager_under_compile(fn):
    """torch.compile (PyTorch >= 2.1) runs `fn` eagerly, a graph break: its RPCs cannot be
    traced. PyTorch 1.x has no torch.compile: `fn` as is."""
    compiler = getattr(torch, "compiler", None)
    return compiler.disable(fn) if hasattr(compiler, "disable") else fn


def _autocast_dtype(device_type):
    """The dtype torch.autocast casts to on `device_type` now, or None when it is off."""
    if hasattr(torch, "get_autocast_dtype"):  # PyTorch >= 2.4
        try:
            enabled = torch.is_autocast_enabled(device_type)
        except (TypeError, RuntimeError):
            return None
        return torch.get_autocast_dtype(device_type) if enabled else None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    return None


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


def _run_forward(module, x2d, keep):
    """Forward RPC; returns (out tensor in x's dtype, aux, z, step_id, path): path is the
    CudaStepper the step went through (its Backward goes the same way), or None."""
    datatype = _wire_datatype(x2d.dtype)
    cuda = module._cuda_stepper(x2d)
    if cuda is not None:  # x and out stay on the GPU: CUDA IPC
        try:
            r, out = cuda.forward(module.name, x2d, datatype, keep)
        except FailedPrecondition as e:
            if cuda.steps:
                raise
            # The workers could not open this process's GPU memory (another host, another GPU
            # set): said once, then shared memory or gRPC for every step of this device.
            module._cuda[x2d.device.index] = None
            cuda.close()
            _log.warning("moe_client: %s: CUDA IPC refused by the workers (%s); tensors on %s "
                         "go through %s from now on", module.name, e.message, x2d.device,
                         "shared memory" if module._shm is not None else "gRPC")
            return _run_forward(module, x2d, keep)
        module.last_tokens_per_expert = r.tokens_per_expert
        module.last_z_loss = r.z_loss
        return out.to(dtype=x2d.dtype), r.aux_loss, r.z_loss, r.step_id, cuda
    if module._shm is not None:  # x and out through shared memory, copied by torch
        r, out = module._shm.forward(module.name, x2d, datatype, keep)
    else:
        r = module.client.forward(module.name, x2d, keep_for_backward=keep, datatype=datatype,
                                  raw=True)
        out = codec.to_torch(r.out)
    out = out.to(device=x2d.device, dtype=x2d.dtype)
    module.last_tokens_per_expert = r.tokens_per_expert
    module.last_z_loss = r.z_loss
    return out, r.aux_loss, r.z_loss, r.step_id, None


class _RemoteMoEFunction(torch.autograd.Function):
    """(x2d, anchor) -> (out, aux_loss, z_loss). `anchor` is the module's grad_marker, a
    scalar that requires grad: backward runs even when x does not require grad (the server's
    weights still need their gradients), and its gradient shows a later zero_grad()."""

    @staticmethod
    def forward(ctx, x2d, anchor, module):
        out, aux, z, step_id, ctx.cuda = _run_forward(module, x2d, keep=True)
        ctx.module = module
        ctx.anchor = (anchor.dtype, anchor.device)
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
        module._zero_server_if_reset()
        step, cuda = ctx.step, ctx.cuda
        if not step.consume():  # a second backward through this graph: run Forward again
            _, _, _, step_id, cuda = _run_forward(module, x2d, keep=True)
            step = _Step(module.client, module.name, step_id)
            step.consume()
        datatype = _wire_datatype(x2d.dtype)
        # Both scalars in one device-to-host copy (each float() of a CUDA tensor is a wait).
        d_aux, d_z = torch.stack([d_aux.detach().reshape(()).to(torch.float64),
                                  d_z.detach().reshape(()).to(torch.float64)]).tolist()
        if cuda is not None:  # the step's forward went by CUDA IPC: d_out and d_x too
            d_x = cuda.backward(module.name, step.step_id, d_out, datatype, d_aux, d_z)
            module._server_has_grads = True
            d_anchor = torch.full((), _MARKER_GRAD, dtype=ctx.anchor[0], device=ctx.anchor[1])
            return d_x.to(dtype=x2d.dtype), d_anchor, None
        d_out = d_out.to(x2d.dtype if x2d.dtype == torch.bfloat16 else torch.float32)
        if module._shm is not None:
            d_x = module._shm.backward(module.name, step.step_id, d_out, datatype, d_aux, d_z)
        else:
            d_x = codec.to_torch(module.client.backward(
                module.name, step.step_id, d_out, d_aux=float(d_aux), d_z_loss=float(d_z),
                datatype=datatype, raw=True))
        module._server_has_grads = True
        d_anchor = torch.full((), _MARKER_GRAD, dtype=ctx.anchor[0], device=ctx.anchor[1])
        return d_x.to(device=x2d.device, dtype=x2d.dtype), d_anchor, None


class RemoteMoE(torch.nn.Module):
    """A moed MoE layer used like a local module (see the module docstring)."""

    def __init__(self, client, name, create="if_missing", config=None, optimizer=None,
                 shared_memory=False, data_parallel="auto", checkpoint_state=None,
                 conditional_steps=True, cuda_ipc=True, **config_fields):
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
        cuda_ipc: CUDA tensors go to the workers in place, by CUDA IPC (moe_client.cuda_ipc:
        one region of GPU memory per device, registered once; a device-to-device copy in and
        out per step, no host copy) when the server can: moed on this host with
        --allow_client_shm and CUDA workers. Otherwise (flag off, CPU workers, another host,
        a handle the workers cannot open) one log line says so at the first CUDA step and
        CUDA tensors go through shared memory (shared_memory=True) or gRPC;
        `module.uses_cuda_ipc` says whether the last CUDA step used it.
        data_parallel: "auto" makes step() a data-parallel step when torch.distributed is
        initialised with more than one process; False never; True requires it.
        checkpoint_state: None, or a checkpoint name inside moed's --checkpoint_root that
        state_dict() saves to and load_state_dict() loads from (a reference in the state
        dict instead of the weights; includes the optimizer state).
        conditional_steps: step() applies only on the optimizer step its gradients were
        computed on, else raises Aborted (module docstring, "Conditional steps"); False sends
        unconditional steps.
        """
        super().__init__()
        self.client = client if isinstance(client, Client) else Client(client)
        self.name = name
        self.optimizer = optimizer
        self.data_parallel = data_parallel
        self.checkpoint_state = checkpoint_state
        self.last_z_loss = None
        self.last_tokens_per_expert = None
        self.grad_marker = torch.nn.Parameter(torch.zeros(()))
        self._server_has_grads = False  # this process' backwards since the last step / zero
        self._ranks = None  # DataParallelRanks, found at the first data-parallel step()
        self._shared_by_ranks = False  # a data-parallel step() ran: other ranks share the grads
        self._next_step = 0  # the data-parallel step number step() sends next
        self.conditional_steps = conditional_steps
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
        # The layer's optimizer step as this module last saw it (expected_optimizer_step).
        self._optimizer_step = self.info.optimizer_step
        self._shm = ShmStepper.create(self.client) if shared_memory else None
        self.cuda_ipc = cuda_ipc
        self._cuda = {}  # device index -> CudaStepper, or None where CUDA IPC is refused
        if shared_memory and self._shm is None:
            _log.info("moe_client: %s: the server cannot use this host's shared memory; "
                      "using gRPC", self.name)

    @property
    def uses_shared_memory(self):
        return self._shm is not None

    @property
    def uses_cuda_ipc(self):
        return any(stepper is not None and stepper.steps for stepper in self._cuda.values())

    def _cuda_stepper(self, x):
        """The CudaStepper for CUDA tensor x's device (made at its first step), or None: x on
        the CPU, cuda_ipc=False, or the server refused it (said once, in the log)."""
        if not self.cuda_ipc or not x.is_cuda:
            return None
        device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if device not in self._cuda:
            stepper = CudaStepper.create(self.client, device)
            if not isinstance(stepper, CudaStepper):
                _log.warning("moe_client: %s: the server cannot use this process's GPU memory "
                             "(%s); tensors on cuda:%d go through %s", self.name,
                             getattr(stepper, "message", stepper), device,
                             "shared memory" if self._shm is not None else "gRPC")
                stepper = None
            self._cuda[device] = stepper
        return self._cuda[device]

    def _attach(self, config):
        info = self.client.get_layer(self.name)
        if config is not None:
            for field, value in config.ListFields():
                have = getattr(info.config, field.name)
                if have != value:
                    raise ValueError("layer %r exists with %s=%r, asked for %r" %
                                     (self.name, field.name, have, value))
        return info

    @_eager_under_compile
    def forward(self, x, return_z_loss=False):
        # A wrong last dimension goes to the server as is: it answers INVALID_ARGUMENT, raised
        # here as moe_client.InvalidArgument with the gRPC code.
        cast = _autocast_dtype(x.device.type)
        if cast is not None and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = x.to(cast)
        shape = x.shape
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x
        if torch.is_grad_enabled():
            out, aux, z = _RemoteMoEFunction.apply(x2d, self.grad_marker, self)
        else:
            out, aux, z, _, _ = _run_forward(self, x2d, keep=False)
            loss_dtype = _loss_dtype(x2d.dtype)
            aux = torch.tensor(aux, dtype=loss_dtype, device=x2d.device)
            z = torch.tensor(z, dtype=loss_dtype, device=x2d.device)
        out = out.reshape(shape)
        return (out, aux, z) if return_z_loss else (out, aux)

    def step(self, sgd=None, adamw=None, step=None, num_ranks=None, rank=None, run_id=None,
             timeout=None):
        """ApplyOptimizer with the given optimizer, or the constructor's default; zeroes the
        server's gradients afterwards. Returns the server's ApplyOptimizerResponse.

        Data parallel (see __init__'s data_parallel): the step number is `step`, else the
        module's count of its data-parallel steps (0, 1, ...). num_ranks / rank / run_id
        given explicitly replace what torch.distributed says (num_ranks <= 1: a plain step).
        A data-parallel call waits for the other ranks: give a `timeout` (seconds) long
        enough for the slowest rank to arrive."""
        if sgd is None and adamw is None:
            if not self.optimizer:
                raise TypeError("step() needs sgd= or adamw= (or optimizer= at construction)")
            sgd, adamw = self.optimizer.get("sgd"), self.optimizer.get("adamw")
        self._zero_server_if_reset()
        ranks = self._data_parallel_ranks(num_ranks, rank, run_id)
        if ranks is None:
            answer = self._plain_step(sgd, adamw, timeout)
        else:
            number = self._next_step if step is None else step
            answer = self.client.apply_optimizer(
                self.name, sgd=sgd, adamw=adamw, timeout=timeout, num_ranks=ranks.num_ranks,
                rank=ranks.rank, step=number, run_id=ranks.run_id())
            self._next_step = number + 1
            self._shared_by_ranks = True
        self._server_has_grads = False
        self._optimizer_step = answer.optimizer_step
        return answer

    def _plain_step(self, sgd, adamw, timeout):
        """ApplyOptimizer, conditional on this module's optimizer step (conditional_steps)."""
        expected = self._optimizer_step if self.conditional_steps else None
        try:
            return self.client.apply_optimizer(self.name, sgd=sgd, adamw=adamw, timeout=timeout,
                                               expected_optimizer_step=expected)
        except Aborted:
            # Nothing was applied. Start the next batch from the layer as it is: its step,
            # and no gradients (what the server still holds was partly dropped or stale).
            self._optimizer_step = self.client.get_layer(self.name).optimizer_step
            self.client.zero_gradients(self.name)
            self._server_has_grads = False
            raise

    def _data_parallel_ranks(self, num_ranks, rank, run_id):
        if num_ranks is not None:
            if num_ranks <= 1:
                return None
            return DataParallelRanks(num_ranks, rank or 0, run_id or "")
        if self.data_parallel is False:
            return None
        if self._ranks is None:
            self._ranks = DataParallelRanks.from_torch_distributed()
            if self._ranks is None and self.data_parallel is True:
                raise RuntimeError("RemoteMoE(data_parallel=True): torch.distributed is not "
                                   "initialised with more than one process")
        return self._ranks

    def _zero_server_if_reset(self):
        """A zero_grad() of a parent module or optimizer since this process' last backward
        reset grad_marker's gradient: the server's gradients of those backwards go too."""
        if not self._server_has_grads:
            return
        grad = self.grad_marker.grad
        if grad is not None and bool(grad.detach().ne(0).any()):
            return
        if self._shared_by_ranks or (self.data_parallel is not False and
                                     DataParallelRanks.from_torch_distributed() is not None):
            raise RuntimeError(
                "RemoteMoE %r: zero_grad() ran between a backward and step() under data "
                "parallel training; the server's gradients are the sum over every rank and "
                "cannot be zeroed for this rank alone (call zero_grad() after step(), or "
                "moe.client.zero_gradients() on purpose)" % self.name)
        self.client.zero_gradients(self.name)
        self._server_has_grads = False

    def zero_grad(self, set_to_none=True):
        """ZeroGradients on the server (and the usual zero_grad of local submodules)."""
        super().zero_grad(set_to_none=set_to_none)
        self.client.zero_gradients(self.name)
        self._server_has_grads = False

    def weights(self):
        """{name: fp32 numpy array} of the layer's parameters (GetWeights)."""
        return self.client.get_weights(self.name)

    def gradients(self):
        """{name: fp32 numpy array} of the accumulated gradients (GetGradients)."""
        self._zero_server_if_reset()
        return self.client.get_gradients(self.name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # grad_marker is bookkeeping, not state: never saved.
        if self.checkpoint_state is not None:
            destination[prefix + "checkpoint"] = self.client.save_checkpoint(
                self.name, self.checkpoint_state)
            return
        for name, array in self.client.get_weights(self.name).items():
            destination[prefix + name] = torch.from_numpy(array)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        ours = {key[len(prefix):]: value for key, value in state_dict.items()
                if key.startswith(prefix) and "." not in key[len(prefix):]}
        ours.pop("grad_marker", None)  # tolerated, never used
        if "checkpoint" in ours:
            self.client.load_checkpoint(self.name, ours.pop("checkpoint"))
            unexpected_keys.extend(prefix + name for name in ours)
            return
        names = [p.name for p in self.info.parameters]
        tensors = {}
        for name in names:
            if name in ours:
                tensors[name] = ours.pop(name).detach().to("cpu", torch.float32).numpy()
            else:
                missing_keys.append(prefix + name)
        unexpected_keys.extend(prefix + name for name in ours)
        if tensors:  # one SetWeights: all of them or none
            self.client.set_weights(self.name, tensors)

    def extra_repr(self):
        c = self.info.config
        return "name=%r, hidden=%d, ffn=%d, experts=%d, top_k=%d, ep_ranks=%d, server=%s" % (
            self.name, c.hidden, c.ffn, c.num_experts, c.top_k, self.info.ep_ranks,
            self.client.address)
