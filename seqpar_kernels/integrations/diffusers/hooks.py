"""The hooks apply() installs on a diffusers transformer: one call's state (Call), the
hooks every mode shares (Hooks), ulysses/ring/usp through a TokenPlan (TokenSharding),
and the attention that replaces torch's SDPA inside the plan's attention modules
(SequenceParallelAttention). DSP's hooks are dsp.py's.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from seqpar_kernels.integrations.diffusers.plans import Gather, Split, TokenPlan
from seqpar_kernels.parallel.parallelism import SequenceParallelism

__all__ = ["Call", "Hooks", "TokenSharding"]

# ----------------------------------------------------------------------------------
# one call of the transformer
# ----------------------------------------------------------------------------------


@dataclass
class Call:
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


def describe_inputs(value):
    """What every rank's inputs must agree on: shapes and dtypes of the tensors, the
    plain values; nested in tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (tuple, list)):
        return tuple(describe_inputs(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, describe_inputs(item)) for key, item in sorted(value.items(), key=lambda kv: str(kv[0])))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def parameter_names(module: torch.nn.Module) -> list[str]:
    return list(inspect.signature(module.forward).parameters)


def change_argument(names: list[str], args: tuple, kwargs: dict, argument: str, change):
    """(args, kwargs) with change(value) in place of `argument` (by name, or at its
    position in `names`, the forward's parameters); unchanged when it was not passed."""
    if argument in kwargs:
        return args, dict(kwargs, **{argument: change(kwargs[argument])})
    position = names.index(argument) if argument in names else len(args)
    if position < len(args):
        return args[:position] + (change(args[position]),) + args[position + 1 :], kwargs
    return args, kwargs


def modules_matching(transformer: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
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


class SequenceParallelAttention(TorchFunctionMode):
    """Active while an attention module of the plan runs: its processor's call of
    scaled_dot_product_attention on (B, H, S_r, D) tensors becomes ours on their
    (B, S_r, H, D) views. Everything else passes through."""

    def __init__(self, sharding: TokenSharding, module_name: str):
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


class Hooks:
    """The hooks apply() installed on one transformer, and the call they share."""

    def __init__(self, transformer: torch.nn.Module, parallelism: SequenceParallelism):
        self.transformer, self.parallelism = transformer, parallelism
        self.name = type(transformer).__name__
        self.handles: list = []
        self.call: Call | None = None
        self.forward_names = parameter_names(transformer)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def describe(self) -> str:
        return f"{self.parallelism.mode} on {self.name}"

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece of x along dim: a slice (its gradient is zero elsewhere),
        made contiguous for the model code that views it."""
        return self.parallelism.take(x, dim).contiguous()

    def start_call(self, args, kwargs) -> dict:
        """The bound arguments of a call of the transformer, after every rank agreed on them."""
        bound = inspect.signature(self.transformer.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        device = next((value.device for value in arguments.values() if isinstance(value, torch.Tensor)), None)
        # Every rank must call the transformer with the same full inputs.
        describe = f"{self.describe()}: the ranks were called with different inputs"
        self.parallelism.agree(describe, describe_inputs(arguments), device)
        return arguments

    def input_hook(self, module: torch.nn.Module, argument: str, change) -> None:
        """Run change(value) -> value on `argument` of module's forward, positional or not."""
        names = parameter_names(module)
        self.handles.append(
            module.register_forward_pre_hook(
                lambda module, args, kwargs: change_argument(names, args, kwargs, argument, change), with_kwargs=True
            )
        )


class TokenSharding(Hooks):
    """ulysses, ring and usp through a TokenPlan."""

    def __init__(self, transformer, parallelism: SequenceParallelism, plan: TokenPlan):
        super().__init__(transformer, parallelism)
        self.plan = plan
        root_splits = [split for split in plan.splits if split.module == ""]
        self.handles.append(transformer.register_forward_pre_hook(
            lambda module, args, kwargs: self._enter(args, kwargs, root_splits), with_kwargs=True))  # fmt: skip
        self.handles.append(transformer.register_forward_hook(lambda module, args, output: self._leave()))
        for split in plan.splits:
            if split.module == "":
                continue
            modules = modules_matching(transformer, split.module)
            if not modules:
                raise ValueError(f"apply: {self.name} has no submodule {split.module!r}: this diffusers "
                                 "release's model is not the one the plan was written for")  # fmt: skip
            for module in modules:
                if split.argument is None:
                    self.handles.append(module.register_forward_hook(
                        lambda module, args, output, split=split: self._split(split, output)))  # fmt: skip
                else:
                    self.input_hook(module, split.argument, lambda value, split=split: self._split(split, value))
        for gather in plan.gathers:
            for module in modules_matching(transformer, gather.module):
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
            raise ValueError(f"apply: {self.name} has no attention module {plan.attention}")
        for name, module in self.attention_modules:
            self._intercept(name, module)

    # -- the call --------------------------------------------------------------

    def _enter(self, args, kwargs, root_splits):
        arguments = self.start_call(args, kwargs)
        self.call = Call(arguments)
        if self.plan.check is not None:
            self.plan.check(arguments)
        for split in root_splits:
            args, kwargs = change_argument(self.forward_names, args, kwargs, split.argument,
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
            pieces = self.take(x.unflatten(split.dim, (-1, total)), split.dim + 1)
            return pieces.flatten(split.dim, split.dim + 1)
        total = x.shape[split.dim]
        if split.tokens:
            if total < self.parallelism.pieces:
                where = f"{split.module or 'the transformer'}'s {split.argument or 'output'} {tuple(x.shape)}"
                raise ValueError(f"{self.describe()}: {total} tokens along dim {split.dim} of {where}, fewer than the "
                                 f"{self.parallelism.pieces} ranks: every rank needs one")  # fmt: skip
            call.token_totals[split] = total
        return self.take(x, split.dim)

    def _gather(self, gather: Gather, output):
        if not isinstance(output, torch.Tensor):
            raise ValueError(f"{self.describe()}: {gather.module} returned {type(output).__name__}, not a tensor")
        call = self.call
        # The output holds the tokens of the first token split (the video's, not the text's).
        total = next(iter(call.token_totals.values()), 0)
        if output.shape[gather.dim] != self.parallelism.piece_lengths(total)[self.parallelism.piece]:
            raise ValueError(f"{self.describe()}: {gather.module}'s output {tuple(output.shape)} is not this rank's "
                             f"piece of the {total} video tokens along dim {gather.dim}")  # fmt: skip
        call.gathered = True
        return self.parallelism.gather(output, gather.dim, total)

    # -- attention ---------------------------------------------------------------

    def _intercept(self, name: str, module: torch.nn.Module) -> None:
        modes: list[SequenceParallelAttention] = []

        def enter(module, args, kwargs):
            mode = SequenceParallelAttention(self, name)
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
            per_split = [self.parallelism.piece_lengths(total) for total in self.call.token_totals.values()]
            sizes = [sum(piece) for piece in zip(*per_split)]
        local = q.shape[2]
        if sizes is None or k.shape[2] != local or sizes[self.parallelism.piece] != local:
            raise ValueError(
                f"{describe}: query {tuple(q.shape)} and key {tuple(k.shape)} are not this rank's "
                f"{None if sizes is None else sizes[self.parallelism.piece]} tokens of the sharded sequence: this "
                "diffusers release's model is not the one the plan was written for"
            )
        # (B, H, S_r, D) -> (B, S_r, H, D): views.
        out = self.parallelism.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         softmax_scale=call.get("scale"), seq_lens=list(sizes))  # fmt: skip
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
