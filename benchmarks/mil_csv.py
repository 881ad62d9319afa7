"""Reading MIL data sets written as CSV, one per file, as the benchmarks on real data take them.

One row per instance, no header: column 0 the bag's label (0/1 or −1/+1, repeated on each of its
instances; a bag's label is the largest of its rows'), column 1 the bag id (any text; ids that are
all numbers are ordered by value), the rest the features (finite numbers, the same count on every
row) — the layout of the ``mil`` package's copies of the classic benchmarks.

A file that breaks these rules is refused with one line naming the file, the row and the field; a
folder of data sets skips such files with one line each on stderr and evaluates the others
(:func:`load_mil_folder`).
"""
from __future__ import annotations

import csv
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np

__all__ = ["MILFileError", "load_mil_csv", "load_mil_folder", "mil_csv_files"]


class MILFileError(ValueError):
    """A MIL CSV file that cannot be read as a data set; the message names the file and where."""


def _number(text: str) -> Decimal | None:
    """``text`` as an exact number (``"01"`` → 1, ``"1e3"`` → 1000), ``None`` when it is not one."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _bag_order(ids: list[str], path: Path) -> list[str]:
    """The bag ids in evaluation order: by value when every id is a number (so 2 comes before 10, as
    the committed results were split), else as text. Two ids of one value written apart (``1`` and
    ``01``) are refused: they may or may not name one bag."""
    numbers = [_number(i) for i in ids]
    if any(n is None for n in numbers):
        return sorted(ids)
    seen: dict[Decimal, str] = {}
    for text, value in zip(ids, numbers):
        if seen.setdefault(value, text) != text:
            raise MILFileError(f"{path}: bag ids {seen[value]!r} and {text!r} are the same number written apart; "
                               "write each bag's id one way")
    return [text for _, text in sorted(zip(numbers, ids))]


def _feature(text: str, path: Path, line: int, column: int) -> float:
    try:
        return float(text)
    except ValueError:
        raise MILFileError(f"{path}: row {line}, column {column}: {text!r} is not a number") from None


def load_mil_csv(path: Path) -> tuple[list[np.ndarray], np.ndarray]:
    """Bags ``(n_b, D)`` float64 and bag labels ``(B,)`` int 0/1 from one CSV file (module docstring).

    Raises :class:`MILFileError` naming the file, row and field for an empty file, a row with fewer
    than three fields or another count than the first row's, a label other than 0/1 or −1/+1 (the
    two codings mixed), or a feature that is not a finite number."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            rows = [(n, row) for n, row in enumerate(csv.reader(fh), start=1)
                    if row and not row[0].lstrip().startswith("#")]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise MILFileError(f"{path}: cannot be read as CSV ({err})") from err
    if not rows:
        raise MILFileError(f"{path}: no rows")
    width = len(rows[0][1])
    labels, ids, features = [], [], np.empty((len(rows), max(width - 2, 0)))
    for i, (line, row) in enumerate(rows):
        if len(row) < 3 or len(row) != width:
            raise MILFileError(f"{path}: row {line} has {len(row)} fields; every row needs the label, the bag id and "
                               f"the same features as row {rows[0][0]} ({width} fields)")
        label = _number(row[0].strip())
        if label not in (-1, 0, 1):
            raise MILFileError(f"{path}: row {line}: label {row[0]!r} is not 0/1 or -1/+1")
        labels.append(int(label))
        ids.append(row[1].strip())
        try:
            features[i] = np.asarray(row[2:], dtype=np.float64)
        except ValueError:
            features[i] = [_feature(text, path, line, column) for column, text in enumerate(row[2:], start=3)]
        if not np.isfinite(features[i]).all():
            column = 3 + int(np.flatnonzero(~np.isfinite(features[i]))[0])
            raise MILFileError(f"{path}: row {line}, column {column}: feature {row[column - 1]!r} is not finite")
    coding = set(labels)
    if {-1, 0} <= coding:
        raise MILFileError(f"{path}: labels mix -1 and 0; use 0/1 or -1/+1 throughout")
    order = _bag_order(sorted(set(ids)), path)
    position = {bag: b for b, bag in enumerate(order)}
    inverse = np.array([position[i] for i in ids])
    rows_in_order = np.argsort(inverse, kind="stable")
    bags = np.split(features[rows_in_order], np.cumsum(np.bincount(inverse))[:-1])
    y = np.zeros(len(order))
    np.maximum.at(y, inverse, np.maximum(labels, 0))
    return bags, y.astype(int)


def mil_csv_files(data_dir: str | Path) -> list[Path]:
    """The ``*.csv`` files (any case) directly in ``data_dir``, sorted by name; ``SystemExit`` with
    one line when the folder does not exist or holds none."""
    folder = Path(data_dir)
    if not folder.is_dir():
        raise SystemExit(f"--data-dir {folder}: no such folder")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".csv" and p.is_file())
    if not files:
        raise SystemExit(f"no *.csv files in {folder}")
    return files


def load_mil_folder(data_dir: str | Path, min_bags_per_class: int = 1) -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
    """Every data set of :func:`mil_csv_files` by file stem. A file that cannot be read, or that
    has fewer than ``min_bags_per_class`` bags of a class (stratified k-fold needs ``k``), is
    skipped with one line on stderr; ``SystemExit`` when none is left."""
    sets = {}
    for path in mil_csv_files(data_dir):
        try:
            bags, y = load_mil_csv(path)
        except MILFileError as err:
            print(f"skipped {err}", file=sys.stderr, flush=True)
            continue
        counts = np.bincount(y, minlength=2)
        if counts.min() < min_bags_per_class:
            print(f"skipped {path}: {counts[1]} positive and {counts[0]} negative bags; each class needs at least "
                  f"{min_bags_per_class}", file=sys.stderr, flush=True)
            continue
        sets[path.stem] = (bags, y)
    if not sets:
        raise SystemExit(f"no usable data set in {data_dir} (see the lines above)")
    return sets

