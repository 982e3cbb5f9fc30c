"""Memory for long sequences: MLPs run a tile of tokens at a time, and the activations
kept for the backward offloaded to host memory.

    tile_mlp(model, tile_tokens=None)      every decoder layer's MLP runs in tiles of
                                           tokens, forward and backward (recomputed)
    untile_mlp(model)                      undoes it
    TiledTokenwise.apply(module, tile_tokens, x, *params)
                                           the autograd function behind it, for any
                                           module that maps each token on its own
    offload_activations(min_bytes=...)     a context: the tensors autograd saves while
                                           it is active live in host memory until the
                                           backward needs them

Why tile the MLP. Under sequence parallelism with activation checkpointing, a rank's
largest tensors at long lengths are the MLP's intermediates: gate, up, their product,
each (tokens, intermediate), intermediate = 3.5 x hidden for Llama. A token's MLP output
depends on that token alone, so the MLP can run T tokens at a time: the forward keeps
only its input, the backward runs each tile again with grad and backpropagates it at
once (ALST's TiledMLP idea). The intermediate then never exceeds one tile, at the cost
of computing the MLP's forward once more.

Why offload. With activation checkpointing every layer keeps its input (tokens x hidden)
until the backward: layers x tokens x hidden bytes, which dominates at long lengths.
offload_activations() holds those checkpoints in host memory: on GPUs pinned memory, the
device-to-host copy on a side stream as they are saved, and in the backward the
host-to-device copy of the next one needed started as the current one is used, so that
copies overlap compute. On CPU devices the tensors move out of torch's allocator into
plain host buffers (the same memory), which only serves to measure what a GPU would
keep.
"""

from __future__ import annotations

import types
import weakref

import numpy as np
import torch
from torch.distributed.tensor import DTensor

# The attribute tile_mlp() sets on an MLP: its tokens per tile (and its forward is the tiled one).
TILE_ATTRIBUTE = "seqpar_tile_tokens"


# ----------------------------------------------------------------------------------
# Tiled MLP
# ----------------------------------------------------------------------------------


class TiledTokenwise(torch.autograd.Function):
    """module(x) for a module that maps each token on its own, tile_tokens tokens at a
    time, forward and backward; only x (and the parameters) are saved.

    x: (..., hidden); the tokens are its leading dims flattened: (n, hidden), tiled by
    rows. params: the module's parameters (in module.named_parameters() order), passed
    so that autograd hands their gradients back here, once per call: summed over the
    tiles in the backward, then accumulated by autograd as one gradient (DDP's and
    FSDP's hooks fire once per parameter, as without tiling). The module must be
    deterministic (no dropout): the backward recomputes it, under the forward's autocast.

    Memory: the forward holds x, the output and one tile's intermediates; the backward
    one tile's recomputed intermediates and their gradients, plus the gradient of x and
    the parameters' gradients (fp32 sums for fp16/bf16 parameters)."""

    @staticmethod
    def forward(ctx, module, tile_tokens: int, x, *params):
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)  # (n, hidden): a view when x is contiguous
        out = None
        for start in range(0, rows.shape[0], tile_tokens):
            tile_out = module.forward_untiled(rows[start : start + tile_tokens])  # (t, hidden_out)
            if out is None:
                out = tile_out.new_empty(rows.shape[0], tile_out.shape[-1])
            out[start : start + tile_out.shape[0]] = tile_out
            del tile_out  # before the next tile's intermediates
        if out is None:  # no tokens
            out = module.forward_untiled(rows)
        ctx.module, ctx.tile_tokens = module, tile_tokens
        device_type = x.device.type
        # The backward recomputes under the forward's autocast, as activation checkpointing does.
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.names = [name for name, _ in module.named_parameters()]
        ctx.save_for_backward(x, *params)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)
        grad_rows = grad_out.reshape(rows.shape[0], -1)
        needs_x = ctx.needs_input_grad[2]
        wanted = [index for index, needed in enumerate(ctx.needs_input_grad[3:]) if needed]
        grad_x = torch.empty_like(rows) if needs_x else None
        # Parameter gradients summed over the tiles in fp32 (one rounding for fp16/bf16); zeros_like
        # keeps a tensor-parallel parameter's DTensor placements, which its tiles' gradients have.
        sums = {index: torch.zeros_like(params[index], dtype=torch.float32) for index in wanted}
        device_type, autocast_enabled, autocast_dtype = ctx.autocast
        for start in range(0, rows.shape[0], ctx.tile_tokens):
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_enabled):
                tile = rows[start : start + ctx.tile_tokens].detach().requires_grad_(needs_x)
                leaves = {name: param.detach().requires_grad_(index in sums)
                          for index, (name, param) in enumerate(zip(ctx.names, params))}  # fmt: skip
                tile_out = torch.func.functional_call(ctx.module, leaves, (tile,), {"tiled": False})
                inputs = ([tile] if needs_x else []) + [leaves[ctx.names[index]] for index in wanted]
                grads = torch.autograd.grad(tile_out, inputs, grad_rows[start : start + tile.shape[0]])
            if needs_x:
                grad_x[start : start + tile.shape[0]] = grads[0]
                grads = grads[1:]
            for index, grad in zip(wanted, grads):
                sums[index] += grad
            del tile_out, grads  # before the next tile's recompute
        grad_params = [None] * len(params)
        for index, total in sums.items():
            grad_params[index] = total.to(params[index].dtype)
        return (None, None, None if grad_x is None else grad_x.view_as(x), *grad_params)


