"""The GP head for aggregate outputs (VBAgg; Law et al., *Variational learning on aggregate outputs
with Gaussian processes*, NeurIPS 2018): :class:`~lightning_modules.gp_head.GPHead` with an
:class:`~milgp.likelihoods.aggregate.AggregateLikelihood`, real-valued bag targets ``y_a`` and
instance populations ``w_i``. It differs in its start (k-means++ over all instances, a constant
mean at ``Ψ⁻¹(Σ_a y_a / Σ_i w_i)`` as :class:`milgp.estimators.VBAggRegressor`), its fit steps
(:class:`~milgp.variational.aggregate_fit.AggregateSteps`), its predictions (aggregates with
predictive std and NLL) and its metrics; it makes no bag decision."""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import numpy as np
import torch
from torch import Tensor

from lightning_modules.gp_head import GPHead
from milgp.data.bags import BagBatch, Bags, weights_or_ones
from milgp.likelihoods.aggregate import AggregateLikelihood
from milgp.variational.aggregate_fit import AggregateSteps, bag_log_predictive, predict_bag_moments
from milgp.variational.natural_update import NaturalStatistics

__all__ = ["AggregateGPHead", "aggregate_records_metrics"]


def aggregate_records_metrics(records: list[dict], likelihood: AggregateLikelihood) -> dict[str, float]:
    """Regression metrics of aggregate-output records.

    Bag level: ``bag_nll`` (mean of the records' predictive ``bag_nll``), ``bag_mse``, ``bag_mae``,
    ``bag_r2`` of ``E[y_a]`` (``bag_prob``) against ``y_a`` (``bag_label``), and the metrics that
    only ``likelihood``'s observation model defines (:meth:`AggregateLikelihood.bag_metrics`, e.g.
    ``bag_poisson_deviance``). Instance level, over the records with known instance targets
    (``slice_labels``): ``instance_mse``, ``instance_mae`` of the posterior mean rate
    (``slice_probs``)."""
    if not records:
        return {}
    mu = np.array([r["bag_prob"] for r in records], dtype=float)
    y = np.array([r["bag_label"] for r in records], dtype=float)
    err = mu - y
    out = {"bag_mse": float(np.mean(err**2)), "bag_mae": float(np.mean(np.abs(err)))}
    ss = float(np.sum((y - y.mean()) ** 2))
    out["bag_r2"] = 1.0 - float(np.sum(err**2)) / ss if ss > 0 else float("nan")
    nll = np.array([r.get("bag_nll", np.nan) for r in records], dtype=float)
    out["bag_nll"] = float(np.mean(nll))
    out.update({f"bag_{name}": value for name, value in likelihood.bag_metrics(y, mu).items()})
    labelled = [r for r in records if r.get("slice_labels") is not None]
    if labelled:
        t = np.concatenate([np.asarray(r["slice_labels"], dtype=float) for r in labelled])
        p = np.concatenate([np.asarray(r["slice_probs"], dtype=float) for r in labelled])
        out["instance_mse"] = float(np.mean((p - t) ** 2))
        out["instance_mae"] = float(np.mean(np.abs(p - t)))
        out["instance_count"] = float(len(t))
    out["bag_count"] = float(len(records))
    return out


