"""scikit-learn-style estimators over bags (``clone``, ``GridSearchCV``, ``cross_val_score`` work).

Bags are given as a sequence of ``(n_b, d)`` arrays; bag targets as a ``(B,)`` array. One estimator
per module: :class:`VGPMILClassifier` (ψ-VGPMIL), :class:`ProbitMILClassifier` (MIL probit),
:class:`VBAggRegressor` (aggregate outputs); the MIL classifiers share :mod:`._mil_base`.
"""
from milgp.estimators._validation import check_bag_weights, check_bags, check_binary_bag_labels
from milgp.estimators.probit import ProbitMILClassifier
from milgp.estimators.vbagg import VBAggRegressor
from milgp.estimators.vgpmil import VGPMILClassifier

__all__ = [
    "ProbitMILClassifier",
    "VBAggRegressor",
    "VGPMILClassifier",
    "check_bag_weights",
    "check_bags",
    "check_binary_bag_labels",
]
