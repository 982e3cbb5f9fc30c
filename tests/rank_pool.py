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

import gc
import multiprocessing
import os
import queue
import socket
import sys
import tempfile
import traceback

TIMEOUT_SECONDS = float(os.environ.get("SEQPAR_TEST_TIMEOUT", "300"))
FAILURE_GRACE_SECONDS = 5.0
# Groups a rank may keep (cached by tests, or held where the pool cannot free them: DTensor
# parameters of a finished FSDP2 test) before the pool restarts: each holds three threads.
MAX_GROUPS = 64


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _references_from_torch(c10d, process_group_type) -> dict[int, int]:
    """How many references torch's own registries of process groups hold to each group (by id)."""
    counts: dict[int, int] = {}
    for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag",
                 "pg_coalesce_state"):  # fmt: skip
        registry = getattr(c10d._world, name, None)
        for key, value in registry.items() if isinstance(registry, dict) else ():
            for item in (key, *(value if isinstance(value, list) else (value,))):
                if isinstance(item, process_group_type):
                    counts[id(item)] = counts.get(id(item), 0) + 1
    return counts


def _clear_torch_caches_of_meshes() -> None:
    """DTensor's caches (redistribution plans, sharding propagation) hold the meshes of
    finished tests, hence their groups; dropped here, they are rebuilt on next use."""
    try:
        from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    except ImportError:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = (
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
        getattr(propagator, "propagate_op_sharding", None),
        getattr(propagator, "_propagate_tensor_meta_cached", None),
    )
    clears = [getattr(_redistribute, "clear_redistribute_planner_cache", None)]
    clears += [getattr(cache, "cache_clear", None) for cache in caches]
    for clear in clears:
        if clear is not None:
            clear()


def release_groups_nobody_holds() -> int:
    """Destroys the process groups (meshes' too) that only torch's registries still hold:
    those a finished task made and dropped. Each gloo group keeps three threads that wake
    on their own: hundreds of them, left by the tests that build meshes, made every rank
    of the pools slower (twice the time per collective, half a core each while idle). A
    group a test caches (a module-level mesh, on_ranks.timeout_group) is held, so kept.
    Returns how many groups this rank has left, the world's included. Local to this
    rank: call it once every rank has finished the tasks that used the groups (the pool
    does, after a task that made groups)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._world.default_pg
    candidates: list = [group for group in c10d._world.pg_map if group is not default]
    if not candidates:
        return len(c10d._world.pg_map)
    _clear_torch_caches_of_meshes()
    gc.collect()  # a mesh in a reference cycle of a finished test still holds its groups
    # A probe only this list holds gives the count of a group nothing else holds.
    candidates.append(object())
    totals = [sys.getrefcount(candidates[index]) for index in range(len(candidates))]
    baseline = totals.pop()
    candidates.pop()
    from_torch = _references_from_torch(c10d, dist.ProcessGroup)
    unheld = [index for index in range(len(candidates))
              if totals[index] - baseline == from_torch.get(id(candidates[index]), 0)]  # fmt: skip
    for index in unheld:
        dist.destroy_process_group(candidates[index])
    candidates.clear()
    return len(c10d._world.pg_map)


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.distributed as dist

    # Ranks share 2 cores: one thread each keeps them from fighting.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from torch.distributed import distributed_c10d as c10d

    import seqpar_kernels  # noqa: F401  (load the ops once)

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            results.put((rank, True, value, len(c10d._world.pg_map)))
        except BaseException as error:  # noqa: BLE001 - everything goes back to the test
            message = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            results.put((rank, False, message, len(c10d._world.pg_map)))
    dist.destroy_process_group()


class RankFailure(AssertionError):
    """A rank raised: the message holds every failing rank's traceback."""


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._processes = []
        self._groups_kept = 1
        self.starts = 0  # how often the workers started (the session's summary prints it)
        self.restarts_for_groups = 0

    def _start(self) -> None:
        self.starts += 1
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
        groups = 0
        while len(outcomes) < self.world_size:
            failed = any(not ok for ok, _ in outcomes.values())
            try:
                rank, ok, value, count = self._results.get(timeout=FAILURE_GRACE_SECONDS if failed else TIMEOUT_SECONDS)
            except queue.Empty:
                break
            outcomes[rank] = (ok, value)
            groups = max(groups, count)
        silent = sorted(set(range(self.world_size)) - set(outcomes))
        failures = [f"rank {rank}: {value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        if silent:
            self.close(stuck=True)  # a fresh pool starts next time
            waited = f"{FAILURE_GRACE_SECONDS} s after a failure" if failures else f"{TIMEOUT_SECONDS} s"
            failures.append(f"ranks {silent}: no answer in {waited} (killed)")
        if failures:
            raise RankFailure(f"{fn.__name__} on {self.world_size} ranks failed:\n" + "\n".join(failures))
        if groups > self._groups_kept:
            self._release_groups()
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _release_groups(self) -> None:
        """Destroys the groups the finished task dropped (every rank has finished it);
        restarts the pool when the groups something still holds pass MAX_GROUPS."""
        self._groups_kept = 1 << 30  # the release task itself makes none
        self._groups_kept = max(self.run(release_groups_nobody_holds))
        if self._groups_kept > MAX_GROUPS:
            self.restarts_for_groups += 1
            self.close()

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
        self._groups_kept = 1
