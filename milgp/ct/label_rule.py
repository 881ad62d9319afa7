"""Validation of bag and slice labels read from label files.

A MIL label is 0 or 1; anything else (2, -1, 0.5, ``nan``, ``yes``) is refused unless a mapping
says what it means (``--label-map yes=1,no=0``). An aggregate target (a count or amount per bag)
must be a finite, non-negative number. Indexers use one :class:`LabelRule` per run; a row it
refuses leaves its bag out of the index (and of everything built from it), reported with the file,
the line and the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["LABEL_TARGETS", "LabelRule", "parse_label_map"]

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
