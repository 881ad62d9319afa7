"""GPMILModule with aggregate-output (VBAgg) likelihoods: real-valued bag targets, populations.

The Lightning training step with an aggregate likelihood is one iteration of the library's
:func:`milgp.variational.aggregate_fit.fit_aggregate` (natural step on q(u), then Adam on the
hyperparameters); these tests check that it is (to float rounding), that the Normal model's
full-batch exact step matches :class:`milgp.estimators.VBAggRegressor`, that a Poisson-exp model
trained through the Trainer recovers instance rates, that targets and populations flow through the
data modules and the CLI, and that DDP ranks hold the same q(u).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from lightning_modules import BagArrayDataModule, GPMILModule, SmallCNN
from lightning_modules.cli import run_cli
from lightning_modules.features import FeatureTable, save_features
from milgp.data.bags import BagBatch, Bags, collate_bags
from milgp.estimators import VBAggRegressor
from milgp.likelihoods import MILBernoulliLikelihood, NormalAggregateLikelihood, PoissonAggregateLikelihood
from milgp.variational.aggregate_fit import fit_aggregate
from lm_helpers import image_bags, trainer_cfg, write_config

warnings.filterwarnings("ignore", message=".*does not have many workers.*")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def rate_fn(x: np.ndarray) -> np.ndarray:
    """The true instance rate of the Poisson problems, a smooth function of 2-D features."""
    return np.exp(0.3 + 0.8 * np.sin(1.2 * x[:, 0]) + 0.4 * x[:, 1])


def latent_fn(x: np.ndarray) -> np.ndarray:
    """The true instance mean of the Normal problems."""
    return np.sin(x[:, 0]) + 0.5 * x[:, 1]


def aggregate_bags(num_bags: int, seed: int, kind: str = "poisson", noise: float = 0.1) -> dict:
    """Bags of 5–20 instances around random centres in [-2, 2]², populations U(0.5, 2).

    Poisson: ``y_a ~ Poisson(Σ p_i rate(x_i))``, instance targets = the rates.
    Normal: ``y_a ~ N(Σ w_i f(x_i), noise · Σ w_i²)``, instance targets = ``f(x_i)``."""
    rng = np.random.default_rng(seed)
    xs, pops, ys, targets = [], [], [], []
    for _ in range(num_bags):
        n = int(rng.integers(5, 21))
        x = rng.uniform(-2, 2, size=2) + 0.4 * rng.standard_normal((n, 2))
        p = rng.uniform(0.5, 2.0, size=n)
        if kind == "poisson":
            t = rate_fn(x)
            y = float(rng.poisson((p * t).sum()))
        else:
            t = latent_fn(x)
            y = float((p * t).sum() + np.sqrt(noise * (p * p).sum()) * rng.standard_normal())
        xs.append(x)
        pops.append(p)
        ys.append(y)
        targets.append(t)
    return {"x": xs, "pop": pops, "y": ys, "targets": targets, "ids": [f"bag_{i:03d}" for i in range(num_bags)]}


def dict_loader(data: dict, idx: list[int], batch_size: int | None = None) -> torch.utils.data.DataLoader:
    """Bags as dict samples carrying ``instance_weights`` (collate_bags' mapping form)."""
    samples = [{"x": data["x"][i], "bag_label": data["y"][i], "bag_id": data["ids"][i],
                "instance_weights": data["pop"][i], "instance_labels": data["targets"][i]} for i in idx]
    return torch.utils.data.DataLoader(samples, batch_size=batch_size or len(samples), collate_fn=collate_bags)


def _trainer(epochs: int, **kw) -> pl.Trainer:
    kw.setdefault("num_sanity_val_steps", 0)
    return pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kw)


