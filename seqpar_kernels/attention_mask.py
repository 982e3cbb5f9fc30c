"""The attention mask: which key positions each query position attends, as one pure value.

    AttentionMask(causal, window, chunk_size, cu_seqlens)

Every path of the package reads this value: the public attention functions build it once
from their arguments (AttentionMask.checked), the engine's custom ops carry it as
primitive arguments and rebuild it (engine/attention_ops.py, the one place that encodes
and decodes it), the ring cuts it into steps (engine/step_masks.py), and the model
adapters translate a model's mask functions into it (the transformers integration reads
transformers' mask functions as one).

No torch.distributed and no other module of the package: a mask is a function of
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# No bound on that side of a window.
UNBOUNDED = -1


@dataclass(frozen=True)
class AttentionMask:
    """Which key positions each query position attends, over a sequence of global
    positions (flash-attention's conventions):

        causal       key j <= query i
        window       (left, right): i - left <= j <= i + right; -1 is no bound on that side
        chunk_size   None, or a query sees only the keys of its own chunk: positions
                     counted from its document's start, cut every chunk_size (Llama 4's
                     chunked attention)
        cu_seqlens   None (one sequence), or document bounds from 0 to the total,
                     increasing: a query sees only the keys of its own document

    Every combination keeps the keys a query sees one interval of positions, which
    contains the query itself (key_bounds), and the queries that see a key one interval
    (query_bounds); both bounds grow with the position. The step kernels take them."""

    causal: bool = False
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    chunk_size: int | None = None
    cu_seqlens: tuple[int, ...] | None = None

    @classmethod
    def checked(cls, causal, window_size=(-1, -1), attention_chunk_size=None, cu_seqlens=None) -> AttentionMask:
        """The mask of a public call's arguments; raises ValueError naming a bad one.
        causal: a bool; window_size: (left, right), two ints >= -1; attention_chunk_size:
        None or an int >= 1; cu_seqlens: None or document bounds (already checked)."""
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")
        valid = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
            isinstance(side, int) and not isinstance(side, bool) and side >= UNBOUNDED for side in window_size
        )  # fmt: skip
        if not valid:
            raise ValueError(
                "window_size must be (left, right), two ints >= -1 (-1: no bound on that side), got "
                f"{window_size!r:.80}"
            )
        chunk = attention_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"attention_chunk_size must be None or an int >= 1, got {chunk!r:.80}")
        return cls(causal, tuple(window_size), chunk, None if cu_seqlens is None else tuple(cu_seqlens))

    @property
    def has_documents(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def is_local(self) -> bool:
        """Whether a window or chunks bound the keys a query sees (beyond documents)."""
        return self.window != (UNBOUNDED, UNBOUNDED) or self.chunk_size is not None

    def with_documents(self, cu_seqlens: Sequence[int] | None) -> AttentionMask:
        """The same pattern inside each document bounded by cu_seqlens."""
        return AttentionMask(self.causal, self.window, self.chunk_size, None if cu_seqlens is None else
                             tuple(cu_seqlens))  # fmt: skip

    def document_bounds(self, total: int) -> tuple[int, ...]:
        """cu_seqlens, or one document of `total` positions."""
        return self.cu_seqlens if self.cu_seqlens is not None else (0, total)

    def key_bounds(self, positions, starts, ends):
        """[low, high) of the key positions the queries at `positions` attend, whose
        documents span [starts, ends); int64 tensors or ints alike."""
        left, right = self.window
        # Causal: no key after the query, whatever the window's right side.
        return self._bounds(positions, starts, ends, left, 0 if self.causal else right)

    def query_bounds(self, positions, starts, ends):
        """[low, high) of the query positions that attend the keys at `positions`: the
        window seen from the key's side (a key is seen from `right` positions before it
        to `left` after it; causal: from itself on)."""
        left, right = self.window
        return self._bounds(positions, starts, ends, 0 if self.causal else right, left)

    def _bounds(self, positions, starts, ends, before: int, after: int):
        """[low, high) of the positions from `before` positions before each of
        `positions` to `after` after it (-1: unbounded), inside its document
        [starts, ends) and its chunk."""
        low, high = starts, ends
        if before >= 0:
            low = _maximum(low, positions - before)
        if after >= 0:
            high = _minimum(high, positions + after + 1)
        if self.chunk_size is not None:
            chunk_start = starts + (positions - starts) // self.chunk_size * self.chunk_size
            low, high = _maximum(low, chunk_start), _minimum(high, chunk_start + self.chunk_size)
        return low, high

    def allows(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """Whether query position q_idx attends key position kv_idx (broadcast int
        tensors), in one sequence starting at 0 (documents are not read here)."""
        start = torch.zeros((), dtype=torch.long, device=q_idx.device)
        end = torch.full((), torch.iinfo(torch.long).max // 2, dtype=torch.long, device=q_idx.device)
        low, high = self.key_bounds(q_idx, start, end)
        return (kv_idx >= low) & (kv_idx < high)

    def __and__(self, other: AttentionMask) -> AttentionMask:
        """The keys both allow, where that is one mask again (chunks of sizes that
        divide each other, the same documents); else ValueError."""

        def tighter(a: int, b: int) -> int:
            return b if a < 0 else a if b < 0 else min(a, b)

        chunks = [size for size in (self.chunk_size, other.chunk_size) if size is not None]
        if len(chunks) == 2 and max(chunks) % min(chunks):
            raise ValueError(f"sequence-parallel attention: chunks of {chunks[0]} and of {chunks[1]} positions at once")
        documents = {bounds for bounds in (self.cu_seqlens, other.cu_seqlens) if bounds is not None}
        if len(documents) > 1:
            raise ValueError("sequence-parallel attention: two masks over different documents at once")
        return AttentionMask(
            self.causal or other.causal,
            (tighter(self.window[0], other.window[0]), tighter(self.window[1], other.window[1])),
            min(chunks) if chunks else None,
            next(iter(documents), None),
        )


def _minimum(a, b):
    return torch.minimum(a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else min(a, b)


def _maximum(a, b):
    return torch.maximum(a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else max(a, b)
