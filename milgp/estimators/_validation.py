"""Input validation and feature standardisation shared by the estimators.

Every check raises a one-line ``ValueError`` naming the bag, instance or feature at fault.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np
import torch
from scipy.sparse import issparse

from milgp.data.bags import without_negative_strides
from milgp.data.standardize import standardization_scale

__all__ = [
    "FeatureScaler", "as_float_array", "check_bag_weights", "check_bags", "check_binary_bag_labels", "check_positive", "check_seed",
    "check_settings", "keeps_state_on_error", "torch_dtype", "user_stacklevel",
]


_Fit = TypeVar("_Fit", bound=Callable[..., Any])


def keeps_state_on_error(fit: _Fit) -> _Fit:
    """Decorator of an estimator's ``fit``: when it raises (input or settings refused, a failed or
    interrupted fit), the estimator's attributes are restored as they were, so a refused re-fit
    leaves the earlier fit whole (its ``dtype_``, ``device_``, model and scaler), as predictions
    after it assume."""

    @functools.wraps(fit)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = dict(vars(self))
        try:
            return fit(self, *args, **kwargs)
        except BaseException:
            vars(self).clear()
            vars(self).update(saved)
            raise

    return wrapper  # type: ignore[return-value]


def user_stacklevel() -> int:
    """The ``stacklevel`` of a ``warnings.warn`` call that points the warning at the first frame
    outside milgp (the user's line), however deep in the estimators' calls it is made."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def as_float_array(a: Any, name: str = "X") -> np.ndarray:
    """``a`` as a float64 NumPy array; a SciPy sparse matrix (e.g. word counts) as its dense array,
    since the standardisation makes every feature dense anyway; a torch tensor detached. What is not
    numeric is refused in one line naming ``name``."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
    if np.iscomplexobj(a.data if issparse(a) else a):
        raise ValueError(f"{name} has complex values: features must be real numbers")
    try:
        arr = np.asarray(a.toarray() if issparse(a) else a, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} is not an array of numbers: {err}") from None
    return without_negative_strides(arr)


def check_bags(bags: Iterable[Any], name: str = "bags", n_features: int | None = None) -> list[np.ndarray]:
    """Validate bags: a non-empty sequence (or other iterable) of non-empty 2-D finite float arrays
    with at least one feature, of equal width (``n_features``, where given: the width a fitted model
    expects); sparse bags are taken as their dense arrays (:func:`as_float_array`)."""
    if issparse(bags) or (isinstance(bags, (np.ndarray, torch.Tensor)) and bags.dtype != object and bags.ndim == 2):
        raise ValueError(f"{name} must be a sequence of (n_b, d) arrays, one per bag, not a single 2-D array")
    bags = bags if isinstance(bags, (Sequence, np.ndarray, torch.Tensor)) else list(bags)
    if len(bags) == 0:
        raise ValueError(f"{name} is empty: need at least one bag")
    out: list[np.ndarray] = []
    for b, bag in enumerate(bags):
        arr = as_float_array(bag, f"{name}[{b}]")
        if arr.ndim == 1:
            raise ValueError(f"{name}[{b}] is 1-D with shape {arr.shape}; each bag must be (n_b, d) — use reshape(1, -1) for a bag of one")
        if arr.ndim != 2:
            raise ValueError(f"{name}[{b}] must be 2-D (n_b, d), got shape {arr.shape}")
        if arr.shape[0] == 0:
            raise ValueError(f"{name}[{b}] is empty: every bag needs at least one instance")
        if arr.shape[1] == 0:
            raise ValueError(f"{name}[{b}] has no features: every instance needs at least one")
        if not np.isfinite(arr).all():
            row = int(np.nonzero(~np.isfinite(arr).all(1))[0][0])
            raise ValueError(f"{name}[{b}] has NaN or inf features (first in instance {row})")
        if out and arr.shape[1] != out[0].shape[1]:
            raise ValueError(f"{name}[{b}] has {arr.shape[1]} features, but {name}[0] has {out[0].shape[1]}")
        out.append(arr)
    if n_features is not None and out[0].shape[1] != n_features:
        raise ValueError(f"{name} have {out[0].shape[1]} features, the model was fitted on {n_features}")
    return out


def check_binary_bag_labels(y: Any, num_bags: int, require_both: bool = True) -> np.ndarray:
    """Validate ``(B,)`` bag labels — 0/1, −1/+1 or booleans, the positive class 1 (``True``) — and
    return them as floats in {0, 1}."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"y must be a 1-D array of bag labels, got shape {y.shape}")
    if len(y) != num_bags:
        raise ValueError(f"got {num_bags} bags but {len(y)} labels in y")
    if y.dtype.kind not in "biuf":
        raise ValueError(f"bag labels must be 0/1, -1/1 or booleans (1 = positive), got {y.dtype} labels such as {y[0].item()!r}")
    yf = y.astype(np.float64)
    bad = np.nonzero(~np.isin(yf, (-1.0, 0.0, 1.0)))[0]
    if len(bad):
        raise ValueError(f"bag {int(bad[0])} has label {y[bad[0]].item()!r}; bag labels must be 0/1 or -1/1 (1 = positive)")
    if (yf == -1.0).any() and (yf == 0.0).any():
        raise ValueError(f"bag {int(np.nonzero(yf == 0.0)[0][0])} has label 0 and bag {int(np.nonzero(yf == -1.0)[0][0])} label -1: use 0/1 or -1/1")
    if require_both and len(np.unique(yf)) < 2:
        raise ValueError(f"the training set has only bags of class {y[0].item()!r}; MIL training needs positive and negative bags")
    return (yf == 1.0).astype(np.float64)


def check_bag_weights(weights: Any, bags: list[np.ndarray], name: str = "weights") -> list[np.ndarray]:
    """Per-bag populations ``(n_b,)``: finite and strictly positive; ``None`` → ones; any iterable,
    like the bags."""
    if weights is None:
        return [np.ones(len(b)) for b in bags]
    weights = weights if isinstance(weights, (Sequence, np.ndarray, torch.Tensor)) else list(weights)
    if len(weights) != len(bags):
        raise ValueError(f"got {len(bags)} bags but {len(weights)} entries in {name}")
    out = []
    for b, (w, bag) in enumerate(zip(weights, bags)):
        w = np.asarray(w, dtype=np.float64).reshape(-1)
        if w.shape[0] != bag.shape[0]:
            raise ValueError(f"{name}[{b}] has {w.shape[0]} entries but bag {b} has {bag.shape[0]} instances")
        if not (np.isfinite(w).all() and (w > 0).all()):
            i = int(np.nonzero(~(np.isfinite(w) & (w > 0)))[0][0])
            raise ValueError(f"bag {b} has weight/population {float(w[i])} (instance {i}); populations must be finite and > 0")
        out.append(w)
    return out


def check_positive(name: str, value: Any, none: str | None = None) -> float | None:
    """``value`` as a Python ``float`` when it is a finite number > 0 (NumPy scalars included),
    ``None`` when it is ``None`` and ``none`` says what that means; otherwise a one-line
    ``ValueError`` naming the setting."""
    if value is None and none is not None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"{name} must be a positive number" + (f" or None ({none})" if none is not None else "") + f", got {value!r}")


