"""Where each diffusers transformer's tokens are split and gathered: one TokenPlan per
transformer class (how "ulysses", "ring" and "usp" run it), and the family code a plan
runs on a call's arguments. The hooks (hooks.py) read the plans; a new model family is a
plan here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["DSP_TRANSFORMERS", "TOKEN_PLANS", "Gather", "Split", "TokenPlan"]


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


def _hunyuan_video_valid_text(call, text: torch.Tensor) -> torch.Tensor:
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
