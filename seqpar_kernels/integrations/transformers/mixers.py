"""The sequence-mixing layers of hybrid models (linear attention, state-space scans, short
convolutions) under sequence parallelism: their state passed across ranks.

transformers' mixer modules (Qwen3-Next's and Qwen3.5's Gated DeltaNet, Kimi Linear's and
BailingHybrid's delta attention, the Mamba2 mixers of Bamba, Falcon-H1, GraniteMoeHybrid,
Nemotron-H and Zamba2, the Mamba mixers of Jamba, Zamba and Mamba, LFM2's short
convolution) call a few functions of their modeling module by name: the convolution
(causal_conv1d_fn), the gated delta rule (torch_chunk_gated_delta_rule), Kimi's delta
attention (chunk_kimi_delta_attention), the Mamba2 and Mamba scans (mamba2_chunk_scan,
mamba_selective_scan), directly or through a wrapper that reads and updates the cache
(causal_conv1d_forward, mamba_scan_forward, mamba2_scan_forward: transformers 5.25 on).
install() finds the model's mixers by those names, replaces the mixing functions in their
modeling modules by dispatchers, and hooks each mixer so that, while it runs, the
dispatchers run the package's sequence-parallel op on this rank's tokens (the
SequenceShard's layout and documents) instead; outside a hooked mixer they call the
original. The wrappers run as they are: the functions they call are the dispatchers. The
fused kernels' entry points (mamba2_split_conv1d_scan_combined, mamba_inner_fn) return
None there, which sends the mixer down its unfused path, and the single-token decode
functions raise outside a sequence-parallel generate (a KV cache is not
sequence-parallel).

A mixer that mixes inline, calling no function by name (MiniMax's lightning attention),
has its class's forward replaced the same way (MODULE_FORWARDS): the package's forward
while it runs hooked, the original otherwise.

A module whose forward calls sequence-mixing functions the package does not run
(RecurrentGemma's scan, ...) makes install() raise, naming it; a hooked mixer that runs without
calling a dispatcher (a wrapper replaced, by kernels' kernelize say) raises.
"""

from __future__ import annotations

import inspect
import sys
import threading

import torch

from seqpar_kernels.integrations.transformers.generation import running_step
from seqpar_kernels.parallel.gated_delta import gated_delta_rule, kimi_delta_attention, lightning_attention
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.recurrent import causal_conv1d
from seqpar_kernels.parallel.state_space import selective_scan, ssd_scan
from seqpar_kernels.parallel.training import SequenceShard

__all__ = ["install", "mixers_of", "HANDLED_FUNCTIONS"]


def _where(context) -> dict:
    """The ops' keyword arguments for the running mixer: its groups, and the batch's
    layout and lengths (a packed batch: its varlen plan)."""
    parallelism, shard, _ = context
    where = parallelism.group_kwargs()
    if shard is None:
        return dict(where, layout=parallelism.dense_layout)
    if shard.varlen is not None:
        return dict(where, varlen=shard.varlen)
    return dict(where, layout=parallelism.dense_layout, seq_lens=list(shard.seq_lens))


def _conv(context, hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' causal_conv1d_fn: hidden_states (B, C, S) -> (B, C, S). In a
    generate's prefill, every sequence's last inputs go to the cache's layer."""
    cache = _prefilling()
    out = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation,
                        return_final_states=cache is not None, **_where(context))  # fmt: skip
    if cache is not None:
        out, finals = out  # (sequences, kernel, channels)
        cache.layers[context[2].layer_idx].keep_conv_state(finals.transpose(1, 2).to(hidden_states.dtype))
    return out.transpose(1, 2)


def _prefilling():
    """The ShardedCache of a generate's prefill running now, or None."""
    cache = running_step()
    return cache if cache is not None and cache.step.kind == "prefill" else None


def _decoding() -> bool:
    cache = running_step()
    return cache is not None and cache.step.kind == "decode"


def _ssd(context, hidden_states, dt, A, B, C, chunk_size=256, D=None, dt_bias=None, initial_states=None,
         dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):  # fmt: skip
    """transformers' mamba2_chunk_scan: hidden_states (B, S, H, P) -> (B, S, H, P) fp32,
    as transformers' scan returns it [, every sequence's final state (generate's prefill)]."""
    return ssd_scan(hidden_states.float(), dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                    dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=return_final_states,
                    **_where(context))  # fmt: skip


