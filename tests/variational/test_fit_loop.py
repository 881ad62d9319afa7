"""The one fit loop (fit_loop) driven by a recording FitSteps: order of steps, bags, stopping."""
from __future__ import annotations

import math

import pytest
import torch

from milgp.data.bags import BagBatch, bag_index_from_sizes
from milgp.models.sparse_gp import SparseGP
from milgp.variational.fit_loop import fit_loop
from milgp.variational.fit_result import FitResult


class RecordingSteps:
    """A FitSteps that records what the loop asks of it; its ELBO follows a given sequence."""

    def __init__(self, sizes: list[int], elbos: list[float]):
        bag_index = bag_index_from_sizes(sizes)
        self.batch = BagBatch(torch.zeros(len(bag_index), 1, dtype=torch.float64), bag_index, torch.zeros(len(sizes)))
        self.strategy = SparseGP(torch.zeros(2, 1, dtype=torch.float64)).variational_strategy
        self.q = self.strategy.whitened_posterior()
        self.locals, self.step_size, self.elbo_estimate = None, 0.0, None
        self.elbos, self.calls = list(elbos), []

    def sweep(self) -> None:
        self.calls.append(("sweep",))

    def minibatch_step(self, bags, rho, scale) -> None:
        self.calls.append(("minibatch", sorted(bags.tolist()), rho, scale))

    def hyper_step(self, bags, optimizer) -> None:
        self.calls.append(("hyper", None if bags is None else sorted(bags.tolist())))

    def hyperparameters_changed(self) -> None:
        self.calls.append(("changed",))

    def evaluate(self, with_objective: bool):
        value = self.elbos.pop(0)
        return value, (value - 1.0 if with_objective else None)

    def finish(self, result: FitResult) -> None:
        self.calls.append(("finish",))


def run(steps: RecordingSteps, **kw) -> FitResult:
    options = dict(max_iter=10, tol=0.0, min_iter=1, optimizer=None, hyper_steps=2, hyper_max_instances=10**9,
                   bags_per_batch=None, schedule=None, seed=0, progress=False, callback=None, desc="test")
    return fit_loop(steps, **{**options, **kw})


def test_full_batch_iteration_is_a_sweep_then_hyperparameter_steps_on_all_bags() -> None:
    """Each full-batch iteration is one sweep, then ``hyper_steps`` hyperparameter steps on all bags
    (they fit the budget) and one ``hyperparameters_changed``; the ELBO trace holds every iteration
    and the objective, when hyperparameters are learned, is what is watched. If this fails, the loop
    takes the steps of Algorithm 1 in another order or skips one."""
    steps = RecordingSteps([2, 3, 1], elbos=[-5.0, -4.0, -3.5])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    result = run(steps, max_iter=3, optimizer=optimizer)
    assert steps.calls == [("sweep",), ("hyper", None), ("hyper", None), ("changed",)] * 3 + [("finish",)]
    assert result.elbo == [-5.0, -4.0, -3.5] and result.objective == [-6.0, -5.0, -4.5]
    assert result.iterations == 3 and not result.converged


def test_hyperparameter_steps_use_whole_bags_within_the_instance_budget() -> None:
    """With more instances than ``hyper_max_instances`` every hyperparameter step gets whole bags
    holding at most that many instances (at least one bag), drawn afresh. If this fails, the
    hyperparameter steps' memory is not bounded or they see parts of bags."""
    sizes = [4, 3, 5, 2, 6, 1]
    steps = RecordingSteps(sizes, elbos=[-4.0, -3.0, -2.0, -1.0])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    run(steps, max_iter=4, optimizer=optimizer, hyper_max_instances=8)
    subsets = [c[1] for c in steps.calls if c[0] == "hyper"]
    assert len(subsets) == 8
    assert all(subsets) and all(sum(sizes[b] for b in s) <= 8 for s in subsets)
    assert len({tuple(s) for s in subsets}) > 1


def test_an_epoch_of_minibatches_visits_every_bag_once_with_the_schedule() -> None:
    """With ``bags_per_batch`` an iteration is an epoch: minibatches partition the bags, the step
    size follows the schedule over all steps, the scale is training bags / minibatch bags, and the
    hyperparameter steps run on the minibatch just stepped. If this fails, the stochastic natural
    steps are biased (bags skipped or repeated, wrong scale) or the schedule restarts each epoch."""
    steps = RecordingSteps([1] * 7, elbos=[-2.0, -1.0])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    run(steps, max_iter=2, optimizer=optimizer, hyper_steps=1, bags_per_batch=3, schedule=lambda t: 1.0 / (t + 1))
    mb = [c for c in steps.calls if c[0] == "minibatch"]
    assert len(mb) == 6
    for epoch in (mb[:3], mb[3:]):
        assert sorted(b for c in epoch for b in c[1]) == list(range(7))
    assert [c[2] for c in mb] == pytest.approx([1.0 / (t + 1) for t in range(6)])
    assert [c[3] for c in mb] == pytest.approx([7 / len(c[1]) for c in mb])
    kinds = [c[0] for c in steps.calls if c[0] != "finish"]
    assert kinds == ["minibatch", "hyper", "changed"] * 6
    assert [c[1] for c in steps.calls if c[0] == "hyper"] == [c[1] for c in mb]


def test_stops_after_two_small_changes_and_refuses_a_non_finite_elbo() -> None:
    """The loop stops once the watched value changed by at most ``tol`` twice in a row (after
    ``min_iter``), and a non-finite ELBO raises a one-line FloatingPointError naming the iteration.
    If this fails, fits run to ``max_iter`` when converged or carry on with NaNs."""
    steps = RecordingSteps([1, 1], elbos=[-10.0, -5.0, -5.0, -5.0, -4.0])
    result = run(steps, tol=1e-9, min_iter=2)
    assert result.converged and result.iterations == 4
    with pytest.raises(FloatingPointError, match="iteration 1"):
        run(RecordingSteps([1, 1], elbos=[-1.0, math.nan]))


@pytest.mark.parametrize("rho", [0.0, -0.5, 1.5, math.nan])
def test_a_schedule_value_outside_0_1_is_refused(rho: float) -> None:
    """Every family's minibatch steps need ρ in (0, 1]; the loop refuses another schedule value in
    one line naming the schedule and the step. If this fails, a family may take no step at all (and
    report convergence) or an overshooting one."""
    steps = RecordingSteps([2, 3, 1], elbos=[-1.0])
    with pytest.raises(ValueError, match=r"^schedule\(0\) returned .*rho must be in \(0, 1\]$"):
        run(steps, bags_per_batch=2, schedule=lambda t: rho)
