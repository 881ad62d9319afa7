"""Preprocessed per-bag cache of windowed, resized CT slices.

Reading and windowing DICOM files costs far more than a training step, so a :class:`BagIndex` is
preprocessed once (:func:`build_cache`) into::

    cache_dir/
      params.json            preprocessing parameters (windows, size, dtype, format version)
      manifest.json          the cached bags of the last build's index: id, patient, labels, slice count, file
      skipped.json           files and bags left out, with reasons
      bags/<stem>.npy        (S, C, H, W) slices of one bag, in scan order
      bags/<stem>.json       per-bag "done" marker and metadata, written after the .npy

**Storage dtype: uint8** (default). Windowed values live in ``[0, 1]``; 8 bits quantise them in
steps of 1/255 of the window width: 0.31 HU for the brain window (80 HU), 0.78 HU for the
subdural window (200 HU) and 1.5 HU for the soft-tissue window (380 HU) -- all below the
3-10 HU noise of a head CT, so nothing the network could use is lost, at half the size of float16
and a quarter of float32. ``"float16"`` is offered for windows wider than ~1000 HU. Bags are
stored as uncompressed ``.npy`` so that the dataset can memory-map them and read only the slices
it subsamples.

Robustness: every file is written to a temporary file in its directory and moved into place with
``os.replace`` (never a partial file); a bag counts as done only once its marker exists, so an
interrupted run resumes without redoing finished bags (a bag is redone when its source files or
labels changed). A cache is bound to its parameters: building into or opening a cache with
different parameters raises :class:`CacheParamsMismatch`. One writer per cache at a time.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from milgp.data.atomic import atomic_save_npy, atomic_write_json, remove_stale_temporaries
from milgp.data.ct_index import BagIndex, BagRecord
from milgp.data.dicom import HEAD_CT_WINDOWS, DicomReadError, ct_channels, read_hu

__all__ = [
    "BagResult",
    "CACHE_FORMAT_VERSION",
    "CTCache",
    "CacheEntry",
    "CacheParams",
    "CacheParamsMismatch",
    "CacheReport",
    "bag_file_stem",
    "build_cache",
    "check_cache_params",
    "process_bag",
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
        if not self.windows or any(w <= 0 for _, w in self.windows):
            raise ValueError(f"cache windows must be non-empty (center, width > 0) pairs, got {self.windows}")

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


def bag_file_stem(bag_id: str) -> str:
    """File-name stem for a bag: its id with unsafe characters replaced, plus a short hash.

    The hash keeps ids that differ only in replaced characters (``a/b`` vs ``a_b``) apart.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", bag_id)[:80].lstrip(".") or "bag"
    return f"{safe}-{hashlib.sha1(bag_id.encode('utf-8')).hexdigest()[:10]}"


@dataclass
class BagResult:
    """Outcome of :func:`process_bag` for one bag.

    ``status`` is ``"done"`` (computed now), ``"reused"`` (already in the cache) or ``"failed"``
    (``reason`` says why); ``skipped`` lists ``(path, reason)`` for slices left out.
    """

    bag_id: str
    status: str
    num_slices: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    reason: str = ""


def _finished_marker(bags_dir: Path, record: BagRecord) -> dict | None:
    """The marker metadata of a finished bag made from the same files and labels as ``record``
    (``None`` when the bag is not finished or was made from other files or labels)."""
    stem = bag_file_stem(record.bag_id)
    marker_path, npy_path = bags_dir / f"{stem}.json", bags_dir / f"{stem}.npy"
    if not (marker_path.is_file() and npy_path.is_file()):
        return None
    try:
        meta = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    same = (
        meta.get("bag_id") == record.bag_id
        and meta.get("index_slice_paths") == list(record.slice_paths)
        and meta.get("index_slice_labels") == (None if record.slice_labels is None else list(record.slice_labels))
        and meta.get("bag_label") == record.bag_label
        and meta.get("patient_id") == record.patient_id
    )
    return meta if same else None


