"""What one cache build did, bag by bag and file by file (``skipped.json`` and the printed summary)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from milgp.data.atomic import atomic_write_json
from milgp.ct.report_entry import ReportEntry, printable

__all__ = ["CacheReport", "REPORT_FILE_NAME"]

#: Name of the report file inside a cache folder.
REPORT_FILE_NAME = "skipped.json"
_SHOWN = 10


@dataclass
class CacheReport:
    """Summary of one :func:`milgp.ct.cache.build_cache` run.

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

    def write(self) -> None:
        """Write ``skipped.json`` atomically."""
        atomic_write_json(self.report_path, self.to_json_dict())
