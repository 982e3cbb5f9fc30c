"""Sequence parallelism for diffusers' video and image transformers.

    import seqpar_kernels.integrations.diffusers as sp_diffusers

    sp_diffusers.apply(pipe.transformer, "dsp")              # Latte: frames <-> patches
    sp_diffusers.apply(pipe.transformer, "ulysses")          # or "ring"; "usp" on a mesh
    video = pipe(prompt, num_inference_steps=50).frames      # the same video on every rank

apply() installs torch module hooks on a loaded transformer; the transformer is then
called exactly as diffusers calls it, with the full inputs on every rank (as every rank
of a pipeline holds the same latents), and returns the full output on every rank. Each
rank computes its share of the tokens between the hooks:

    "dsp"      Dynamic Sequence Parallelism on a transformer whose blocks alternate a
               spatial block (attention within each frame) and a temporal block
               (attention across the frames of each spatial position):
               LatteTransformer3DModel. The frames are sharded through the spatial blocks
               and the spatial positions through the temporal ones; all_to_all_reshard
               switches between the two at each change of block, so no attention needs
               a collective.
    "ulysses"  the tokens sharded after the patch embedding, and every attention over
    "ring"     them (self-attention, or joint text-video attention) run by
    "usp"      ulysses_attention, ring_attention or usp_attention on this rank's tokens;
               attention to replicated text (cross-attention) stays local.

How the hooks find the tokens: a plan per transformer class (TOKEN_PLANS below) names
where the tokens are split (an argument or output of a submodule: after the patch
embedding, the rotary embedding's output at global positions), where they are gathered
(the output projection, before unpatchifying), and which attention modules attend over
them. Splits are plain slices, so each rank's backward gives its share of every
parameter's gradient and all_reduce_gradients sums the shares; the gather's backward
keeps this rank's piece of the gradient (the loss being the same on every rank).

Inside an attention module of the plan, the processor runs unchanged: its one call of
torch's scaled_dot_product_attention (diffusers' "native" attention backend, directly or
through the attention dispatcher) is replaced by ours, on the (batch, tokens, heads,
head_dim) views of its query, key and value. Text tokens that join the video tokens in
one attention (Flux, CogVideoX, HunyuanVideo) are sharded with them, so each rank's
joint sequence is its text piece and its video piece: non-causal attention does not
depend on the order of the keys, and the rotary embeddings travel with their tokens.

Supported releases: diffusers 0.35 and newer (the tests run the newest and 0.35.2). 0.35
is the release from which the plans' module layouts hold: Wan's rotary embedding became
the (cos, sin) pair with the tokens on dim 1 that its plan cuts (before, one complex
tensor with the tokens on dim 2), and Wan's, Flux's, LTX-Video's and HunyuanVideo's
attention moved to the dispatcher, whose native backend calls SDPA.
"""

from __future__ import annotations

import fnmatch
import inspect
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

try:
    import diffusers
except ImportError as error:  # pragma: no cover - exercised only without diffusers
    raise ImportError(
        'seqpar_kernels.integrations.diffusers needs diffusers 0.35 or newer: pip install "seqpar-kernels[diffusers]"'
    ) from error

from seqpar_kernels import (
    all_to_all_reshard,
    gather_sequence,
    ring_attention,
    ulysses_attention,
    usp_attention,
    usp_split,
)

__all__ = ["DSP_TRANSFORMERS", "MODES", "TOKEN_PLANS", "Gather", "Parallelism", "Split", "TokenPlan", "apply", "remove"]

MODES = ("dsp", "ulysses", "ring", "usp")
# The attribute apply() sets on the transformer (remove() reads it).
SETTINGS_ATTRIBUTE = "seqpar_parallelism"


# ----------------------------------------------------------------------------------
# plans: where a transformer's tokens are split and gathered
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """Where a tensor is cut to this rank's piece along `dim`.

    module: the submodule's path ("" the transformer itself; "blocks.*" every block).
    argument: the name of an argument of its forward (cut before the forward runs), or
        None: its output (cut after).
    index: an element of a tuple argument or output (None: the tensor itself).
    ndim: cut only a tensor of this many dims (None: any); others pass unchanged.
    tokens: the pieces are tokens of the sequence the plan's attention runs over (text
        tokens joined to the video's included); they must be non-empty on every rank.
        The first token split a call makes is the video's: the gather's.
    per_token_rows: dim is (rows x the call's tokens) flattened (Latte's batch of
        spatial positions): the tokens part is cut.
    prepare: family code run on the whole tensor first (call state, tensor) -> tensor."""

    module: str
    argument: str | None = None
    index: int | None = None
    dim: int = 1
    ndim: int | None = None
    tokens: bool = False
    per_token_rows: bool = False
    prepare: Callable | None = None