def process_bag(record: BagRecord, cache_dir: str | os.PathLike[str], params: CacheParams) -> BagResult:
    """Window, resize and store one bag (unless its marker says it is already done).

    Unreadable slices are skipped (and reported); a bag with no readable slice, or with slices of
    different sizes when ``params.size`` is ``None``, fails without writing anything.

    Returns:
        A :class:`BagResult`.
    """
    bags_dir = Path(cache_dir) / "bags"
    stem = bag_file_stem(record.bag_id)
    npy_path, marker_path = bags_dir / f"{stem}.npy", bags_dir / f"{stem}.json"
    meta = _finished_marker(bags_dir, record)
    if meta is not None:
        return BagResult(record.bag_id, "reused", int(meta["num_slices"]), [tuple(s) for s in meta["skipped"]])
    marker_path.unlink(missing_ok=True)
    hus, kept, skipped = [], [], []
    for i, path in enumerate(record.slice_paths):
        try:
            hus.append(read_hu(path))
        except DicomReadError as err:
            skipped.append((err.path, err.reason))
            continue
        kept.append(i)
    if not hus:
        return BagResult(record.bag_id, "failed", 0, skipped, "no readable slice")
    shapes = sorted({h.shape for h in hus})
    if len(shapes) == 1:
        channels = ct_channels(np.stack(hus), params.windows, params.size)
    elif params.size is None:
        return BagResult(record.bag_id, "failed", 0, skipped, f"slices of different sizes {shapes} and no resize size set")
    else:
        channels = np.stack([ct_channels(h, params.windows, params.size) for h in hus])
    atomic_save_npy(npy_path, params.encode(channels))
    labels = None if record.slice_labels is None else [int(record.slice_labels[i]) for i in kept]
    atomic_write_json(
        marker_path,
        {
            "bag_id": record.bag_id,
            "file": npy_path.name,
            "patient_id": record.patient_id,
            "bag_label": record.bag_label,
            "num_slices": len(kept),
            "shape": list(channels.shape),
            "slice_labels": labels,
            "slice_paths": [record.slice_paths[i] for i in kept],
            "series_uid": record.series_uid,
            "ordering": record.ordering,
            "skipped": [list(s) for s in skipped],
            "index_slice_paths": list(record.slice_paths),
            "index_slice_labels": None if record.slice_labels is None else list(record.slice_labels),
        },
    )
    return BagResult(record.bag_id, "done", len(kept), skipped)


@dataclass
class CacheReport:
    """Summary of one :func:`build_cache` run.

    Attributes:
        cache_dir: the cache.
        done: bags computed in this run.
        reused: bags found finished from an earlier run.
        failed: ``(bag_id, reason)`` for bags that produced nothing.
        skipped_files: ``(bag_id, path, reason)`` for slices left out (this run and reused bags),
            plus ``("", path, reason)`` for files the index had already skipped.
        slices_written: slices stored in this run.
        seconds: wall time of this run.
    """

    cache_dir: str
    done: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped_files: list[tuple[str, str, str]] = field(default_factory=list)
    slices_written: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [
            f"cache {self.cache_dir}: {len(self.done)} bags computed ({self.slices_written} slices, "
            f"{self.seconds:.1f} s), {len(self.reused)} reused, {len(self.failed)} failed, "
            f"{len(self.skipped_files)} files skipped"
        ]
        lines += [f"  failed bag {b}: {r}" for b, r in self.failed[:10]]
        lines += [f"  skipped {p} ({'bag ' + b if b else 'index'}): {r}" for b, p, r in self.skipped_files[:10]]
        more = max(0, len(self.failed) - 10) + max(0, len(self.skipped_files) - 10)
        if more:
            lines.append(f"  ... and {more} more, see {Path(self.cache_dir) / 'skipped.json'}")
        return "\n".join(lines)


