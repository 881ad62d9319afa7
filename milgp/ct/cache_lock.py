"""The writer lock of a CT cache: one writing process per cache folder at a time.

How a second writer is refused or waits, and how the lock file of a killed writer is taken over, is
described in ``docs/ct_data.md``, "The cache". The file is removed on release; a writer checks after
locking that the file it locked is still the one in the folder, so a release racing with a new
writer never leaves two holders. The lock is re-entrant within a process (the CLI holds it around
indexing, ``build_cache`` and the splits; ``build_cache`` takes it again), and it is not inherited
by forked pool workers.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from milgp.data.atomic import current_umask
from milgp.ct.report_entry import printable

__all__ = ["CacheLock", "CacheLockedError", "LOCK_FILE_NAME"]

#: Name of the lock file inside a cache folder.
LOCK_FILE_NAME = "milgp-cache.lock"
_POLL_S = 0.2


class CacheLockedError(RuntimeError):
    """Another live process holds the cache's writer lock."""


def _holder_text(lock_path: Path) -> tuple[str, int | None]:
    """``(description, pid)`` of the holder recorded in the lock file (``pid`` ``None`` when unreadable)."""
    try:
        info = json.loads(lock_path.read_text(encoding="utf-8"))
        pid = int(info["pid"])
        return f"PID {pid} on {info.get('host', '?')} (since {info.get('started', '?')})", pid
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose PID is not recorded yet", None


class CacheLock:
    """Exclusive writer lock on a cache folder (a context manager); says on stderr when it waits for
    another writer or takes over a stale lock.

    Args:
        cache_dir: the cache folder (created if missing).
        wait_s: how long to wait for another writer to finish: ``0`` refuses at once (default),
            ``math.inf`` waits without limit.

    Raises:
        CacheLockedError: on enter, naming the lock file and the PID holding it, when another
            process holds the lock after ``wait_s`` seconds.
    """

    _held: dict[str, "CacheLock"] = {}

    def __init__(self, cache_dir: str | os.PathLike[str], wait_s: float = 0.0):
        self.root = Path(cache_dir)
        self.path = self.root / LOCK_FILE_NAME
        self.wait_s = float(wait_s)
        self.took_over: str = ""
        self._fd: int | None = None
        self._owner_pid = 0
        self._nested = False  # entered while this process already held the lock: the outer one releases it

    def _try_lock(self) -> bool:
        """One attempt: lock the file now in the folder; ``True`` when this process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise OSError(err.errno, f"cannot lock ({err.strerror}; does this file system support flock?)", str(self.path)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the previous holder removed the file between our open and our lock
            os.close(fd)
            return self._try_lock()
        self._fd = fd
        return True

    def __enter__(self) -> "CacheLock":
        key = str(self.root.resolve())
        held = CacheLock._held.get(key)
        if held is not None and held._owner_pid == os.getpid():
            self._nested = True
            return held
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        announced = False
        while not self._try_lock():
            holder, _ = _holder_text(self.path)
            if time.monotonic() >= deadline:
                hint = "" if self.wait_s > 0 else "; rerun with --wait to wait for it"
                raise CacheLockedError(
                    f"{printable(self.path)}: the cache is being written by {holder}{hint} "
                    "(delete the lock file only if that process is gone)"
                )
            if not announced:
                limit = "" if math.isinf(self.wait_s) else f" (at most {self.wait_s:g} s)"
                print(f"milgp-cache: waiting for {holder}, which holds {printable(self.path)}{limit}", file=sys.stderr)
                announced = True
            time.sleep(_POLL_S)
        previous, pid = _holder_text(self.path)
        if pid is not None and pid != os.getpid():
            self.took_over = f"took over the stale lock {printable(self.path)} left by {previous}, which no longer holds it"
            print(f"milgp-cache: {self.took_over}", file=sys.stderr)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
        os.fchmod(self._fd, 0o666 & ~current_umask())
        self._owner_pid = os.getpid()
        CacheLock._held[key] = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._nested:
            self._nested = False
            return
        CacheLock._held.pop(str(self.root.resolve()), None)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

