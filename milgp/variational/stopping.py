"""The stopping rule of the fit loop: a small relative change, twice in a row."""
from __future__ import annotations

__all__ = ["RelativeChangeStop"]


class RelativeChangeStop:
    """Stop when the watched objective changes by at most ``tol · max(1, |previous|)`` twice in a
    row (a hyperparameter step or a damped local update can make one sweep's change small while the
    fit is still moving), once at least ``min_iter`` iterations have run. Call it once per iteration
    with the value of that iteration; it returns whether to stop.
    """

    def __init__(self, tol: float, min_iter: int = 1):
        self.tol, self.min_iter = float(tol), int(min_iter)
        self.previous: float | None = None
        self.quiet = 0

    def __call__(self, value: float, iteration: int) -> bool:
        previous, self.previous = self.previous, value
        if previous is not None and abs(value - previous) <= self.tol * max(1.0, abs(previous)):
            self.quiet += 1
            return self.quiet >= 2 and iteration + 1 >= self.min_iter
        self.quiet = 0
        return False
