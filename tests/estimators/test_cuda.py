"""The estimators on a CUDA device agree with the CPU in float64 (run by hand on a GPU machine:
``python -m pytest -m cuda tests``; skipped without one)."""
import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from milgp.estimators import ProbitMILClassifier, VBAggRegressor, VGPMILClassifier

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def digit_bags(num_bags: int = 40, size: int = 12, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Bags of digits; a positive bag holds 1–4 nines. Returns bags, bag labels, counts of nines."""
    digits = load_digits()
    x, t = digits.data / 16.0, digits.target
    rng = np.random.default_rng(seed)
    nines, others = np.nonzero(t == 9)[0], np.nonzero(t != 9)[0]
    bags, y, counts = [], [], []
    for b in range(num_bags):
        k = int(rng.integers(1, 5)) if b % 2 else 0
        idx = np.r_[rng.choice(nines, k, replace=False), rng.choice(others, size - k, replace=False)]
        bags.append(x[rng.permutation(idx)])
        y.append(b % 2)
        counts.append(k)
    return bags, np.asarray(y), np.asarray(counts, dtype=float)


@pytest.mark.parametrize("make", [lambda **kw: VGPMILClassifier(**kw), lambda **kw: VGPMILClassifier(psi="gamma", **kw), lambda **kw: ProbitMILClassifier(**kw)])
def test_mil_classifiers_on_cuda_agree_with_cpu(make) -> None:
    """The whole default fit (candidate kernels and π rules, out-of-bag calibration, pseudo-BMA+
    average) and every prediction must be the same on CUDA as on the CPU to 1e-8 in float64: a
    CPU-only step (a NumPy BLAS shortcut, a generator on the wrong device) would raise or differ."""
    bags, y, _ = digit_bags()
    cpu = make(num_inducing=24, random_state=0).fit(bags, y)
    gpu = make(num_inducing=24, random_state=0, device="cuda").fit(bags, y)
    assert gpu.model_.variational_strategy.inducing_points.device.type == "cuda"
    test, _, _ = digit_bags(num_bags=10, seed=1)
    for a, b in zip(cpu.predict_bag_proba(test), gpu.predict_bag_proba(test)):
        np.testing.assert_allclose(b, a, atol=1e-8)
    for a, b in zip(cpu.predict_instance_proba(test), gpu.predict_instance_proba(test)):
        np.testing.assert_allclose(b, a, atol=1e-8)
    assert [m.weight for m in gpu.ensemble_.members] == pytest.approx([m.weight for m in cpu.ensemble_.members], abs=1e-8)


def test_vbagg_on_cuda_agrees_with_cpu() -> None:
    """VBAggRegressor (count of nines per bag) must fit and predict the same on CUDA as on the CPU."""
    bags, _, counts = digit_bags()
    cpu = VBAggRegressor(num_inducing=24, random_state=0).fit(bags, counts)
    gpu = VBAggRegressor(num_inducing=24, random_state=0, device="cuda").fit(bags, counts)
    test, _, _ = digit_bags(num_bags=10, seed=1)
    a, b = cpu.predict_bags(test), gpu.predict_bags(test)
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-6, atol=1e-8)
