"""Noise calibration: the noise multiplier that meets a target epsilon after a planned number of steps.

:func:`calibrate_noise_multiplier` answers the question a DP-SGD user starts from ("epsilon 3 at
delta 1e-5 over 10 epochs at this sampling rate: which sigma?"). It searches with
``dp_accounting``'s :func:`~dp_accounting.mechanism_calibration.calibrate_dp_mechanism` (Brent's
method, with its guarantee that the returned parameter meets the target), over the very epsilon
:class:`~psg_core.accounting.PrivacyAccountant` computes (same method, same PLD discretisation), so
an accountant given the calibrated sigma and the planned steps reports an epsilon within the target
and a budget of that target never refuses one of those steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import dp_accounting
from dp_accounting import dp_event as dpe
from dp_accounting import mechanism_calibration

from psg_core.accounting import (_DEFAULT_DISCRETISATION, MAX_STEPS_SEARCHED, AccountingMethod, _check_delta,
                                 _check_epsilon, _epsilon, _event, _Ledger)
from psg_core.errors import ConfigError
from psg_core.modes import parse_enum

__all__ = ["DEFAULT_CALIBRATION_TOLERANCE", "calibrate_noise_multiplier", "steps_for_epochs"]

#: Default absolute tolerance of :func:`calibrate_noise_multiplier` on sigma: the answer is at most
#: this much above the smallest sigma that meets the target (sigmas of DP-SGD are ~0.5 to ~20).
DEFAULT_CALIBRATION_TOLERANCE = 1e-3
#: sigma is searched below this; a target no sigma up to it meets is refused.
_MAX_SIGMA = 2.0 ** 20


def steps_for_epochs(epochs: float, sample_rate: float) -> int:
    """Steps of ``epochs`` passes at ``sample_rate``: ``ceil(epochs * round(1 / sample_rate))``,
    as many batches per epoch as :class:`~psg_core.sampling.PoissonBatchSampler` draws by default.

    >>> steps_for_epochs(10, 128 / 1437)
    110
    """
    where = "steps_for_epochs"
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) \
            or epochs <= 0:
        raise ConfigError(f"{where}: epochs must be a finite number > 0, got {epochs!r}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise ConfigError(f"{where}: sample_rate must be a number in (0, 1], got {sample_rate!r}")
    # The slack keeps a product like 0.7 * 10 = 7.000000000000001 at 7 steps, not 8.
    return max(1, math.ceil(epochs * max(1, round(1 / sample_rate)) - 1e-9))


class _LedgerAccountant(dp_accounting.PrivacyAccountant):
    """psg's epsilon behind ``dp_accounting``'s accountant interface, so that its calibration
    searches the function :class:`~psg_core.accounting.PrivacyAccountant` enforces (the smaller of
    the RDP and PLD bounds, PLD on psg's grid), not a neighbouring one."""

    def __init__(self, epsilon_of: Callable[[_Ledger, float], float]) -> None:
        super().__init__(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        self._epsilon_of = epsilon_of
        self._counts: dict[tuple[float, float], int] = {}

    def _maybe_compose(self, event: dpe.DpEvent, count: int,
                       do_compose: bool) -> dp_accounting.PrivacyAccountant.CompositionErrorDetails | None:
        if isinstance(event, dpe.SelfComposedDpEvent):
            return self._maybe_compose(event.event, count * event.count, do_compose)
        if isinstance(event, dpe.PoissonSampledDpEvent) and isinstance(event.event, dpe.GaussianDpEvent):
            if do_compose:
                mechanism = (float(event.event.noise_multiplier), float(event.sampling_probability))
                self._counts[mechanism] = self._counts.get(mechanism, 0) + count
            return None
        return self.CompositionErrorDetails(invalid_event=event,
                                            error_message="psg accounts Poisson-sampled Gaussian steps only")

    def get_epsilon(self, target_delta: float) -> float:
        return self._epsilon_of(tuple(sorted(self._counts.items())), target_delta)


def _check_steps(steps: int | None, epochs: float | None, sample_rate: float, *, where: str) -> int:
    if (steps is None) == (epochs is None):
        raise ConfigError(f"{where}: give the planned steps or epochs (one of them), got steps={steps!r}, "
                          f"epochs={epochs!r}")
    if epochs is not None:
        steps = steps_for_epochs(epochs, sample_rate)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS_SEARCHED:
        raise ConfigError(f"{where}: steps must be an int in 1..{MAX_STEPS_SEARCHED}, got {steps!r}")
    return steps


def calibrate_noise_multiplier(target_epsilon: float, *, delta: float, sample_rate: float,
                               steps: int | None = None, epochs: float | None = None,
                               accountant: AccountingMethod | str = AccountingMethod.PLD,
                               tolerance: float = DEFAULT_CALIBRATION_TOLERANCE,
                               value_discretization_interval: float = _DEFAULT_DISCRETISATION) -> float:
    """The smallest noise multiplier sigma whose epsilon after the planned steps is at most
    ``target_epsilon``, within ``tolerance``.

    The returned sigma meets the target (``epsilon(sigma) <= target_epsilon``, evaluated as
    :class:`~psg_core.accounting.PrivacyAccountant` with the same method and discretisation does)
    and is at most ``tolerance`` above the smallest sigma that does. Steps are Poisson-subsampled
    Gaussian steps at ``sample_rate``, under add-or-remove-one adjacency; the plan counts from zero
    (an accountant that already recorded steps needs a sigma for what is left of its budget).

    Args:
        target_epsilon: epsilon after the last planned step, > 0.
        delta: delta in (0, 1) of that epsilon.
        sample_rate: q in (0, 1], each example's probability of joining a batch.
        steps: planned steps; or
        epochs: planned epochs, :func:`steps_for_epochs` steps.
        accountant: ``"pld"`` (default, tighter, so a smaller sigma) or ``"rdp"``.
        tolerance: absolute tolerance on sigma, > 0.
        value_discretization_interval: the PLD grid, as the accountant's.

    Returns:
        sigma > 0.

    Raises:
        ConfigError: an argument is out of range, or no sigma up to 2**20 meets the target.

    >>> sigma = calibrate_noise_multiplier(2.6, delta=1e-5, sample_rate=256 / 60000, steps=14100,
    ...                                    accountant="rdp")
    >>> round(sigma, 2)
    1.1
    """
    where = "calibrate_noise_multiplier"
    target = _check_epsilon(target_epsilon, where=where)
    delta = _check_delta(delta, where=where)
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise ConfigError(f"{where}: sample_rate must be a number in (0, 1], got {sample_rate!r}")
    sample_rate = float(sample_rate)
    steps = _check_steps(steps, epochs, sample_rate, where=where)
    method = AccountingMethod(parse_enum(AccountingMethod, accountant, what=f"{where}: accountant"))
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise ConfigError(f"{where}: tolerance must be a number > 0, got {tolerance!r}")
    interval = value_discretization_interval
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < 1:
        raise ConfigError(f"{where}: value_discretization_interval must be in (0, 1), got {interval!r}")
    if method is AccountingMethod.PLD:
        # The PLD method's epsilon is at most the RDP one, so the RDP answer (cheap) bounds sigma.
        upper = _calibrate(AccountingMethod.RDP, target, delta, sample_rate, steps, float(tolerance),
                           float(interval), upper=None)
        return _calibrate(method, target, delta, sample_rate, steps, float(tolerance), float(interval),
                          upper=upper)
    return _calibrate(method, target, delta, sample_rate, steps, float(tolerance), float(interval), upper=None)


def _calibrate(method: AccountingMethod, target: float, delta: float, sample_rate: float, steps: int,
               tolerance: float, discretisation: float, *, upper: float | None) -> float:
    epsilons: dict[_Ledger, float] = {}

    def epsilon_of(ledger: _Ledger, delta_: float) -> float:
        if ledger not in epsilons:
            epsilons[ledger] = _epsilon(method, ledger, delta_, discretisation)
        return epsilons[ledger]

    def gap(sigma: float) -> float:
        return epsilon_of((((sigma, sample_rate), steps),), delta) - target

    # An explicit bracket [lower, upper] with gap(lower) > 0 >= gap(upper), found by doubling and
    # halving: dp_accounting's own search starts from 0, where epsilon is infinite.
    if upper is None:
        upper = 1.0
        while gap(upper) > 0:
            if upper >= _MAX_SIGMA:
                raise ConfigError(f"calibrate_noise_multiplier: no noise_multiplier up to {_MAX_SIGMA:g} "
                                  f"reaches epsilon {target} at delta {delta} after {steps} steps at "
                                  f"sample_rate {sample_rate}")
            upper *= 2
    lower = upper / 2
    while gap(lower) <= 0:
        upper, lower = lower, lower / 2
        if upper <= tolerance:
            return upper
    sigma = mechanism_calibration.calibrate_dp_mechanism(
        lambda: _LedgerAccountant(epsilon_of),
        lambda s: dpe.SelfComposedDpEvent(_event(float(s), sample_rate), steps),
        target, delta, bracket_interval=mechanism_calibration.ExplicitBracketInterval(lower, upper),
        tol=tolerance)
    return float(sigma)
