"""One line of a data report: a file or bag left out, or a warning, with the reason.

Indexers, :func:`milgp.ct.series.load_series` and the cache never abort a batch because of one
input: they leave it out and say so with a :class:`ReportEntry` (the cache writes them to ``skipped.json``).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = ["ReportEntry", "printable"]


def printable(text: str | os.PathLike[str]) -> str:
    """``text`` safe to print on any terminal: undecodable file-name bytes (kept by Python as lone
    surrogates) are shown as ``\\xNN`` escapes instead of raising ``UnicodeEncodeError``."""
    value = os.fspath(text) if isinstance(text, os.PathLike) else str(text)
    try:
        raw = value.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:  # a surrogate that is not an escaped byte
        raw = value.encode("utf-8", errors="surrogatepass")
    return raw.decode("utf-8", errors="backslashreplace")


class ReportEntry(NamedTuple):
    """A file or bag left out (or a warning about one).

    Attributes:
        bag_id: the bag concerned (``""`` when the file could not be attributed to a bag).
        path: the file or folder at fault (a label file with its line where a label row is at fault).
        reason: one line saying what is wrong and what was done.
    """

    bag_id: str
    path: str
    reason: str

    def __str__(self) -> str:
        where = f"bag {printable(self.bag_id)}: " if self.bag_id else ""
        return f"{where}{printable(self.path)}: {printable(self.reason)}"

    def to_json_dict(self) -> dict[str, str]:
        return {"bag_id": self.bag_id, "path": self.path, "reason": self.reason}

    @classmethod
    def from_json_dict(cls, obj: dict[str, Any]) -> "ReportEntry":
        return cls(str(obj.get("bag_id", "")), str(obj["path"]), str(obj["reason"]))
