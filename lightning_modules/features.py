"""The feature-file format: per-slice features written by a frozen extractor, read by the GP.

One row per instance (slice), rows of a bag contiguous and in scan order, as ``.npz`` (default) or
``.csv`` with the same columns, chosen by the file suffix; the columns are in the README
("Feature-file format").
"""
from __future__ import annotations

import csv
import dataclasses
import io
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from milgp.ct.label_rule import read_csv_rows
from milgp.data.atomic import atomic_open, atomic_write_text

__all__ = ["FeatureTable", "load_features", "save_features"]

FORMAT = "milgp-features"
VERSION = 1


@dataclass
class FeatureTable:
    """Feature file contents (the columns: README, "Feature-file format")."""

    features: np.ndarray
    bag_index: np.ndarray
    slice_index: np.ndarray
    instance_labels: np.ndarray
    bag_ids: list[str]
    bag_labels: np.ndarray
    patient_ids: list[str]
    splits: list[str]

    @property
    def num_bags(self) -> int:
        return len(self.bag_ids)

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    def bag_rows(self) -> list[np.ndarray]:
        """Row indices of each bag, in scan order."""
        order = np.lexsort((self.slice_index, self.bag_index))
        sizes = np.bincount(self.bag_index, minlength=self.num_bags)
        return np.split(order, np.cumsum(sizes)[:-1])

    @classmethod
    def from_bags(
        cls,
        bags: Sequence[np.ndarray],
        bag_ids: Sequence[str],
        bag_labels: Sequence[float],
        instance_labels: Sequence[np.ndarray | None] | None = None,
        patient_ids: Sequence[str] | None = None,
        splits: Sequence[str] | None = None,
    ) -> "FeatureTable":
        """Build a table from per-bag ``(n_b, D)`` feature arrays."""
        sizes = [len(b) for b in bags]
        B = len(bags)
        labels = instance_labels if instance_labels is not None else [None] * B
        inst = [np.full(n, np.nan, np.float32) if lab is None else np.asarray(lab, np.float32).reshape(-1)
                for n, lab in zip(sizes, labels, strict=True)]
        return cls(
            features=np.concatenate([np.asarray(b, np.float32) for b in bags]).reshape(sum(sizes), -1),
            bag_index=np.repeat(np.arange(B), sizes).astype(np.int64),
            slice_index=np.concatenate([np.arange(n) for n in sizes]).astype(np.int64),
            instance_labels=np.concatenate(inst),
            bag_ids=[str(b) for b in bag_ids],
            bag_labels=np.asarray(bag_labels, np.float64),
            patient_ids=[str(p) for p in (patient_ids or [""] * B)],
            splits=[str(s) for s in (splits or [""] * B)],
        )


