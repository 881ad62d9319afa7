"""One bag of the CT cache: compute it (:func:`process_bag`), or decide that the copy on disk can be
reused (:func:`cached_bag_problem`). A cached bag is ``bags/<stem>.npy`` plus its marker
``bags/<stem>.json``, written after the array; what the marker records and when a rerun reuses the
bag (anything else rebuilds it, reported with the reason) is in ``docs/ct_data.md``, "The cache".

The ``.npy`` file can be truncated, emptied, overwritten by random bytes or replaced by another
bag's array: :func:`array_file_problem` checks it first (also before :class:`milgp.ct.cache.CTCache`
maps it), so that the error names the file instead of being an ``mmap`` error in the middle of an epoch.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
from numpy.lib import format as npy_format

from milgp.data.atomic import atomic_save_npy, atomic_write_json, file_sha256
from milgp.ct.cache_params import CacheParams
from milgp.ct.index import BagRecord
from milgp.ct.hounsfield import read_series_values
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.windows import ct_channels

__all__ = [
    "MANIFEST_KEYS",
    "BagResult",
    "CachedBagState",
    "array_file_problem",
    "bag_file_stem",
    "cached_bag_label",
    "cached_bag_problem",
    "process_bag",
    "process_bag_isolated",
    "source_identity",
]

#: The marker fields copied into ``manifest.json`` for each bag.
MANIFEST_KEYS: tuple[str, ...] = (
    "bag_id", "file", "patient_id", "bag_label", "num_slices", "shape", "dtype", "slice_labels",
    "sha256", "file_size", "sources_sha256", "units", "series_uid",
)


def bag_file_stem(bag_id: str) -> str:
    """File-name stem for a bag: its id with unsafe characters replaced, plus a short hash.

    The hash keeps ids that differ only in replaced characters (``a/b`` vs ``a_b``) apart; ids
    holding undecodable bytes (from file names) hash their original bytes.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", bag_id)[:80].lstrip(".") or "bag"
    return f"{safe}-{hashlib.sha1(bag_id.encode('utf-8', 'surrogateescape')).hexdigest()[:10]}"