class AggregateGPHead(GPHead):
    """:class:`GPHead` for an aggregate likelihood (module docstring); same arguments, the
    likelihood required. ``constant_mean=None`` means a constant mean here."""

    bag_label_kind: ClassVar[str] = "aggregate"
    makes_decision: ClassVar[bool] = False
    likelihood_type: ClassVar[type] = AggregateLikelihood
    default_constant_mean: ClassVar[bool] = True

    @torch.no_grad()
    def initialize(
        self,
        features: Tensor,
        instance_bag_labels: Tensor | None = None,
        bag_targets: Tensor | None = None,
        instance_weights: Tensor | None = None,
    ) -> None:
        """As :meth:`GPHead.initialize`, with k-means++ over all instances and a constant mean
        started at ``Ψ⁻¹(Σ_a y_a / Σ_i w_i)`` from the training bags' targets ``bag_targets``
        ``(B,)`` and weights ``instance_weights`` ``(N,)`` (default ones)."""
        x = features.detach().to(torch.float64).cpu()
        super().initialize(features, torch.zeros(x.shape[0], dtype=torch.float64))
        if bag_targets is not None and hasattr(self.gp.mean_module, "constant"):
            w = weights_or_ones(instance_weights, x[:, 0])
            self.gp.mean_module.constant.data.fill_(self.likelihood.pooled_latent(torch.as_tensor(bag_targets).to(x), w))

    def check_data(self, bag_targets: Tensor, instance_weights: Tensor, bags: Bags) -> None:
        """The likelihood's check of the targets ``(B,)`` and weights ``(N,)`` (``ValueError`` naming the bag)."""
        self.likelihood.check_data(bag_targets, instance_weights, bags)

    def records_metrics(self, records: list[dict]) -> dict[str, float]:
        """Regression metrics of the records (:func:`aggregate_records_metrics`)."""
        return aggregate_records_metrics(records, self.likelihood)

    def decision_summary(self) -> None:
        """Aggregate heads make no bag decision."""
        return None

    def fit_steps(
        self, z: Tensor, bags: Bags, bag_labels: Tensor, *, weights: Tensor | None = None, locals_: Any = None,
        rho: float = 1.0, rho_max: float = 1.0, reduce: Callable[[NaturalStatistics], NaturalStatistics] | None = None,
        reduce_value: Callable[[float], float] | None = None,
    ) -> AggregateSteps:
        """:class:`~milgp.variational.aggregate_fit.AggregateSteps` on a batch of standardised
        features ``z`` ``(N, D)`` (detached) with bag targets ``(B,)`` and populations ``weights``
        ``(N,)`` (``None`` = ones), starting full-batch steps at the adaptive step size ``rho``;
        ``reduce`` and ``reduce_value`` sum statistics and data terms over DDP ranks (no locals)."""
        z = z.detach().to(torch.float64)
        batch = BagBatch(z, bags.index, bag_labels.to(z), instance_weights=None if weights is None else weights.to(z))
        return AggregateSteps(
            self.strategy, self.likelihood, batch, rho=rho, rho_max=rho_max, chunk_instances=self.chunk_instances,
            block_budget=self.block_budget, reduce=reduce, reduce_value=reduce_value,
        )

    @torch.no_grad()
    def predict(
        self, z: Tensor, bags: Bags, weights: Tensor | None = None, bag_targets: Tensor | None = None
    ) -> dict[str, Tensor | dict[str, Tensor]]:
        """The keys of :meth:`GPHead.predict` (``weights``: populations ``(N,)``, ``None`` = ones):
        ``instance`` is the individual rate ``E[Ψ(f)]``, ``bag`` the predicted aggregate ``E[y_a]``
        with its predictive std; ``bag_fields`` hold ``y_mean``, ``y_var`` and ``bag_rate_mean``,
        ``bag_rate_var`` of ``η_a = Σ w_i Ψ(f_i)`` (full within-bag covariance,
        :func:`~milgp.variational.aggregate_fit.predict_bag_moments`), ``outside_training``
        (:meth:`GPHead.outside_training`) and, with ``bag_targets``, ``bag_nll``, the predictive
        ``−log p(y_a | data)``
        (:func:`~milgp.variational.aggregate_fit.bag_log_predictive`: exact for the Normal model,
        Monte Carlo over the joint ``q(f_b)`` with ``nll_samples`` draws for the others)."""
        z, lik, w = z.to(torch.float64), self.likelihood, weights
        mean, var = self.moments(z)
        bag = predict_bag_moments(self.gp, lik, z, bags, w, self.chunk_instances, self.block_budget)
        fields = {"y_mean": bag["y_mean"], "y_var": bag["y_var"], "bag_rate_mean": bag["rate_mean"], "bag_rate_var": bag["rate_var"],
                  "outside_training": self.outside_training(z, var, bags)}
        if bag_targets is not None:
            fields["bag_nll"] = -bag_log_predictive(
                self.gp, lik, z, bags, bag_targets.to(z), w, samples=self.nll_samples, generator=self.generator(z.device),
                chunk_instances=self.chunk_instances, block_budget=self.block_budget, moments=bag,
            )
        return {"mean": mean, "var": var, "instance": lik.rate_mean(mean, var), "instance_std": lik.link.variance(mean, var).clamp_min(0).sqrt(),
                "bag": bag["y_mean"], "bag_std": bag["y_var"].clamp_min(0).sqrt(), "bag_fields": fields}
