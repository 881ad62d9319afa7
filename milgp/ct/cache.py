"""Preprocessed per-bag cache of windowed, resized CT slices: building it (:func:`build_cache`) and reading it.

Reading and windowing DICOM files costs far more than a training step, so a :class:`BagIndex` is
preprocessed once. The cache folder's files, the uint8 storage and the robustness measures are
described in ``docs/ct_data.md``, "The cache".
Bags are uncompressed ``.npy`` so that the dataset can memory-map them and read only the slices it
subsamples. The pieces: :mod:`milgp.ct.cache_params`, :mod:`milgp.ct.cache_lock`,
:mod:`milgp.ct.cache_bag`, :mod:`milgp.ct.worker_pool`, :mod:`milgp.ct.cache_verify`.
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from milgp.data.atomic import atomic_write_json, remove_stale_temporaries
from milgp.ct.cache_bag import (
    MANIFEST_KEYS,
    BagResult,
    array_file_problem,
    bag_file_stem,
    cached_bag_problem,
    process_bag_isolated,
)
from milgp.ct.cache_lock import CacheLock
from milgp.ct.cache_params import (
    CacheParams,
    CacheParamsMismatch,
    check_cache_params,
    read_cache_params,
    write_cache_params,
)
from milgp.ct.index import BagIndex
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.worker_pool import run_isolated

__all__ = [
    "CTCache",
    "CacheCorruptError",
    "CacheEntry",
    "CacheParams",
    "CacheParamsMismatch",
    "CacheReport",
    "REPORT_FILE_NAME",
    "build_cache",
    "check_cache_params",
    "read_manifest",
    "repair_hint",
]

#: Name of the report file inside a cache folder.
REPORT_FILE_NAME = "skipped.json"
_SHOWN = 10


@dataclass
class CacheReport:
    """Summary of one :func:`build_cache` run: ``skipped.json`` and the printed summary.

    Attributes:
        cache_dir: the cache.
        done: bags computed in this run (rebuilt ones included).
        reused: bags whose cached copy verified.
        rebuilt: bags computed again because their cached copy was corrupt or stale (subset of
            ``done``), with the file at fault and the reason.
        failed: bags that produced nothing in this run, with the reason.
        refused: bags the index left out whole (invalid label, refused series).
        skipped_files: files left out (by the index, or slices left out of a cached bag).
        warnings: findings that did not leave anything out (gaps, assumed rescale, clamped air).
        slices_written: slices stored in this run.
        seconds: wall time of this run.
        lock_note: set when this run took over a stale writer lock.
    """

    cache_dir: str
    done: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    rebuilt: list[ReportEntry] = field(default_factory=list)
    failed: list[ReportEntry] = field(default_factory=list)
    refused: list[ReportEntry] = field(default_factory=list)
    skipped_files: list[ReportEntry] = field(default_factory=list)
    warnings: list[ReportEntry] = field(default_factory=list)
    slices_written: int = 0
    seconds: float = 0.0
    lock_note: str = ""

    @property
    def report_path(self) -> Path:
        return Path(self.cache_dir) / REPORT_FILE_NAME

    def summary_line(self) -> str:
        """One line with every count, for stderr."""
        cached = len(self.done) + len(self.reused)
        return (
            f"milgp-cache: {cached} bags cached ({len(self.done)} computed, of which {len(self.rebuilt)} rebuilt; "
            f"{len(self.reused)} reused), {len(self.failed)} failed, {len(self.refused)} refused at indexing, "
            f"{len(self.skipped_files)} files skipped, {len(self.warnings)} warnings; all listed in {printable(self.report_path)}"
        )

    def summary(self) -> str:
        """A few human-readable lines: the counts, then the first entries of each list."""
        lines = [
            f"cache {printable(self.cache_dir)}: {len(self.done)} bags computed ({len(self.rebuilt)} rebuilt, "
            f"{self.slices_written} slices, {self.seconds:.1f} s), {len(self.reused)} reused, {len(self.failed)} failed, "
            f"{len(self.refused)} refused at indexing, {len(self.skipped_files)} files skipped, {len(self.warnings)} warnings"
        ]
        if self.lock_note:
            lines.append(f"  {self.lock_note}")
        more = 0
        for label, entries in (("rebuilt", self.rebuilt), ("failed", self.failed), ("refused", self.refused),
                               ("skipped", self.skipped_files), ("warning", self.warnings)):
            lines += [f"  {label}: {e}" for e in entries[:_SHOWN]]
            more += max(0, len(entries) - _SHOWN)
        if more:
            lines.append(f"  ... and {more} more, see {printable(self.report_path)}")
        return "\n".join(lines)

    def to_json_dict(self) -> dict:
        return {
            "format": "milgp-ct-cache-report",
            "failed_bags": [e.to_json_dict() for e in self.failed],
            "refused_bags": [e.to_json_dict() for e in self.refused],
            "rebuilt_bags": [e.to_json_dict() for e in self.rebuilt],
            "skipped_files": [e.to_json_dict() for e in self.skipped_files],
            "warnings": [e.to_json_dict() for e in self.warnings],
        }


_WORKER_DIED = ("the worker process died while caching this bag (killed by a signal: a crash in a decoder, or out "
                "of memory); the other bags were cached")


class CacheCorruptError(ValueError):
    """A cache file is unreadable, damaged, or not what the manifest says.

    The message names the file (and the bag) and says how to check and repair the cache.
    """


def repair_hint(root: Path) -> str:
    """How to check and repair the cache ``root`` (ends every corruption error)."""
    return f"check and repair the cache with: milgp-cache verify {printable(root)} --repair"


def _refuse_empty_index(index: BagIndex, root: Path, wait_s: float) -> None:
    """Raise the one-line ``ValueError`` of an index without bags: how many bags were refused and
    why the first one was, with the whole list in ``root/skipped.json`` where no cache is there yet."""
    report = CacheReport(cache_dir=str(root), refused=list(index.refused), skipped_files=list(index.skipped),
                         warnings=list(index.warnings))
    if (root / "manifest.json").exists():
        where = f"; {printable(root)} keeps its earlier cache and report"
    else:
        with CacheLock(root, wait_s=wait_s):
            atomic_write_json(report.report_path, report.to_json_dict())
        where = f"; all listed in {printable(report.report_path)}"
    first = next(iter(index.refused or index.skipped), None)
    example = "" if first is None else f" (first: {first})"
    raise ValueError(f"the bag index is empty: nothing to cache; {len(index.refused)} bags refused at indexing, "
                     f"{len(index.skipped)} files skipped{example}{where}")


def build_cache(
    index: BagIndex,
    cache_dir: str | os.PathLike[str],
    params: CacheParams = CacheParams(),
    workers: int = 1,
    progress: bool = True,
    on_bag: Callable[[BagResult], None] | None = None,
    wait_s: float = 0.0,
) -> CacheReport:
    """Preprocess every bag of ``index`` into ``cache_dir`` (created), resuming a previous run.

    Args:
        index: the bags (slices already in scan order).
        cache_dir: cache folder; may hold an earlier (possibly interrupted) run with the same
            ``params``, whose bags are reused once they verify.
        params: preprocessing parameters.
        workers: processes (``<= 1``: in this process).
        progress: show a tqdm progress bar.
        on_bag: called in this process with each bag's :class:`BagResult` as it finishes.
        wait_s: how long to wait for another writer of ``cache_dir`` (``math.inf``: no limit;
            default: refuse at once).

    Returns:
        A :class:`CacheReport`; ``index.json``, ``manifest.json`` and ``skipped.json`` are
        (re)written even when the run is interrupted, the manifest then listing the bags of the
        index this run did not get to whose cached copy still matches (checksum not read).

    Raises:
        CacheParamsMismatch: when ``cache_dir`` holds a cache made with other parameters.
        CacheLockedError: when another process writes into ``cache_dir``.
        ValueError: for an empty index, with the number of bags the indexer refused and the first
            reason; the refusals are written to ``skipped.json`` unless the folder already holds
            a cache (whose report then stays that of its last build).
    """
    start = time.perf_counter()
    root = Path(cache_dir)
    if len(index) == 0:
        _refuse_empty_index(index, root, wait_s)
    check_cache_params(root, params)  # before anything is written, the lock file included
    with CacheLock(root, wait_s=wait_s) as lock:
        (root / "bags").mkdir(parents=True, exist_ok=True)
        write_cache_params(root, params)
        remove_stale_temporaries(root / "bags")
        remove_stale_temporaries(root)
        index.save(root / "index.json")
        report = CacheReport(
            cache_dir=str(root), refused=list(index.refused), skipped_files=list(index.skipped),
            warnings=list(index.warnings), lock_note=lock.took_over,
        )
        entries: dict[str, dict] = {}
        bar = tqdm(total=len(index), desc="caching bags", unit="bag", disable=not progress)
        # bags cached before this build: a bag whose worker wrote it but died with its pool before
        # reporting it is found verified on the retry, and counts as built here, not as reused
        cached_before = {marker.stem for marker in (root / "bags").glob("*.json")}

        def record(result: BagResult) -> None:
            if result.status == "failed":
                report.failed.append(ReportEntry(result.bag_id, result.path, result.reason))
            elif result.status == "reused" and bag_file_stem(result.bag_id) in cached_before:
                report.reused.append(result.bag_id)
            else:
                report.done.append(result.bag_id)
                report.slices_written += result.num_slices
                if result.status == "rebuilt":
                    report.rebuilt.append(ReportEntry(result.bag_id, result.path, result.reason))
            if result.entry is not None:
                entries[result.bag_id] = result.entry
            report.skipped_files.extend(result.skipped)
            report.warnings.extend(result.warnings)
            bar.update(1)
            if on_bag is not None:
                on_bag(result)

        try:
            run_isolated(
                functools.partial(process_bag_isolated, cache_dir=root, params=params), index.bags, workers,
                on_result=lambda i, result: record(result),
                on_crash=lambda i: record(BagResult(
                    index.bags[i].bag_id, "failed", reason=_WORKER_DIED, path=index.bags[i].slice_paths[0]
                )),
            )
        finally:
            bar.close()
            # bags this run did not get to (interrupted) stay listed when their marker still matches their
            # record, sources and params; the checksum is left to the next run, so that Ctrl-C stays quick
            processed = set(report.done) | set(report.reused) | {e.bag_id for e in report.failed}
            for bag in index.bags:
                if bag.bag_id not in processed:
                    marker = cached_bag_problem(root / "bags", bag, params, checksum=False).marker
                    if marker is not None:
                        entries[bag.bag_id] = {k: marker[k] for k in MANIFEST_KEYS}
            # the bags of this build's index, in index order: bags cached from other indexes keep their
            # files in bags/ but are not listed, so every reader of the manifest sees exactly this index
            bags = [entries[b] for b in index.bag_ids if b in entries]
            atomic_write_json(root / "manifest.json", {"format": "milgp-ct-cache-manifest", "bags": bags})
            report.seconds = time.perf_counter() - start
            atomic_write_json(report.report_path, report.to_json_dict())
    return report


@dataclass(frozen=True)
class CacheEntry:
    """One cached bag as listed in ``manifest.json``.

    ``slice_labels`` are the labels of the stored slices (``None`` when unknown); ``shape`` is the
    stored ``(S, C, H, W)``; ``sha256`` the checksum of the ``.npy`` file (``""`` in caches written
    before checksums existed); ``units`` ``"HU"`` unless a non-CT series was accepted explicitly.
    """

    bag_id: str
    file: str
    patient_id: str
    bag_label: float
    num_slices: int
    shape: tuple[int, int, int, int]
    slice_labels: tuple[int, ...] | None
    dtype: str = ""
    sha256: str = ""
    units: str = "HU"

    @classmethod
    def from_json_dict(cls, e: dict) -> "CacheEntry":
        shape = tuple(int(s) for s in e["shape"])
        if len(shape) != 4:
            raise ValueError(f"shape {shape} is not (S, C, H, W)")
        return cls(
            bag_id=str(e["bag_id"]), file=str(e["file"]), patient_id=str(e["patient_id"]), bag_label=float(e["bag_label"]),
            num_slices=int(e["num_slices"]), shape=shape,  # type: ignore[arg-type]
            slice_labels=None if e["slice_labels"] is None else tuple(int(v) for v in e["slice_labels"]),
            dtype=str(e.get("dtype", "")), sha256=str(e.get("sha256", "")), units=str(e.get("units", "HU")),
        )


def read_manifest(cache_dir: str | os.PathLike[str]) -> list[CacheEntry]:
    """The entries of ``cache_dir/manifest.json``.

    Raises:
        FileNotFoundError: naming the folder when there is no manifest (never built).
        CacheCorruptError: one line naming the file when it is truncated, not JSON, or malformed.
    """
    root = Path(cache_dir)
    path = root / "manifest.json"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{printable(root)}: no manifest.json; run build_cache (milgp-cache) first") from None
    except (OSError, ValueError) as err:
        raise CacheCorruptError(f"{printable(path)}: unreadable manifest ({type(err).__name__}: {err}); {repair_hint(root)}") from None
    if not isinstance(obj, dict) or obj.get("format") != "milgp-ct-cache-manifest" or not isinstance(obj.get("bags"), list):
        raise CacheCorruptError(f"{printable(path)}: not a milgp cache manifest; {repair_hint(root)}")
    entries = []
    for i, e in enumerate(obj["bags"]):
        try:
            entries.append(CacheEntry.from_json_dict(e))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CacheCorruptError(f"{printable(path)}: bag entry {i} is malformed ({type(err).__name__}: {err}); {repair_hint(root)}") from None
    return entries


class CTCache:
    """Read access to a cache written by :func:`build_cache`.

    Args:
        cache_dir: the cache folder.
        expected_params: when given, raise :class:`CacheParamsMismatch` unless the cache was built
            with exactly these parameters.

    Raises:
        FileNotFoundError, CacheCorruptError: one line naming the folder or file when the cache is
            missing or its ``params.json``/``manifest.json`` are unreadable.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], expected_params: CacheParams | None = None):
        self.root = Path(cache_dir)
        self.params = read_cache_params(self.root)
        if expected_params is not None:
            check_cache_params(self.root, expected_params)
        self.entries: list[CacheEntry] = read_manifest(self.root)
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
            raise KeyError(f"bag {bag_id!r} is not in the cache {printable(self.root)}") from None

    def path(self, bag_id: str) -> Path:
        """The ``.npy`` file of a bag."""
        return self.root / "bags" / self.entry(bag_id).file

    def load(self, bag_id: str, mmap: bool = True) -> np.ndarray:
        """The stored ``(S, C, H, W)`` array of a bag (storage dtype; memory-mapped when ``mmap``).

        The file's header, shape, dtype and size are checked first (not its checksum: that is
        ``milgp-cache verify``'s job).

        Raises:
            CacheCorruptError: naming the bag and the file when it is missing, truncated, emptied,
                or holds another shape or dtype than the manifest says.
        """
        path = self.path(bag_id)
        problem = array_file_problem(path, self.entry(bag_id).shape, self.params.dtype)
        if not problem:
            try:
                return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
            except (OSError, ValueError, EOFError) as err:
                problem = f"cannot be loaded ({type(err).__name__}: {err})"
        raise CacheCorruptError(
            f"cached bag {bag_id!r}: {printable(path)}: {problem}; {repair_hint(self.root)}"
        )