@dataclass(frozen=True)
class Gather:
    """Where the output of a submodule is gathered along `dim` (every rank's piece, in
    piece order): the whole output on every rank."""

    module: str
    dim: int = 1


@dataclass(frozen=True)
class TokenPlan:
    """How ulysses, ring and usp run a transformer class.

    attention: paths (with "*") of the attention modules whose attention runs over the
        sharded tokens; other attention modules (cross-attention to replicated text,
        attention within a replicated text encoder) run unchanged.
    check: family code run on the bound arguments of each call before anything else
        (raises ValueError for inputs the plan cannot honour)."""

    splits: tuple[Split, ...]
    gathers: tuple[Gather, ...]
    attention: tuple[str, ...]
    check: Callable | None = None
    check_model: Callable | None = None


def _no_controlnet(arguments: dict) -> None:
    for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
        if arguments.get(name) is not None:
            raise ValueError(
                f"{name}: ControlNet residuals are added to the whole image's tokens; sequence parallelism of "
                "the transformer does not split them (run the ControlNet pipeline without it)"
            )
    if "ip_adapter_image_embeds" in (arguments.get("joint_attention_kwargs") or {}):
        raise ValueError("IP-Adapter image embeddings: its extra attention is not sequence-parallel; unload it")


def _hunyuan_video_model(transformer) -> None:
    if getattr(transformer.config, "image_condition_type", None) == "token_replace":
        raise ValueError(
            "HunyuanVideo with image_condition_type='token_replace' modulates the first frame's tokens by their "
            "position in the sequence, which sharding moves: not supported"
        )


def _hunyuan_video_prompts(arguments: dict) -> None:
    """HunyuanVideo masks the text tokens past each prompt's length (counted by
    encoder_attention_mask) in a joint mask it builds from the local lengths, which
    sharding makes wrong. Such tokens are keys nobody attends to and queries whose
    outputs are dropped, so the text is cut to the prompts' length before it is split
    (_hunyuan_video_valid_text): exact when every prompt of the batch has one length."""
    mask = arguments.get("encoder_attention_mask")
    if mask is not None:
        lengths = mask.sum(dim=1).tolist()  # the host reads it once per call
        if len(set(lengths)) > 1:
            raise ValueError(
                f"HunyuanVideo: prompts of different lengths {lengths} in one batch (encoder_attention_mask "
                f"{tuple(mask.shape)}): their padding is masked by position, which sharding moves; call the "
                "transformer with one prompt length per batch (one prompt at a time)"
            )


def _hunyuan_video_valid_text(call: _Call, text: torch.Tensor) -> torch.Tensor:
    """The prompt's tokens without their padding (see _hunyuan_video_prompts)."""
    mask = call.arguments.get("encoder_attention_mask")
    return text if mask is None else text[:, : int(mask[0].sum())]


TOKEN_PLANS: dict[str, TokenPlan] = {
    # (B*T, S, C) per frame through the spatial blocks, (B*S, T, C) per position through the
    # temporal ones: the spatial positions are sharded, the temporal blocks are then local.
    "LatteTransformer3DModel": TokenPlan(
        splits=(
            Split("pos_embed", dim=1, tokens=True),
            Split("temporal_transformer_blocks.*", "timestep", dim=0, per_token_rows=True),
        ),
        gathers=(Gather("proj_out", 1),),
        attention=("transformer_blocks.*.attn1",),
    ),
    "WanTransformer3DModel": TokenPlan(
        splits=(
            Split("rope", index=0, dim=1, ndim=4),
            Split("rope", index=1, dim=1, ndim=4),
            Split("blocks.0", "hidden_states", dim=1, tokens=True),
            Split("", "timestep", dim=1, ndim=2),  # Wan 2.2 TI2V: a timestep per token
        ),
        gathers=(Gather("proj_out", 1),),
        attention=("blocks.*.attn1",),
    ),
    "LTXVideoTransformer3DModel": TokenPlan(
        splits=(
            Split("", "hidden_states", dim=1, ndim=3, tokens=True),
            Split("", "timestep", dim=1, ndim=2),  # conditioned frames: a timestep per token
            Split("rope", index=0, dim=1, ndim=3),
            Split("rope", index=1, dim=1, ndim=3),
        ),
        gathers=(Gather("proj_out", 1),),
        attention=("transformer_blocks.*.attn1",),
    ),
    "CogVideoXTransformer3DModel": TokenPlan(
        splits=(
            Split("", "image_rotary_emb", index=0, dim=0, ndim=2),
            Split("", "image_rotary_emb", index=1, dim=0, ndim=2),
            Split("transformer_blocks.0", "hidden_states", dim=1, tokens=True),
            Split("transformer_blocks.0", "encoder_hidden_states", dim=1, tokens=True),
        ),
        gathers=(Gather("proj_out", 1),),
        attention=("transformer_blocks.*.attn1",),
    ),
    "HunyuanVideoTransformer3DModel": TokenPlan(
        splits=(
            Split("rope", index=0, dim=0, ndim=2),
            Split("rope", index=1, dim=0, ndim=2),
            Split("x_embedder", dim=1, tokens=True),
            Split("context_embedder", dim=1, tokens=True, prepare=_hunyuan_video_valid_text),
        ),
        gathers=(Gather("proj_out", 1),),
        attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        check=_hunyuan_video_prompts,
        check_model=_hunyuan_video_model,
    ),
    "FluxTransformer2DModel": TokenPlan(
        splits=(
            Split("", "hidden_states", dim=1, ndim=3, tokens=True),
            Split("", "encoder_hidden_states", dim=1, ndim=3, tokens=True),
            Split("", "img_ids", dim=0, ndim=2),
            Split("", "img_ids", dim=1, ndim=3),
            Split("", "txt_ids", dim=0, ndim=2),
            Split("", "txt_ids", dim=1, ndim=3),
        ),
        gathers=(Gather("proj_out", 1),),
        attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        check=_no_controlnet,
    ),
}