def _tiled_forward(module, x, tiled: bool = True):
    """The forward tile_mlp() gives a module: TiledTokenwise over its tokens."""
    if not tiled or not torch.is_tensor(x):
        return module.forward_untiled(x)
    params = [param for _, param in module.named_parameters()]
    return TiledTokenwise.apply(module, getattr(module, TILE_ATTRIBUTE), x, *params)


def decoder_mlps(model) -> list[torch.nn.Module]:
    """The MLP of every decoder layer: the `mlp` attribute of each module that has one
    and holds a self-attention (transformers' decoder layers: Llama, Mistral, Qwen,
    Gemma, Phi3, ...)."""
    return [
        module.mlp for module in model.modules()
        if isinstance(getattr(module, "mlp", None), torch.nn.Module) and hasattr(module, "self_attn")
    ]  # fmt: skip


def tile_mlp(model, tile_tokens: int | None = None) -> int:
    """Make every decoder layer's MLP run tile_tokens tokens at a time (TiledTokenwise),
    forward and backward; returns how many MLPs it changed.

    model: a transformers model (or any module whose decoder layers hold `mlp` and
        `self_attn`); each MLP must map every token on its own (dense MLPs: Llama's
        gate/up/down; not mixtures of experts, whose forward returns router logits or
        balances tokens across the batch: those raise).
    tile_tokens: tokens per tile; None: the model's hidden size (the intermediate of one
        tile is then intermediate x hidden elements, about a weight's size).
    Parameter names, state dicts and checkpoints are unchanged (the MLP's forward is
    replaced on the instance). Idempotent; a new tile_tokens replaces the old one."""
    if tile_tokens is None:
        config = getattr(model, "config", None)
        tile_tokens = getattr(getattr(config, "get_text_config", lambda: config)(), "hidden_size", None)
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(
            f"tile_mlp: tile_tokens must be a positive int (or None: the hidden size), got {tile_tokens!r}"
        )
    mlps = decoder_mlps(model)
    if not mlps:
        raise ValueError(f"tile_mlp: {type(model).__name__} has no decoder layer with an `mlp` and a `self_attn`")
    for mlp in mlps:
        name = type(mlp).__name__
        if hasattr(mlp, "experts") or "moe" in name.lower():
            raise ValueError(f"tile_mlp: {name} is a mixture of experts, which does not map each token on its own")
        if TILE_ATTRIBUTE not in vars(mlp):
            mlp.forward_untiled = mlp.forward
            mlp.forward = types.MethodType(_tiled_forward, mlp)
        setattr(mlp, TILE_ATTRIBUTE, tile_tokens)
    return len(mlps)


def untile_mlp(model) -> int:
    """Undo tile_mlp(model); returns how many MLPs it restored."""
    restored = 0
    for mlp in decoder_mlps(model):
        if TILE_ATTRIBUTE in vars(mlp):
            del mlp.forward, mlp.forward_untiled
            delattr(mlp, TILE_ATTRIBUTE)
            restored += 1
    return restored


# ----------------------------------------------------------------------------------
# Activation offload
# ----------------------------------------------------------------------------------


