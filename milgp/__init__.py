"""milgp: deep multiple-instance learning with Gaussian processes.

Library map:

* :mod:`milgp.data` — bags (flat instances + ``bag_index``), a synthetic MIL set, atomic file writes.
* :mod:`milgp.likelihoods` — bag likelihoods for GPyTorch (ψ-VGPMIL, probit, aggregate outputs).
* :mod:`milgp.variational` — closed-form natural updates and the training loop (Algorithm 1).
* :mod:`milgp.models` — the sparse GP head.
* :mod:`milgp.prediction` — from the instance posterior to bag decisions: bag rules (p ± std),
  bag calibration, the out-of-bag choice of both.
* :mod:`milgp.estimators` — scikit-learn-style estimators. :mod:`milgp.metrics` — metrics.
* :mod:`milgp.ct` — the CT DICOM path beside the library: reading and checking series, dataset
  layouts, the preprocessed bag cache (``milgp-cache``), the torch dataset of cached bags.
"""
__version__ = "0.1.0"
