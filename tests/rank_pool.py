"""Runs a function on P local gloo ranks, so distributed tests read like local ones.

    results = pool.run(fn, *args)   # fn(*args) on every rank; a list, one per rank

`fn` must be a module-level function (it is pickled by reference). Workers are started
once per world size and reused (starting Python + torch costs seconds). An exception on
any rank is raised in the test with that rank's traceback. The other ranks then get
FAILURE_GRACE_SECONDS to answer (a rank that failed before a collective leaves its peers
waiting in it); those still busy are killed and reported, and the pool restarts on next
use. A hang with no failure kills the pool after TIMEOUT_SECONDS.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import tempfile
import traceback

TIMEOUT_SECONDS = float(os.environ.get("SEQPAR_TEST_TIMEOUT", "300"))
FAILURE_GRACE_SECONDS = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.distributed as dist

    # Ranks share 2 cores: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    import seqpar_kernels  # noqa: F401  (load the ops once)

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - everything goes back to the test
            results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankFailure(AssertionError):
    """A rank raised: the message holds every failing rank's traceback."""


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._processes = []

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        init_file = tempfile.mktemp(prefix="seqpar_gloo_")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._processes = [
            context.Process(
                target=_worker,
                args=(rank, self.world_size, init_file, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()

    def run(self, fn, *args, **kwargs) -> list:
        if not self._processes or not all(p.is_alive() for p in self._processes):
            self.close()
            self._start()
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        outcomes = {}
        while len(outcomes) < self.world_size:
            failed = any(not ok for ok, _ in outcomes.values())
            try:
                rank, ok, value = self._results.get(timeout=FAILURE_GRACE_SECONDS if failed else TIMEOUT_SECONDS)
            except queue.Empty:
                break
            outcomes[rank] = (ok, value)
        silent = sorted(set(range(self.world_size)) - set(outcomes))
        failures = [f"rank {rank}: {value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        if silent:
            self.close(stuck=True)  # a fresh pool starts next time
            waited = f"{FAILURE_GRACE_SECONDS} s after a failure" if failures else f"{TIMEOUT_SECONDS} s"
            failures.append(f"ranks {silent}: no answer in {waited} (killed)")
        if failures:
            raise RankFailure(f"{fn.__name__} on {self.world_size} ranks failed:\n" + "\n".join(failures))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def close(self, stuck: bool = False) -> None:
        """Stops the workers: asks them to finish, or kills them at once when `stuck`."""
        if stuck:
            for process in self._processes:
                process.kill()
        for task_queue in getattr(self, "_tasks", []):
            try:
                task_queue.put(None)
            except (OSError, ValueError):
                pass
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        self._processes = []