def check_cache_params(cache_dir: str | os.PathLike[str], params: CacheParams) -> None:
    """Refuse to build into ``cache_dir`` with ``params`` when it holds a cache made with others.

    Writes nothing (a folder without ``params.json`` passes), so a caller can check before it
    writes anything into the folder.

    Raises:
        CacheParamsMismatch: ``cache_dir/params.json`` records other parameters or format version.
    """
    root = Path(cache_dir)
    if (root / "params.json").is_file():
        stored = _read_params(root)
        if stored != params:
            raise CacheParamsMismatch(
                f"{root} was built with {stored.to_json_dict()}, not the requested {params.to_json_dict()}; "
                "use another cache folder or the same parameters"
            )


def _check_or_write_params(cache_dir: Path, params: CacheParams) -> None:
    check_cache_params(cache_dir, params)
    if not (cache_dir / "params.json").is_file():
        atomic_write_json(cache_dir / "params.json", {"format": "milgp-ct-cache", **params.to_json_dict()})


def _read_params(cache_dir: Path) -> CacheParams:
    params_path = cache_dir / "params.json"
    try:
        obj = json.loads(params_path.read_text(encoding="utf-8"))
        if obj.get("format") != "milgp-ct-cache":
            raise ValueError(f"format field is {obj.get('format')!r}")
        if obj.get("version") != CACHE_FORMAT_VERSION:
            raise CacheParamsMismatch(
                f"{cache_dir} has cache format version {obj.get('version')}, this milgp uses {CACHE_FORMAT_VERSION}; rebuild it"
            )
        return CacheParams.from_json_dict(obj)
    except FileNotFoundError:
        raise FileNotFoundError(f"{cache_dir} is not a milgp CT cache (no params.json)") from None
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        if isinstance(err, CacheParamsMismatch):
            raise
        raise ValueError(f"{params_path}: unreadable cache parameters ({err})") from err


def _write_manifest(cache_dir: Path, index: BagIndex) -> list[dict]:
    """Rewrite ``manifest.json``: the finished bags of ``index``, in index order.

    Bags that earlier builds cached from other indexes (or from other files or labels) keep their
    files in ``bags/`` but are not listed, so every reader of the manifest (:class:`CTCache`, the
    datasets and data modules) sees exactly the bags of the last build's index.
    """
    keys = ("bag_id", "file", "patient_id", "bag_label", "num_slices", "shape", "slice_labels")
    metas = (_finished_marker(cache_dir / "bags", record) for record in index.bags)
    bags = [{k: meta[k] for k in keys} for meta in metas if meta is not None]
    atomic_write_json(cache_dir / "manifest.json", {"format": "milgp-ct-cache-manifest", "bags": bags})
    return bags


def _worker_init() -> None:
    """One intra-op thread per worker: the pool supplies the parallelism, and a forked child must
    not enter the parent's OpenMP thread pool."""
    torch.set_num_threads(1)


