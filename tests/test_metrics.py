"""milgp.metrics against scikit-learn and a hand-computed expected calibration error."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score, roc_auc_score

from milgp import metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auroc_accuracy_f1_match_sklearn(seed: int) -> None:
    """AUROC (with ties), accuracy and F1 at threshold ½ equal scikit-learn's.

    If this fails, every reported bag/instance metric in metrics.json is wrong."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 200)
    p = np.clip(0.3 * y + rng.uniform(0, 0.7, 200), 0, 1).round(2)  # rounding creates ties
    assert metrics.auroc(p, y) == pytest.approx(roc_auc_score(y, p), abs=1e-6)
    assert metrics.accuracy(p, y) == pytest.approx(accuracy_score(y, p > 0.5), abs=1e-6)
    assert metrics.f1_score(p, y) == pytest.approx(f1_score(y, p > 0.5), abs=1e-6)
    assert metrics.auroc(torch.as_tensor(p), torch.as_tensor(y)) == pytest.approx(roc_auc_score(y, p), abs=1e-6)


def test_auroc_of_raw_scores_and_metrics_in_float64_match_sklearn_exactly() -> None:
    """AUROC of raw scores far outside [0, 1] (decision values, log-likelihood ratios) ranks them as
    scikit-learn does, and AUROC/accuracy/F1 come back in float64 (equal to scikit-learn to 1e-12).

    If this fails, AUROC of large scores is computed after a squashing that ties them (40 and 60
    become 1.0: AUROC 0.5 for a perfect ranking), or the metrics are rounded to float32."""
    y = np.array([0, 1, 0, 1, 1, 0])
    s = np.array([40.0, 50.0, 41.0, 60.0, 45.0, 42.0])
    assert metrics.auroc(s, y) == roc_auc_score(y, s) == 1.0
    assert metrics.classification_metrics(s, y)["auc"] == 1.0
    assert metrics.auroc(-1e6 * s, y) == 0.0
    rng = np.random.default_rng(0)
    p = rng.random(201)
    labels = (rng.random(201) < p).astype(int)
    assert metrics.auroc(p.round(1), labels) == pytest.approx(roc_auc_score(labels, p.round(1)), abs=1e-12)
    assert metrics.accuracy(p, labels) == pytest.approx(accuracy_score(labels, p > 0.5), abs=1e-12)
    assert metrics.f1_score(p, labels) == pytest.approx(f1_score(labels, p > 0.5), abs=1e-12)


def test_degenerate_cases() -> None:
    """One class → AUROC nan (undefined, written as JSON null); nothing predicted positive → F1 0."""
    assert math.isnan(metrics.auroc([0.2, 0.7], [1, 1]))
    assert metrics.f1_score([0.1, 0.2], [1, 0]) == 0.0
    assert metrics.json_safe({"a": float("nan"), "b": np.float32(0.5)}) == {"a": None, "b": 0.5}


def test_ece_by_hand() -> None:
    """ECE with 4 equal-width bins on a 6-sample example worked out by hand.

    bins (0,.25]: p=[.1,.2] y=[0,1] → |0.5−0.15| = 0.35, weight 2/6
    (.25,.5]:     p=[.5]    y=[0]   → |0−0.5| = 0.5,    weight 1/6   (0.5 is the upper edge)
    (.5,.75]:     p=[.7]    y=[1]   → |1−0.7| = 0.3,    weight 1/6
    (.75,1]:      p=[.9,1]  y=[1,1] → |1−0.95| = 0.05,  weight 2/6
    ECE = (0.7 + 0.5 + 0.3 + 0.1) / 6 = 1.6 / 6.

    If this fails, the calibration numbers and plots are wrong."""
    p = [0.1, 0.2, 0.5, 0.7, 0.9, 1.0]
    y = [0, 1, 0, 1, 1, 1]
    assert metrics.expected_calibration_error(p, y, n_bins=4) == pytest.approx(1.6 / 6)
    curve = metrics.calibration_curve(p, y, n_bins=4)
    np.testing.assert_allclose(curve["count"], [2, 1, 1, 2])
    np.testing.assert_allclose(curve["mean_predicted"], [0.15, 0.5, 0.7, 0.95])
    assert metrics.expected_calibration_error([0.0, 1.0], [0, 1]) == 0.0


