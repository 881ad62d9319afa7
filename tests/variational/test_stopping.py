"""RelativeChangeStop: the one stopping rule of fit_closed_form and fit_aggregate."""
from milgp.variational.stopping import RelativeChangeStop


def test_stops_after_two_small_relative_changes_in_a_row():
    """Two consecutive changes within tol·max(1, |previous|) stop the fit; a large change in between
    resets the count (one quiet sweep is not convergence)."""
    stop = RelativeChangeStop(tol=1e-3)
    values = [-100.0, -50.0, -49.99, -40.0, -39.99, -39.985]
    decisions = [stop(v, i) for i, v in enumerate(values)]
    assert decisions == [False, False, False, False, False, True]


def test_the_tolerance_is_absolute_below_one_and_relative_above():
    """|Δ| ≤ tol·max(1, |previous|): near zero an absolute 1e-3 counts as quiet; at 1e4 a change of 5
    is quiet (relative 5e-4) but a change of 20 is not."""
    near_zero = RelativeChangeStop(tol=1e-3)
    assert [near_zero(v, i) for i, v in enumerate([0.0, 0.0009, 0.0017])] == [False, False, True]
    large = RelativeChangeStop(tol=1e-3)
    assert [large(v, i) for i, v in enumerate([1e4, 1e4 + 5, 1e4 + 25, 1e4 + 30])] == [False, False, False, False]


def test_min_iter_holds_off_an_early_stop():
    """A flat objective stops only once ``min_iter`` iterations have run."""
    stop = RelativeChangeStop(tol=1e-6, min_iter=5)
    assert [stop(1.0, i) for i in range(6)] == [False, False, False, False, True, True]
