"""comm_stats: the one place where payload bytes are counted."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass


@dataclass
class CommStats:
    """Payload bytes this rank sent to other ranks (its own share excluded), and how
    many collective or point-to-point calls carried them."""

    bytes_sent: int = 0
    calls: int = 0


_active = threading.local()


def _stack() -> list[CommStats]:
    if not hasattr(_active, "stack"):
        _active.stack = []
    return _active.stack


@contextlib.contextmanager
def comm_stats():
    """Counts the bytes that seqpar's collectives send inside the block.

    >>> with comm_stats() as stats:
    ...     out = ulysses_attention(q, k, v)
    >>> stats.bytes_sent  # (P-1)/P x (q + k + v + o) bytes with even heads

    Blocks nest: an inner block's bytes count in the outer one too.
    """
    stats = CommStats()
    _stack().append(stats)
    try:
        yield stats
    finally:
        _stack().remove(stats)


def record_sent(num_bytes: int) -> None:
    """Called by every seqpar collective with the bytes it sends to other ranks."""
    for stats in _stack():
        stats.bytes_sent += num_bytes
        stats.calls += 1