# Transformers whose blocks alternate spatial and temporal attention, for mode="dsp".
DSP_TRANSFORMERS = ("LatteTransformer3DModel",)


# ----------------------------------------------------------------------------------
# the ranks: pieces and collectives
# ----------------------------------------------------------------------------------


def _piece_sizes(total: int, pieces: int) -> list[int]:
    """torch.tensor_split's sizes: the first total % pieces pieces get one more."""
    return [total // pieces + (1 if piece < total % pieces else 0) for piece in range(pieces)]


@dataclass(frozen=True)
class Parallelism:
    """The mode and the process groups it runs on, as apply() recorded them.

    pieces: the number of pieces the tokens are cut into, piece this rank's (under usp
    the rank at ring index i and Ulysses index j holds piece i * U + j, usp_split's
    contiguous layout)."""

    mode: str
    transformer: str
    group: dist.ProcessGroup | None = None
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    step_backend: str = "auto"
    piece: int = 0
    pieces: int = 1
    ulysses_size: int = 1

    def sizes(self, total: int) -> list[int]:
        return _piece_sizes(total, self.pieces)

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece of x along dim: a slice (its gradient is zero elsewhere),
        made contiguous for the model code that views it."""
        sizes = self.sizes(x.shape[dim])
        return x.narrow(dim, sum(sizes[: self.piece]), sizes[self.piece]).contiguous()

    def gather(self, x: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        """The whole tensor from every rank's piece along dim; backward: this rank's
        piece of the gradient. Under usp: the slot over the Ulysses group, then the
        sequence over the ring group."""
        sizes = self.sizes(total)
        if self.mode != "usp":
            return gather_sequence(x, dim, self.group, sizes=sizes)
        rows = [sizes[i : i + self.ulysses_size] for i in range(0, len(sizes), self.ulysses_size)]
        slot = gather_sequence(x, dim, self.ulysses_group, sizes=rows[self.piece // self.ulysses_size])
        return gather_sequence(slot, dim, self.ring_group, sizes=[sum(row) for row in rows])

    def attention(self, q, k, v, softmax_scale, seq_lens):
        """q (B, S_r, H, D), k, v (B, S_r, H_kv, D), this rank's tokens -> (B, S_r, H, D)."""
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, group=self.group, softmax_scale=softmax_scale, seq_lens=seq_lens)
        if self.mode == "ring":
            return ring_attention(q, k, v, group=self.group, softmax_scale=softmax_scale, seq_lens=seq_lens,
                                  step_backend=self.step_backend)  # fmt: skip
        return usp_attention(
            q,
            k,
            v,
            ulysses_group=self.ulysses_group,
            ring_group=self.ring_group,
            softmax_scale=softmax_scale,
            seq_lens=seq_lens,
            step_backend=self.step_backend,
        )

    def check_groups(self) -> tuple:
        """The groups an every-rank check gathers over, in turn (the grid's two under usp)."""
        return (self.ulysses_group, self.ring_group) if self.mode == "usp" else (self.group,)


