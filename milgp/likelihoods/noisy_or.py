"""Mean-field updates of the instance labels q(y_n) = Bern(π_n) in VGPMIL (Castro-Macías et al. 2024, Eqs. 25, 47–51).

``π_n = sigmoid(μ_n + log H · (2T_b − 1) · (1 − E[max y_{b∖n}]))``.

Under the mean field, ``E[max y_{b∖n}] = 1 − Π_{i∈b, i≠n} (1 − π_i)`` exactly (``"exact"``); the
reference code approximates it by the largest other ``π_i`` (``"max"``). The leave-one-out
product is computed in log space as ``Σ_{i∈b} log1p(−π_i) − log1p(−π_n)`` with ``π`` clamped
away from 1.

``"single"`` takes ``E[max y_{b∖n}] = 0``: every instance of a bag answers for the bag's label on
its own, so all instances of a positive bag are pushed up — the assumption of single-instance
learning, a strong baseline on MIL benchmarks whose positive bags hold many witnesses (wrong when
positives are rare, e.g. a few lesion slices of a CT scan; the estimators choose between ``"max"``
and ``"single"`` on out-of-bag predictions).

``"exact"`` updates are true coordinate ascent: instances are visited by their position within
the bag, all bags at once (bags are independent given q(f)), so every update sees the latest
``π`` of its bag-mates and the ELBO cannot decrease. ``"max"`` updates all ``π`` in parallel from
the previous values, as the reference implementation does, with a damped step (:data:`MAX_RULE_DAMPING`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from milgp.data.bags import BagLayout, Bags, segment_max, segment_sum

__all__ = ["MAX_RULE_DAMPING", "PI_CLAMP", "log_prob_bag_all_negative", "positions_in_bag", "update_instance_labels"]

PI_CLAMP = 1e-7
"""``π`` is kept in ``[PI_CLAMP, 1 − PI_CLAMP]`` so that ``log1p(−π)`` stays finite."""

MAX_RULE_DAMPING = 0.5
"""Default step ``δ`` of the ``"max"`` rule's parallel update, ``π ← (1 − δ)π + δ·π̂``. The undamped
update (``δ = 1``, the reference code's) falls into 2-cycles: two instances of a positive bag that
each see the other as unlikely both jump to 1, then both drop back. Damping keeps the fixed points."""


def positions_in_bag(bag_index: Tensor, num_bags: int) -> list[Tensor]:
    """Instance indices grouped by their position within their bag: element ``k`` holds the
    ``k``-th instance of every bag that has at least ``k + 1`` instances."""
    padding = Bags(bag_index, num_bags).padding
    pos = torch.empty_like(bag_index)
    pos[padding.order] = padding.position
    by_pos = torch.argsort(pos, stable=True)
    counts = torch.bincount(pos).tolist()
    return list(torch.split(by_pos, counts))


def log_prob_bag_all_negative(pi: Tensor, bag_index: Tensor, num_bags: int) -> Tensor:
    """``log Π_{i∈b} (1 − π_i)`` per bag ``(B,)``, i.e. ``log(1 − E[max y_b])``."""
    return segment_sum(torch.log1p(-pi.clamp(PI_CLAMP, 1 - PI_CLAMP)), bag_index, num_bags)


def update_instance_labels(
    mean: Tensor,
    pi: Tensor,
    bags: Bags,
    bag_labels: Tensor,
    log_h: float,
    rule: str = "exact",
    positions: list[Tensor] | BagLayout | None = None,
    damping: float = MAX_RULE_DAMPING,
) -> Tensor:
    """One coordinate-ascent pass over ``q(y)``: the new ``π`` ``(N,)``.

    Args:
        mean: ``(N,)`` current ``μ_n``.
        pi: ``(N,)`` current ``π_n``.
        bags: the instances' :class:`~milgp.data.bags.Bags`.
        bag_labels: ``(B,)`` in ``{0, 1}``.
        log_h: ``log H``.
        rule: ``"exact"`` (noisy-OR leave-one-out), ``"max"`` (largest other π) or ``"single"``
            (``E[max y_{b∖n}] = 0``: every instance answers for its bag's label on its own).
        positions: the order of the sweep: ``None`` (default) the bags' position-major
            :attr:`~milgp.data.bags.Bags.layout` (computed once per ``Bags``), or the per-position
            reference loop :func:`positions_in_bag`.
        damping: step ``δ ∈ (0, 1]`` of the parallel updates (``"max"``, ``"single"``;
            :data:`MAX_RULE_DAMPING`).
    """
    bag_index, num_bags = bags.index, bags.num_bags
    sign = (2 * bag_labels - 1).to(mean.dtype)[bag_index]
    if rule in ("max", "single"):
        if rule == "max":
            target = _parallel_max_update(mean, pi, bag_index, sign, num_bags, log_h)
        else:
            target = torch.sigmoid(mean + log_h * sign).clamp(PI_CLAMP, 1 - PI_CLAMP)
        return (1 - damping) * pi + damping * target
    if rule != "exact":
        raise ValueError(f"unknown rule {rule!r} for E[max y_b\\n]: use 'exact', 'max' or 'single'")
    positions = bags.layout if positions is None else positions
    pi = pi.clamp(PI_CLAMP, 1 - PI_CLAMP).clone()
    log_keep = log_prob_bag_all_negative(pi, bag_index, num_bags)
    if isinstance(positions, BagLayout):
        return _sweep_layout(mean, pi, sign, log_keep, log_h, positions)
    for idx in positions:
        b = bag_index[idx]
        pi[idx], log_keep[b] = _coordinate_step(mean[idx], pi[idx], sign[idx], log_keep[b], log_h)
    return pi


def _coordinate_step(mean: Tensor, pi: Tensor, sign: Tensor, log_keep: Tensor, log_h: float) -> tuple[Tensor, Tensor]:
    """The new ``π`` of one instance per bag and their bags' updated ``log Π_{i∈b} (1 − π_i)``."""
    old = torch.log1p(-pi)
    loo = (log_keep - old).clamp_max(0.0)
    new_pi = torch.sigmoid(mean + log_h * sign * torch.exp(loo)).clamp(PI_CLAMP, 1 - PI_CLAMP)
    return new_pi, log_keep + torch.log1p(-new_pi) - old


def _sweep_layout(mean: Tensor, pi: Tensor, sign: Tensor, log_keep: Tensor, log_h: float, layout: BagLayout) -> Tensor:
    """The exact coordinate-ascent sweep on contiguous slices of the position-major layout (the
    per-position loop's :func:`_coordinate_step`)."""
    flat = layout.flat
    pi_l, mean_l, sign_l = pi[flat], mean[flat], sign[flat]
    keep = log_keep[layout.bag_order]
    off = 0
    for c in layout.counts:
        sl = slice(off, off + c)
        pi_l[sl], keep[:c] = _coordinate_step(mean_l[sl], pi_l[sl], sign_l[sl], keep[:c], log_h)
        off += c
    out = torch.empty_like(pi)
    out[flat] = pi_l
    return out


def _parallel_max_update(mean: Tensor, pi: Tensor, bag_index: Tensor, sign: Tensor, num_bags: int, log_h: float) -> Tensor:
    """Reference-code rule: ``E[max y_{b∖n}] ≈ max_{i∈b, i≠n} π_i`` (0 for a bag of one)."""
    top1 = segment_max(pi, bag_index, num_bags)
    is_top = pi == top1[bag_index]
    # the second largest: mask one occurrence of the maximum per bag
    cand = torch.where(is_top, torch.arange(len(pi), device=pi.device), torch.full_like(bag_index, len(pi)))
    first_idx = torch.full((num_bags,), len(pi), device=pi.device, dtype=torch.long).scatter_reduce(
        0, bag_index, cand, "amin", include_self=True
    )
    # a bag without instances marks the spare last slot: no boolean indexing (a device synchronisation)
    first_top = is_top.new_zeros(len(pi) + 1).index_fill_(0, first_idx, True)[:-1]
    rest = torch.where(first_top, -math.inf, pi)
    top2 = segment_max(rest, bag_index, num_bags)
    other_max = torch.where(first_top, top2[bag_index], top1[bag_index])
    other_max = torch.where(torch.isinf(other_max), torch.zeros_like(other_max), other_max)
    return torch.sigmoid(mean + log_h * sign * (1 - other_max)).clamp(PI_CLAMP, 1 - PI_CLAMP)