def save_features(path: str | os.PathLike[str], table: FeatureTable) -> str:
    """Write ``table`` atomically as ``.npz`` or ``.csv`` (by suffix); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npz":
        with atomic_open(path, "wb", encoding=None) as fh:
            np.savez(
                fh, format=np.array(FORMAT), version=np.array(VERSION), features=table.features.astype(np.float32),
                bag_index=table.bag_index.astype(np.int64), slice_index=table.slice_index.astype(np.int64),
                instance_labels=table.instance_labels.astype(np.float32), bag_ids=np.array(table.bag_ids, dtype=str),
                bag_labels=table.bag_labels.astype(np.float64), patient_ids=np.array(table.patient_ids, dtype=str),
                splits=np.array(table.splits, dtype=str),
            )
    elif path.suffix == ".csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["bag_id", "patient_id", "split", "bag_label", "slice_index", "instance_label"] + [f"f{j}" for j in range(table.feature_dim)])
        for rows in table.bag_rows():
            for r in rows:
                b = int(table.bag_index[r])
                lab = table.instance_labels[r]
                w.writerow([table.bag_ids[b], table.patient_ids[b], table.splits[b], repr(float(table.bag_labels[b])),
                            int(table.slice_index[r]), "" if np.isnan(lab) else int(lab)] + [repr(float(v)) for v in table.features[r]])
        atomic_write_text(path, buf.getvalue())
    else:
        raise ValueError(f"{path}: feature files must end in .npz or .csv")
    return str(path)


def load_features(path: str | os.PathLike[str]) -> FeatureTable:
    """Read a feature file written by :func:`save_features` (or by hand in the same columns).

    Raises a ``ValueError`` naming the file (and the bag) when its bags cannot be told apart — a bag
    id given twice, a CSV bag whose rows are not together, a slice index repeated within a bag, rows
    of no bag or a bag without rows — when a CSV's feature columns are not ``f0 … f{D−1}`` (they are
    read by name, in any order), or when a feature value is beyond float32, the format's feature
    type (an ``.npz`` may store them as float64, and they stay float64: rounding them would change
    what a model trained on them sees); and, naming the
    array, when an ``.npz`` cannot be read (empty, truncated) or an array is missing or not of the
    format's kind and dimensions.
    """
    path = Path(path)
    if path.suffix.lower() == ".npz":  # X.NPZ too
        z = _read_npz(path)
        table = FeatureTable(
            features=z["features"], bag_index=z["bag_index"].astype(np.int64), slice_index=z["slice_index"].astype(np.int64),
            instance_labels=z["instance_labels"], bag_ids=[str(s) for s in z["bag_ids"]],
            bag_labels=z["bag_labels"], patient_ids=[str(s) for s in z["patient_ids"]],
            splits=[str(s) for s in z["splits"]],
        )
        _check_bags(path, table)
        beyond = np.argwhere(_beyond_float32(table.features))
        if len(beyond):
            r, j = (int(i) for i in beyond[0])
            b = int(table.bag_index[r])
            raise ValueError(f"{path}: bag {table.bag_ids[b]!r}, slice_index {int(table.slice_index[r])}, field f{j} = "
                             f"{table.features[r, j]:.3g} is beyond float32, the format's feature type")
        return table
    if path.suffix.lower() != ".csv":
        raise ValueError(f"{path}: feature files must end in .npz or .csv")
    per_bag: dict[str, dict] = {}
    fcols: list[str] = []
    previous = None
    for line, row in read_csv_rows(path, ("bag_id", "bag_label")):
        fcols = fcols or _feature_columns(path, list(row))
        if row["bag_id"] != previous and row["bag_id"] in per_bag:
            raise ValueError(f"{path}: line {line}: bag {row['bag_id']!r} again after other bags; a bag's rows must be together (two scans with one id?)")
        previous = row["bag_id"]
        label = _csv_number(path, line, row, "bag_label")  # on every row: each must agree with the bag's first
        bag = per_bag.setdefault(row["bag_id"], {"label": label, "line": line, "patient": row.get("patient_id", ""),
                                                 "split": row.get("split", ""), "rows": []})
        if label != bag["label"] and not (np.isnan(label) and np.isnan(bag["label"])):
            raise ValueError(f"{path}: line {line}: bag {row['bag_id']!r} column bag_label = {label:g}, "
                             f"but {bag['label']:g} on line {bag['line']}; a bag has one label")
        for key, column in (("patient", "patient_id"), ("split", "split")):  # bag-level too: the first row's was taken silently
            if row.get(column, "") != bag[key]:
                raise ValueError(f"{path}: line {line}: bag {row['bag_id']!r} column {column} = {row.get(column, '')!r}, "
                                 f"but {bag[key]!r} on line {bag['line']}; a bag has one {column}")
        lab = row.get("instance_label", "")
        k = int(_csv_number(path, line, row, "slice_index", whole=True)) if "slice_index" in row else len(bag["rows"])
        values = np.array([_csv_number(path, line, row, c) for c in fcols])
        if _beyond_float32(values).any():
            j = int(np.argmax(_beyond_float32(values)))
            raise ValueError(f"{path}: line {line}: bag {row['bag_id']!r} field f{j} = {values[j]:.3g} is beyond float32, in which features are kept")
        bag["rows"].append((k, np.nan if lab == "" else _csv_number(path, line, row, "instance_label"), values))
    if not per_bag:
        raise ValueError(f"{path}: no data rows (a header only); a feature file needs one row per slice")
    ids = list(per_bag)
    bags, inst = [], []
    for b in ids:
        rows = sorted(per_bag[b]["rows"], key=lambda r: r[0])
        bags.append(np.array([r[2] for r in rows], np.float32).reshape(len(rows), len(fcols)))
        inst.append(np.array([r[1] for r in rows], np.float32))
    table = FeatureTable.from_bags(
        bags, ids, [per_bag[b]["label"] for b in ids], inst, [per_bag[b]["patient"] for b in ids], [per_bag[b]["split"] for b in ids]
    )
    # checked with the file's own slice indices (the table renumbers each bag's rows 0..n_b-1)
    _check_bags(path, dataclasses.replace(table, slice_index=np.concatenate([sorted(r[0] for r in per_bag[b]["rows"]) for b in ids])))
    return table


_NPZ_ARRAYS = {  # key: (dtype kinds accepted, ndim, as the README's table says it)
    "format": ("U", 0, "str"), "version": ("iu", 0, "int"),
    "features": ("fiu", 2, "float32 (N, D)"), "bag_index": ("iu", 1, "int64 (N,)"), "slice_index": ("iu", 1, "int64 (N,)"),
    "instance_labels": ("fiu", 1, "float32 (N,)"), "bag_ids": ("U", 1, "str (B,)"), "bag_labels": ("fiu", 1, "float64 (B,)"),
    "patient_ids": ("U", 1, "str (B,)"), "splits": ("U", 1, "str (B,)"),
}


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` feature file, each of the kind and number of dimensions of the
    format; ``ValueError`` naming the file (and the array) when it cannot be read or an array is
    missing or of another kind (e.g. a float ``bag_index``, 1-d ``features``)."""
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file (0 bytes), not an .npz feature file")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not an .npz feature file (not a zip archive of numpy arrays: truncated, or another kind of file)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in _NPZ_ARRAYS if k not in z.files]
            if "format" not in missing and str(z["format"]) != FORMAT:
                raise ValueError(f"{path}: not a milgp feature file (format {z['format']!r})")
            if missing:
                raise ValueError(f"{path}: array {missing[0]!r} is missing (a feature file holds {', '.join(_NPZ_ARRAYS)})")
            arrays = {}
            for key in _NPZ_ARRAYS:
                try:
                    arrays[key] = z[key]
                except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as err:
                    raise ValueError(f"{path}: array {key!r} cannot be read ({type(err).__name__}: {err})") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise ValueError(f"{path}: not a readable .npz feature file ({type(err).__name__}: {err})") from None
    except ValueError as err:
        if str(err).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable .npz feature file ({err})") from None
    for key, (kinds, ndim, described) in _NPZ_ARRAYS.items():
        a = arrays[key]
        if a.dtype.kind not in kinds or a.ndim != ndim:
            raise ValueError(f"{path}: array {key!r} is {a.dtype} of shape {a.shape}; the format has {described}")
    if int(arrays["version"]) != VERSION:
        raise ValueError(f"{path}: feature file version {int(arrays['version'])}, this milgp reads {VERSION}")
    return arrays


