"""GP-MIL: a sparse-GP bag classifier on CNN features, trained two-stage or end-to-end.

The deep pipeline of Castro-Macías et al., *Hyperbolic secant representation of the logistic
function: application to probabilistic multiple instance learning for CT intracranial hemorrhage
detection* (Artificial Intelligence, 2024), Section 6.3: every training step is one iteration of
its Algorithm 1 on the batch's bags. docs/lightning.md ("The GP module's training step", "The bag
decision and model selection") has its steps, the two modes, the heads (:class:`GPHead`, or
:class:`~lightning_modules.aggregate_gp_head.AggregateGPHead` for aggregate likelihoods), the set-up
from the training features and what a checkpoint holds so that a resumed run continues exactly.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_modules.aggregate_gp_head import AggregateGPHead
from lightning_modules.bag_module_base import BagModuleBase
from lightning_modules.bag_store import BagStore
from lightning_modules.checkpoints import extractor_from_checkpoint
from lightning_modules.distributed import all_gather_objects, all_reduce_sum, world_size
from lightning_modules.gp_head import GPHead
from lightning_modules.input_error import InputError
from lightning_modules.module_config import module_config
from lightning_modules.setting_checks import check_at_least, check_rate
from milgp.data.bags import BagBatch, Bags, bag_index_from_sizes
from milgp.likelihoods.aggregate import AggregateLikelihood
from milgp.likelihoods.base import AugmentedBagLikelihood
from milgp.variational.bag_locals import BagLocals
from milgp.variational.natural_update import NaturalStatistics, RobbinsMonro

__all__ = ["GPMILModule"]

_MODES = ("two_stage", "end_to_end")
_DECISION_BAGS = ("auto", "train", "val")


class GPMILModule(BagModuleBase):
    """Sparse-GP MIL head (+ optional CNN) trained with closed-form natural steps (module docstring).

    Args:
        mode: ``"two_stage"`` or ``"end_to_end"``.
        feature_dim: D when there is no extractor (the feature file's width).
        extractor: per-slice CNN (required end-to-end unless ``extractor_checkpoint`` gives it;
            two-stage it is frozen and used for image inputs only, feature inputs pass through).
        extractor_checkpoint: initialise the extractor from this checkpoint (e.g. the AttCNN's);
            without ``extractor`` the architecture recorded in the checkpoint is built, and the
            checkpoint's CT preprocessing becomes this model's.
        likelihood: any :class:`AugmentedBagLikelihood` or aggregate likelihood
            (:class:`milgp.likelihoods.aggregate.AggregateLikelihood`; ``class_path``/``init_args``
            in YAML); default :class:`GPHead`'s, VGPMIL.
        num_inducing, ard, learn_inducing_locations, constant_mean, standardize, lengthscale,
            outputscale, bag_rule, chunk_instances, block_budget, nll_samples: the GP head
            (:class:`lightning_modules.gp_head.GPHead`; ``constant_mean=None``: constant for aggregate
            likelihoods, zero otherwise; the last three serve aggregate likelihoods only).
        decision_bags: held-out bags the bag decision is fitted on, ``"train"`` (leave-one-bag-out
            cavities of the training bags), ``"val"`` (validation bags, ``val/bag_nll`` then
            cross-fitted) or ``"auto"`` (``"train"`` two-stage, ``"val"`` end to end; docs/lightning.md).
        lr_gp: Adam learning rate of the kernel hyperparameters.
        lr_extractor, weight_decay: Adam for the CNN (end-to-end).
        hyper_steps: Adam steps per natural step (default 5 two-stage, 1 end-to-end).
        warmup_epochs: epochs of natural steps only (no Adam) at the start.
        rm_tau, rm_kappa: Robbins–Monro schedule for minibatch natural steps.
        init_max_bags: use at most this many training bags to set standardisation and inducing
            points (``None``: all).
        standardize_momentum: end-to-end, the standardisation statistics follow the CNN's
            features as an exponential moving average with this momentum per step (0: fixed).
        seed: seed of k-means++ and predictive sampling.
        population_column: aggregate likelihoods, two-stage on features only: the input column
            holding each instance's weight/population (used when the batch has no
            ``instance_weights``); it is removed from the GP's features, so ``feature_dim`` is the
            input width and the GP sees ``feature_dim − 1`` features.
        rho0, rho_max: aggregate likelihoods, first and largest natural step size (non-conjugate).
    """

    def __init__(
        self,
        mode: str = "two_stage",
        feature_dim: int | None = None,
        extractor: nn.Module | None = None,
        extractor_checkpoint: str | None = None,
        likelihood: AugmentedBagLikelihood | AggregateLikelihood | None = None,
        num_inducing: int = 64,
        ard: bool = False,
        learn_inducing_locations: bool = False,
        constant_mean: bool | None = None,
        standardize: bool = True,
        lengthscale: float | None = None,
        outputscale: float = 1.0,
        bag_rule: str = "auto",
        decision_bags: str = "auto",
        lr_gp: float = 0.01,
        lr_extractor: float = 1e-4,
        weight_decay: float = 0.0,
        hyper_steps: int | None = None,
        warmup_epochs: int = 1,
        rm_tau: float = 1.0,
        rm_kappa: float = 0.6,
        init_max_bags: int | None = None,
        standardize_momentum: float = 0.1,
        seed: int = 0,
        population_column: int | None = None,
        rho0: float = 0.5,
        rho_max: float = 1.0,
        chunk_instances: int = 32768,
        block_budget: int = 2_000_000,
        nll_samples: int = 256,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=self._ignored_hparams(["extractor", "likelihood"]))
        for name, value, allowed in (("mode", mode, _MODES), ("decision_bags", decision_bags, _DECISION_BAGS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        extractor = self._built(extractor)
        likelihood = self._built(likelihood)
        if extractor_checkpoint:
            extractor, self.input_preprocessing = extractor_from_checkpoint(extractor_checkpoint, extractor)
        if mode == "end_to_end" and extractor is None:
            raise ValueError("mode='end_to_end' needs an extractor (the CNN trained with the GP)")
        if extractor is None and feature_dim is None:
            raise ValueError("give feature_dim (the feature file's width) when there is no extractor")
        self.automatic_optimization = False
        self.mode = mode
        self.extractor = extractor
        dim = int(getattr(extractor, "feature_dim")) if extractor is not None else int(feature_dim)  # type: ignore[arg-type]
        if feature_dim is not None and extractor is not None and int(feature_dim) != dim:
            raise ValueError(f"feature_dim={feature_dim} but the extractor makes {dim} features")
        if mode == "two_stage" and extractor is not None:
            extractor.requires_grad_(False)
        aggregate = isinstance(likelihood, AggregateLikelihood)
        if population_column is not None:
            if not aggregate:
                raise ValueError("population_column is for aggregate likelihoods (instance weights/populations)")
            if extractor is not None:
                raise ValueError("population_column needs feature inputs (no extractor): images have no population column")
            if not -dim <= int(population_column) < dim or dim < 2:
                raise ValueError(f"population_column={population_column} is not a column of the {dim} input features")
            dim -= 1
        check_rate("lr_gp", lr_gp)
        check_rate("lr_extractor", lr_extractor)
        check_rate("weight_decay", weight_decay, zero=True)
        for name, value, least in (("num_inducing", num_inducing, 1), ("hyper_steps", hyper_steps, 0), ("warmup_epochs", warmup_epochs, 0)):
            check_at_least(name, value, least)
        if not 0.0 < rho0 <= 1.0 or not 0.0 < rho_max <= 1.0:
            raise ValueError(f"rho0 and rho_max must lie in (0, 1], got {rho0} and {rho_max}")
        self.population_column = None if population_column is None else int(population_column)
        self.gp = (AggregateGPHead if aggregate else GPHead)(
            dim, num_inducing, likelihood, ard=ard, learn_inducing_locations=learn_inducing_locations,
            constant_mean=constant_mean, standardize=standardize, lengthscale=lengthscale,
            outputscale=outputscale, bag_rule=bag_rule, seed=seed, chunk_instances=chunk_instances,
            block_budget=block_budget, nll_samples=nll_samples,
        )
        self.rho_max = float(rho_max)
        if aggregate:  # the adaptive step size of full-batch non-conjugate steps (checkpointed)
            self.register_buffer("aggregate_rho", torch.tensor(min(float(rho0), float(rho_max)), dtype=torch.float64))
        self.register_buffer("natural_steps", torch.tensor(0, dtype=torch.long))
        self.lr_gp, self.lr_extractor, self.weight_decay = lr_gp, lr_extractor, weight_decay
        self.hyper_steps = (5 if mode == "two_stage" else 1) if hyper_steps is None else int(hyper_steps)
        self.warmup_epochs = warmup_epochs
        self.schedule = RobbinsMonro(rm_tau, rm_kappa)
        self.init_max_bags = init_max_bags
        self.standardize_momentum = standardize_momentum
        self.num_train_bags: int | None = None
        self.bag_locals = BagLocals()  # every training bag's locals (e.g. π), checkpointed
        self.decision_bags = ("train" if mode == "two_stage" else "val") if decision_bags == "auto" else decision_bags
        self._decision_store = BagStore()  # the held-out bags' features of the current epoch

    @property
    def is_aggregate(self) -> bool:
        """Whether the bag targets are real-valued aggregates (an aggregate head): records then
        hold predicted aggregates in ``bag_prob`` and rates in ``slice_probs``, not probabilities."""
        return self.gp.bag_label_kind == "aggregate"

    # -- features --------------------------------------------------------------------------------
    def _float64(self) -> torch.autocast:
        """Run the GP head outside any autocast region (it is float64)."""
        return torch.autocast(device_type=self.device.type, enabled=False)

    def split_inputs(self, batch: BagBatch) -> tuple[Tensor, Tensor | None]:
        """``(x, weights)``: the inputs without the population column, and the instance
        weights/populations (``batch.instance_weights``, else the population column, else ``None``)."""
        x, w = batch.x, batch.instance_weights
        if self.population_column is not None:
            col = self.population_column % x.shape[1]
            w = x[:, col] if w is None else w
            x = torch.cat([x[:, :col], x[:, col + 1 :]], dim=1)
        return x, w

    def features(self, x: Tensor, grad: bool | None = None) -> Tensor:
        """Instance features ``(N, D)`` (:meth:`BagModuleBase.features`), checked against the head's width."""
        h = super().features(x, grad)
        if h.shape[-1] != self.gp.feature_dim:
            raise InputError(f"{self.input_source()}the inputs have {h.shape[-1]} features per instance, the GP head expects {self.gp.feature_dim}")
        return h

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), "mode": self.mode, "likelihood": module_config(self.gp.likelihood),
               "num_inducing": self.gp.num_inducing}
        decision = self.gp.decision_summary()
        if decision is not None:
            out["bag_decision"] = {**decision, "fitted_on": self.decision_bags}
        return out

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.mode == "two_stage" and self.extractor is not None:
            self.extractor.eval()

    def configure_optimizers(self) -> Any:
        groups = [{"params": self.gp.hyperparameters(), "lr": self.lr_gp}]
        if self.mode == "end_to_end" and self.extractor is not None:
            groups.append({"params": [p for p in self.extractor.parameters() if p.requires_grad],
                           "lr": self.lr_extractor, "weight_decay": self.weight_decay})
        return torch.optim.Adam(groups)

    def on_train_start(self) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        loader = dm.train_dataloader() if dm is not None else self.trainer.train_dataloader
        dataset = getattr(loader, "dataset", None)
        if not hasattr(dataset, "__len__"):
            raise ValueError("GPMILModule needs a training dataset with a length (the number of training bags)")
        self.num_train_bags = len(dataset)
        if not bool(self.gp.initialized):
            self._initialize(loader)

    def _check_targets(self, source: str, bag_ids: list[str], targets: Tensor, weights: Tensor, bags: Bags) -> None:
        """The head's check of bag targets and instance weights (aggregate heads: counts, populations)
        as one line naming ``source`` and the bag by its id."""
        try:
            self.gp.check_data(targets, weights, bags)
        except ValueError as err:
            raise InputError(re.sub(r"^bag (\d+)", lambda m: f"{source}: bag {bag_ids[int(m.group(1))]!r}", str(err))) from err

    def check_bag_data(self, source: str, bag_ids: list[str], bags: list[Any], labels: list[float]) -> None:
        """Check bags a run will fit or score before any work (called by the in-memory data modules'
        ``setup``): the bag targets and the population column's populations as the head's
        likelihood needs them, and the bags' lengths as the head's bag rule needs them
        (:meth:`GPHead.check_bag_lengths`). Binary labels are the data module's own check."""
        if self.gp.makes_decision:
            self.gp.check_bag_lengths(f"{source}: ", bag_ids, [len(b) for b in bags])
        if not self.is_aggregate or not bags:
            return
        x = torch.cat([torch.as_tensor(b, dtype=torch.float64).reshape(len(b), -1) for b in bags])
        bag_index = bag_index_from_sizes([len(b) for b in bags])
        _, w = self.split_inputs(BagBatch(x, bag_index, torch.as_tensor(labels, dtype=torch.float64)))
        weights = torch.ones(len(x), dtype=torch.float64) if w is None else w
        self._check_targets(source, list(bag_ids), torch.as_tensor(labels, dtype=torch.float64), weights, Bags(bag_index, len(bags)))

    @torch.no_grad()
    def _initialize(self, loader: Any) -> None:
        """Standardisation, inducing points and lengthscale from the training bags' features.

        The bags seen by all ranks are gathered and sorted by id, so every rank gets identical
        values whatever its loader (whole training set or a distributed shard) and its order.
        """
        was_training = self.extractor.training if self.extractor is not None else False
        if self.extractor is not None:
            self.extractor.eval()
        store = BagStore(torch.float64)
        for batch in loader:
            batch = batch.to(self.device)
            x, w = self.split_inputs(batch)
            ids = batch.bag_ids or [str(len(store) + i) for i in range(batch.num_bags)]
            store.add(batch, self.features(x), w, ids)
            if self.init_max_bags is not None and len(store) >= self.init_max_bags:
                break
        if self.extractor is not None and self.mode == "end_to_end":
            self.extractor.train(was_training)
        # a loader with a distributed sampler gives each rank a shard
        keys, feats, bag_index, targets, weights = store.take()
        self._check_targets("the training bags", keys, targets, weights, Bags(bag_index, len(keys)))
        self.gp.initialize(feats, targets[bag_index], bag_targets=targets, instance_weights=weights)

    # -- training --------------------------------------------------------------------------------
    @staticmethod
    def _reduce(stats: NaturalStatistics) -> NaturalStatistics:
        """DDP: sum the sufficient statistics over ranks."""
        M = stats.h.shape[0]
        flat = torch.cat([stats.h.reshape(-1), stats.G.reshape(-1)])
        all_reduce_sum(flat)
        return NaturalStatistics(h=flat[:M], G=flat[M:].reshape(M, M))

    def _global_counts(self, batch: BagBatch) -> tuple[float, float]:
        """Bags and instances of this step's batch over all DDP ranks (without a process group
        the batch's own, read on the host)."""
        if world_size() == 1:
            return float(batch.num_bags), float(batch.num_instances)
        counts = all_reduce_sum(torch.tensor([batch.num_bags, batch.num_instances], dtype=torch.float64, device=self.device))
        return float(counts[0]), float(counts[1])

    def _reduce_value(self, value: float) -> float:
        """DDP: sum a float over ranks."""
        return float(all_reduce_sum(torch.tensor([value], dtype=torch.float64, device=self.device))[0])

    def training_step(self, batch: BagBatch, batch_idx: int) -> Tensor:
        """Algorithm 1 on this batch (docs/lightning.md) with the library's fit steps
        (:meth:`GPHead.fit_steps`): the natural step, then ``hyper_steps`` Adam steps."""
        opt = self.optimizers()
        learn = self.current_epoch >= self.warmup_epochs and self.hyper_steps > 0
        train_cnn = learn and self.mode == "end_to_end"
        if self.extractor is not None and self.mode == "two_stage":
            self.extractor.eval()
        x, w = self.split_inputs(batch)
        ddp = world_size() > 1  # the hooks that sum over ranks are passed under DDP only
        # the step's reads back to the host come before the CNN's forward is queued and its copies to
        # the host after the whole step is: on a GPU the head's kernels are launched while the CNN runs
        locals_ = self.bag_locals.gather(batch.bag_ids, batch.bags)
        global_bags, global_instances = self._global_counts(batch)
        rho = float(self.aggregate_rho) if self.is_aggregate else 1.0
        h = self.features(x, grad=train_cnn)
        with self._float64():
            z = self.gp.standardize(h)
            steps = self.gp.fit_steps(
                z, batch.bags, batch.bag_labels, weights=w, locals_=locals_, rho=rho, rho_max=self.rho_max,
                reduce=self._reduce if ddp else None, reduce_value=self._reduce_value if ddp else None,
            )
            if global_bags >= self.num_train_bags:
                steps.sweep()
                if self.is_aggregate:  # the adaptive step size of the next full-batch step (checkpointed)
                    self.aggregate_rho.fill_(steps.rho)
            else:
                steps.minibatch_step(None, self.schedule(int(self.natural_steps)), self.num_train_bags / global_bags)
            self.natural_steps += 1
            if learn:
                loss_value = self._hyper_steps(opt, x, z, train_cnn, global_instances, steps.hyper_objective)
            else:  # warm-up: an optimiser step without gradients changes nothing, but Lightning counts it
                # (its step counter drives checkpointing: else no checkpoint is written in the warm-up epochs)
                opt.zero_grad(set_to_none=True)
                opt.step()
                loss_value = torch.tensor(float("nan"))
            if self.mode == "end_to_end":
                self.gp.update_standardization(h, self.standardize_momentum, all_reduce_sum)
            # under DDP every rank keeps every rank's bags: a bag drawn on another rank later continues from its π
            self.bag_locals.store(batch.bag_ids, batch.bags, steps.locals, all_gather_objects if ddp else None)
            if self.decision_bags == "train" and self.gp.makes_decision:
                self._decision_store.add(batch, h)
                if self.trainer.is_last_batch or batch_idx + 1 >= self.trainer.num_training_batches:
                    self._fit_decision_on_training_bags()
        self.log("train/rho", steps.step_size, batch_size=batch.num_bags)
        if steps.elbo_estimate is not None:
            self.log("train/elbo", steps.elbo_estimate, batch_size=batch.num_bags)
        if learn:
            self.log("train/neg_elbo_per_instance", loss_value.to(torch.float32), prog_bar=True, batch_size=batch.num_bags)
        return loss_value

    # -- bag decision ----------------------------------------------------------------------------
    def _adopt_decision(self, posterior: Any, labels: Tensor, where: str) -> bool:
        """Fit the head's bag decision on a held-out posterior and adopt it; ``False`` (with a
        warning) when the bags hold one class only and the previous decision is kept."""
        if labels.min() == labels.max():
            rank_zero_warn(f"the {where} bags are all of one class: the bag decision is not refitted this epoch")
            return False
        name, decision = self.gp.fit_decision(posterior, labels)
        self.gp.set_decision(name, decision)
        return True

    @torch.no_grad()
    def _fit_decision_on_training_bags(self) -> None:
        """The decision on the leave-one-bag-out cavities of this epoch's training bags (at the end
        of the epoch's last step, so validation and both checkpoints see it)."""
        ids, h, bag_index, labels, _ = self._decision_store.take()
        h, bags = h.to(self.device), Bags(bag_index.to(self.device), len(ids))
        locals_ = self.bag_locals.cat(ids).to(self.device)
        posterior = self.gp.leave_bag_out(self.gp.standardize(h), bags, labels.to(self.device), locals_)
        self._adopt_decision(posterior, labels, "training")

    def _hyper_steps(
        self, opt: Any, x: Tensor, z: Tensor, train_cnn: bool, global_instances: float, objective: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """``hyper_steps`` Adam steps on ``−objective(z) / N_global`` with q(v) and the locals fixed
        (Algorithm 1, step 8); end to end, ``z`` is recomputed from ``x`` through the CNN after each
        step. The loss is scaled by the world size because DDP averages gradients. Returns the last
        loss (per instance, this rank)."""
        R = world_size()
        loss_value = torch.tensor(float("nan"))
        for k in range(self.hyper_steps):
            if k > 0 and train_cnn:
                z = self.gp.standardize(self.features(x, grad=True))
            loss = -R * objective(z) / global_instances
            opt.zero_grad(set_to_none=True)
            self.manual_backward(loss)
            opt.step()
            loss_value = loss.detach() / R
        self.gp.strategy.clear_caches()
        return loss_value

    def on_train_epoch_end(self) -> None:
        if int(self.natural_steps) == 0:
            return
        # the training ELBO on this epoch's last batch is cheap only two-stage; log the kernel instead
        self.log("train/lengthscale", float(self.gp.gp.covar_module.base_kernel.lengthscale.detach().mean()))
        self.log("train/outputscale", float(self.gp.gp.covar_module.outputscale.detach()))

    # -- prediction ------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_records(self, batch: BagBatch) -> list[dict]:
        return self._records(batch)[0]

    @torch.no_grad()
    def _records(self, batch: BagBatch) -> tuple[list[dict], Tensor]:
        """The batch's records (:meth:`GPHead.predict`: bag probabilities, or predicted aggregates
        with their further per-bag fields) and its instance features ``h`` ``(N, D)``; a bag too long
        for the head's bag rule is refused first (:meth:`GPHead.check_bag_lengths`)."""
        if self.gp.makes_decision:
            ids = batch.bag_ids or [f"#{b}" for b in range(batch.num_bags)]
            self.gp.check_bag_lengths(self.input_source(), ids, batch.bags.sizes.tolist())
        x, w = self.split_inputs(batch)
        h = self.features(x)
        with self._float64():
            pred = self.gp.predict(self.gp.standardize(h), batch.bags, weights=w, bag_targets=batch.bag_labels)
        extra = {"gp_mean": pred["mean"], "gp_var": pred["var"]}
        if self.extractor is not None:
            extra["features"] = h.float()
        records = self.make_records(batch, pred["bag"], pred["bag_std"], pred["instance"], pred["instance_std"], extra=extra)
        for name, values in pred["bag_fields"].items():
            for b, r in enumerate(records):
                r[name] = float(values[b])
        return records, h

    def _fits_decision_on_validation(self) -> bool:
        return (self.decision_bags == "val" and self.gp.makes_decision and self.trainer.state.fn == "fit"
                and not self.trainer.sanity_checking)

    def validation_step(self, batch: BagBatch, batch_idx: int) -> None:
        if not self._fits_decision_on_validation():
            return super().validation_step(batch, batch_idx)
        records, h = self._records(batch)
        self._val_records.extend(records)
        self._decision_store.add(batch, h)

    def stage_metrics(self, records: list[dict], stage: str) -> dict[str, float]:
        """The head's metrics of the records (:meth:`GPHead.records_metrics`); with ``decision_bags="val"``
        the validation records first get the decision refitted on them (:meth:`_fit_decision_on_validation`)."""
        heldout_nll = self._fit_decision_on_validation(records) if stage == "val" and self._fits_decision_on_validation() else None
        metrics = self.gp.records_metrics(records)
        if heldout_nll is not None:
            metrics["bag_nll"] = heldout_nll
        return metrics

    @torch.no_grad()
    def _fit_decision_on_validation(self, records: list[dict]) -> float | None:
        """Refit the decision on this epoch's validation bags, rewrite the records' bag
        probabilities with it, and return the cross-fitted validation NLL (``None`` when a class has
        fewer than two validation bags: the NLL is then the in-sample one, and a warning says so)."""
        ids, h, bag_index, labels, _ = self._decision_store.take()
        z, bags = self.gp.standardize(h.to(self.device)), Bags(bag_index.to(self.device), len(ids))
        posterior = self.gp.bag_posterior(z, bags)
        if not self._adopt_decision(posterior, labels, "validation"):
            return None
        p, std = self.gp.decide(posterior)
        by_id = {b: (float(p[k]), float(std[k])) for k, b in enumerate(ids)}
        for r in records:
            r["bag_prob"], r["bag_std"] = by_id[r["bag_id"]]
        heldout = self.gp.cross_fitted_nll(z, bags, labels)
        if heldout is None:
            rank_zero_warn("fewer than two validation bags of a class: val/bag_nll is computed on the bags the decision was fitted on")
        return heldout

    # -- checkpoints -----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["gp_num_train_bags"] = self.num_train_bags

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "gp_locals" in checkpoint:  # written before the locals were a module: move them into its state
            checkpoint["state_dict"].update(BagLocals(checkpoint.pop("gp_locals")).state_dict(prefix="bag_locals."))
        self.num_train_bags = checkpoint.get("gp_num_train_bags")