def _resolve(describe: str, mode, transformer, group, mesh, ulysses_group, ring_group, step_backend) -> Parallelism:
    """The Parallelism of apply()'s arguments; ValueError for bad ones (the same on every rank)."""
    if mode not in MODES:
        raise ValueError(f"{describe}: mode must be one of {MODES}, got {mode!r}")
    if step_backend not in ("auto", "triton", "aten"):
        raise ValueError(f"{describe}: step_backend must be 'auto', 'triton' or 'aten', got {step_backend!r}")
    name = type(transformer).__name__
    initialized = dist.is_available() and dist.is_initialized()
    if mode != "usp":
        if mesh is not None or ulysses_group is not None or ring_group is not None:
            raise ValueError(f"{describe}: mode={mode!r} runs on group= (default: the world), not on a mesh")
        if not initialized:
            return Parallelism(mode, name, step_backend=step_backend)
        group = group if group is not None else dist.group.WORLD
        return Parallelism(mode, name, group=group, step_backend=step_backend, piece=dist.get_rank(group),
                           pieces=dist.get_world_size(group))  # fmt: skip
    if group is not None:
        raise ValueError(f"{describe}: mode='usp' runs on mesh= (or ulysses_group= and ring_group=), not group=")
    if mesh is not None:
        if ulysses_group is not None or ring_group is not None:
            raise ValueError(f"{describe}: pass mesh= or ulysses_group= and ring_group=, not both")
        names = sorted(getattr(mesh, "mesh_dim_names", None) or ())
        if names != ["ring", "ulysses"]:
            raise ValueError(f"{describe}: mesh must be a 2-D DeviceMesh with dims named 'ring' and 'ulysses', "
                             f"got dims {names}")  # fmt: skip
        ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    elif ulysses_group is None or ring_group is None:
        raise ValueError(f"{describe}: mode='usp' needs mesh= (dims 'ring' and 'ulysses') or both ulysses_group= "
                         "and ring_group= (seqpar_kernels.make_usp_groups)")  # fmt: skip
    ulysses_size = dist.get_world_size(ulysses_group)
    piece = dist.get_rank(ring_group) * ulysses_size + dist.get_rank(ulysses_group)
    return Parallelism(mode, name, ulysses_group=ulysses_group, ring_group=ring_group, step_backend=step_backend,
                       piece=piece, pieces=ulysses_size * dist.get_world_size(ring_group),
                       ulysses_size=ulysses_size)  # fmt: skip


# ----------------------------------------------------------------------------------
# one call of the transformer
# ----------------------------------------------------------------------------------


@dataclass
class _Call:
    """What the hooks learn during one call of the transformer: its arguments (bound to
    the names of its forward, defaults included), and the sizes of what was split.
    The hooks of a gradient checkpoint's recomputation read the last call's: a backward
    follows its own forward, as in any training loop."""

    arguments: dict
    # The token splits made so far, in order, by split: their token counts (a gradient
    # checkpoint's recomputation makes some again, which changes nothing).
    token_totals: dict = field(default_factory=dict)
    gathered: bool = False
    frames: int = 0  # dsp: the video's frames and spatial positions, and its batch
    positions: int = 0
    batch: int = 0