def _host_buffer(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty contiguous host tensor like `tensor`: pinned (from torch's caching host
    allocator) for a GPU tensor; for a CPU tensor a numpy buffer, outside torch's
    allocator (so that the allocator's counters show what a device would hold)."""
    if pin:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    flat = torch.from_numpy(np.empty(tensor.numel() * tensor.element_size(), dtype=np.uint8))
    return flat.view(tensor.dtype).view(tensor.shape)


class _Offloaded:
    """One saved tensor in host memory, and (on GPUs) its copy back once started."""

    __slots__ = ("host", "device", "stored", "fetched", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, stored):
        self.host, self.device, self.stored, self.fetched = host, device, stored, None


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A module's parameter (trained or frozen) or another leaf that requires grad."""
    return isinstance(tensor, torch.nn.Parameter) or (tensor.requires_grad and tensor.is_leaf)


class _OffloadedShard:
    """A DTensor saved for the backward: its local shard offloaded (an _Offloaded) and
    what rebuilds it."""

    __slots__ = ("local", "mesh", "placements", "shape", "stride")

    def __init__(self, local: _Offloaded, mesh, placements, shape, stride):
        self.local, self.mesh, self.placements, self.shape, self.stride = local, mesh, placements, shape, stride


class offload_activations(torch.autograd.graph.saved_tensors_hooks):
    """While active, every tensor autograd saves for the backward that is an activation
    (not a parameter, trained or frozen, or another leaf that requires grad, nor a view
    of one: the transposed weight a linear layer saves) of at least min_bytes is copied
    to host memory and freed on the device; the backward gets it back. A DTensor (inside
    a tensor-parallel layer) offloads its local shard, min_bytes counted on the shard.

    Meant around the forward of a model with activation checkpointing: what is saved
    then is each layer's input (the checkpoints, layers x tokens x hidden) and a few
    tensors outside the layers; the layers' recompute in the backward runs outside the
    context, so its activations stay on the device for the moment they are needed.

    On GPUs: host memory is pinned; the device-to-host copy runs on a side stream after
    the work that made the tensor (the tensor's device memory is released to the
    allocator at once, reused only after the copy: record_stream); in the backward,
    taking back a tensor starts the copy back of the one saved before it (the backward
    uses them in reverse order), so each copy overlaps the compute of a layer. A tensor
    saved twice (one input of several ops) is copied once.
    On CPU devices: the tensor's bytes move into a numpy buffer and come back as a view
    of it (no copy back)."""

    def __init__(self, min_bytes: int = 1 << 20):
        self.min_bytes = min_bytes
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._order: list[weakref.ref] = []  # offloaded tensors in the order saved
        self._by_key: dict[tuple, tuple] = {}  # a tensor saved twice: (the tensor, its copy)
        self.offloaded_bytes = 0  # bytes copied to the host since the context began
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._order, self._by_key, self.offloaded_bytes = [], {}, 0
        super().__enter__()
        return self

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, tensor: torch.Tensor):
        base = tensor._base  # a view's base (torch's view tracking): linear saves weight.t()
        if _is_parameter(tensor) or (base is not None and _is_parameter(base)):
            return tensor  # parameters (frozen ones too) and views of them stay where they are
        if isinstance(tensor, DTensor):  # a tensor-parallel layer's activation: its local shard goes
            with torch.no_grad():
                local = tensor.to_local()
            packed = self._pack(local)
            if packed is local:
                return tensor
            # The local shard comes back contiguous: so is the global stride it is rebuilt with.
            stride = torch.empty(tensor.shape, device="meta").stride()
            return _OffloadedShard(packed, tensor.device_mesh, tensor.placements, tensor.shape, stride)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes < self.min_bytes or tensor.layout != torch.strided:
            return tensor  # small tensors: kept as they are
        # The same tensor saved again (one input of several ops): its one copy. Keyed by
        # id, valid while that tensor lives (a freed tensor's id and memory are reused).
        key = (id(tensor), tensor._version)
        known = self._by_key.get(key)
        if known is not None and known[0]() is tensor and known[1]() is not None:
            return known[1]()
        on_gpu = tensor.device.type == "cuda"
        host = _host_buffer(tensor, pin=on_gpu)
        stored = None
        if on_gpu:
            side = self._side_stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
                stored = torch.cuda.Event()
                stored.record(side)
            tensor.record_stream(side)  # its memory is reused only after the copy
        else:
            host.copy_(tensor)
        offloaded = _Offloaded(host, tensor.device, stored)
        self._by_key[key] = (weakref.ref(tensor), weakref.ref(offloaded))
        self._order.append(weakref.ref(offloaded))
        self.offloaded_bytes += nbytes
        return offloaded

    def _fetch(self, offloaded: _Offloaded) -> None:
        """Start the copy back to the GPU on the side stream (after the copy out)."""
        side = self._side_stream(offloaded.device)
        with torch.cuda.stream(side):
            side.wait_event(offloaded.stored)
            fetched = offloaded.host.to(offloaded.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        offloaded.fetched = (fetched, ready)

    def _unpack(self, packed):
        if isinstance(packed, _OffloadedShard):
            local = self._unpack(packed.local)
            return DTensor.from_local(local, packed.mesh, packed.placements, run_check=False, shape=packed.shape,
                                      stride=packed.stride)  # fmt: skip
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.device.type != "cuda":
            return packed.host
        if packed.fetched is None:
            self._fetch(packed)
        self._prefetch_before(packed)
        fetched, ready = packed.fetched
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(ready)
        fetched.record_stream(current)
        return fetched

    def _prefetch_before(self, packed: _Offloaded) -> None:
        """Start the copy back of the tensor saved just before `packed` (the next one
        the backward will need), if it is still held and not fetched yet."""
        index = next((i for i, ref in enumerate(self._order) if ref() is packed), None)
        if index is None:
            return
        for ref in reversed(self._order[:index]):
            earlier = ref()
            if earlier is not None and earlier.fetched is None:
                self._fetch(earlier)
                return