def test_poisson_exp_recovers_instance_rates() -> None:
    """Poisson-exp counts of bags with populations (a population column of the features through
    BagArrayDataModule) trained with the Trainer for 20 epochs (full batch: backtracking natural
    steps + 5 Adam steps each) recover the instance rates of unseen test bags: instance MSE of
    ``E[e^f]`` below a quarter of the best constant rate's (``Σy/Σp`` of the training bags; in
    practice ~1/100), and bag counts with R² > 0.5.

    If this fails, the aggregate natural step, the populations (column not split off / not used),
    the constant-mean initialisation or the Adam objective is wrong."""
    data = aggregate_bags(90, seed=0)
    bags = [np.column_stack([x, p]) for x, p in zip(data["x"], data["pop"])]
    splits = ["train"] * 60 + ["val"] * 10 + ["test"] * 20
    dm = BagArrayDataModule(bags, data["y"], data["targets"], bag_ids=data["ids"], splits=splits)
    batch = next(iter(dm.train_dataloader()))
    assert batch.bag_labels.dtype == torch.float64 and batch.bag_labels.tolist() == data["y"][:60]  # counts flow as float
    model = GPMILModule(feature_dim=3, population_column=-1, likelihood=PoissonAggregateLikelihood("exp"),
                        num_inducing=16, lr_gp=0.05, hyper_steps=5, warmup_epochs=1)
    assert model.gp.feature_dim == 2
    trainer = _trainer(20)
    trainer.fit(model, dm)
    assert "val/bag_nll" in trainer.callback_metrics and np.isfinite(model.val_metrics["instance_mse"])
    trainer.test(model, dm, verbose=False)
    m = model.test_metrics
    rate = sum(data["y"][:60]) / sum(p.sum() for p in data["pop"][:60])
    truth = np.concatenate(data["targets"][70:])
    baseline = float(np.mean((truth - rate) ** 2))
    assert m["instance_count"] == len(truth)
    assert m["instance_mse"] < 0.25 * baseline, (m, baseline)
    assert m["bag_r2"] > 0.5, m
    for k in ("bag_nll", "bag_mse", "bag_mae", "bag_poisson_deviance"):
        assert np.isfinite(m[k]), (k, m)
    rec = model.test_records[0]
    assert rec["bag_prob"] == pytest.approx(rec["y_mean"]) and rec["bag_std"] ** 2 == pytest.approx(rec["y_var"])


