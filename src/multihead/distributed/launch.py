"""Several processes on one machine, sharing one ``torch.distributed`` process group.

:func:`launch` starts the ranks, initialises the group on 127.0.0.1 and a free port, runs a function
on every rank and returns the results in rank order; a failure or a timeout kills every rank.
"""

from __future__ import annotations

import queue as _queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["launch"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launched(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    one_thread: bool,
) -> None:
    try:
        if one_thread:  # a forked child must not use the parent's OpenMP pool (it did not survive fork)
            torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))  # the parent raises it and kills every rank
        return
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh local processes that share one process group.

    Each process initialises ``torch.distributed`` (``backend``: ``"gloo"`` for CPU, ``"nccl"`` with one
    GPU per rank) on 127.0.0.1 and a free port, calls ``fn`` and returns its (picklable) result; the
    list of results is in rank order.

    ``start_method="spawn"`` (default) starts fresh interpreters: ``fn`` must be importable (a
    module-level function of a module, not of ``__main__`` in a notebook) and ``args`` picklable.
    ``"fork"`` (POSIX, CPU only) copies this process instead, so ``fn`` may be defined anywhere -- a
    notebook, a doc page, an interactive session -- and each rank starts in a fraction of the time;
    each forked rank runs with one torch thread (OpenMP thread pools do not survive ``fork``). If a rank
    raises, dies, or the whole run takes longer than ``timeout`` seconds, every process is killed and a
    ``RuntimeError``/``TimeoutError`` (with the rank's traceback) is raised: no process is left running.
    For several machines use ``torchrun`` instead (see docs/distributed.md).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if start_method not in ("spawn", "fork"):
        raise ValueError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
    if start_method == "fork" and backend == "nccl":
        raise ValueError(
            "start_method='fork' cannot start CUDA ranks (CUDA does not survive fork); use 'spawn'"
        )
    ctx = torch.multiprocessing.get_context(start_method)
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_launched,
            args=(r, world_size, port, backend, timeout, fn, args, results, start_method == "fork"),
            daemon=True,
        )
        for r in range(world_size)
    ]
    done: dict[int, Any] = {}
    finished = False
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"launch: ranks {sorted(set(range(world_size)) - set(done))} of {world_size} did not finish "
                    f"within {timeout} s; every process was killed"
                )
            try:
                rank, ok, payload = results.get(timeout=min(left, 0.5))
            except _queue.Empty:
                lost = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if lost:
                    codes = [procs[r].exitcode for r in lost]
                    raise RuntimeError(f"launch: rank(s) {lost} died with exit codes {codes}") from None
                continue
            if not ok:
                raise RuntimeError(f"launch: rank {rank} of {world_size} failed:\n{payload}")
            done[rank] = payload
        finished = True
    finally:
        for p in procs:
            if finished and p.pid is not None:
                p.join(timeout=10)  # normal exit after destroy_process_group
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join()
        results.close()
    return [done[r] for r in range(world_size)]
