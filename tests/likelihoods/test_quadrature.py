"""Gauss–Hermite expectations: their nodes are kept per device and must serve every mode."""
import torch

from milgp.likelihoods.quadrature import _nodes, gauss_hermite_expectation


def test_nodes_first_made_under_inference_mode_still_carry_gradients() -> None:
    """The nodes are made once per (size, dtype, device) and kept. Lightning validates under
    ``torch.inference_mode`` before it trains; nodes made there as inference tensors would make
    every later training step fail ("Inference tensors cannot be saved for backward")."""
    _nodes.cache_clear()
    mean, var = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    with torch.inference_mode():
        gauss_hermite_expectation(torch.sigmoid, mean, var, num_points=13)
    m, v = mean.clone().requires_grad_(), var.clone().requires_grad_()
    gauss_hermite_expectation(torch.sigmoid, m, v, num_points=13).sum().backward()
    assert (m.grad.abs() > 1e-3).all() and (v.grad.abs() > 1e-3).all()