def test_normal_exact_step_matches_vbagg_regressor() -> None:
    """Normal aggregates with non-unit weights (``instance_weights`` of the batch): one full-batch
    epoch without Adam is the exact conjugate optimum of q(u) and equals VBAggRegressor's single
    exact step on the same bags — same standardisation, k-means++ inducing points, constant mean
    Σy/Σw, and (given its lengthscale) the same
    q(u) to 1e-9 and the same instance predictions.

    If this fails, the training step is not the library's exact Normal step (wrong statistics,
    weights dropped, wrong scaling) or the head's aggregate initialisation differs."""
    data = aggregate_bags(30, seed=1, kind="normal")
    idx = list(range(30))
    reg = VBAggRegressor(likelihood="normal", num_inducing=12, outputscale=1.0, warmup_iter=1, max_iter=0, noise=0.3, random_state=0)
    reg.fit(data["x"], data["y"], data["pop"])
    ls = float(reg.model_.covar_module.base_kernel.lengthscale.detach())
    model = GPMILModule(feature_dim=2, likelihood=NormalAggregateLikelihood(noise=0.3), num_inducing=12,
                        hyper_steps=0, warmup_epochs=0, lengthscale=ls, seed=0)
    # the regressor fits y / target_scale_ at GPyTorch's jitter, i.e. jitter × target_scale_² in y's units
    model.gp.gp.variational_strategy.jitter_val = reg.model_.variational_strategy.jitter_val
    _trainer(1).fit(model, dict_loader(data, idx))
    torch.testing.assert_close(model.gp.gp.variational_strategy.inducing_points, reg.model_.variational_strategy.inducing_points, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.gp.gp.mean_module.constant.detach(), reg.model_.mean_module.constant.detach(), rtol=1e-12, atol=1e-12)
    q, q_ref = model.gp.posterior(), reg.model_.variational_strategy.whitened_posterior()
    torch.testing.assert_close(q.m, q_ref.m, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(q.S, q_ref.S, rtol=1e-9, atol=1e-9)
    X = np.concatenate(data["x"])
    pred = model.gp.predict(model.gp.standardize(torch.as_tensor(X)), Bags(torch.zeros(len(X), dtype=torch.long), 1))
    np.testing.assert_allclose(pred["instance"].numpy(), reg.predict(X), rtol=1e-8, atol=1e-9)
    # a second exact step at the same hyperparameters stays at the optimum
    _trainer(1).fit(model, dict_loader(data, idx))
    torch.testing.assert_close(model.gp.posterior().m, q_ref.m, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("kind", ["poisson", "normal"])
def test_epochs_equal_fit_aggregate(kind: str) -> None:
    """Three full-batch epochs with 2 Adam steps each give the same q(u), kernel, mean (and noise)
    as three iterations of :func:`fit_aggregate` from the same initial GP: the Normal model's exact
    step, the Poisson model's ELBO backtracking with adaptive ρ (ρ0 = 0.5, ×1.5), and Adam on
    ``−Σ bag terms / N`` are the library's, to 1e-9.

    If this fails, the Lightning step has drifted from the library iteration (order of natural and
    Adam steps, ρ schedule, normalisation of the objective, or weights)."""
    data = aggregate_bags(24, seed=2, kind=kind)
    loader = dict_loader(data, list(range(24)))
    lik = PoissonAggregateLikelihood("exp") if kind == "poisson" else NormalAggregateLikelihood(noise=0.3)
    model = GPMILModule(feature_dim=2, likelihood=lik, num_inducing=10, hyper_steps=2, warmup_epochs=0, lr_gp=0.05, rho0=0.5)
    model._initialize(loader)
    ref = copy.deepcopy(model.gp)
    K = 3
    _trainer(K).fit(model, loader)
    batch = next(iter(loader))
    z = ref.standardize(batch.x)
    res = fit_aggregate(ref.gp, ref.likelihood, BagBatch(z, batch.bag_index, batch.bag_labels.double(), instance_weights=batch.instance_weights.double()),
                        max_iter=K, tol=0.0, min_iter=K, hyper_steps=2, lr=0.05, rho0=0.5)
    assert res.iterations == K and int(model.natural_steps) == K
    q, q_ref = model.gp.posterior(), ref.gp.variational_strategy.whitened_posterior()
    torch.testing.assert_close(q.m, q_ref.m, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(q.S, q_ref.S, rtol=1e-9, atol=1e-9)
    state, state_ref = model.gp.state_dict(), ref.state_dict()
    for k in state:
        if state[k].is_floating_point():
            torch.testing.assert_close(state[k], state_ref[k], rtol=1e-9, atol=1e-9, msg=k)
    if kind == "poisson":
        assert float(model.aggregate_rho) == pytest.approx(res.rho)


def test_minibatch_end_to_end_runs_and_trains_the_cnn() -> None:
    """End-to-end (SmallCNN features) with Poisson counts, 2 bags per step: stochastic natural
    steps (Robbins–Monro ρ, statistics scaled by training bags / batch bags) and Adam through the
    CNN run, change the CNN weights and keep q(u) finite; validation logs regression metrics.

    If this fails, the aggregate step cannot take gradients through the features or breaks with
    minibatches."""
    pl.seed_everything(0)
    data = image_bags(num_bags=8, size=16, seed=5, max_slices=4)
    counts = [float(np.asarray(i).sum() + 1) for i in data["instance_labels"]]
    dm = BagArrayDataModule(data["bags"], counts, [np.asarray(i) + 0.5 for i in data["instance_labels"]],
                            splits=["train"] * 6 + ["val"] * 2, batch_size=2)
    cnn = SmallCNN(feature_dim=4, widths=(4, 4))
    model = GPMILModule(mode="end_to_end", extractor=cnn, likelihood=PoissonAggregateLikelihood("exp"), num_inducing=6,
                        warmup_epochs=0, lr_extractor=1e-2)
    before = copy.deepcopy(cnn.state_dict())
    trainer = _trainer(2)
    trainer.fit(model, dm)
    assert int(model.natural_steps) == 6
    changed = any(not torch.equal(before[k], v) for k, v in cnn.state_dict().items() if v.is_floating_point())
    assert changed
    q = model.gp.posterior()
    assert torch.isfinite(q.m).all() and torch.isfinite(q.S).all()
    assert {"val/bag_nll", "val/bag_mse", "val/instance_mse"} <= set(trainer.callback_metrics)


def test_aggregate_through_cli(tmp_path: Path) -> None:
    """Poisson-exp head on a feature CSV (population as a feature column, counts as bag labels,
    rates as instance labels) configured by class_path and fitted/tested through ``milgp-train``
    (resuming the test from the checkpoint); the test metrics are the regression metrics.

    If this fails, the aggregate likelihood cannot be chosen in YAML (typed __init__), the float
    targets do not flow through FeatureDataModule, or the test hooks/report break on aggregates."""
    data = aggregate_bags(40, seed=3)
    bags = [np.column_stack([x, p]) for x, p in zip(data["x"], data["pop"])]
    splits = ["train"] * 28 + ["val"] * 4 + ["test"] * 8
    table = FeatureTable.from_bags(bags, data["ids"], data["y"], data["targets"], splits=splits)
    save_features(tmp_path / "agg.csv", table)
    trainer = trainer_cfg(tmp_path, "agg", max_epochs=4)
    cfg = {
        "seed_everything": 0,
        "trainer": trainer,
        "model": {"class_path": "lightning_modules.GPMILModule",
                  "init_args": {"feature_dim": 3, "population_column": 2, "num_inducing": 12, "warmup_epochs": 1, "lr_gp": 0.05,
                                "likelihood": {"class_path": "milgp.likelihoods.PoissonAggregateLikelihood", "init_args": {"link": "exp"}}}},
        "data": {"class_path": "lightning_modules.FeatureDataModule", "init_args": {"path": str(tmp_path / "agg.csv")}},
    }
    path = write_config(tmp_path / "agg.yaml", cfg)
    cli = run_cli(["fit", "--config", path])
    assert isinstance(cli.model.gp.likelihood, PoissonAggregateLikelihood)
    cli = run_cli(["test", "--config", path, "--ckpt_path", "last"])
    m = cli.model.test_metrics
    assert len(cli.model.test_records) == 8
    for k in ("bag_nll", "bag_mse", "bag_mae", "bag_r2", "bag_poisson_deviance", "instance_mse", "instance_mae"):
        assert k in m and np.isfinite(m[k]), (k, m)
    assert "bag_auc" not in m


def test_aggregate_resume_continues_exactly(tmp_path: Path) -> None:
    """Poisson-exp, full batch (adaptive ρ): 3 epochs straight equal 2 epochs + resume for the 3rd.

    If this fails, the checkpoint misses the adaptive step size (``aggregate_rho``), q(u), the
    step counter or Adam's state."""
    data = aggregate_bags(20, seed=6)
    bags = [np.column_stack([x, p]) for x, p in zip(data["x"], data["pop"])]

    def fit(root: Path, epochs: int, ckpt: str | None = None) -> GPMILModule:
        dm = BagArrayDataModule(bags, data["y"], bag_ids=data["ids"], splits=["train"] * 16 + ["val"] * 4)
        model = GPMILModule(feature_dim=3, population_column=2, likelihood=PoissonAggregateLikelihood("exp"), num_inducing=8,
                            warmup_epochs=1, hyper_steps=2, lr_gp=0.05)
        trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, default_root_dir=str(root), logger=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0,
                             callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, save_top_k=-1)])
        trainer.fit(model, dm, ckpt_path=ckpt)
        return model

    straight = fit(tmp_path / "a", 3)
    fit(tmp_path / "b", 2)
    ckpt = tmp_path / "b" / "ckpt" / "last.ckpt"
    assert "aggregate_rho" in torch.load(ckpt, weights_only=True)["state_dict"]
    resumed = fit(tmp_path / "b", 3, ckpt=str(ckpt))
    s1, s2 = straight.state_dict(), resumed.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], rtol=0, atol=0, msg=k)