def check_settings(estimator: Any, flags: Sequence[str], counts: dict[str, int]) -> None:
    """Refuse, in one line naming the setting, an estimator's True/False settings given as anything
    but a boolean (``"no"`` counted as True), counts (``{name: minimum}``) that are not integers at
    least their minimum (``max_iter=-1`` ran one sweep, ``2.5`` was a TypeError deep in the fit), a
    negative or non-finite ``tol`` and a ``device`` torch does not know."""
    for name in flags:
        value = getattr(estimator, name)
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    for name, minimum in counts.items():
        value = getattr(estimator, name)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    tol = estimator.tol
    if isinstance(tol, (bool, np.bool_)) or not isinstance(tol, numbers.Real) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    try:
        torch.device(estimator.device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {estimator.device!r}") from None


def check_seed(random_state: Any) -> int:
    """The seed of ``random_state``: an integer ≥ 0 (NumPy integers included) as is; ``None`` a fresh
    seed from the operating system's entropy; a ``np.random.RandomState`` or ``Generator`` one drawn
    from it (as scikit-learn's estimators draw theirs: the object advances, each fit gets a new
    seed). The global random states are never read or moved."""
    if random_state is None:
        return int(np.random.SeedSequence().generate_state(1)[0])
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, (bool, np.bool_)) and random_state >= 0:
        return int(random_state)
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(2**31 - 1))
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(2**63 - 1))
    raise ValueError(f"random_state must be an integer >= 0, a NumPy RandomState or Generator, or None, got {random_state!r}")


