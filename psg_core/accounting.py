"""Privacy accounting for DP-SGD with Poisson subsampling, on Google's ``dp-accounting`` package.

Each step of DP-SGD is a Poisson-subsampled Gaussian mechanism: every example joins the batch
independently with probability ``sample_rate`` (q), and the sum of clipped gradients gets noise of
std ``noise_multiplier * C`` (sigma * C). :class:`PrivacyAccountant` keeps a ledger of how many
steps ran with each ``(sigma, q)`` and converts it to epsilon at a given delta, under the
add-or-remove-one neighbouring relation, with one of two methods:

* ``"pld"`` (default): privacy loss distributions (Koskela et al., 2020; Doroshenko et al., 2022),
  a numerically tight pessimistic bound. Both methods give valid upper bounds on the true epsilon,
  so ``"pld"`` reports the smaller of the two (in practice the PLD value).
* ``"rdp"``: Renyi DP (Mironov, 2017; Mironov et al., 2019), looser but nearly free to evaluate.

Budget checks use that order: a step the RDP bound already certifies needs no PLD evaluation, so
only the last steps before the budget runs out pay for the (slower) PLD.

The ledger is a multiset, so epsilon is computed from scratch on demand (composition is
commutative); a step with ``noise_multiplier = 0`` is not private and makes epsilon infinite.

:meth:`PrivacyAccountant.state_dict` is the ledger and the settings as plain JSON values, versioned
(:data:`STATE_VERSION`), so a training checkpoint (``torch.save``, a JSON file, a database row)
carries it and :meth:`~PrivacyAccountant.load_state_dict` resumes exactly where it stopped.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from psg_core.errors import BudgetExhaustedError, ConfigError
from psg_core.modes import parse_enum

__all__ = ["AccountingMethod", "PrivacyAccountant", "MAX_STEPS_SEARCHED", "PLD_EPSILON_CUTOFF", "STATE_VERSION"]

logger = logging.getLogger(__name__)

#: :meth:`PrivacyAccountant.steps_within_budget` searches at most this many steps by default; PLD
#: evaluation time grows with the number of composed steps.
MAX_STEPS_SEARCHED = 10**6
#: Above this RDP epsilon, ``method="pld"`` returns the RDP bound instead: the PLD's support (and
#: its cost) grows with epsilon / discretisation, e.g. tens of GiB near epsilon 10**4, and such a
#: run has no meaningful privacy anyway. The RDP value is still a valid upper bound.
PLD_EPSILON_CUTOFF = 50.0
_DEFAULT_DISCRETISATION = 1e-4
#: Version of :meth:`PrivacyAccountant.state_dict`'s layout; :meth:`~PrivacyAccountant.load_state_dict`
#: reads this version and refuses others.
STATE_VERSION = 1
_STATE_FORMAT = "psg_core.PrivacyAccountant"

#: ``((noise_multiplier, sample_rate), count)`` pairs, sorted: the canonical form of a ledger.
_Ledger = tuple[tuple[tuple[float, float], int], ...]


class AccountingMethod(str, enum.Enum):
    """How :class:`PrivacyAccountant` turns the ledger into epsilon."""

    PLD = "pld"
    RDP = "rdp"


def _check_delta(delta: object, *, where: str) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ConfigError(f"{where}: delta must be a number in (0, 1), got {delta!r}")
    return float(delta)


def _check_epsilon(epsilon: object, *, where: str) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) \
            or epsilon <= 0:
        raise ConfigError(f"{where}: target_epsilon must be a finite number > 0, got {epsilon!r}")
    return float(epsilon)


def _check_mechanism(noise_multiplier: object, sample_rate: object, *, where: str) -> tuple[float, float]:
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)) \
            or not math.isfinite(noise_multiplier) or noise_multiplier < 0:
        raise ConfigError(f"{where}: noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) \
            or not 0 < sample_rate <= 1:
        raise ConfigError(f"{where}: sample_rate must be a number in (0, 1], got {sample_rate!r}")
    return float(noise_multiplier), float(sample_rate)


def _check_count(num_steps: object, *, where: str) -> int:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ConfigError(f"{where}: num_steps must be an int >= 1, got {num_steps!r}")
    return num_steps


def _event(noise_multiplier: float, sample_rate: float) -> dpe.DpEvent:
    return dpe.PoissonSampledDpEvent(sample_rate, dpe.GaussianDpEvent(noise_multiplier))


class _DropUnconvergedOrders(logging.Filter):
    """dp_accounting warns when a fractional RDP order's series does not converge; it then drops
    that order (infinite RDP, the conservative choice), which is expected for orders near 1."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@functools.lru_cache(maxsize=64)
