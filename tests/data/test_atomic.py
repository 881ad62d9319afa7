"""milgp.data.atomic: finished files get the permissions of the umask, like open(path, "w") would give them."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

import milgp.data.atomic as atomic
from milgp.data.atomic import atomic_save_npy, atomic_write_json, atomic_write_text, current_umask


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_atomic_writes_respect_the_umask(tmp_path: Path, umask: int) -> None:
    """Files written atomically must have mode 0o666 & ~umask, not mkstemp's owner-only 0o600: otherwise a
    cache built by one user cannot be read by the group that trains on it."""
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        atomic_write_text(tmp_path / "a.txt", "x")
        atomic_write_json(tmp_path / "b.json", {"a": 1})
        atomic_save_npy(tmp_path / "c.npy", np.zeros(3))
    finally:
        os.umask(old)
    for name in ("a.txt", "b.json", "c.npy"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def test_full_disk_names_the_file_and_keeps_the_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails on a full disk (the error from fsync names no file) must raise an OSError naming the
    target, leave its previous content intact and no temporary file behind."""
    target = tmp_path / "manifest.json"
    atomic_write_json(target, {"old": True})

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device") as err:
        atomic_write_json(target, {"new": True})
    assert err.value.filename == str(target) and err.value.errno == errno.ENOSPC
    assert json.loads(target.read_text()) == {"old": True} and os.listdir(tmp_path) == ["manifest.json"]
