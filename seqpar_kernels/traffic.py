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


# One stack for the whole process, not one per thread: on CUDA the autograd engine
# runs the backward (and its collectives) on a worker thread of its own, and a
# per-thread stack there would count none of the backward's bytes.
_lock = threading.Lock()
_active: list[CommStats] = []


@contextlib.contextmanager
def comm_stats():
    """Counts the bytes that seqpar's collectives send inside the block.

    >>> with comm_stats() as stats:
    ...     out = ulysses_attention(q, k, v)
    >>> stats.bytes_sent  # (P-1)/P x (q + k + v + o) bytes with even heads

    Blocks nest: an inner block's bytes count in the outer one too. A block counts
    what this process sends from any thread while it is open, the backward that the
    autograd engine runs on its own thread included.
    """
    stats = CommStats()
    with _lock:
        _active.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _active.remove(stats)


def record_sent(num_bytes: int) -> None:
    """Called by every seqpar collective with the bytes it sends to other ranks."""
    with _lock:
        for stats in _active:
            stats.bytes_sent += num_bytes
            stats.calls += 1
