"""PrivacyAccountant: reference values, agreement with dp_accounting, budgets, validation."""

from __future__ import annotations

import math
import time

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from psg_core.accounting import PLD_EPSILON_CUTOFF, AccountingMethod, PrivacyAccountant
from psg_core.errors import BudgetExhaustedError, ConfigError

MNIST_Q = 256 / 60000
#: A coarser PLD grid keeps the budget tests fast; the semantics tested do not depend on it.
FAST_PLD = {"value_discretization_interval": 1e-3}


def make(method: str, **kwargs: float) -> PrivacyAccountant:
    return PrivacyAccountant(method, **(FAST_PLD if method == "pld" else {}), **kwargs)


def test_reference_value_abadi_mnist() -> None:
    # sigma = 1.1, q = 256/60000, 60 epochs = 14100 steps, delta = 1e-5: the DP-SGD MNIST setting
    # (Abadi et al., 2016); RDP gives epsilon ~= 2.60 (dp_accounting 0.6: 2.6003), PLD is tighter
    # (2.3852).
    rdp = PrivacyAccountant("rdp")
    rdp.step(1.1, MNIST_Q, num_steps=14100)
    pld = PrivacyAccountant()
    pld.step(1.1, MNIST_Q, num_steps=14100)
    assert pld.method is AccountingMethod.PLD
    eps_rdp, eps_pld = rdp.epsilon(1e-5), pld.epsilon(1e-5)
    assert eps_rdp == pytest.approx(2.60, abs=0.01)
    assert eps_pld == pytest.approx(2.385, abs=0.01)
    assert eps_pld <= eps_rdp


def test_full_batch_single_step_is_the_gaussian_mechanism() -> None:
    # q = 1, one step: the plain Gaussian mechanism, whose exact epsilon dp_accounting computes
    # analytically (Balle & Wang, 2018). PLD must match it closely; RDP is an upper bound.
    exact = dp_accounting.get_epsilon_gaussian(2.0, 1e-5)
    pld = PrivacyAccountant()
    pld.step(2.0, 1.0)
    rdp = PrivacyAccountant("rdp")
    rdp.step(2.0, 1.0)
    assert pld.epsilon(1e-5) == pytest.approx(exact, rel=1e-3)
    assert pld.epsilon(1e-5) >= exact - 1e-9  # pessimistic discretisation
    assert rdp.epsilon(1e-5) > exact


def test_mixed_ledger_matches_dp_accounting_directly() -> None:
    accountant_pld, accountant_rdp = PrivacyAccountant(), PrivacyAccountant("rdp")
    plan = [(1.0, 0.01, 30), (2.0, 0.05, 10), (1.0, 0.01, 20)]
    for sigma, q, count in plan:
        for accountant in (accountant_pld, accountant_rdp):
            accountant.step(sigma, q, num_steps=count)
    reference_pld = pld_privacy_accountant.PLDAccountant()
    reference_rdp = rdp_privacy_accountant.RdpAccountant()
    for sigma, q, count in plan:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
        reference_pld.compose(event)
        reference_rdp.compose(event)
    assert accountant_pld.epsilon(1e-6) == pytest.approx(reference_pld.get_epsilon(1e-6), rel=1e-6)
    assert accountant_rdp.epsilon(1e-6) == pytest.approx(reference_rdp.get_epsilon(1e-6), rel=1e-9)
    assert accountant_pld.steps == accountant_rdp.steps == 60
    assert accountant_pld.history == [(1.0, 0.01, 50), (2.0, 0.05, 10)]
    # the exported ledger is a dp_accounting event that gives the same answer.
    again = rdp_privacy_accountant.RdpAccountant().compose(accountant_rdp.dp_event)
    assert again.get_epsilon(1e-6) == pytest.approx(accountant_rdp.epsilon(1e-6), rel=1e-9)


def test_single_steps_equal_batched_steps_and_epsilon_grows() -> None:
    one_by_one, batched = PrivacyAccountant("rdp"), PrivacyAccountant("rdp")
    previous = 0.0
    assert one_by_one.epsilon(1e-5) == 0.0
    for _ in range(25):
        one_by_one.step(1.0, 0.02)
        current = one_by_one.epsilon(1e-5)
        assert current > previous
        previous = current
    batched.step(1.0, 0.02, num_steps=25)
    assert batched.epsilon(1e-5) == pytest.approx(previous, rel=1e-12)
    # a smaller delta costs more epsilon.
    assert batched.epsilon(1e-8) > batched.epsilon(1e-5)


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_no_noise_means_infinite_epsilon(method: str) -> None:
    accountant = PrivacyAccountant(method)
    accountant.step(1.0, 0.1)
    accountant.step(0.0, 0.1)
    assert accountant.epsilon(1e-5) == math.inf
    budgeted = PrivacyAccountant(method, target_epsilon=100.0, target_delta=1e-5)
    with pytest.raises(BudgetExhaustedError, match="noise_multiplier=0.0.*epsilon=inf"):
        budgeted.step(0.0, 0.1)
    assert budgeted.steps == 0
    assert budgeted.steps_within_budget(noise_multiplier=0.0, sample_rate=0.1) == 0


@pytest.mark.parametrize(("method", "sigma", "q", "target"),
                         [("rdp", 1.1, MNIST_Q, 2.6), ("rdp", 0.8, 0.1, 4.0), ("pld", 1.0, 0.02, 1.5)])
