"""Two-stage GPMILModule with the full training set as one batch is Algorithm 1 (fit_closed_form)."""
from __future__ import annotations

import copy

import pytorch_lightning as pl
import torch

from lightning_modules import BagArrayDataModule, GPMILModule
from milgp.models.closed_form_strategy import WhitenedPosterior
from milgp.variational.fit import fit_closed_form
from lm_helpers import feature_bags


def test_full_batch_epochs_equal_fit_closed_form() -> None:
    """K epochs of the Lightning module (no hyperparameter steps) give the same q(v) and locals as
    K full-batch CAVI iterations of :func:`milgp.variational.fit_closed_form` from the same start.

    If this fails, the Lightning training step is not the library's closed-form natural update
    (wrong scaling, wrong order of locals/natural step, or stale locals between epochs)."""
    data = feature_bags(num_bags=16, dim=3, seed=2)
    dm = BagArrayDataModule(**data, fractions=(0.75, 0.0, 0.25))
    model = GPMILModule(mode="two_stage", feature_dim=3, num_inducing=10, hyper_steps=0, warmup_epochs=0)
    K = 4
    trainer = pl.Trainer(accelerator="cpu", max_epochs=K, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    # a fresh copy of the initial GP to run the library loop on
    trainer.fit(model, dm)
    batch = next(iter(dm.train_dataloader()))
    z = model.gp.standardize(batch.x)
    ref = copy.deepcopy(model.gp.gp)  # same Z and kernel (no hyperparameter steps were taken) ...
    eye = torch.eye(10, dtype=torch.float64)
    ref.variational_strategy.set_whitened_posterior(WhitenedPosterior(torch.zeros(10, dtype=torch.float64), eye, eye))  # ... q(v) back at the prior
    lik = model.gp.likelihood
    from milgp.data.bags import BagBatch

    result = fit_closed_form(ref, lik, BagBatch(z, batch.bag_index, batch.bag_labels.double()), max_iter=K, tol=0.0,
                             learn_hyperparameters=False, min_iter=K)
    assert result.iterations == K
    q_ref, q = ref.variational_strategy.whitened_posterior(), model.gp.posterior()
    torch.testing.assert_close(q.m, q_ref.m, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(q.S, q_ref.S, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model.bag_locals.gather(batch.bag_ids, batch.to("cpu").bags), result.locals, rtol=1e-10, atol=1e-10)