def _fingerprint(value) -> int:
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def _describe_inputs(value):
    """What every rank's inputs must agree on: shapes and dtypes of the tensors, the
    plain values; nested in tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (tuple, list)):
        return tuple(_describe_inputs(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _describe_inputs(item)) for key, item in sorted(value.items(), key=lambda kv: str(kv[0])))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _agree_on_every_rank(describe: str, parallelism: Parallelism, value, device) -> None:
    """Raises ValueError on every rank unless every rank's `value` is the same: one
    small all-gather per group (nested over the grid under usp, so that a disagreement
    in any Ulysses group reaches every rank through the ring groups)."""
    if parallelism.pieces == 1:
        return
    mine, agreed = _fingerprint(value), 1
    for group in parallelism.check_groups():
        metadata_device = device if "nccl" in str(dist.get_backend(group)).lower() else torch.device("cpu")
        local = torch.tensor([mine, agreed], dtype=torch.int64, device=metadata_device)
        gathered = local.new_empty(dist.get_world_size(group) * 2)
        # all_gather_single is the newer name (torch >= 2.14) of all_gather_into_tensor.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, local, group=group)
        rows = gathered.view(-1, 2).tolist()
        agreed = int(all(row[1] for row in rows) and len({row[0] for row in rows}) == 1)
    if not agreed:
        raise ValueError(
            f"{describe}: the ranks were called with different inputs (shapes, dtypes or options); every rank "
            f"must call the transformer with the same full inputs. This rank's: {str(value)[:400]}"
        )


def _parameter_names(module: torch.nn.Module) -> list[str]:
    return list(inspect.signature(module.forward).parameters)


def _change_argument(names: list[str], args: tuple, kwargs: dict, argument: str, change):
    """(args, kwargs) with change(value) in place of `argument` (by name, or at its
    position in `names`, the forward's parameters); unchanged when it was not passed."""
    if argument in kwargs:
        return args, dict(kwargs, **{argument: change(kwargs[argument])})
    position = names.index(argument) if argument in names else len(args)
    if position < len(args):
        return args[:position] + (change(args[position]),) + args[position + 1 :], kwargs
    return args, kwargs


def _modules(transformer: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
    """The submodules whose path matches pattern ("" the transformer; "*" one level)."""
    if pattern == "":
        return [transformer]
    depth = pattern.count(".")
    return [
        module
        for name, module in transformer.named_modules()
        if name.count(".") == depth and fnmatch.fnmatchcase(name, pattern)
    ]


# ----------------------------------------------------------------------------------
# the attention of a module over the sharded tokens
# ----------------------------------------------------------------------------------

_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _SequenceParallelAttention(TorchFunctionMode):
    """Active while an attention module of the plan runs: its processor's call of
    scaled_dot_product_attention on (B, H, S_r, D) tensors becomes ours on their
    (B, S_r, H, D) views. Everything else passes through."""

    def __init__(self, sharding: _TokenSharding, module_name: str):
        super().__init__()
        self.sharding, self.module_name = sharding, module_name
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        call = dict(zip(_SDPA_ARGUMENTS, args), **kwargs)
        return self.sharding.attend(self.module_name, self.calls, call)


# ----------------------------------------------------------------------------------
# hooks
# ----------------------------------------------------------------------------------


class _Hooks:
    """The hooks apply() installed on one transformer, and the call they share."""

    def __init__(self, transformer: torch.nn.Module, parallelism: Parallelism):
        self.transformer, self.parallelism = transformer, parallelism
        self.handles: list = []
        self.call: _Call | None = None
        self.forward_names = _parameter_names(transformer)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def describe(self) -> str:
        return f"{self.parallelism.mode} on {self.parallelism.transformer}"

    def start_call(self, args, kwargs) -> dict:
        """The bound arguments of a call of the transformer, after every rank agreed on them."""
        bound = inspect.signature(self.transformer.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        device = next((value.device for value in arguments.values() if isinstance(value, torch.Tensor)), None)
        _agree_on_every_rank(self.describe(), self.parallelism, (self.parallelism.mode, _describe_inputs(arguments)),
                             device)  # fmt: skip
        return arguments

    def input_hook(self, module: torch.nn.Module, argument: str, change) -> None:
        """Run change(value) -> value on `argument` of module's forward, positional or not."""
        names = _parameter_names(module)
        self.handles.append(
            module.register_forward_pre_hook(
                lambda module, args, kwargs: _change_argument(names, args, kwargs, argument, change), with_kwargs=True
            )
        )


class _TokenSharding(_Hooks):
    """ulysses, ring and usp through a TokenPlan."""

    def __init__(self, transformer, parallelism: Parallelism, plan: TokenPlan):
        super().__init__(transformer, parallelism)
        self.plan = plan
        root_splits = [split for split in plan.splits if split.module == ""]
        self.handles.append(transformer.register_forward_pre_hook(
            lambda module, args, kwargs: self._enter(args, kwargs, root_splits), with_kwargs=True))  # fmt: skip
        self.handles.append(transformer.register_forward_hook(lambda module, args, output: self._leave()))
        for split in plan.splits:
            if split.module == "":
                continue
            modules = _modules(transformer, split.module)
            if not modules:
                raise ValueError(f"apply: {parallelism.transformer} has no submodule {split.module!r}: this diffusers "
                                 "release's model is not the one the plan was written for")  # fmt: skip
            for module in modules:
                if split.argument is None:
                    self.handles.append(module.register_forward_hook(
                        lambda module, args, output, split=split: self._split(split, output)))  # fmt: skip
                else:
                    self.input_hook(module, split.argument, lambda value, split=split: self._split(split, value))
        for gather in plan.gathers:
            for module in _modules(transformer, gather.module):
                self.handles.append(
                    module.register_forward_hook(
                        lambda module, args, output, gather=gather: self._gather(gather, output)
                    )
                )
        self.attention_modules = [
            (name, module)
            for pattern in plan.attention
            for name, module in transformer.named_modules()
            if name.count(".") == pattern.count(".") and fnmatch.fnmatchcase(name, pattern)
        ]
        if not self.attention_modules:
            raise ValueError(f"apply: {parallelism.transformer} has no attention module {plan.attention}")
        for name, module in self.attention_modules:
            self._intercept(name, module)

    # -- the call --------------------------------------------------------------

    def _enter(self, args, kwargs, root_splits):
        arguments = self.start_call(args, kwargs)
        self.call = _Call(arguments)
        if self.plan.check is not None:
            self.plan.check(arguments)
        for split in root_splits:
            args, kwargs = _change_argument(self.forward_names, args, kwargs, split.argument,
                                            lambda value, split=split: self._split(split, value))  # fmt: skip
        return args, kwargs

    def _leave(self):
        if self.call is not None and not self.call.gathered:
            raise ValueError(f"{self.describe()}: the output was not gathered (no call of "
                             f"{[gather.module for gather in self.plan.gathers]}): this diffusers release's model "
                             "is not the one the plan was written for")  # fmt: skip

    def _split(self, split: Split, value):
        if split.index is not None:
            if not isinstance(value, (tuple, list)):
                return value
            items = list(value)
            items[split.index] = self._split_tensor(split, items[split.index])
            return type(value)(items)
        return self._split_tensor(split, value)

    def _split_tensor(self, split: Split, x):
        if not isinstance(x, torch.Tensor) or (split.ndim is not None and x.dim() != split.ndim):
            return x
        call = self.call
        if split.prepare is not None:
            x = split.prepare(call, x)
        if split.per_token_rows:
            total = next(iter(call.token_totals.values()))
            # (rows x tokens, ...) -> (rows, tokens, ...): cut the tokens, flatten back.
            pieces = self.parallelism.take(x.unflatten(split.dim, (-1, total)), split.dim + 1)
            return pieces.flatten(split.dim, split.dim + 1)
        total = x.shape[split.dim]
        if split.tokens:
            if total < self.parallelism.pieces:
                where = f"{split.module or 'the transformer'}'s {split.argument or 'output'} {tuple(x.shape)}"
                raise ValueError(f"{self.describe()}: {total} tokens along dim {split.dim} of {where}, fewer than the "
                                 f"{self.parallelism.pieces} ranks: every rank needs one")  # fmt: skip
            call.token_totals[split] = total
        return self.parallelism.take(x, split.dim)

    def _gather(self, gather: Gather, output):
        if not isinstance(output, torch.Tensor):
            raise ValueError(f"{self.describe()}: {gather.module} returned {type(output).__name__}, not a tensor")
        call = self.call
        # The output holds the tokens of the first token split (the video's, not the text's).
        total = next(iter(call.token_totals.values()), 0)
        if output.shape[gather.dim] != self.parallelism.sizes(total)[self.parallelism.piece]:
            raise ValueError(f"{self.describe()}: {gather.module}'s output {tuple(output.shape)} is not this rank's "
                             f"piece of the {total} video tokens along dim {gather.dim}")  # fmt: skip
        call.gathered = True
        return self.parallelism.gather(output, gather.dim, total)

    # -- attention ---------------------------------------------------------------

    def _intercept(self, name: str, module: torch.nn.Module) -> None:
        modes: list[_SequenceParallelAttention] = []

        def enter(module, args, kwargs):
            mode = _SequenceParallelAttention(self, name)
            mode.__enter__()
            modes.append(mode)

        def leave(module, args, kwargs, output):
            mode = modes.pop()
            mode.__exit__(None, None, None)
            if mode.calls == 0 and output is not None:
                raise ValueError(
                    f"{self.describe()}: {name} computed its attention without torch's scaled_dot_product_attention "
                    "(an attention backend such as flash, sage or flex, or a processor of its own): sequence-parallel "
                    "attention replaces that call; use diffusers' native backend "
                    "(transformer.set_attention_backend('native'))"
                )

        self.handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        self.handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))

    def attend(self, name: str, number: int, call: dict):
        """Our attention for the SDPA call `call` (its arguments by name) in module `name`."""
        describe = f"{self.describe()}: attention in {name}"
        q, k, v = call["query"], call["key"], call["value"]
        if number > 1:
            raise ValueError(
                f"{describe}: a second attention call in one forward of the module (an extra "
                "attention such as an IP-Adapter's?): only one over the sharded tokens is supported"
            )
        if call.get("is_causal") or call.get("dropout_p", 0.0):
            raise ValueError(f"{describe}: causal attention or attention dropout is not supported "
                             f"(is_causal={call.get('is_causal')}, dropout_p={call.get('dropout_p')})")  # fmt: skip
        mask = call.get("attn_mask")
        if mask is not None and not self._all_true(mask):
            raise ValueError(
                f"{describe}: an attention mask {tuple(mask.shape)} that masks some keys (padded text of prompts "
                "of different lengths in one batch?): sequence-parallel attention takes no mask; run the prompts "
                "one at a time"
            )
        sizes = None
        if self.call is not None and self.call.token_totals:
            # Every piece's tokens: its piece of each token split (text and video, joined).
            per_split = [self.parallelism.sizes(total) for total in self.call.token_totals.values()]
            sizes = [sum(piece) for piece in zip(*per_split)]
        local = q.shape[2]
        if sizes is None or k.shape[2] != local or sizes[self.parallelism.piece] != local:
            raise ValueError(
                f"{describe}: query {tuple(q.shape)} and key {tuple(k.shape)} are not this rank's "
                f"{None if sizes is None else sizes[self.parallelism.piece]} tokens of the sharded sequence: this "
                "diffusers release's model is not the one the plan was written for"
            )
        # (B, H, S_r, D) -> (B, S_r, H, D): views.
        out = self.parallelism.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), call.get("scale"),
                                         list(sizes))  # fmt: skip
        return out.transpose(1, 2)

    def _all_true(self, mask: torch.Tensor) -> bool:
        """Whether a mask lets every key through: a boolean mask all true, or an
        additive one all zero. Read once per mask tensor (the model passes the same
        one to every block)."""
        cache = getattr(self, "_mask_checked", None)
        if cache is not None and cache[0] is mask:
            return cache[1]
        result = bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())
        self._mask_checked = (mask, result)
        return result


