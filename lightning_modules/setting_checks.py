"""Checks of a module's or data module's settings when it is made: a value out of range is a
one-line ``ValueError`` naming the setting (printed by ``milgp-train`` with exit status 2), not a
torch traceback from the first optimiser or sampler that uses it (docs/lightning.md, "Bad input")."""
from __future__ import annotations

import math

__all__ = ["check_at_least", "check_rate"]


def check_at_least(name: str, value: int | None, least: int, none: str = "", error: type[ValueError] = ValueError) -> None:
    """``value`` (a count: batch size, workers, inducing points) is at least ``least``; ``None``
    passes, ``none`` says what it means in the message (e.g. ``" (or None: every slice)"``);
    ``error``: the class raised (an entry point's :class:`~lightning_modules.input_error.InputError`)."""
    if value is not None and value < least:
        raise error(f"{name} must be at least {least}{none}, got {value}")


def check_rate(name: str, value: float, zero: bool = False) -> None:
    """``value`` (a learning rate, weight decay, loss weight) is finite and > 0 (``>= 0`` with ``zero``)."""
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {value}")