def torch_dtype(name: str) -> torch.dtype:
    """``"float64"`` / ``"float32"`` → the torch dtype."""
    if name not in ("float64", "float32"):
        raise ValueError(f"dtype must be 'float64' or 'float32', got {name!r}")
    return torch.float64 if name == "float64" else torch.float32


class FeatureScaler:
    """z-scoring with training statistics, refusing what would make it meaningless.

    Constant features (zero spread in training) are reported in one warning and ignored: they
    standardise to 0 in training and in prediction (:func:`~milgp.data.standardize.standardization_scale`);
    when every feature is constant the model can only predict the base rate. Features whose spread
    overflows (e.g. values of 1e154: their variance is inf) are refused with an error naming the
    first one: scaling them by an infinite standard deviation would turn them into zeros or NaN.
    """

    def __init__(self, standardize: bool = True):
        self.standardize = standardize

    def fit(self, flat: np.ndarray, weights: np.ndarray | None = None) -> "FeatureScaler":
        """Statistics of training instances ``(N, D)``, optionally weighted ``(N,)``."""
        D = flat.shape[1]
        if not self.standardize:
            self.mean_, self.scale_ = np.zeros(D), np.ones(D)
            return self
        w = np.ones(len(flat)) if weights is None else np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        with np.errstate(over="ignore", invalid="ignore"):
            mean = w @ flat
            scale = np.sqrt(w @ (flat - mean) ** 2)
        bad = np.nonzero(~np.isfinite(mean) | ~np.isfinite(scale))[0]
        if len(bad):
            j = int(bad[0])
            raise ValueError(
                f"feature {j} cannot be standardised: its mean or spread overflows float64 "
                f"(max |value| {np.abs(flat[:, j]).max():.3g}); rescale it before fitting"
            )
        scale = standardization_scale(torch.as_tensor(mean), torch.as_tensor(scale)).numpy()
        constant = np.nonzero(np.isinf(scale))[0]
        if len(constant):
            warnings.warn(
                f"{len(constant)} of {D} features are constant in the training bags to float32 resolution (spread at "
                f"most a millionth of their mean; first: feature {int(constant[0])}); they are ignored (a feature that "
                "varies on a large common offset: subtract the offset first)"
                + (" — every feature is constant, so only the base rate can be learned" if len(constant) == D else ""),
                UserWarning, stacklevel=user_stacklevel(),
            )
        self.mean_, self.scale_ = mean, scale
        return self

    def transform(self, x: torch.Tensor, bag_index: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Standardised ``x`` ``(N, D)`` on its device, computed in ``x``'s dtype and returned in
        ``dtype`` (default: the same), so that from float64 instances a float32 model gets features
        whose common offset cancelled before the rounding. An instance whose standardised squared
        norm (what every kernel computes from it) overflows ``dtype`` is refused with a
        ``ValueError`` naming it and, given ``bag_index`` ``(N,)``, its bag."""
        z = ((x - torch.as_tensor(self.mean_).to(x)) / torch.as_tensor(self.scale_).to(x)).to(dtype or x.dtype)
        overflow = ~torch.isfinite(z.square().sum(1))
        if overflow.any():
            i = int(overflow.nonzero()[0, 0])
            where = f"instance {i}"
            if bag_index is not None:
                b = int(bag_index[i])
                where = f"bags[{b}] instance {i - int((bag_index < b).sum())}"
            raise ValueError(
                f"{where}: its features, standardised with the training statistics, overflow {str(z.dtype).removeprefix('torch.')} "
                f"(largest |value| {float(x[i].abs().max()):.3g}); rescale the features"
            )
        return z
