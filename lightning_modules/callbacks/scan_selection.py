"""Which scans a report draws: true positives, the most confident false positives and false negatives."""
from __future__ import annotations

import math

__all__ = ["OUTCOMES", "outcome", "scans_to_plot"]

OUTCOMES = ("true positive", "false positive", "false negative", "true negative")


def outcome(record: dict, threshold: float) -> str | None:
    """The decision's outcome for a labelled scan (``None`` without a bag label)."""
    label = float(record["bag_label"])
    if not math.isfinite(label):
        return None
    called = record["bag_prob"] > threshold
    if label > 0.5:
        return "true positive" if called else "false negative"
    return "false positive" if called else "true negative"


def scans_to_plot(records: list[dict], threshold: float, per_kind: int) -> list[tuple[str, dict]]:
    """Up to ``per_kind`` scans of each kind, most confident first: true positives (highest
    probability), false positives (highest probability: the most confident false alarms) and false
    negatives (lowest probability: the most confident misses); scans without labels are drawn
    as ``"unlabelled"``, the most probable first."""
    by_kind: dict[str, list[dict]] = {"true positive": [], "false positive": [], "false negative": [], "unlabelled": []}
    for r in records:
        kind = outcome(r, threshold) or "unlabelled"
        if kind in by_kind:
            by_kind[kind].append(r)
    chosen = []
    for kind, rs in by_kind.items():
        rs = sorted(rs, key=lambda r: (r["bag_prob"] if kind == "false negative" else -r["bag_prob"], r["bag_id"]))
        chosen += [(kind, r) for r in rs[:per_kind]]
    return chosen