def test_steps_within_budget_is_the_exact_boundary(method: str, sigma: float, q: float, target: float) -> None:
    accountant = make(method)
    n = accountant.steps_within_budget(target, 1e-5, noise_multiplier=sigma, sample_rate=q)
    assert n > 0
    accountant.step(sigma, q, num_steps=n)
    assert accountant.epsilon(1e-5) <= target
    accountant.step(sigma, q)
    assert accountant.epsilon(1e-5) > target
    # with history, it counts the steps still left (default mechanism: the last one used).
    assert accountant.steps_within_budget(target, 1e-5) == 0
    assert accountant.steps_within_budget(2 * target, 1e-5) > 0


def test_pld_allows_more_steps_than_rdp() -> None:
    kwargs = dict(noise_multiplier=1.0, sample_rate=0.02)
    pld = make("pld").steps_within_budget(1.5, 1e-5, **kwargs)
    rdp = PrivacyAccountant("rdp").steps_within_budget(1.5, 1e-5, **kwargs)
    assert pld > rdp


def test_steps_within_budget_is_capped_by_max_steps() -> None:
    accountant = PrivacyAccountant("rdp")
    assert accountant.steps_within_budget(10.0, 1e-5, noise_multiplier=50.0, sample_rate=1e-4,
                                          max_steps=1000) == 1000


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_budget_refuses_the_step_that_would_exceed_it(method: str) -> None:
    target, delta, sigma, q = 1.0, 1e-5, 1.5, 0.05
    accountant = make(method, target_epsilon=target, target_delta=delta)
    allowed = accountant.steps_within_budget(noise_multiplier=sigma, sample_rate=q)
    assert allowed > 1
    accountant.step(sigma, q, num_steps=allowed - 1)
    accountant.check_step(sigma, q)  # the last one fits
    accountant.step(sigma, q)
    assert accountant.steps == allowed
    spent = accountant.epsilon()
    assert spent <= target
    with pytest.raises(BudgetExhaustedError, match=rf"would spend epsilon=.* > target_epsilon={target}"):
        accountant.step(sigma, q)
    with pytest.raises(BudgetExhaustedError):
        accountant.check_step(sigma, q)
    # a refused step records nothing.
    assert accountant.steps == allowed and accountant.epsilon() == spent
    # a much quieter, sparser step may still fit; a batch of steps is refused as a whole.
    accountant.step(4.0, 0.01)
    with pytest.raises(BudgetExhaustedError, match="100000 step"):
        accountant.step(4.0, 0.01, num_steps=100_000)
    assert accountant.steps == allowed + 1
    assert "target_epsilon=1.0" in repr(accountant)


def test_budget_with_mixed_mechanisms() -> None:
    accountant = PrivacyAccountant("rdp", target_epsilon=2.0, target_delta=1e-5)
    accountant.step(1.5, 0.05, num_steps=50)
    left = accountant.steps_within_budget(noise_multiplier=0.9, sample_rate=0.01)
    accountant.step(0.9, 0.01, num_steps=left)
    with pytest.raises(BudgetExhaustedError):
        accountant.step(0.9, 0.01)
    assert accountant.epsilon() <= 2.0


def test_pld_falls_back_to_rdp_for_huge_epsilon() -> None:
    # the PLD of this ledger would need tens of GiB; it is not meaningfully private anyway.
    pld, rdp = PrivacyAccountant(), PrivacyAccountant("rdp")
    for accountant in (pld, rdp):
        accountant.step(0.5, 0.5, num_steps=100_000)
    start = time.perf_counter()
    value = pld.epsilon(1e-5)
    assert time.perf_counter() - start < 5
    assert value == rdp.epsilon(1e-5) > PLD_EPSILON_CUTOFF


def test_validation_errors() -> None:
    accountant = PrivacyAccountant()
    for sigma, q in [(1.0, 0.0), (1.0, 1.5), (1.0, math.nan), (1.0, -0.1), (-1.0, 0.1), (math.inf, 0.1),
                     (True, 0.1)]:
        with pytest.raises(ConfigError, match="PrivacyAccountant.step: (noise_multiplier|sample_rate)"):
            accountant.step(sigma, q)
    with pytest.raises(ConfigError, match="num_steps must be an int >= 1, got 0"):
        accountant.step(1.0, 0.1, num_steps=0)
    for delta in (0.0, 1.0, -1e-5, math.nan):
        with pytest.raises(ConfigError, match="delta must be a number in"):
            accountant.epsilon(delta)
    with pytest.raises(ConfigError, match="no delta given"):
        accountant.epsilon()
    with pytest.raises(ConfigError, match="no step recorded yet"):
        accountant.steps_within_budget(1.0, 1e-5)
    with pytest.raises(ConfigError, match="no target_epsilon given"):
        accountant.steps_within_budget(delta=1e-5, noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ConfigError, match="expected one of 'pld', 'rdp'"):
        PrivacyAccountant("gdp")
    with pytest.raises(ConfigError, match="both target_epsilon and target_delta"):
        PrivacyAccountant(target_epsilon=1.0)
    with pytest.raises(ConfigError, match="target_epsilon must be a finite number > 0"):
        PrivacyAccountant(target_epsilon=0.0, target_delta=1e-5)
    assert accountant.steps == 0


def test_budget_checks_within_the_rdp_bound_need_no_pld(monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps far from the budget are certified by the (cheap) RDP cap, computed once and cached;
    # the PLD is only consulted near the end of the budget.
    def no_pld(*args: object) -> None:
        raise AssertionError("PLD evaluated during a budget check far from the budget")

    monkeypatch.setattr("psg_core.accounting._pld_per_step", no_pld)
    accountant = PrivacyAccountant(target_epsilon=3.0, target_delta=1e-5)
    start = time.perf_counter()
    for _ in range(2000):
        accountant.step(1.1, MNIST_Q)
    assert time.perf_counter() - start < 5
    assert accountant.steps == 2000