def test_classification_metrics_keys() -> None:
    out = metrics.classification_metrics([0.2, 0.8, 0.6], [0, 1, 0], prefix="bag_")
    assert set(out) == {"bag_auc", "bag_accuracy", "bag_f1", "bag_ece", "bag_nll", "bag_count"}
    from sklearn.metrics import log_loss

    assert out["bag_nll"] == pytest.approx(log_loss([0, 1, 0], [0.2, 0.8, 0.6]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scores_are_refused_naming_the_index(bad: float) -> None:
    """A NaN or infinite score must stop every metric with a ValueError naming its index. If this fails, an
    all-NaN evaluation reports AUROC 0.25 (or a NaN turned into 0) as if the model had been scored."""
    scores = [0.2, 0.9, bad, 0.4]
    labels = [0, 1, 1, 0]
    for metric in (metrics.auroc, metrics.accuracy, metrics.f1_score, metrics.log_loss, metrics.expected_calibration_error,
                   metrics.calibration_curve, metrics.classification_metrics):
        with pytest.raises(ValueError, match=r"score 2 is .*not finite"):
            metric(scores, labels)
    with pytest.raises(ValueError, match=r"score 0 is nan \(4 of 4"):
        metrics.auroc(torch.full((4,), float("nan")), torch.tensor([0, 1, 0, 1]))


def test_non_binary_or_nan_labels_are_refused_naming_the_index() -> None:
    """A NaN or non-0/1 label must raise naming its index, not be counted as a class."""
    with pytest.raises(ValueError, match=r"label 1 is nan"):
        metrics.auroc([0.1, 0.2, 0.3], [0, float("nan"), 1])
    with pytest.raises(ValueError, match=r"label 2 is 2.0"):
        metrics.classification_metrics([0.1, 0.2, 0.3], [0, 1, 2])


def test_calibrated_ece_is_the_mean_ece_of_labels_drawn_from_the_probabilities() -> None:
    """calibrated_ece must equal a plain Monte-Carlo average of expected_calibration_error over
    labels drawn from the probabilities; otherwise it is not the floor it claims to be."""
    rng = np.random.default_rng(3)
    p = rng.beta(1.0, 2.0, 60)
    direct = np.mean([metrics.expected_calibration_error(p, rng.random(p.size) < p) for _ in range(4000)])
    assert metrics.calibrated_ece(p, draws=4000) == pytest.approx(direct, abs=0.004)


def test_calibrated_ece_shrinks_with_the_sample_and_vanishes_for_certain_forecasts() -> None:
    """The floor is a small-sample effect (≈ 1/√n): more samples, lower floor; a forecaster that
    only says 0 or 1 and is calibrated can never be wrong."""
    rng = np.random.default_rng(0)
    floors = [metrics.calibrated_ece(rng.uniform(size=n)) for n in (20, 80, 320, 1280)]
    assert all(a > b for a, b in zip(floors, floors[1:]))
    assert floors[0] / floors[-1] == pytest.approx(8.0, rel=0.35)
    assert metrics.calibrated_ece(np.array([0.0, 1.0, 1.0, 0.0])) == 0.0


def test_calibrated_ece_leaves_global_rng_alone_and_refuses_non_probabilities() -> None:
    state = np.random.get_state()
    metrics.calibrated_ece(np.full(10, 0.3), seed=5)
    assert np.array_equal(np.random.get_state()[1], state[1])
    with pytest.raises(ValueError, match="probability 1 is 1.5"):
        metrics.calibrated_ece(np.array([0.2, 1.5]))
