"""CSV text of a table, as the report and prediction writers write it."""
from __future__ import annotations

import csv
import io
import math
from typing import Any, Sequence

__all__ = ["csv_text"]


def csv_text(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """CSV with ``header``; ``None`` and non-finite floats are written as empty cells, floats with
    full precision."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([[_cell(v) for v in row] for row in rows])
    return buf.getvalue()


def _cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return repr(value) if isinstance(value, float) else value