def source_identity(paths: tuple[str, ...] | list[str]) -> list[dict]:
    """``[{"path", "size", "mtime_ns"}]`` of the source files now (``None`` values for an unreadable file)."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append({"path": p, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        except OSError:
            out.append({"path": p, "size": None, "mtime_ns": None})
    return out


def _changed_source(recorded: list[dict]) -> tuple[str, str, str]:
    """``(path, reason, note)``: the first source file that changed since it was cached (``reason``),
    or else the first one that is gone (``note``: the cached copy is then the only one left)."""
    gone = ("", "")
    for old, new in zip(recorded, source_identity([s["path"] for s in recorded])):
        if old == new:
            continue
        path = old["path"]
        if new["size"] is None:
            if not gone[0]:
                gone = (path, f"source file {printable(path)} is gone or unreadable; the cached copy (checksum verified) is kept")
            continue
        if old["size"] is None:
            return path, f"source file {printable(path)} was unreadable when the bag was cached and is readable now", ""
        return path, (f"source file {printable(path)} changed since the bag was cached "
                      f"(size {old['size']} -> {new['size']} bytes, modification time changed by "
                      f"{(new['mtime_ns'] - old['mtime_ns']) / 1e9:+.3f} s)"), ""
    return gone[0], "", gone[1]


_HEADER_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def array_file_problem(
    path: str | os.PathLike[str], shape: tuple[int, ...], dtype: str | np.dtype, sha256: str | None = None
) -> str:
    """Why ``path`` is not the expected cached array (``""`` when it is).

    Checks the ``.npy`` header (readable, version 1.0 or 2.0, C order), the shape, the dtype and
    the file size (header + data exactly); with ``sha256`` also the checksum of the whole file
    (reads every byte).
    """
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                return "empty file (0 bytes)"
            try:
                version = npy_format.read_magic(fh)
                reader = _HEADER_READERS.get(version)
                if reader is None:
                    raise ValueError(f".npy format version {version}; the cache writes 1.0 or 2.0")
                got_shape, fortran, got_dtype = reader(fh)
            except Exception as err:  # numpy raises ValueError/EOFError/SyntaxError for damaged headers
                return f"not a readable .npy file ({type(err).__name__}: {err})"
            offset = fh.tell()
    except FileNotFoundError:
        return "file missing"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if fortran:
        return "Fortran-ordered array; the cache writes C order"
    got_shape, got_dtype = tuple(int(s) for s in got_shape), np.dtype(got_dtype)
    if got_shape != tuple(shape):
        return f"holds an array of shape {got_shape}, the manifest says {tuple(shape)} (another bag's array?)"
    if got_dtype != np.dtype(dtype):
        return f"holds {got_dtype} values, the cache stores {np.dtype(dtype)}"
    expected = offset + int(np.prod(got_shape)) * got_dtype.itemsize
    if size != expected:
        return f"is {size} bytes, {expected} expected for {got_shape} {got_dtype} (truncated or appended to)"
    if sha256 is not None:
        try:
            if file_sha256(path) != sha256:
                return "content does not match its checksum (corrupted or overwritten)"
        except OSError as err:
            return f"cannot be read ({err.strerror or err})"
    return ""


class CachedBagState(NamedTuple):
    """What :func:`cached_bag_problem` found.

    ``marker`` is the bag's marker when the cached copy can be reused (``note`` then may say that
    some source files are gone); otherwise ``None``, with ``reason`` saying why (``""`` when
    nothing is cached) and ``path`` naming the file at fault.
    """

    marker: dict | None
    path: str = ""
    reason: str = ""
    note: str = ""


@dataclass
class BagResult:
    """Outcome of :func:`process_bag` for one bag.

    Attributes:
        bag_id: the bag.
        status: ``"done"`` (computed now), ``"rebuilt"`` (computed now, replacing a cached copy that
            could not be reused: ``reason`` says why), ``"reused"`` (cached copy verified) or
            ``"failed"`` (nothing written; ``reason`` says why).
        num_slices: slices stored.
        skipped: slices left out, with reasons.
        reason: why the bag failed or was rebuilt.
        path: the file at fault for ``"failed"``/``"rebuilt"``.
        warnings: findings about the stored bag (assumed rescale, air clamped by the 12-bit repair).
        entry: the bag's ``manifest.json`` entry (``None`` when failed).
    """

    bag_id: str
    status: str
    num_slices: int = 0
    skipped: list[ReportEntry] = field(default_factory=list)
    reason: str = ""
    path: str = ""
    warnings: list[ReportEntry] = field(default_factory=list)
    entry: dict | None = None


def _index_fields(record: BagRecord) -> dict:
    """What the marker records of the index row the bag was made from (the cached bag's own label,
    ``bag_label``, is :func:`cached_bag_label`'s)."""
    return {
        "bag_id": record.bag_id,
        "patient_id": record.patient_id,
        "index_bag_label": record.bag_label,
        "label_from_slices": record.label_from_slices,
        "index_slice_paths": list(record.slice_paths),
        "index_slice_labels": None if record.slice_labels is None else list(record.slice_labels),
        "series_uid": record.series_uid,
        "ordering": record.ordering,
        "modality": record.modality,
    }


def cached_bag_label(record: BagRecord, kept_labels: list[int] | None) -> tuple[float, str]:
    """``(label, note)``: the label of the cached bag, whose kept slices have ``kept_labels``.

    A label the index took as the maximum of the slice labels (``record.label_from_slices``, RSNA)
    is taken again over the kept slices: a bag whose only positive slices were left out (unreadable
    pixels) is negative, as its slices are. A label given on its own (CQ500, generic) is kept. The
    note (``""`` when there is nothing to say) reports a changed label, or a given label that the
    kept slices' labels contradict.
    """
    if kept_labels is None or record.slice_labels is None:
        return record.bag_label, ""
    dropped_positive = sum(record.slice_labels) - sum(kept_labels)
    if record.label_from_slices:
        label = float(max(kept_labels))
        if label != record.bag_label:
            return label, (f"bag label {record.bag_label:g} -> {label:g}: the {dropped_positive} slices labelled 1 were left "
                           "out (see the skipped files), and the bag label is the maximum of the kept slices' labels")
        return label, ""
    if record.bag_label == 0 and max(kept_labels) > 0:
        return record.bag_label, (f"bag label 0 given in the index, but {sum(kept_labels)} kept slices are labelled 1; "
                                  "the label is kept as given")
    if record.bag_label > 0 and dropped_positive and max(kept_labels) == 0:
        return record.bag_label, (f"every slice labelled 1 ({dropped_positive}) was left out; the bag label "
                                  f"{record.bag_label:g} is kept as given, with no positive slice left")
    return record.bag_label, ""


def cached_bag_problem(bags_dir: Path, record: BagRecord, params: CacheParams, checksum: bool = True) -> CachedBagState:
    """Whether the cached copy of ``record``, preprocessed with ``params``, can be reused (the rule:
    ``docs/ct_data.md``, "The cache", a cache that verifies itself).

    With ``checksum`` the whole array is read once to check its checksum; without it only the
    marker, the source files' identity and the array's header and size are looked at (what a
    build interrupted by Ctrl-C can afford for the bags it did not get to).
    """
    stem = bag_file_stem(record.bag_id)
    marker_path, npy_path = bags_dir / f"{stem}.json", bags_dir / f"{stem}.npy"
    if not marker_path.exists() and not npy_path.exists():
        return CachedBagState(None)
    try:
        meta = json.loads(marker_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return CachedBagState(None, str(npy_path), "cached array without its marker (a write was interrupted)")
    except (OSError, ValueError) as err:
        return CachedBagState(None, str(marker_path), f"marker unreadable ({type(err).__name__}: {err})")
    try:
        if "sha256" not in meta:
            return CachedBagState(None, str(marker_path), "no checksum recorded (cached by an older milgp)")
        if "params" not in meta:
            return CachedBagState(None, str(marker_path), "no preprocessing parameters recorded (cached by an older milgp)")
        missing = [k for k in (*MANIFEST_KEYS, "sources", "skipped", "warnings") if k not in meta]
        if missing or meta["file"] != npy_path.name:
            return CachedBagState(None, str(marker_path), f"marker malformed (missing {missing} or names another file)")
        recorded, wanted = meta["params"], params.to_json_dict()
        changed_params = ", ".join(
            f"{k} {recorded.get(k)} -> {wanted[k]}" for k in wanted if recorded.get(k) != wanted[k]
        )
        if changed_params:
            return CachedBagState(None, str(marker_path), f"cached with other preprocessing parameters ({changed_params})")
        # markers of an older milgp hold only the served "bag_label", which was the index's label; an
        # index of an older milgp does not know how its label was made: the marker may say it
        known = record.label_from_slices if record.label_from_slices is not None else meta.get("label_from_slices")
        record = replace(record, label_from_slices=known)
        older = {"index_bag_label": meta.get("bag_label"), "label_from_slices": known}
        if any({**older, **meta}.get(k) != v for k, v in _index_fields(record).items()):
            return CachedBagState(None, str(marker_path), "the bag's slices, labels or patient changed in the index")
        kept_labels = meta["slice_labels"]
        served, label_note = cached_bag_label(record, None if kept_labels is None else [int(v) for v in kept_labels])
        if float(meta["bag_label"]) != served:
            return CachedBagState(None, str(marker_path), f"cached with bag label {meta['bag_label']}, but the maximum of its "
                                                          f"kept slices' labels is {served:g} (cached by an older milgp)")
        if label_note and "index_bag_label" not in meta:  # an older milgp reused it without a word: rebuild, and report
            return CachedBagState(None, str(marker_path), f"cached by an older milgp, which did not check the bag label against "
                                                          f"the kept slices: {label_note}; if the label was the maximum of the "
                                                          "slice labels (RSNA), index the source again to take it anew")
        changed_path, changed, note = _changed_source(meta["sources"])
        if changed:
            return CachedBagState(None, changed_path, changed)
        problem = array_file_problem(npy_path, tuple(meta["shape"]), meta["dtype"], meta["sha256"] if checksum else None)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        return CachedBagState(None, str(marker_path), f"marker malformed ({type(err).__name__}: {err})")
    if problem:
        return CachedBagState(None, str(npy_path), f"cached array {problem}")
    return CachedBagState(meta, changed_path, "", note)


def process_bag(record: BagRecord, cache_dir: str | os.PathLike[str], params: CacheParams) -> BagResult:
    """Window, resize and store one bag, unless its cached copy verifies (:func:`cached_bag_problem`).

    Unreadable slices are skipped (and reported); a bag with no readable slice, with slices in
    different units, or with slices of different sizes when ``params.size`` is ``None``, fails
    without writing anything. Nothing of an earlier copy is removed before the new one is complete:
    the array is replaced first, then the marker, each atomically.

    Returns:
        A :class:`BagResult`.
    """
    bags_dir = Path(cache_dir) / "bags"
    state = cached_bag_problem(bags_dir, record, params)
    meta = state.marker
    if meta is not None:
        notes = [ReportEntry(record.bag_id, state.path, state.note)] if state.note else []
        return BagResult(
            record.bag_id, "reused", int(meta["num_slices"]), [ReportEntry.from_json_dict(s) for s in meta["skipped"]],
            warnings=[ReportEntry.from_json_dict(s) for s in meta["warnings"]] + notes, entry={k: meta[k] for k in MANIFEST_KEYS},
        )
    sources = source_identity(record.slice_paths)  # before reading: an edit while reading shows on the next run
    read = read_series_values(record.slice_paths, record.bag_id, allow_non_ct=record.modality != "CT")
    values, kept, units, skipped, found = read.values, read.kept, read.units, read.skipped, read.warnings
    if not values:
        return BagResult(record.bag_id, "failed", 0, skipped, "no readable slice", path=record.slice_paths[0])
    if len(units) > 1:
        return BagResult(record.bag_id, "failed", 0, skipped, f"slices in different units {sorted(units)}", path=record.slice_paths[0])
    shapes = sorted({v.shape for v in values})
    if len(shapes) == 1:
        channels = ct_channels(np.stack(values), params.windows, params.size)
    elif params.size is None:
        return BagResult(record.bag_id, "failed", 0, skipped, f"slices of different sizes {shapes} and no resize size set",
                         path=record.slice_paths[0])
    else:
        channels = np.stack([ct_channels(v, params.windows, params.size) for v in values])
    stem = bag_file_stem(record.bag_id)
    npy_path, marker_path = bags_dir / f"{stem}.npy", bags_dir / f"{stem}.json"
    stored = params.encode(channels)
    kept_labels = None if record.slice_labels is None else [int(record.slice_labels[i]) for i in kept]
    bag_label, label_note = cached_bag_label(record, kept_labels)
    if label_note:  # name the slice the note is about: a kept positive one for a bag labelled 0, else a left-out one
        kept_set = set(kept)
        positive = [i for i, v in enumerate(record.slice_labels or ()) if v and (i in kept_set) == (record.bag_label == 0)]
        found.append(ReportEntry(record.bag_id, record.slice_paths[positive[0] if positive else kept[0]], label_note))
    atomic_save_npy(npy_path, stored)
    meta = {
        **_index_fields(record),
        "bag_label": bag_label,
        "file": npy_path.name,
        "num_slices": len(kept),
        "shape": list(stored.shape),
        "dtype": str(stored.dtype),
        "sha256": file_sha256(npy_path),
        "file_size": npy_path.stat().st_size,
        "slice_labels": kept_labels,
        "slice_paths": [record.slice_paths[i] for i in kept],
        "units": units.pop(),
        "sources": sources,
        "sources_sha256": hashlib.sha256(json.dumps(sources, sort_keys=True).encode("ascii")).hexdigest(),
        "skipped": [s.to_json_dict() for s in skipped],
        "warnings": [w.to_json_dict() for w in found],
        "params": params.to_json_dict(),
    }
    atomic_write_json(marker_path, meta)
    status = "rebuilt" if state.reason else "done"
    return BagResult(record.bag_id, status, len(kept), skipped, state.reason, state.path, found, {k: meta[k] for k in MANIFEST_KEYS})


def process_bag_isolated(record: BagRecord, cache_dir: str | os.PathLike[str], params: CacheParams) -> BagResult:
    """:func:`process_bag` with any exception of this one bag (a failed write, a full disk, an
    unexpected decoder error) turned into a ``"failed"`` result naming the bag, the file and the reason."""
    try:
        return process_bag(record, cache_dir, params)
    except Exception as err:
        filename = getattr(err, "filename", None)
        if isinstance(err, OSError) and filename:  # name the file when the error knows it
            return BagResult(record.bag_id, "failed", 0, reason=f"{printable(filename)}: {err.strerror or err}", path=str(filename))
        return BagResult(record.bag_id, "failed", 0, reason=f"{type(err).__name__}: {err}", path=record.slice_paths[0])
