"""Reading the label CSV files of the CT layouts with one-line errors naming the file.

Label files come from spreadsheets and scripts: a UTF-8 byte-order mark (Excel), spaces around
column names, short rows, blank lines, another text encoding. :func:`read_csv_rows` accepts the
harmless ones and turns the others into a ``ValueError`` naming the file (and the line).
"""
from __future__ import annotations

import csv
import os
from typing import Iterator, Sequence

from milgp.ct.report_entry import printable

__all__ = ["read_csv_rows"]


def read_csv_rows(
    path: str | os.PathLike[str], required: Sequence[str], errors: str = "strict"
) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line number, row)`` for each non-blank data row of a CSV file with a header.

    Column names are stripped; a missing value (a short row) reads as ``""``; values are stripped.
    ``errors="surrogateescape"`` reads files that hold undecodable file names written by
    :meth:`milgp.ct.index.BagIndex.save`.

    Raises:
        ValueError: naming the file when it cannot be read, is not UTF-8, is empty, or lacks a
            ``required`` column.
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