def test_aggregate_errors() -> None:
    """Clear errors: invalid counts name the training bag by id; a population column needs an
    aggregate likelihood.

    If this fails, bad targets reach the optimiser (NaN later) or the options are not validated."""
    data = aggregate_bags(6, seed=4)
    data["y"][3] = 2.5
    model = GPMILModule(feature_dim=2, likelihood=PoissonAggregateLikelihood("exp"), num_inducing=4)
    with pytest.raises(ValueError, match="bag_003.*non-negative integers"):
        model._initialize(dict_loader(data, list(range(6))))
    with pytest.raises(ValueError, match="population_column"):
        GPMILModule(feature_dim=3, population_column=2, likelihood=MILBernoulliLikelihood())


_DDP_WORKER = textwrap.dedent('''
    import os, sys, warnings
    import numpy as np, pytorch_lightning as pl, torch
    sys.path.insert(0, {here!r})
    from test_gp_aggregate import aggregate_bags
    from lightning_modules import GPMILModule
    from lightning_modules.distributed import end_process_group, is_distributed
    from milgp.data.bags import collate_bags
    from milgp.likelihoods import PoissonAggregateLikelihood
    warnings.filterwarnings("ignore")

    class Save(pl.Callback):
        def on_train_end(self, trainer, module):
            q = module.gp.posterior()
            state = {{k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}
            torch.save({{"m": q.m, "S": q.S, "state": state}}, f"devices{{devices}}_rank{{trainer.global_rank}}.pt")

    devices = int(sys.argv[1])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    data = aggregate_bags(12, seed=5)
    samples = [{{"x": data["x"][i], "bag_label": data["y"][i], "bag_id": data["ids"][i], "instance_weights": data["pop"][i]}}
               for i in range(12)]

    class DM(pl.LightningDataModule):
        def train_dataloader(self):
            sampler = torch.utils.data.DistributedSampler(samples, shuffle=False) if is_distributed() else None
            return torch.utils.data.DataLoader(samples, batch_size=12 // devices, sampler=sampler, collate_fn=collate_bags)

    model = GPMILModule(feature_dim=2, likelihood=PoissonAggregateLikelihood("exp"), num_inducing=8, warmup_epochs=1,
                        hyper_steps=2, lr_gp=0.05)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=3,
                         limit_val_batches=0, use_distributed_sampler=False, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Save()])
    trainer.fit(model, DM())
    end_process_group()
''')


