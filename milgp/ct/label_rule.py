"""Label files: reading the CSVs (:func:`read_csv_rows`) and validating their labels (:class:`LabelRule`).

A refused label leaves its bag out of the index, reported with the file and the line
(``docs/ct_data.md``, "Layouts").
"""
from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from milgp.ct.report_entry import printable

__all__ = ["LABEL_TARGETS", "LabelRule", "parse_label_map", "read_csv_rows"]

#: ``"binary"``: MIL labels 0/1; ``"aggregate"``: finite non-negative bag targets.
LABEL_TARGETS: tuple[str, ...] = ("binary", "aggregate")


def parse_label_map(text: str) -> dict[str, float]:
    """``"yes=1,no=0"`` -> ``{"yes": 1.0, "no": 0.0}`` (keys compared case-insensitively, stripped).

    Raises:
        ValueError: for an item that is not ``TEXT=NUMBER``, a key given twice, or a non-finite value.
    """
    mapping: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not key:
            raise ValueError(f"label map item {item!r} is not TEXT=NUMBER (e.g. yes=1,no=0)")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"label map item {item!r}: {value.strip()!r} is not a number") from None
        if not math.isfinite(number):
            raise ValueError(f"label map item {item!r}: the value must be finite")
        if key in mapping:
            raise ValueError(f"label map gives {key!r} twice")
        mapping[key] = number
    return mapping


@dataclass(frozen=True)
class LabelRule:
    """How label text becomes a validated number.

    Args:
        target: ``"binary"`` (MIL: the result must be 0 or 1) or ``"aggregate"`` (finite, >= 0).
        mapping: label text -> number, tried first (case-insensitive); other text must be a number.
            With ``target="binary"`` every mapped value must be 0 or 1.
    """

    target: str = "binary"
    mapping: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target not in LABEL_TARGETS:
            raise ValueError(f"label target must be one of {LABEL_TARGETS}, got {self.target!r}")
        object.__setattr__(self, "mapping", {str(k).strip().lower(): float(v) for k, v in self.mapping.items()})
        for key, value in self.mapping.items():
            problem = self._problem(value)
            if problem:
                raise ValueError(f"label map {key!r}={value:g}: {problem}")

    def _problem(self, value: float) -> str:
        if not math.isfinite(value):
            return "not a finite number"
        if self.target == "binary" and value not in (0.0, 1.0):
            return "a MIL label must be 0 or 1 (give --label-map for other encodings)"
        if value < 0:
            return "an aggregate target must be non-negative"
        return ""

    def parse(self, text: str | None) -> float:
        """The validated label of ``text``.

        Raises:
            ValueError: saying why ``text`` is not a valid label (empty, not a number, non-finite,
                not 0/1 for MIL, negative for aggregate targets).
        """
        raw = "" if text is None else str(text).strip()
        if raw == "":
            raise ValueError("empty label")
        value = self.mapping.get(raw.lower())
        if value is None:
            try:
                value = float(raw)
            except ValueError:
                known = f" or one of {sorted(self.mapping)}" if self.mapping else ""
                raise ValueError(f"label {raw!r} is not a number{known}") from None
        problem = self._problem(value)
        if problem:
            raise ValueError(f"label {raw!r}: {problem}")
        return value


def read_csv_rows(
    path: str | os.PathLike[str], required: Sequence[str], errors: str = "strict"
) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line number, row)`` for each non-blank data row of a CSV file with a header.

    Column names are stripped; a missing value (a short row) reads as ``""``; values are stripped.
    ``errors="surrogateescape"`` reads files that hold undecodable file names written by
    :meth:`milgp.ct.index.BagIndex.save`.

    Raises:
        ValueError: naming the file when it cannot be read, is not UTF-8, is empty, lacks a
            ``required`` column, or names a column twice.
    """
    name = printable(path)
    try:
        with open(path, newline="", encoding="utf-8-sig", errors=errors) as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{name}: empty file (expected a header with columns {list(required)})")
            columns = [c.strip() for c in header]
            missing = [c for c in required if c not in columns]
            if missing:
                raise ValueError(f"{name}: missing columns {missing} (the header is {columns})")
            twice = sorted({c for c in columns if c and columns.count(c) > 1})
            if twice:  # one of them would be read silently
                raise ValueError(f"{name}: column {twice[0]!r} appears {columns.count(twice[0])} times in the header {columns}; "
                                 "which one is meant cannot be told")
            for values in reader:
                if not any(v.strip() for v in values):
                    continue
                row = {c: (values[i].strip() if i < len(values) else "") for i, c in enumerate(columns)}
                yield reader.line_num, row
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    except csv.Error as err:
        raise ValueError(f"{name}: malformed CSV ({err})") from None
    except OSError as err:
        raise ValueError(f"{name}: cannot read the file ({err.strerror or err})") from None
