"""milgp: deep multiple-instance learning with Gaussian processes.

Library map:

* :mod:`milgp.data` — bags (flat instances + ``bag_index``), CT DICOM data path, datasets.
* :mod:`milgp.likelihoods` — bag likelihoods for GPyTorch (ψ-VGPMIL, probit, aggregate outputs).
* :mod:`milgp.variational` — closed-form natural updates and the training loop (Algorithm 1).
* :mod:`milgp.models` — the sparse GP head.
* :mod:`milgp.prediction` — from the instance posterior to bag decisions: bag rules (p ± std),
  bag calibration, the out-of-bag choice of both.
* :mod:`milgp.estimators` — scikit-learn-style estimators. :mod:`milgp.metrics` — metrics.
"""
__version__ = "0.1.0"