def _selective(context, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
               return_last_state=False, **kwargs):  # fmt: skip
    """transformers' mamba_selective_scan: hidden_states, dt, z (B, D, S), B and C
    (B, N, S) -> (B, D, S) [, every sequence's final state (generate's prefill)]."""
    out = selective_scan(
        hidden_states.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D=D,
        z=None if z is None else z.transpose(1, 2), delta_bias=delta_bias, delta_softplus=delta_softplus,
        return_final_states=return_last_state, **_where(context),
    )  # fmt: skip
    return (out[0].transpose(1, 2), out[1]) if return_last_state else out.transpose(1, 2)


def _gated_delta(context, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
    """transformers' torch_chunk_gated_delta_rule: query, key (B, S, Hk, dk), value
    (B, S, Hv, dv), g and beta (B, S, Hv) -> ((B, S, Hv, dv), every sequence's final
    state where asked (generate's prefill) or None)."""
    out = gated_delta_rule(query, key, value, g, beta, use_qk_l2norm=use_qk_l2norm_in_kernel,
                           return_final_states=output_final_state, **_where(context))  # fmt: skip
    return out if output_final_state else (out, None)


def _kimi_delta(context, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
    """transformers' chunk_kimi_delta_attention: query, key (B, S, H, dk), value (B, S,
    H, dv), g (B, S, H, dk), beta (B, S, H) -> ((B, S, H, dv), None)."""
    _no_generate("chunk_kimi_delta_attention")
    out = kimi_delta_attention(query, key, value, g, beta, use_qk_l2norm=use_qk_l2norm_in_kernel, **_where(context))
    return out, None


def _no_generate(name: str) -> None:
    """Raises in a sequence-parallel generate: its cache does not keep these mixers' states yet."""
    if running_step() is not None:
        raise ValueError(f"sequence-parallel mixers: a sequence-parallel generate does not run {name} yet; "
                         "generate in one process")  # fmt: skip


def _lightning(context, module, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """MiniMaxLightningAttention's forward (B, S, hidden) -> ((B, S, hidden), None), its
    block loop replaced by lightning_attention over the sharded sequence; the rest (the
    projections, SiLU, the padding mask, the norm and the output gate) as the module's."""
    _no_generate(type(module).__name__)
    batch, length, _ = hidden_states.shape
    heads, head_dim = module.num_attention_heads, module.head_dim
    modeling = sys.modules[type(module).__module__]
    qkv = modeling.apply_mask_to_padding_states(module.act_fn(module.qkv_proj(hidden_states)), attention_mask)
    query, key, value = torch.split(qkv.reshape(batch, length, heads, 3 * head_dim), head_dim, dim=3)
    out = lightning_attention(query, key, value, module.slope_rate.reshape(heads), scale=1.0, **_where(context))
    out = module.norm(out.reshape(batch, length, heads * head_dim))
    return module.out_proj(torch.sigmoid(module.output_gate(hidden_states)) * out), None


# The functions a mixer calls by name, and what runs in their place under sequence parallelism.
HANDLED_FUNCTIONS = {
    "causal_conv1d_fn": _conv, "torch_chunk_gated_delta_rule": _gated_delta, "mamba2_chunk_scan": _ssd,
    "mamba_selective_scan": _selective, "chunk_kimi_delta_attention": _kimi_delta,
}  # fmt: skip
# Mixer classes that mix inline, and the forward (context, module, *args, **kwargs) that
# runs in place of theirs under sequence parallelism.
MODULE_FORWARDS = {"MiniMaxLightningAttention": _lightning}
# transformers' wrappers that read and update a mixer's cache, and the mixing functions
# each calls (which dispatch); the wrapper itself runs as it is.
WRAPPER_FUNCTIONS = {
    "causal_conv1d_forward": ("causal_conv1d_fn", "causal_conv1d_update"),
    "mamba_scan_forward": ("mamba_selective_scan", "mamba_selective_state_update"),
    "mamba2_scan_forward": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
}  # fmt: skip
# Fused kernels' entry points: None makes the mixer take its unfused path.
FUSED_FUNCTIONS = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")
# One token at a time from a cache (generation): not sequence-parallel.
DECODE_FUNCTIONS = (
    "causal_conv1d_update", "mamba2_selective_state_update", "mamba_selective_state_update",
    "torch_recurrent_gated_delta_rule", "recurrent_kimi_delta_attention",
)  # fmt: skip
# The functions replaced by dispatchers.
_RUNS = (*HANDLED_FUNCTIONS, *FUSED_FUNCTIONS, *DECODE_FUNCTIONS)
# Every sequence-mixing function of transformers' mixers known here; those not run above
# make install() raise (RecurrentGemma's scan, ...).
MIXING_FUNCTIONS = (*_RUNS, *WRAPPER_FUNCTIONS, "_rnn_scan")

# The mixers running now on this thread, innermost last.
_running = threading.local()


class _Running:
    """A hooked mixer running now: the handlers' context (parallelism, shard, module), and
    whether it has called a dispatcher yet."""

    __slots__ = ("context", "dispatched")

    def __init__(self, context: tuple):
        self.context = context
        self.dispatched = False


def _stack() -> list[_Running]:
    if not hasattr(_running, "stack"):
        _running.stack = []
    return _running.stack


def _dispatcher(name: str, original):
    """The function that replaces `name` in a modeling module."""

    def dispatch(*args, **kwargs):
        stack = _stack()
        if not stack:
            return original(*args, **kwargs)
        stack[-1].dispatched = True
        if name in FUSED_FUNCTIONS:
            return None
        if name in DECODE_FUNCTIONS:
            if _decoding():  # generate's decode step: the same token and states on every rank
                return original(*args, **kwargs)
            raise ValueError(
                f"sequence-parallel mixers: {name} decodes one token from a cache outside a sequence-parallel "
                "generate; pass use_cache=False"
            )
        if _prefilling() is None:
            kwargs = _without_cache(name, kwargs)
        return HANDLED_FUNCTIONS[name](stack[-1].context, *args, **kwargs)

    dispatch.seqpar_original = original
    dispatch.__name__ = dispatch.__qualname__ = name
    return dispatch


def _without_cache(name: str, kwargs: dict) -> dict:
    """kwargs without what a cache would pass (raising where it asks for a state)."""
    for key in ("initial_state", "initial_states"):
        if kwargs.get(key) is not None:
            raise ValueError(f"sequence-parallel mixers: {name} got a cached {key}; pass use_cache=False")
    for key in ("output_final_state", "return_final_states", "return_last_state"):  # the state a cache keeps
        if kwargs.get(key):
            raise ValueError(f"sequence-parallel mixers: {name} was asked for its final state (a cache); "
                             "pass use_cache=False")  # fmt: skip
    return kwargs


def _mixing_names(module: torch.nn.Module) -> set[str]:
    """The sequence-mixing function names the module's forward calls, a wrapper's standing
    for the functions it calls."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    names = set(code.co_names) & set(MIXING_FUNCTIONS) if code is not None else set()
    return {called for name in names for called in WRAPPER_FUNCTIONS.get(name, (name,))}


def mixers_of(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's sequence-mixing modules other than attention, by path. Raises
    ValueError for one that calls a function the package does not run sequence-parallel."""
    mixers = {}
    for path, module in model.named_modules():
        names = _mixing_names(module)
        unsupported = sorted(names - set(_RUNS))
        if unsupported:
            raise ValueError(
                f"apply: {type(module).__name__} ({path}) mixes the sequence with {unsupported}, which the package "
                f"does not run sequence-parallel (it runs {sorted(HANDLED_FUNCTIONS)})"
            )
        if names or type(module).__name__ in MODULE_FORWARDS:
            mixers[path] = module
    return mixers


def _patch(module: torch.nn.Module) -> None:
    """The dispatchers in place of the mixing functions of module's modeling module
    (once per function: a patched one stays)."""
    modeling = sys.modules[type(module).__module__]
    for name in _RUNS:
        function = getattr(modeling, name, None)
        if function is not None and callable(function) and not hasattr(function, "seqpar_original"):
            setattr(modeling, name, _dispatcher(name, function))
    cls = type(module)
    if cls.__name__ in MODULE_FORWARDS and not hasattr(cls.forward, "seqpar_original"):
        cls.forward = _forward_dispatcher(MODULE_FORWARDS[cls.__name__], cls.forward)


def _forward_dispatcher(forward, original):
    """The forward that replaces a MODULE_FORWARDS class's: `forward` while the module runs
    hooked (the innermost running mixer), the original otherwise."""

    def dispatch(module, *args, **kwargs):
        stack = _stack()
        if not stack or stack[-1].context[2] is not module:
            return original(module, *args, **kwargs)
        stack[-1].dispatched = True
        return forward(stack[-1].context, module, *args, **kwargs)

    dispatch.seqpar_original = original
    dispatch.__name__ = dispatch.__qualname__ = "forward"
    return dispatch


def install(model: torch.nn.Module, parallelism: SequenceParallelism) -> dict[str, torch.nn.Module]:
    """Make the model's mixers sequence-parallel under `parallelism` (apply() calls it):
    the dispatchers in their modeling modules, and hooks on each mixer that give the
    dispatchers the parallelism and the batch's SequenceShard while it runs. Replaces
    the hooks of an earlier install. Returns the mixers by path.

    The shard reaches a mixer in its keyword arguments where the model passes them down
    (Qwen3-Next, Bamba, ...); where it does not (Jamba), from the model's own call: hooks
    on the model and its base model record the shard of the latest call (a gradient
    checkpoint's recomputation, in the backward, reads the call it belongs to: the latest)."""
    mixers = mixers_of(model)
    latest = _LatestShard()
    for module in {id(m): m for m in (model, getattr(model, "base_model", model))}.values():
        recording = module.register_forward_pre_hook(latest.record, with_kwargs=True)
        _replace_hooks(module, "seqpar_shard_hooks", (recording,))
    for module in mixers.values():
        _patch(module)
        _replace_hooks(module, "seqpar_mixer_hooks", (
            module.register_forward_pre_hook(_entering(parallelism, type(module).__name__, latest), with_kwargs=True),
            module.register_forward_hook(_leaving, always_call=True),
        ))  # fmt: skip
    return mixers


def _replace_hooks(module: torch.nn.Module, attribute: str, handles: tuple) -> None:
    for handle in getattr(module, attribute, ()):
        handle.remove()
    setattr(module, attribute, handles)


class _LatestShard:
    """The SequenceShard of the model's latest call (None: called without one)."""

    def __init__(self):
        self.shard = None

    def record(self, module, args, kwargs):
        self.shard = kwargs.get("sequence_shard")


def _entering(parallelism: SequenceParallelism, name: str, latest: _LatestShard):
    def enter(module, args, kwargs):
        shard = kwargs.get("sequence_shard", latest.shard)
        # Pushed first: the leaving hook runs even when this one raises.
        _stack().append(_Running((parallelism, shard if isinstance(shard, SequenceShard) else None, module)))
        cached = [key for key in ("cache", "cache_params", "past_key_values") if kwargs.get(key) is not None]
        generating = running_step()
        if cached and generating is None:
            raise ValueError(f"{name}: got a cache ({cached[0]}): sequence-parallel mixers run training and prefill "
                             "over the sharded sequence without one, or a sequence-parallel generate; pass "
                             "use_cache=False")  # fmt: skip
        if generating is not None and generating.step.kind == "chunk":
            raise ValueError(f"{name}: a next turn over a sharded cache does not run recurrent mixers yet; generate "
                             "from the whole conversation")  # fmt: skip
        if shard is not None and (not isinstance(shard, SequenceShard) or shard.parallelism != parallelism):
            made = shard.parallelism if isinstance(shard, SequenceShard) else type(shard).__name__
            raise ValueError(
                f"{name}: the batch was sharded for {made}, the model's mixers run {parallelism}: pass shard_batch "
                "the mode, layout and groups given to apply()"
            )

    return enter


def _leaving(module, args, output):
    running = _stack().pop()
    # None: the mixer or its entering hook raised (this hook runs then too).
    if output is not None and not running.dispatched:
        raise ValueError(
            f"{type(module).__name__}: ran without calling a function the package dispatches ({sorted(_RUNS)}), so "
            "its sequence mixing saw this rank's tokens only: its wrappers were replaced (kernels' kernelize?); "
            "apply() runs transformers' own mixing functions"
        )