class _LatteDSP(_Hooks):
    """DSP on LatteTransformer3DModel.

    Latte's forward keeps hidden_states as (B*T, S, C) for a spatial block and reshapes
    it to (B*S, T, C) for a temporal block (rows in batch-major order). Here each rank
    holds T_r of the T frames through a spatial block, (B*T_r, S, C), and S_r of the S
    spatial positions through a temporal block, (B*S_r, T, C); Latte's own reshapes
    between the blocks then carry this rank's piece, since they only move the batch of
    frames and the batch of positions:

        pos_embed out (B*T, S, C)  -> cut: this rank's frames (B*T_r, S, C)
        spatial block i            (B*T_r, S, C); its text and timestep rows cut alike
          out: (B, T_r, S, C) -all_to_all_reshard(scatter S, gather T)-> (B, T, S_r, C)
               = (B*T, S_r, C), which Latte turns into (B*S_r, T, C)
        temporal block i           (B*S_r, T, C); its timestep rows cut alike
          out (not the last):  (B, S_r, T, C) -reshard(scatter T, gather S)-> (B, S, T_r, C)
               = (B*S, T_r, C), which Latte turns into (B*T_r, S, C)
        after the last block       (B*T, S_r, C): final norm and projection per token,
        proj_out out               gathered over the positions: (B*T, S, p*p*c_out)

    Without temporal attention (enable_temporal_attentions=False) the frames stay
    sharded until the last spatial block, whose output is resharded for the output
    projection. No attention needs a collective."""

    def __init__(self, transformer, parallelism: Parallelism):
        super().__init__(transformer, parallelism)
        self.handles.append(transformer.register_forward_pre_hook(
            lambda module, args, kwargs: self._enter(args, kwargs), with_kwargs=True))  # fmt: skip
        self.handles.append(transformer.pos_embed.register_forward_hook(
            lambda module, args, output: self._cut_frames(output)))  # fmt: skip
        spatial, temporal = transformer.transformer_blocks, transformer.temporal_transformer_blocks
        last = len(spatial) - 1
        for index, block in enumerate(spatial):
            for argument in ("encoder_hidden_states", "encoder_attention_mask", "timestep"):
                self.input_hook(block, argument, self._cut_frames)
            self.handles.append(block.register_forward_hook(
                lambda module, args, output, index=index: self._after_spatial(output, index == last)))  # fmt: skip
        for index, block in enumerate(temporal):
            self.input_hook(block, "timestep", self._cut_positions)
            if index < last:
                self.handles.append(block.register_forward_hook(
                    lambda module, args, output: self._after_temporal(output)))  # fmt: skip
        self.handles.append(transformer.proj_out.register_forward_hook(
            lambda module, args, output: self.parallelism.gather(output, 1, self.call.positions)))  # fmt: skip

    def _enter(self, args, kwargs):
        arguments = self.start_call(args, kwargs)
        video = arguments["hidden_states"]  # (B, C, T, H, W)
        patch = self.transformer.config.patch_size
        batch, frames = video.shape[0], video.shape[2]
        positions = (video.shape[3] // patch) * (video.shape[4] // patch)
        pieces = self.parallelism.pieces
        if frames < pieces or positions < pieces:
            raise ValueError(
                f"{self.describe()}: a video of {frames} frames of {positions} patches on {pieces} ranks: DSP gives "
                "every rank whole frames and whole patch trajectories, so it needs at least as many frames and "
                "patches per frame as ranks (mode='ulysses' shards the patches alone)"
            )
        self.call = _Call(arguments, frames=frames, positions=positions, batch=batch)

    def _cut_frames(self, x):
        """This rank's frames of (B*T, ...) rows (batch-major); other tensors pass."""
        call = self.call
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] != call.batch * call.frames:
            raise ValueError(f"{self.describe()}: {tuple(x.shape)} does not have a row per frame of each video "
                             f"({call.batch} x {call.frames})")  # fmt: skip
        return self.parallelism.take(x.unflatten(0, (call.batch, call.frames)), 1).flatten(0, 1)

    def _cut_positions(self, x):
        """This rank's spatial positions of (B*S, ...) rows (batch-major)."""
        call = self.call
        return self.parallelism.take(x.unflatten(0, (call.batch, call.positions)), 1).flatten(0, 1)

    def _after_spatial(self, output, last: bool):
        """(B*T_r, S, C) -> (B*T, S_r, C) when a temporal block follows or the output
        projection does; else the frames stay sharded."""
        call = self.call
        if not (call.arguments.get("enable_temporal_attentions", True) or last):
            return output
        video = output.unflatten(0, (call.batch, -1))  # (B, T_r, S, C)
        resharded = all_to_all_reshard(video, scatter_dim=2, gather_dim=1, group=self.parallelism.group,
                                       gather_sizes=self.parallelism.sizes(call.frames))  # fmt: skip
        return resharded.flatten(0, 1)  # (B*T, S_r, C)

    def _after_temporal(self, output):
        """(B*S_r, T, C) -> (B*S, T_r, C) for the next spatial block."""
        call = self.call
        trajectories = output.unflatten(0, (call.batch, -1))  # (B, S_r, T, C)
        resharded = all_to_all_reshard(trajectories, scatter_dim=2, gather_dim=1, group=self.parallelism.group,
                                       gather_sizes=self.parallelism.sizes(call.positions))  # fmt: skip
        return resharded.flatten(0, 1)  # (B*S, T_r, C)