def build_cache(
    index: BagIndex,
    cache_dir: str | os.PathLike[str],
    params: CacheParams = CacheParams(),
    workers: int = 1,
    progress: bool = True,
    on_bag: Callable[[BagResult], None] | None = None,
) -> CacheReport:
    """Preprocess every bag of ``index`` into ``cache_dir`` (created), resuming a previous run.

    Args:
        index: the bags (slices already in scan order).
        cache_dir: cache folder; may hold an earlier (possibly interrupted) run with the same
            ``params``, whose finished bags are reused.
        params: preprocessing parameters.
        workers: processes (``<= 1``: in this process).
        progress: show a tqdm progress bar.
        on_bag: called in this process with each bag's :class:`BagResult` as it finishes.

    Returns:
        A :class:`CacheReport`; ``manifest.json`` and ``skipped.json`` are (re)written even when
        the run is interrupted.

    Raises:
        CacheParamsMismatch: when ``cache_dir`` holds a cache made with other parameters.
        ValueError: for an empty index.
    """
    if len(index) == 0:
        raise ValueError("the bag index is empty: nothing to cache")
    start = time.perf_counter()
    root = Path(cache_dir)
    (root / "bags").mkdir(parents=True, exist_ok=True)
    _check_or_write_params(root, params)
    remove_stale_temporaries(root / "bags")
    remove_stale_temporaries(root)
    report = CacheReport(cache_dir=str(root))
    report.skipped_files.extend(("", p, r) for p, r in index.skipped)
    bar = tqdm(total=len(index), desc="caching bags", unit="bag", disable=not progress)

    def record(result: BagResult) -> None:
        if result.status == "failed":
            report.failed.append((result.bag_id, result.reason))
        elif result.status == "reused":
            report.reused.append(result.bag_id)
        else:
            report.done.append(result.bag_id)
            report.slices_written += result.num_slices
        report.skipped_files.extend((result.bag_id, p, r) for p, r in result.skipped)
        bar.update(1)
        if on_bag is not None:
            on_bag(result)

    try:
        if workers <= 1:
            for bag in index.bags:
                record(process_bag(bag, root, params))
        else:
            # fork where available: workers start in milliseconds instead of re-importing torch
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init) as pool:
                pending: set[Future[BagResult]] = {pool.submit(process_bag, bag, root, params) for bag in index.bags}
                try:
                    while pending:
                        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for fut in finished:
                            record(fut.result())
                except BaseException:
                    for fut in pending:
                        fut.cancel()
                    raise
    finally:
        bar.close()
        _write_manifest(root, index)
        atomic_write_json(
            root / "skipped.json",
            {
                "failed_bags": [{"bag_id": b, "reason": r} for b, r in report.failed],
                "skipped_files": [{"bag_id": b, "path": p, "reason": r} for b, p, r in report.skipped_files],
            },
        )
        report.seconds = time.perf_counter() - start
    return report


@dataclass(frozen=True)
class CacheEntry:
    """One cached bag as listed in ``manifest.json``.

    ``slice_labels`` are the labels of the stored slices (``None`` when unknown); ``shape`` is the
    stored ``(S, C, H, W)``.
    """

    bag_id: str
    file: str
    patient_id: str
    bag_label: float
    num_slices: int
    shape: tuple[int, int, int, int]
    slice_labels: tuple[int, ...] | None


class CTCache:
    """Read access to a cache written by :func:`build_cache`.

    Args:
        cache_dir: the cache folder.
        expected_params: when given, raise :class:`CacheParamsMismatch` unless the cache was built
            with exactly these parameters.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], expected_params: CacheParams | None = None):
        self.root = Path(cache_dir)
        self.params = _read_params(self.root)
        if expected_params is not None and expected_params != self.params:
            raise CacheParamsMismatch(
                f"{self.root} was built with {self.params.to_json_dict()}, not the expected {expected_params.to_json_dict()}"
            )
        manifest_path = self.root / "manifest.json"
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.root}: no manifest.json; run build_cache (milgp-cache) first") from None
        self.entries: list[CacheEntry] = [
            CacheEntry(
                bag_id=e["bag_id"], file=e["file"], patient_id=e["patient_id"], bag_label=float(e["bag_label"]),
                num_slices=int(e["num_slices"]), shape=tuple(e["shape"]),
                slice_labels=None if e["slice_labels"] is None else tuple(e["slice_labels"]),
            )
            for e in manifest["bags"]
        ]
        self._by_id = {e.bag_id: e for e in self.entries}

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def bag_ids(self) -> list[str]:
        return [e.bag_id for e in self.entries]

    def entry(self, bag_id: str) -> CacheEntry:
        """The manifest entry of a bag (``KeyError`` naming the bag and cache when absent)."""
        try:
            return self._by_id[bag_id]
        except KeyError:
            raise KeyError(f"bag {bag_id!r} is not in the cache {self.root}") from None

    def load(self, bag_id: str, mmap: bool = True) -> np.ndarray:
        """The stored ``(S, C, H, W)`` array of a bag (storage dtype; memory-mapped when ``mmap``)."""
        path = self.root / "bags" / self.entry(bag_id).file
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)

    def skipped_report(self) -> dict:
        """The ``skipped.json`` content of the last build (``{}`` when absent)."""
        path = self.root / "skipped.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
