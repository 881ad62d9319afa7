"""Atomic file writes: write a temporary file in the target's directory, then ``os.replace``.

A reader (or a resumed run after a crash) sees either the old file or the complete new one, never
a partial file. Temporary files are named ``.<name>.tmp-<random>`` so that
:func:`remove_stale_temporaries` can clean up after a process that was killed mid-write. The
finished file gets the permissions an ordinary ``open(path, "w")`` would give it
(``0o666 & ~umask``), not the owner-only mode of :func:`tempfile.mkstemp`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np

__all__ = [
    "TMP_MARKER",
    "atomic_open",
    "atomic_save_npy",
    "atomic_write_json",
    "atomic_write_text",
    "current_umask",
    "file_sha256",
    "remove_stale_temporaries",
]

#: Infix of temporary file names (``.<name>.tmp-<random>``).
TMP_MARKER = ".tmp-"
_UMASK_RE = re.compile(r"^Umask:\s*([0-7]+)\s*$", re.MULTILINE)


def current_umask() -> int:
    """The process umask, read without changing it (``/proc/self/status`` on Linux).

    Where ``/proc`` is unavailable it is read by setting and restoring it, which is not safe
    against other threads creating files at the same instant.
    """
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as fh:
        match = _UMASK_RE.search(fh.read())
        if match is not None:
            return int(match.group(1), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8", errors: str | None = None
) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on success ``fsync`` + ``os.replace`` it onto ``path``.

    ``encoding`` and ``errors`` apply to text modes.

    On any exception inside the ``with`` block the temporary file is removed and ``path`` is left
    untouched; an ``OSError`` that names no file (a full disk) is raised again naming ``path``.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}{TMP_MARKER}", dir=target.parent)
    binary = "b" in mode
    try:
        with os.fdopen(fd, mode, encoding=None if binary else encoding, errors=None if binary else errors) as fh:
            yield fh
            fh.flush()
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename is None:  # os.write/fsync errors (a full disk) name no file
            raise OSError(err.errno, err.strerror or str(err), str(target)) from err
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_open(path, "w") as fh:
        fh.write(text)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_save_npy(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Save ``array`` in ``.npy`` format to ``path`` atomically (``path`` should end in ``.npy``)."""
    with atomic_open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[str]:
    """Delete temporary files left in ``directory`` by a killed writer; returns their paths.

    Only safe when no other process is writing into ``directory``.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith(".") and TMP_MARKER in p.name and p.is_file()]
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return [str(p) for p in stale]