# ----------------------------------------------------------------------------------
# apply / remove
# ----------------------------------------------------------------------------------


def apply(
    transformer: torch.nn.Module,
    mode: str,
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    step_backend: str = "auto",
) -> Parallelism:
    """Make a loaded diffusers transformer sequence-parallel, in place.

    transformer: a diffusers ModelMixin: LatteTransformer3DModel for "dsp"; a class of
        TOKEN_PLANS for "ulysses", "ring" and "usp" (Latte, Wan, LTX-Video, CogVideoX,
        HunyuanVideo, Flux).
    mode: "dsp", "ulysses" or "ring" over `group` (default: the world); "usp" over
        `mesh` (a 2-D DeviceMesh with dims "ring" and "ulysses") or ulysses_group and
        ring_group (make_usp_groups).
    step_backend: what computes the ring's steps (ring and usp; ring_attention's).
    The transformer is then called as before, with the same full inputs on every rank,
    and returns the full output on every rank. Training: each rank's backward gives its
    share of the parameters' gradients; all_reduce_gradients(transformer, ...) sums them.
    Returns the Parallelism recorded on the transformer (remove() undoes apply()).
    Raises ValueError, alike on every rank, for a bad mode or a transformer the mode
    cannot run (no alternating spatial and temporal blocks for "dsp", no plan for the
    others, diffusers' own context parallelism enabled); a call raises for what it
    cannot honour (an attention backend that does not call torch's SDPA, a mask that
    hides keys, inputs that differ by rank)."""
    settings = _resolve("apply", mode, transformer, group, mesh, ulysses_group, ring_group, step_backend)
    name = settings.transformer
    if not isinstance(transformer, diffusers.ModelMixin):
        raise ValueError(f"apply: transformer must be a diffusers ModelMixin, got {name}")
    if getattr(transformer, SETTINGS_ATTRIBUTE, None) is not None:
        raise ValueError(f"apply: {name} is already sequence-parallel ({getattr(transformer, SETTINGS_ATTRIBUTE)}); "
                         "call remove() first")  # fmt: skip
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError(f"apply: {name} runs diffusers' own context parallelism (enable_parallelism); use one or "
                         "the other")  # fmt: skip
    if mode == "dsp":
        if name not in DSP_TRANSFORMERS:
            instead = ("attends over all of a video's tokens at once: use 'ulysses', 'ring' or 'usp'"
                       if name in TOKEN_PLANS else "is not one")  # fmt: skip
            raise ValueError(
                f"apply: mode='dsp' needs a transformer whose blocks alternate spatial and temporal attention "
                f"({', '.join(DSP_TRANSFORMERS)}); {name} {instead}"
            )
        hooks = _LatteDSP(transformer, settings)
    else:
        plan = TOKEN_PLANS.get(name)
        if plan is None:
            raise ValueError(f"apply: no sequence-parallel plan for {name}; mode={mode!r} runs {sorted(TOKEN_PLANS)}")
        if plan.check_model is not None:
            plan.check_model(transformer)
        if mode == "usp":
            # Checks once that the two groups form a grid (usp_split's collectives): the
            # calls pass every rank's lengths, which skips that check.
            device = next(transformer.parameters()).device
            usp_split(torch.zeros(settings.pieces, device=device), 0, ulysses_group=settings.ulysses_group,
                      ring_group=settings.ring_group)  # fmt: skip
        hooks = _TokenSharding(transformer, settings, plan)
    setattr(transformer, SETTINGS_ATTRIBUTE, settings)
    transformer._seqpar_hooks = hooks
    return settings


def remove(transformer: torch.nn.Module) -> None:
    """Undo apply(): the transformer runs whole on each rank again."""
    hooks = getattr(transformer, "_seqpar_hooks", None)
    if hooks is not None:
        hooks.remove()
        del transformer._seqpar_hooks
    if getattr(transformer, SETTINGS_ATTRIBUTE, None) is not None:
        delattr(transformer, SETTINGS_ATTRIBUTE)
