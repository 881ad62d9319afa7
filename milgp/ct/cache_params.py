"""The preprocessing parameters that bind a CT cache (``params.json``).

**Storage dtype: uint8** (default): steps of 1/255 of a window's width are below the noise of a
head CT (the numbers are in ``docs/ct_data.md``, "The cache"); ``"float16"`` is offered for windows
wider than ~1000 HU.

A cache is bound to its parameters: building into or opening a cache with different parameters
raises :class:`CacheParamsMismatch`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from milgp.data.atomic import atomic_write_json
from milgp.ct.report_entry import printable
from milgp.ct.windows import HEAD_CT_WINDOWS

__all__ = [
    "CACHE_FORMAT_VERSION",
    "CacheParams",
    "CacheParamsMismatch",
    "check_cache_params",
    "read_cache_params",
    "write_cache_params",
]

#: Version of the on-disk cache layout; bump when the stored arrays change meaning.
CACHE_FORMAT_VERSION = 1
_DTYPES = ("uint8", "float16")


class CacheParamsMismatch(ValueError):
    """A cache exists with preprocessing parameters different from the requested ones."""


@dataclass(frozen=True)
class CacheParams:
    """Preprocessing parameters recorded in (and binding) a cache.

    Attributes:
        windows: ``(center, width)`` display windows in HU, one per channel.
        size: output ``(H, W)`` in pixels, or ``None`` to keep the native size (then all slices of
            a bag must share one size).
        dtype: storage dtype, ``"uint8"`` (values ``round(255 * x)``) or ``"float16"``.
        version: :data:`CACHE_FORMAT_VERSION`.
    """

    windows: tuple[tuple[float, float], ...] = HEAD_CT_WINDOWS
    size: tuple[int, int] | int | None = (256, 256)
    dtype: str = "uint8"
    version: int = CACHE_FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "windows", tuple((float(c), float(w)) for c, w in self.windows))
        if self.size is not None:
            size = (self.size, self.size) if isinstance(self.size, int) else tuple(int(s) for s in self.size)
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"cache size must be a positive (H, W), got {self.size}")
            object.__setattr__(self, "size", size)
        if self.dtype not in _DTYPES:
            raise ValueError(f"cache dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not self.windows or any(not (math.isfinite(c) and math.isfinite(w)) or w <= 0 for c, w in self.windows):
            raise ValueError(f"cache windows must be non-empty (center, width > 0) pairs of finite numbers, got {self.windows}")

    def to_json_dict(self) -> dict:
        return {"windows": [list(w) for w in self.windows], "size": None if self.size is None else list(self.size),
                "dtype": self.dtype, "version": self.version}

    @classmethod
    def from_json_dict(cls, obj: dict) -> "CacheParams":
        return cls(
            windows=tuple(tuple(w) for w in obj["windows"]),
            size=None if obj["size"] is None else tuple(obj["size"]),
            dtype=obj["dtype"],
            version=int(obj["version"]),
        )

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Windowed float values in ``[0, 1]`` -> storage dtype."""
        if self.dtype == "uint8":
            return np.rint(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)
        return x.astype(np.float16)

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """Storage dtype -> float32 in ``[0, 1]``."""
        if self.dtype == "uint8":
            return stored.astype(np.float32) * np.float32(1.0 / 255.0)
        return stored.astype(np.float32)


def check_cache_params(cache_dir: str | os.PathLike[str], params: CacheParams) -> None:
    """Refuse to build into ``cache_dir`` with ``params`` when it holds a cache made with others.

    Writes nothing (a folder without ``params.json`` passes), so a caller can check before it
    writes anything into the folder.

    Raises:
        CacheParamsMismatch: ``cache_dir/params.json`` records other parameters or format version.
    """
    root = Path(cache_dir)
    if (root / "params.json").is_file():
        stored = read_cache_params(root)
        if stored != params:
            raise CacheParamsMismatch(
                f"{printable(root)} was built with {stored.to_json_dict()}, not the requested {params.to_json_dict()}; "
                "use another cache folder or the same parameters"
            )


def write_cache_params(cache_dir: Path, params: CacheParams) -> None:
    """Record ``params`` in a new cache (:func:`check_cache_params` first: an existing cache must match)."""
    check_cache_params(cache_dir, params)
    if not (cache_dir / "params.json").is_file():
        atomic_write_json(cache_dir / "params.json", {"format": "milgp-ct-cache", **params.to_json_dict()})


def read_cache_params(cache_dir: Path) -> CacheParams:
    """The parameters recorded in ``cache_dir/params.json``.

    Raises:
        FileNotFoundError: naming the folder when it is not a cache.
        CacheParamsMismatch: for another cache format version.
        ValueError: naming the file when it is unreadable.
    """
    params_path = cache_dir / "params.json"
    try:
        obj = json.loads(params_path.read_text(encoding="utf-8"))
        if obj.get("format") != "milgp-ct-cache":
            raise ValueError(f"format field is {obj.get('format')!r}")
        if obj.get("version") == CACHE_FORMAT_VERSION:
            return CacheParams.from_json_dict(obj)
    except FileNotFoundError:
        raise FileNotFoundError(f"{printable(cache_dir)} is not a milgp CT cache (no params.json)") from None
    except (KeyError, TypeError, AttributeError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{printable(params_path)}: unreadable cache parameters ({type(err).__name__}: {err})") from None
    raise CacheParamsMismatch(
        f"{printable(cache_dir)} has cache format version {obj.get('version')}, this milgp uses {CACHE_FORMAT_VERSION}; rebuild it"
    )
