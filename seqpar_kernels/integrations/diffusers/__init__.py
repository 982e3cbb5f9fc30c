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

How the hooks find the tokens: a plan per transformer class (TOKEN_PLANS, plans.py) names
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

import torch
import torch.distributed as dist

try:
    import diffusers
except ImportError as error:  # pragma: no cover - exercised only without diffusers
    raise ImportError(
        'seqpar_kernels.integrations.diffusers needs diffusers 0.35 or newer: pip install "seqpar-kernels[diffusers]"'
    ) from error

from seqpar_kernels.integrations.diffusers.dsp import LatteDSP
from seqpar_kernels.integrations.diffusers.hooks import TokenSharding
from seqpar_kernels.integrations.diffusers.plans import DSP_TRANSFORMERS, TOKEN_PLANS, Gather, Split, TokenPlan
from seqpar_kernels.parallel.parallelism import MODES as ALL_MODES
from seqpar_kernels.parallel.parallelism import SequenceParallelism

__all__ = ["DSP_TRANSFORMERS", "MODES", "TOKEN_PLANS", "Gather", "Parallelism", "Split", "TokenPlan", "apply", "remove"]

MODES = ("dsp", *(mode for mode in ALL_MODES if mode != "dsp"))
# The attribute apply() sets on the transformer (remove() reads it).
SETTINGS_ATTRIBUTE = "seqpar_parallelism"
# What apply() returns: the package's one value for a mode, its groups and layout.
Parallelism = SequenceParallelism


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
    settings = SequenceParallelism.resolve("apply", mode, group=group, mesh=mesh, ulysses_group=ulysses_group,
                                           ring_group=ring_group, step_backend=step_backend, modes=MODES)  # fmt: skip
    name = type(transformer).__name__
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
        hooks = LatteDSP(transformer, settings)
    else:
        plan = TOKEN_PLANS.get(name)
        if plan is None:
            raise ValueError(f"apply: no sequence-parallel plan for {name}; mode={mode!r} runs {sorted(TOKEN_PLANS)}")
        if plan.check_model is not None:
            plan.check_model(transformer)
        if mode == "usp":
            # Checks once that the two groups form a grid (the agreement's collectives):
            # the calls pass every rank's lengths, which skips that check.
            settings.agree("apply", (mode, name), next(transformer.parameters()).device)
        hooks = TokenSharding(transformer, settings, plan)
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
