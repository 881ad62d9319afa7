"""Process pools for the CT data path (``docs/ct_data.md``, "The cache": parallel, fault isolation).

A ``ProcessPoolExecutor`` worker outlives a parent killed with ``SIGKILL`` (the pool's shutdown code
never runs): :func:`process_pool` makes workers that die with their parent.
A worker that dies breaks the whole pool (``BrokenProcessPool`` for every unfinished task):
:func:`run_isolated` retries those items one per fresh process, so only an item that kills its
worker again is lost, and reported.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Sequence, TypeVar

import torch

__all__ = ["process_pool", "run_isolated"]

T = TypeVar("T")
R = TypeVar("R")

_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_WATCH_INTERVAL_S)
    os._exit(1)


def _init_worker(parent_pid: int) -> None:
    """One intra-op torch thread per worker (the pool supplies the parallelism, and a forked child
    must not enter the parent's OpenMP thread pool), and exit as soon as ``parent_pid`` is no longer
    the parent: on Linux the kernel delivers ``SIGKILL`` when the parent dies; elsewhere a daemon
    thread polls ``os.getppid()`` every half second. A parent that died before this call is noticed
    at once."""
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="milgp-parent-watch").start()
    if os.getppid() != parent_pid:
        os._exit(1)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes (fork where available: workers start in milliseconds instead
    of re-importing torch) that die with this process."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(),))


def _apply(fn: Callable[[T], R], chunk: list[T]) -> list[R]:
    return [fn(x) for x in chunk]


def run_isolated(
    fn: Callable[[T], R],
    items: Sequence[T],
    workers: int,
    on_result: Callable[[int, R], None],
    on_crash: Callable[[int], None],
    chunk: int = 1,
) -> None:
    """Run ``fn`` on every item in a pool of ``workers`` processes (:func:`process_pool`), or in this
    process, in order, when ``workers <= 1``.

    ``on_result(i, fn(items[i]))`` is called in this process as results arrive (in any order),
    ``chunk`` items per task. When a worker dies, the unfinished items are run one per fresh
    single-process pool; ``on_crash(i)`` is called for an item whose worker dies again. ``fn``
    must be picklable (a module-level function, or a ``functools.partial`` of one).
    """
    if workers <= 1:
        for i, item in enumerate(items):
            on_result(i, fn(item))
        return
    pending = list(range(len(items)))
    isolate = False
    while pending:
        if isolate:
            batches, pending = [pending[:1]], pending[1:]
        else:
            batches, pending = [pending[k:k + chunk] for k in range(0, len(pending), chunk)], []
        crashed: list[int] = []
        with process_pool(1 if isolate else workers) as pool:
            futures = {pool.submit(_apply, fn, [items[i] for i in batch]): batch for batch in batches}
            try:
                for fut in as_completed(futures):
                    try:
                        results = fut.result()
                    except BrokenProcessPool:
                        crashed += futures[fut]
                        continue
                    for i, result in zip(futures[fut], results):
                        on_result(i, result)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
        if crashed and isolate:
            on_crash(crashed[0])
        elif crashed:
            isolate = True
            pending = sorted(crashed) + pending