def _rdp_per_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of one step at every default order; composition multiplies it by the count."""
    accountant = rdp_lib.RdpAccountant()
    quiet = _DropUnconvergedOrders()
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(quiet)
    try:
        accountant.compose(_event(noise_multiplier, sample_rate))
    finally:
        absl_logger.removeFilter(quiet)
    return np.asarray(accountant.rdp, dtype=np.float64)


@functools.lru_cache(maxsize=64)
def _pld_per_step(noise_multiplier: float, sample_rate: float,
                  discretisation: float) -> pld_lib.PrivacyLossDistribution:
    """PLD of one step; building it dominates the cost of a fresh evaluation, so it is cached."""
    return pld_lib.from_gaussian_mechanism(standard_deviation=noise_multiplier,
                                           sampling_prob=sample_rate,
                                           value_discretization_interval=discretisation)


def _rdp_epsilon(ledger: _Ledger, delta: float) -> float:
    orders = np.asarray(rdp_lib.DEFAULT_RDP_ORDERS, dtype=np.float64)
    total = sum((count * _rdp_per_step(*mechanism) for mechanism, count in ledger),
                np.zeros_like(orders))
    epsilon, _ = rdp_lib.compute_epsilon(orders, total, delta)
    return float(epsilon)


def _epsilon(method: AccountingMethod, ledger: _Ledger, delta: float, discretisation: float) -> float:
    ledger = tuple(entry for entry in ledger if entry[1] > 0)
    if not ledger:
        return 0.0
    if any(noise_multiplier == 0.0 for (noise_multiplier, _), _ in ledger):
        return math.inf
    rdp_epsilon = _rdp_epsilon(ledger, delta)
    if method is AccountingMethod.RDP:
        return rdp_epsilon
    if rdp_epsilon > PLD_EPSILON_CUTOFF:
        logger.debug("PrivacyAccountant: RDP epsilon %.3g > %g, returning it instead of the PLD value",
                     rdp_epsilon, PLD_EPSILON_CUTOFF)
        return rdp_epsilon
    composed = pld_lib.identity(value_discretization_interval=discretisation)
    for mechanism, count in ledger:
        composed = composed.compose(_pld_per_step(*mechanism, discretisation).self_compose(count))
    return min(rdp_epsilon, float(composed.get_epsilon_for_delta(delta)))


def _largest_within(epsilon_at: Callable[[int], float], target: float, *, guess: int, limit: int) -> int:
    """The largest m in [0, limit] with ``epsilon_at(m) <= target`` (-1 if not even 0), for a
    non-decreasing ``epsilon_at``: bracket around ``guess`` by doubling/halving, then shrink the
    bracket by interpolation in log-log space, falling back to bisection when it stalls."""
    values: dict[int, float] = {}

    def within(m: int) -> bool:
        values[m] = epsilon_at(m)
        return values[m] <= target

    if not within(0):
        return -1
    lo, hi = 0, limit + 1
    m = min(max(guess, 1), limit)
    if within(m):
        lo = m
        while lo < limit:
            m = min(limit, 2 * lo)
            if not within(m):
                hi = m
                break
            lo = m
        else:
            return limit
    else:
        hi = m
        while hi > 1:
            m = hi // 2
            if within(m):
                lo = m
                break
            hi = m
    bisect = False
    while hi - lo > 1:
        e_lo, e_hi = values[lo], values[hi]
        if bisect or lo == 0 or e_lo <= 0 or not math.isfinite(e_hi):
            m = (lo + hi) // 2
        else:
            t = (math.log(target) - math.log(e_lo)) / (math.log(e_hi) - math.log(e_lo))
            m = round(math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo))))
            m = min(max(m, lo + 1), hi - 1)
        width = hi - lo
        if within(m):
            lo = m
        else:
            hi = m
        bisect = hi - lo > width / 2
    return lo


class PrivacyAccountant:
    """Tracks the (epsilon, delta) spent by DP-SGD steps, optionally refusing to exceed a budget.

    Args:
        method: ``"pld"`` (default, tighter) or ``"rdp"``.
        target_epsilon, target_delta: an optional budget; when set, :meth:`step` raises
            :class:`~psg_core.errors.BudgetExhaustedError` instead of recording a step that would
            make ``epsilon(target_delta)`` exceed ``target_epsilon``. Give both or neither.
        value_discretization_interval: PLD only; smaller is tighter and slower.

    Thread-safe: the ledger and caches are guarded by a lock.

    >>> accountant = PrivacyAccountant(method="rdp")
    >>> accountant.step(noise_multiplier=1.1, sample_rate=256 / 60000, num_steps=14100)
    >>> round(accountant.epsilon(1e-5), 2)
    2.6
    """

    def __init__(self, method: AccountingMethod | str = AccountingMethod.PLD, *,
                 target_epsilon: float | None = None, target_delta: float | None = None,
                 value_discretization_interval: float = _DEFAULT_DISCRETISATION) -> None:
        where = "PrivacyAccountant"
        self._method = AccountingMethod(parse_enum(AccountingMethod, method, what=f"{where}: method"))
        if (target_epsilon is None) != (target_delta is None):
            raise ConfigError(f"{where}: give both target_epsilon and target_delta or neither, got "
                              f"target_epsilon={target_epsilon!r}, target_delta={target_delta!r}")
        self._target_epsilon = None if target_epsilon is None else _check_epsilon(target_epsilon, where=where)
        self._target_delta = None if target_delta is None else _check_delta(target_delta, where=where)
        interval = value_discretization_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < 1:
            raise ConfigError(f"{where}: value_discretization_interval must be in (0, 1), got {interval!r}")
        self._discretisation = float(interval)
        self._counts: dict[tuple[float, float], int] = {}
        self._last: tuple[float, float] | None = None
        # (method, other entries, mechanism, target_epsilon, delta) -> (largest total count of the
        # mechanism within the budget, the bound the search stopped at); exact when cap < bound.
        self._caps: dict[tuple[AccountingMethod, _Ledger, tuple[float, float], float, float],
                         tuple[int, int]] = {}
        self._epsilons: dict[tuple[AccountingMethod, _Ledger, float], float] = {}
        self._lock = threading.RLock()

    # -- read-only views -------------------------------------------------------------------

    @property
    def method(self) -> AccountingMethod:
        """The accounting method."""
        return self._method

    @property
    def target_epsilon(self) -> float | None:
        """The budget's epsilon, or None without a budget."""
        return self._target_epsilon

    @property
    def target_delta(self) -> float | None:
        """The budget's delta, or None without a budget."""
        return self._target_delta

    @property
    def value_discretization_interval(self) -> float:
        """The PLD grid (unused by the RDP method)."""
        return self._discretisation

    @property
    def steps(self) -> int:
        """Number of steps recorded."""
        with self._lock:
            return sum(self._counts.values())

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """``[(noise_multiplier, sample_rate, num_steps), ...]`` in order of first use."""
        with self._lock:
            return [(sigma, q, count) for (sigma, q), count in self._counts.items()]

    @property
    def dp_event(self) -> dpe.DpEvent:
        """The ledger as a ``dp_accounting`` event, for use with its other tools."""
        with self._lock:
            return dpe.ComposedDpEvent([dpe.SelfComposedDpEvent(_event(sigma, q), count)
                                             for (sigma, q), count in self._counts.items()])

    # -- accounting ------------------------------------------------------------------------

    def _ledger(self, extra: tuple[float, float] | None = None, extra_count: int = 0) -> _Ledger:
        counts = dict(self._counts)
        if extra is not None:
            counts[extra] = counts.get(extra, 0) + extra_count
        return tuple(sorted(counts.items()))

    def _epsilon_of(self, ledger: _Ledger, delta: float, method: AccountingMethod | None = None) -> float:
        method = self._method if method is None else method
        key = (method, ledger, delta)
        if key not in self._epsilons:
            if len(self._epsilons) > 256:
                self._epsilons.clear()
            self._epsilons[key] = _epsilon(method, ledger, delta, self._discretisation)
        return self._epsilons[key]

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the budget's delta); 0 before any step,
        ``inf`` after a step without noise.

        >>> PrivacyAccountant().epsilon(1e-5)
        0.0
        """
        with self._lock:
            delta = self._resolve_delta(delta, where="PrivacyAccountant.epsilon")
            return self._epsilon_of(self._ledger(), delta)

    def _resolve_delta(self, delta: float | None, *, where: str) -> float:
        if delta is None:
            if self._target_delta is None:
                raise ConfigError(f"{where}: no delta given and the accountant has no target_delta")
            return self._target_delta
        return _check_delta(delta, where=where)

    def _max_total(self, mechanism: tuple[float, float], target_epsilon: float, delta: float, limit: int,
                   method: AccountingMethod) -> int:
        """Largest total count of ``mechanism`` (others as recorded) with ``method``'s epsilon
        within the budget, capped at ``limit`` above the current count; -1 when the other entries
        alone exceed it."""
        others = tuple(sorted((m, c) for m, c in self._counts.items() if m != mechanism))
        current = self._counts.get(mechanism, 0)
        bound = current + limit
        key = (method, others, mechanism, target_epsilon, delta)
        if key in self._caps:
            cap, searched = self._caps[key]
            if cap < searched or searched >= bound:
                return min(cap, bound)
        if mechanism[0] == 0.0:
            cap = 0 if self._epsilon_of(others, delta, method) <= target_epsilon else -1
        else:
            def epsilon_at(total: int) -> float:
                return self._epsilon_of(tuple(sorted(others + ((mechanism, total),))), delta, method)

            guess = max(current, 1)
            if method is AccountingMethod.PLD:
                # The PLD-method epsilon is at most the RDP one, so the RDP answer is a cheap
                # lower bracket.
                guess = max(guess, self._max_total(mechanism, target_epsilon, delta, limit,
                                                   AccountingMethod.RDP))
            cap = _largest_within(epsilon_at, target_epsilon, guess=guess, limit=bound)
        if len(self._caps) > 64:
            self._caps.clear()
        self._caps[key] = (cap, bound)
        return cap

    def steps_within_budget(self, target_epsilon: float | None = None, delta: float | None = None, *,
                            noise_multiplier: float | None = None, sample_rate: float | None = None,
                            max_steps: int = MAX_STEPS_SEARCHED) -> int:
        """How many more steps keep ``epsilon(delta) <= target_epsilon``.

        Args:
            target_epsilon, delta: the budget (default: the accountant's own).
            noise_multiplier, sample_rate: the mechanism of the future steps (default: the last
                recorded step's).
            max_steps: search bound; the answer is at most this.

        >>> PrivacyAccountant("rdp").steps_within_budget(2.6, 1e-5, noise_multiplier=1.1,
        ...                                              sample_rate=256 / 60000)
        14096
        """
        where = "PrivacyAccountant.steps_within_budget"
        with self._lock:
            if target_epsilon is None:
                if self._target_epsilon is None:
                    raise ConfigError(f"{where}: no target_epsilon given and the accountant has no budget")
                target_epsilon = self._target_epsilon
            target = _check_epsilon(target_epsilon, where=where)
            delta = self._resolve_delta(delta, where=where)
            if noise_multiplier is None and sample_rate is None:
                if self._last is None:
                    raise ConfigError(f"{where}: no step recorded yet; pass noise_multiplier and sample_rate")
                mechanism = self._last
            else:
                mechanism = _check_mechanism(noise_multiplier, sample_rate, where=where)
            if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
                raise ConfigError(f"{where}: max_steps must be an int >= 1, got {max_steps!r}")
            cap = self._max_total(mechanism, target, delta, max_steps, self._method)
            return max(0, cap - self._counts.get(mechanism, 0))

    def check_step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Raises :class:`~psg_core.errors.BudgetExhaustedError` if recording these steps would
        exceed the budget; records nothing. Without a budget it only validates the arguments."""
        where = "PrivacyAccountant.step"
        mechanism = _check_mechanism(noise_multiplier, sample_rate, where=where)
        num_steps = _check_count(num_steps, where=where)
        if self._target_epsilon is None or self._target_delta is None:
            return
        with self._lock:
            target, delta = self._target_epsilon, self._target_delta
            requested = self._counts.get(mechanism, 0) + num_steps
            # Cheapest certificate first: within the RDP budget means within the PLD one too.
            methods = [AccountingMethod.RDP] if self._method is AccountingMethod.RDP else \
                [AccountingMethod.RDP, AccountingMethod.PLD]
            if any(requested <= self._max_total(mechanism, target, delta, MAX_STEPS_SEARCHED, method)
                   for method in methods):
                return
            # Caps stop MAX_STEPS_SEARCHED above the current count; evaluate past them directly.
            after = self._epsilon_of(self._ledger(mechanism, num_steps), delta)
            if after <= target:
                return
            raise BudgetExhaustedError(
                f"{where}: {num_steps} step(s) with noise_multiplier={mechanism[0]}, "
                f"sample_rate={mechanism[1]} would spend epsilon={after:.4g} > "
                f"target_epsilon={self._target_epsilon} at delta={self._target_delta} "
                f"({self.steps} steps recorded, epsilon now "
                f"{self._epsilon_of(self._ledger(), self._target_delta):.4g})")

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Records ``num_steps`` Poisson-subsampled Gaussian steps, after :meth:`check_step`.

        The check and the record are one atomic operation (under the accountant's lock): of
        concurrent callers that compete for the last steps of a budget, only those within it are
        recorded, and the others raise. Call it before releasing what the steps pay for.

        Args:
            noise_multiplier: sigma >= 0 (0: no noise, epsilon becomes infinite).
            sample_rate: q in (0, 1], each example's probability of joining the batch.
            num_steps: how many such steps.

        Raises:
            BudgetExhaustedError: with a budget, when the steps would exceed it (nothing recorded).
        """
        with self._lock:
            self.check_step(noise_multiplier, sample_rate, num_steps)
            mechanism = (float(noise_multiplier), float(sample_rate))
            self._counts[mechanism] = self._counts.get(mechanism, 0) + num_steps
            self._last = mechanism

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The settings and the ledger as JSON-serialisable values (``json.dumps`` takes it as it
        is; so does ``torch.save`` / ``torch.load(weights_only=True)``).

        >>> accountant = PrivacyAccountant("rdp")
        >>> accountant.step(1.1, 0.01, num_steps=3)
        >>> state = accountant.state_dict()
        >>> state["ledger"], state["version"]
        ([[1.1, 0.01, 3]], 1)
        >>> resumed = PrivacyAccountant()
        >>> resumed.load_state_dict(state)
        >>> resumed.method.value, resumed.steps, resumed.epsilon(1e-5) == accountant.epsilon(1e-5)
        ('rdp', 3, True)
        """
        with self._lock:
            return {"format": _STATE_FORMAT, "version": STATE_VERSION, "method": self._method.value,
                    "target_epsilon": self._target_epsilon, "target_delta": self._target_delta,
                    "value_discretization_interval": self._discretisation,
                    "ledger": [[sigma, q, count] for (sigma, q), count in self._counts.items()],
                    "last": None if self._last is None else list(self._last)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replaces the settings (method, budget, PLD grid) and the ledger with ``state``'s, from
        :meth:`state_dict` of this version; validates everything before changing anything.

        Raises:
            ConfigError: ``state`` is not an accountant's state of a version this code reads, or
                holds invalid values.
        """
        where = "PrivacyAccountant.load_state_dict"
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ConfigError(f"{where}: not a PrivacyAccountant state (format "
                              f"{state.get('format') if isinstance(state, Mapping) else type(state).__name__!r})")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"{where}: state version {state.get('version')!r} is not supported (this code "
                              f"reads version {STATE_VERSION})")
        try:
            fresh = PrivacyAccountant(state["method"], target_epsilon=state["target_epsilon"],
                                      target_delta=state["target_delta"],
                                      value_discretization_interval=state["value_discretization_interval"])
            counts: dict[tuple[float, float], int] = {}
            for sigma, q, count in state["ledger"]:
                mechanism = _check_mechanism(sigma, q, where=where)
                counts[mechanism] = counts.get(mechanism, 0) + _check_count(count, where=where)
            last = state["last"]
            last = None if last is None else _check_mechanism(*last, where=where)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"{where}: malformed state ({type(err).__name__}: {err})") from None
        if last is not None and last not in counts:
            raise ConfigError(f"{where}: the last step's mechanism {last} is not in the ledger")
        with self._lock:
            self._method = fresh._method
            self._target_epsilon, self._target_delta = fresh._target_epsilon, fresh._target_delta
            self._discretisation = fresh._discretisation
            self._counts = counts
            self._last = last
            self._caps.clear()
            self._epsilons.clear()

    def __getstate__(self) -> dict[str, Any]:
        # The lock cannot be pickled; the state dict is everything else worth keeping.
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        PrivacyAccountant.__init__(self)
        self.load_state_dict(state)

    def __repr__(self) -> str:
        budget = "" if self._target_epsilon is None else \
            f", target_epsilon={self._target_epsilon}, target_delta={self._target_delta}"
        return f"PrivacyAccountant(method={self._method.value!r}, steps={self.steps}{budget})"