def _beyond_float32(values: np.ndarray) -> np.ndarray:
    """Where ``values`` are finite but too large for float32, the format's feature type (rounded to
    it they would become ±inf; a non-finite value is left to the data module's finiteness check)."""
    values = np.asarray(values)
    if values.dtype.kind != "f" or values.dtype.itemsize <= 4:
        return np.zeros(values.shape, bool)
    return np.isfinite(values) & (np.abs(values) > np.finfo(np.float32).max)


def _csv_number(path: Path, line: int, row: dict[str, str], column: str, whole: bool = False) -> float:
    """The CSV value of ``column`` on ``line`` as a number (a whole one for ``whole``);
    ``ValueError`` naming the file, line, bag and column when it is empty (a short row: every
    column from there on empty) or not a number."""
    text = row[column]
    where = f"{path}: line {line}: bag {row['bag_id']!r} column {column}"
    if text == "":
        columns = list(row)
        if all(row[c] == "" for c in columns[columns.index(column):]):
            raise ValueError(f"{where} is missing: the row ends before it (the header has {len(columns)} columns)")
        raise ValueError(f"{where} is empty; it needs a number{' (nan: an unlabelled bag)' if column == 'bag_label' else ''}")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where} = {text!r} is not a number") from None
    if whole and not value.is_integer():
        raise ValueError(f"{where} = {text!r} is not a whole number")
    return value


def _feature_columns(path: Path, columns: list[str]) -> list[str]:
    """The CSV's feature columns ``f0 … f{D−1}`` in index order (``ValueError`` naming the file
    when one is missing, repeated or numbered otherwise)."""
    names = [c for c in columns if c.startswith("f") and c[1:].isdigit()]
    expected = [f"f{j}" for j in range(len(names))]
    if not names or sorted(names, key=lambda c: (int(c[1:]), c)) != expected:
        raise ValueError(f"{path}: the feature columns must be f0 … f{max(len(names) - 1, 0)}, each once; the header has {names}")
    return expected


def _check_bags(path: Path, table: FeatureTable) -> None:
    """``ValueError`` naming the file and the bag when the table's bags cannot be told apart."""
    B, N = table.num_bags, len(table.bag_index)
    if not (len(table.bag_labels) == len(table.patient_ids) == len(table.splits) == B):
        raise ValueError(f"{path}: bag_ids, bag_labels, patient_ids and splits must have one entry per bag ({B})")
    if not (len(table.features) == len(table.slice_index) == len(table.instance_labels) == N):
        raise ValueError(f"{path}: features, bag_index, slice_index and instance_labels must have one row per slice ({N})")
    if N and (table.bag_index.min() < 0 or table.bag_index.max() >= B):
        raise ValueError(f"{path}: bag_index must lie in 0..{B - 1} (one per bag id); it holds {int(table.bag_index.min())}..{int(table.bag_index.max())}")
    ids, counts = np.unique(np.array(table.bag_ids, dtype=str), return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{path}: bag id {str(ids[counts > 1][0])!r} is given to {int(counts[counts > 1][0])} bags; each scan needs its own id")
    sizes = np.bincount(table.bag_index, minlength=B)
    if (sizes == 0).any():
        raise ValueError(f"{path}: bag {table.bag_ids[int(np.argmin(sizes))]!r} has no rows")
    pairs = table.bag_index.astype(np.int64) * (int(table.slice_index.max(initial=0)) + 1) + table.slice_index
    unique, counts = np.unique(pairs, return_counts=True)
    if (counts > 1).any():
        b, k = divmod(int(unique[counts > 1][0]), int(table.slice_index.max(initial=0)) + 1)
        raise ValueError(f"{path}: bag {table.bag_ids[b]!r} has slice_index {k} twice (two scans with one id?)")