@pytest.mark.slow
def test_ddp_aggregate_same_q_as_one_process(tmp_path: Path) -> None:
    """Poisson-exp, two CPU ranks (gloo) with 6 bags each = the full batch: the aggregate natural
    statistics and the ELBO of the backtracking are all-reduced, so both ranks hold bit-identical
    q(u) and hyperparameters, equal (to float summation order) to one process on all 12 bags.

    If the ranks differ, the aggregate statistics/ELBO are not summed across ranks."""
    script = tmp_path / "agg_ddp_worker.py"
    script.write_text(_DDP_WORKER.format(here=str(HERE)))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore")
    for devices in (2, 1):
        proc = subprocess.run([sys.executable, str(script), str(devices)], cwd=str(tmp_path), env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1, one = (torch.load(tmp_path / f, weights_only=True) for f in ("devices2_rank0.pt", "devices2_rank1.pt", "devices1_rank0.pt"))
    assert torch.equal(r0["m"], r1["m"]) and torch.equal(r0["S"], r1["S"])
    for k in r0["state"]:
        assert torch.equal(r0["state"][k], r1["state"][k]), k
    torch.testing.assert_close(r0["m"], one["m"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(r0["S"], one["S"], rtol=1e-6, atol=1e-8)
    for k in one["state"]:
        if one["state"][k].is_floating_point():
            torch.testing.assert_close(r0["state"][k], one["state"][k], rtol=1e-6, atol=1e-8, msg=k)


def test_each_head_refuses_the_other_family_of_likelihood() -> None:
    """The MIL head takes augmented MIL likelihoods and the aggregate head aggregate ones; the module
    picks the head from its likelihood. If this fails, an aggregate likelihood would be trained with
    the MIL head's closed-form steps (or the reverse) and fail deep inside a step, or silently."""
    from lightning_modules.aggregate_gp_head import AggregateGPHead
    from lightning_modules.gp_head import GPHead

    with pytest.raises(TypeError, match="GPHead needs a likelihood of type AugmentedBagLikelihood, got PoissonAggregateLikelihood"):
        GPHead(3, 4, PoissonAggregateLikelihood("exp"))
    with pytest.raises(TypeError, match="AggregateGPHead needs a likelihood of type AggregateLikelihood, got MILBernoulliLikelihood"):
        AggregateGPHead(3, 4, MILBernoulliLikelihood())
    assert type(GPMILModule(feature_dim=3, likelihood=PoissonAggregateLikelihood("exp"), num_inducing=4).gp) is AggregateGPHead
    assert type(GPMILModule(feature_dim=3, num_inducing=4).gp) is GPHead
