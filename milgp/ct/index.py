"""The bag index: which files make up each CT bag, in scan order, with their labels.

Layout-specific indexers (:mod:`milgp.ct.rsna`, :mod:`milgp.ct.cq500`,
:mod:`milgp.ct.generic_layout`) all produce a :class:`BagIndex`, the table the cache
(:mod:`milgp.ct.cache`) consumes. It is saved as JSON (lossless) or CSV (one row per slice),
always atomically, and split by patient with :func:`split_by_patient`.
"""
from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from milgp.data.atomic import atomic_open, atomic_write_json
from milgp.ct.dicom import SliceHeader
from milgp.ct.label_rule import read_csv_rows
from milgp.ct.report_entry import ReportEntry, printable
from milgp.ct.series_check import check_series
from milgp.ct.series_policy import SeriesPolicy

__all__ = ["BagIndex", "BagRecord", "INDEX_FORMAT_VERSION", "bag_from_headers", "read_splits", "split_by_patient"]

#: Version of the JSON index format written by :meth:`BagIndex.save`.
INDEX_FORMAT_VERSION = 1
_CSV_COLUMNS = ["bag_id", "patient_id", "bag_label", "slice_index", "path", "slice_label", "series_uid", "ordering", "modality",
                "label_from_slices"]
_CSV_REQUIRED = _CSV_COLUMNS[:-2]  # indexes saved before "modality" existed are CT; before "label_from_slices", labels were given


