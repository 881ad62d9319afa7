"""Process pools for the CT data path whose workers die with the process that started them.

A ``ProcessPoolExecutor`` worker outlives its parent when the parent is killed with ``SIGKILL``
(the pool's shutdown code never runs), and keeps writing into a cache that a rerun is about to
rebuild. Workers made by :func:`process_pool` ask the kernel to kill them when their parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux) or, where that call does not exist, watch
``os.getppid()`` from a daemon thread and exit once it changes.
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
from concurrent.futures import ProcessPoolExecutor

import torch

__all__ = ["die_with_parent", "process_pool"]

_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_WATCH_INTERVAL_S)
    os._exit(1)


def die_with_parent(parent_pid: int) -> None:
    """Make this (child) process exit as soon as ``parent_pid`` is no longer its parent.

    On Linux the kernel delivers ``SIGKILL`` when the parent dies; elsewhere a daemon thread polls
    ``os.getppid()`` every half second. A parent that died before this call is noticed at once.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="milgp-parent-watch").start()
    if os.getppid() != parent_pid:
        os._exit(1)


def _init_worker(parent_pid: int) -> None:
    """One intra-op torch thread per worker (the pool supplies the parallelism, and a forked child
    must not enter the parent's OpenMP thread pool), and death with the parent."""
    torch.set_num_threads(1)
    die_with_parent(parent_pid)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes (fork where available: workers start in milliseconds instead
    of re-importing torch) that die with this process."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(),))
