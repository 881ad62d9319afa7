"""Atomic file writes: write a temporary file in the target's directory, then ``os.replace``.

A reader (or a resumed run after a crash) sees either the old file or the complete new one, never
a partial file. Temporary files are named ``.<name>.tmp-<random>`` so that
:func:`remove_stale_temporaries` can clean up after a process that was killed mid-write.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np

__all__ = ["TMP_MARKER", "atomic_open", "atomic_save_npy", "atomic_write_json", "atomic_write_text", "remove_stale_temporaries"]

#: Infix of temporary file names (``.<name>.tmp-<random>``).
TMP_MARKER = ".tmp-"


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on success ``fsync`` + ``os.replace`` it onto ``path``.

    On any exception inside the ``with`` block the temporary file is removed and ``path`` is left
    untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}{TMP_MARKER}", dir=target.parent)
    binary = "b" in mode
    try:
        with os.fdopen(fd, mode, encoding=None if binary else encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
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