def _flag(value: object) -> bool | None:
    """A saved ``label_from_slices`` (JSON ``true``/``false``/``null``, CSV ``1``/``0``/empty; ``null``
    and empty: not known, as in an index saved by an older milgp); anything else is a ``ValueError``."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true"):
        return True
    if text in ("0", "false"):
        return False
    if text == "":
        return None
    raise ValueError(f"label_from_slices {value!r} is not true or false")


@dataclass(frozen=True)
class BagRecord:
    """One bag (a CT series): its ordered slices and labels.

    Attributes:
        bag_id: unique identifier (SeriesInstanceUID for RSNA, ``CQ500-CT-<n>`` for CQ500, the
            folder name for the generic layout).
        patient_id: the patient, for patient-grouped splits.
        bag_label: bag target (``0.0``/``1.0`` for hemorrhage; a finite number in any case).
        slice_paths: ``S`` files ordered along the scan axis.
        slice_labels: ``S`` per-slice labels (``0``/``1``) or ``None`` when unknown.
        series_uid: SeriesInstanceUID of the slices (empty when unknown).
        ordering: ``"geometry"`` or ``"instance_number"`` (see :func:`milgp.ct.series_check.order_slices`).
        modality: the slices' Modality; anything but ``"CT"`` was accepted explicitly
            (``allow_non_ct``) and its values are not Hounsfield units.
        label_from_slices: ``bag_label`` is the maximum of ``slice_labels`` (RSNA), so the cache
            takes it again over the slices it keeps; ``False``: the bag label was given on its own
            (CQ500 reads, a generic ``labels.csv``) and is kept as given; ``None``: not known (an
            index saved by an older milgp), kept as given and checked against the kept slices.
    """

    bag_id: str
    patient_id: str
    bag_label: float
    slice_paths: tuple[str, ...]
    slice_labels: tuple[int, ...] | None = None
    series_uid: str = ""
    ordering: str = "geometry"
    modality: str = "CT"
    label_from_slices: bool | None = False

    def __post_init__(self) -> None:
        if not self.slice_paths:
            raise ValueError(f"bag {self.bag_id!r} has no slices")
        if not math.isfinite(self.bag_label):
            raise ValueError(f"bag {self.bag_id!r}: bag label {self.bag_label} is not a finite number")
        if self.slice_labels is not None:
            if len(self.slice_labels) != len(self.slice_paths):
                raise ValueError(
                    f"bag {self.bag_id!r}: {len(self.slice_labels)} slice labels for {len(self.slice_paths)} slices"
                )
            bad = next((v for v in self.slice_labels if v not in (0, 1)), None)
            if bad is not None:
                raise ValueError(f"bag {self.bag_id!r}: slice label {bad!r} is not 0 or 1")
        if self.label_from_slices and (self.slice_labels is None or self.bag_label != max(self.slice_labels)):
            raise ValueError(f"bag {self.bag_id!r}: bag label {self.bag_label:g} is said to be the maximum of its slice labels, "
                             f"which are {'unknown' if self.slice_labels is None else max(self.slice_labels)}")

    @property
    def num_slices(self) -> int:
        return len(self.slice_paths)

    @classmethod
    def from_json_dict(cls, obj: dict) -> "BagRecord":
        """Inverse of :func:`dataclasses.asdict` (a bag of :meth:`BagIndex.to_json_dict`).

        Relative slice paths (a hand-written index, or one saved by an older milgp) are made absolute
        against the working directory, where they would be opened, so that the index written into
        a cache names the same files from any directory.

        Raises:
            KeyError, TypeError, ValueError, AttributeError: for a malformed entry.
        """
        labels = obj.get("slice_labels")
        return cls(
            bag_id=str(obj["bag_id"]),
            patient_id=str(obj["patient_id"]),
            bag_label=float(obj["bag_label"]),
            slice_paths=tuple(os.path.abspath(str(p)) for p in obj["slice_paths"]),
            slice_labels=None if labels is None else tuple(int(v) for v in labels),
            series_uid=str(obj.get("series_uid", "")),
            ordering=str(obj.get("ordering", "geometry")),
            modality=str(obj.get("modality", "CT")),
            label_from_slices=_flag(obj.get("label_from_slices")),
        )


@dataclass
class BagIndex:
    """A table of bags plus what was left out while building it.

    Attributes:
        bags: the :class:`BagRecord` rows, bag ids unique.
        skipped: files left out of their bag (unreadable, not CT, duplicates, unlisted), with reasons.
        refused: bags left out whole (invalid label, refused series, no readable slice), with reasons.
        warnings: findings about indexed bags (gaps in a series).
    """

    bags: list[BagRecord]
    skipped: list[ReportEntry] = field(default_factory=list)
    refused: list[ReportEntry] = field(default_factory=list)
    warnings: list[ReportEntry] = field(default_factory=list)

    _ids: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _by_series_uid: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Bag ids, and bag id by series UID, of :attr:`bags` (kept by :meth:`add_series`, so that
    indexing an archive of ``n`` series costs ``O(n)``, not ``O(n²)``)."""

    def __post_init__(self) -> None:
        for b in self.bags:
            if b.bag_id in self._ids:
                raise ValueError(f"bag id {b.bag_id!r} appears twice in the index")
            self._ids.add(b.bag_id)
            if b.series_uid:
                self._by_series_uid.setdefault(b.series_uid, b.bag_id)

    def __len__(self) -> int:
        return len(self.bags)

    def add_series(
        self,
        bag_id: str,
        headers: Sequence[SliceHeader],
        bag_label: float | None,
        slice_labels_by_path: dict[str, int] | None,
        patient_id: str | None,
        policy: SeriesPolicy,
        where: str,
    ) -> None:
        """Index one series as a bag (:func:`bag_from_headers`), or list it in ``refused`` (at ``where``,
        a file or folder) with the reason when it cannot be one, or when an indexed bag already holds
        the same series (a duplicate export); its left-out files and warnings are kept."""
        try:
            record, dropped, notes = bag_from_headers(bag_id, headers, bag_label, slice_labels_by_path, patient_id, policy)
        except ValueError as err:
            self.refused.append(ReportEntry(bag_id, where, f"left out: {err}"))
            return
        if bag_id in self._ids:
            raise ValueError(f"bag id {bag_id!r} appears twice in the index")
        twin = self._by_series_uid.get(record.series_uid) if record.series_uid else None
        if twin is not None:
            self.refused.append(ReportEntry(
                bag_id, where, f"left out: the same series (SeriesInstanceUID {record.series_uid}) as bag {twin!r}, "
                "a duplicate export; keeping both would count the scan twice and could put it in two splits",
            ))
            return
        self.bags.append(record)
        self._ids.add(bag_id)
        if record.series_uid:
            self._by_series_uid[record.series_uid] = bag_id
        self.skipped += dropped
        self.warnings += notes

    @property
    def bag_ids(self) -> list[str]:
        return [b.bag_id for b in self.bags]

    def subset(self, bag_ids: Iterable[str]) -> "BagIndex":
        """The bags with the given ids, in index order (unknown ids raise ``KeyError`` naming one)."""
        wanted = set(bag_ids)
        missing = wanted - set(self.bag_ids)
        if missing:
            raise KeyError(f"bag id {sorted(missing)[0]!r} is not in the index")
        return BagIndex([b for b in self.bags if b.bag_id in wanted], list(self.skipped), list(self.refused), list(self.warnings))

    def to_json_dict(self) -> dict:
        """A JSON-serialisable dict (the :meth:`save` format)."""
        return {
            "format": "milgp-bag-index",
            "version": INDEX_FORMAT_VERSION,
            "bags": [asdict(b) for b in self.bags],
            "skipped": [e.to_json_dict() for e in self.skipped],
            "refused": [e.to_json_dict() for e in self.refused],
            "warnings": [e.to_json_dict() for e in self.warnings],
        }

    @classmethod
    def from_json_dict(cls, obj: dict, source: str = "<dict>") -> "BagIndex":
        """Inverse of :meth:`to_json_dict`; ``source`` names the file in errors.

        A malformed bag entry (e.g. a label edited to ``NaN``) is left out and listed in ``refused``;
        a file that is not an index at all raises ``ValueError`` naming ``source``.
        """
        if obj.get("format") != "milgp-bag-index":
            raise ValueError(f"{source}: not a milgp bag index (format field is {obj.get('format')!r})")
        if obj.get("version") != INDEX_FORMAT_VERSION:
            raise ValueError(f"{source}: bag index version {obj.get('version')}, this milgp reads {INDEX_FORMAT_VERSION}")
        bags = []
        refused = []
        for i, b in enumerate(obj.get("bags", [])):
            try:
                bags.append(BagRecord.from_json_dict(b))
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                name = str(b.get("bag_id", f"entry {i}")) if isinstance(b, dict) else f"entry {i}"
                refused.append(ReportEntry(name, source, f"bag entry {i} of the saved index is malformed ({err}); left out"))
        try:
            lists = {k: [ReportEntry.from_json_dict(e) for e in obj.get(k, [])] for k in ("skipped", "refused", "warnings")}
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{source}: malformed report entry: {err!r}") from err
        lists["refused"] += refused
        try:
            return cls(bags, **lists)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save atomically; the format follows the suffix: ``.json`` (lossless) or ``.csv``.

        The CSV has one row per slice (columns ``bag_id, patient_id, bag_label, slice_index, path,
        slice_label, series_uid, ordering, modality, label_from_slices``; ``slice_label`` empty when unknown) and does
        not keep the report lists (skipped, refused, warnings).
        """
        suffix = Path(path).suffix.lower()
        if suffix == ".json":
            atomic_write_json(path, self.to_json_dict())
        elif suffix == ".csv":
            with atomic_open(path, "w", errors="surrogateescape") as fh:  # undecodable file names round-trip
                writer = csv.writer(fh, lineterminator="\n")
                writer.writerow(_CSV_COLUMNS)
                for b in self.bags:
                    for i, p in enumerate(b.slice_paths):
                        label = "" if b.slice_labels is None else b.slice_labels[i]
                        writer.writerow([b.bag_id, b.patient_id, b.bag_label, i, p, label, b.series_uid, b.ordering,
                                         b.modality, "" if b.label_from_slices is None else int(b.label_from_slices)])
        else:
            raise ValueError(f"{path}: bag index files must end in .json or .csv")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "BagIndex":
        """Load an index written by :meth:`save` (format from the suffix).

        Raises:
            ValueError: one line naming the file when it is not a readable index.
        """
        suffix = Path(path).suffix.lower()
        if suffix == ".json":
            try:
                with open(path, encoding="utf-8") as fh:
                    obj = json.load(fh)
            except ValueError as err:
                raise ValueError(f"{printable(path)}: not a valid JSON bag index ({err})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{printable(path)}: not a milgp bag index (a JSON {type(obj).__name__})")
            return cls.from_json_dict(obj, source=printable(path))
        if suffix == ".csv":
            return cls._load_csv(path)
        raise ValueError(f"{printable(path)}: bag index files must end in .json or .csv")

    @classmethod
    def _load_csv(cls, path: str | os.PathLike[str]) -> "BagIndex":
        rows: dict[str, list[dict[str, str]]] = {}
        first_line: dict[str, int] = {}
        for line, row in read_csv_rows(path, _CSV_REQUIRED, errors="surrogateescape"):
            rows.setdefault(row["bag_id"], []).append(row)
            first_line.setdefault(row["bag_id"], line)
        bags = []
        refused = []
        for bag_id, bag_rows in rows.items():
            try:
                bag_rows.sort(key=lambda r: int(r["slice_index"]))
                labels = [r["slice_label"] for r in bag_rows]
                has_labels = all(v != "" for v in labels)
                if not has_labels and any(v != "" for v in labels):
                    raise ValueError("slice labels given for some slices only")
                first = bag_rows[0]  # the bag's columns, as on every row of the bag
                bags.append(BagRecord.from_json_dict({
                    **first, "slice_paths": [r["path"] for r in bag_rows],
                    "slice_labels": labels if has_labels else None, "modality": first.get("modality") or "CT",
                }))
            except (KeyError, TypeError, ValueError) as err:  # as from_json_dict: that bag is refused, the others kept
                refused.append(ReportEntry(bag_id, printable(path), f"the {len(bag_rows)} rows of this bag in the saved index "
                                                                    f"(from line {first_line[bag_id]}) are malformed ({err}); left out"))
        return cls(bags, refused=refused)


def bag_from_headers(
    bag_id: str,
    headers: Sequence[SliceHeader],
    bag_label: float | None,
    slice_labels_by_path: dict[str, int] | None = None,
    patient_id: str | None = None,
    policy: SeriesPolicy = SeriesPolicy(),
) -> tuple[BagRecord, list[ReportEntry], list[ReportEntry]]:
    """A :class:`BagRecord` from the headers of one series, checked and ordered by
    :func:`milgp.ct.series_check.check_series`.

    Args:
        bag_id: the bag's id (also names the bag in errors).
        headers: the series' slice headers, any order.
        bag_label: the bag target; ``None``: the maximum of the kept slices' labels.
        slice_labels_by_path: label per slice path (every slice the check keeps needs one), or
            ``None`` when slice labels are unknown.
        patient_id: defaults to the first slice's PatientID.
        policy: what the series may contain.

    Returns:
        ``(record, skipped files, warnings)``.

    Raises:
        ValueError: naming the bag and files when the series is refused
            (:class:`~milgp.ct.series_check.SeriesRefused`), a kept slice has no label, or a
            given bag label 0 contradicts a kept slice labelled 1.
    """
    checked = check_series(headers, bag_id, policy)
    paths = tuple(h.path for h in checked.headers)
    labels = None
    if slice_labels_by_path is not None:
        missing = [p for p in paths if p not in slice_labels_by_path]
        if missing:
            raise ValueError(
                f"bag {printable(bag_id)}: slice {printable(missing[0])} has no slice label "
                f"({len(missing)} of {len(paths)} slices lack one)"
            )
        labels = tuple(int(slice_labels_by_path[p]) for p in paths)
        positive = [p for p, v in zip(paths, labels) if v]
        if bag_label is not None and bag_label == 0 and positive:
            raise ValueError(
                f"bag {printable(bag_id)}: bag label 0 contradicts its slice labels: {len(positive)} of its {len(paths)} "
                f"slices are labelled 1 (e.g. {printable(positive[0])}); a bag with a positive slice is positive"
            )
    derived = bag_label is None
    if derived:
        if labels is None:
            raise ValueError(f"bag {printable(bag_id)}: no bag label and no slice labels to take the maximum of")
        bag_label = float(max(labels))
    first = checked.headers[0]
    record = BagRecord(
        bag_id=bag_id,
        patient_id=first.patient_id if patient_id is None else patient_id,
        bag_label=float(bag_label),
        slice_paths=paths,
        slice_labels=labels,
        series_uid=first.series_uid,
        ordering=checked.ordering,
        modality=first.modality or "CT",
        label_from_slices=derived,
    )
    return record, checked.skipped, checked.warnings


def split_by_patient(
    index: BagIndex,
    fractions: Sequence[float] = (0.8, 0.1, 0.1),
    seed: int = 0,
    names: Sequence[str] = ("train", "val", "test"),
) -> dict[str, BagIndex]:
    """Patient-grouped, label-stratified split: no patient appears in two splits.

    Patients are the groups (all bags of a patient go to one split); a patient is positive when any
    of its bags is (``bag_label > 0.5``). Within each stratum (negative / positive patients) the
    patients are shuffled with ``seed`` and dealt to the splits in proportion to ``fractions``
    (largest-remainder rounding), so each split gets its share of positive patients -- the
    grouping and stratification of scikit-learn's ``StratifiedGroupKFold``, for arbitrary
    fractions and for datasets of a handful of patients. Deterministic given ``seed``.

    Args:
        index: the bags to split.
        fractions: non-negative split sizes (in patients), summing to 1.
        seed: shuffling seed.
        names: split names, one per fraction.

    Returns:
        ``{name: BagIndex}``; a split may be empty for tiny datasets.
    """
    frac = np.asarray(fractions, dtype=np.float64)
    if len(frac) != len(names):
        raise ValueError(f"{len(frac)} fractions for {len(names)} split names {list(names)}")
    if (frac < 0).any() or abs(frac.sum() - 1.0) > 1e-6:
        raise ValueError(f"split fractions must be non-negative and sum to 1, got {list(fractions)}")
    positive: dict[str, bool] = {}
    for b in index.bags:
        positive[b.patient_id] = positive.get(b.patient_id, False) or b.bag_label > 0.5
    rng = np.random.default_rng(seed)
    split_of: dict[str, int] = {}
    for stratum in (False, True):
        patients = sorted(p for p, pos in positive.items() if pos == stratum)
        patients = [patients[i] for i in rng.permutation(len(patients))]
        raw = frac * len(patients)
        counts = np.floor(raw).astype(int)
        for k in np.argsort(-(raw - counts), kind="stable")[: len(patients) - int(counts.sum())]:
            counts[k] += 1
        split_ids = np.repeat(np.arange(len(frac)), counts)
        split_of.update(zip(patients, (int(s) for s in split_ids)))
    return {
        name: index.subset(b.bag_id for b in index.bags if split_of[b.patient_id] == k) for k, name in enumerate(names)
    }


def read_splits(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """``{split name: bag ids}`` from a ``splits.json`` (written by ``milgp-cache --splits``).

    Raises:
        ValueError: naming the file when it is not a splits file (and how to rewrite it).
        OSError: when it cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            return {str(k): [str(b) for b in v] for k, v in json.load(fh).items()}
    except (ValueError, AttributeError, TypeError) as err:
        raise ValueError(f"{printable(path)} is not a splits file ({type(err).__name__}: {err}); "
                         "rerun milgp-cache with --splits to rewrite it") from None
