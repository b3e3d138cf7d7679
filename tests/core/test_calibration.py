"""Noise calibration: the smallest sigma (within the tolerance) that meets a target epsilon, for both
accountants, and DPStep taking target_epsilon + epochs or steps in place of sigma."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psg_core.accounting import PrivacyAccountant
from psg_core.calibration import calibrate_noise_multiplier, steps_for_epochs
from psg_core.config import DPConfig
from psg_core.dp_step import DPStep
from psg_core.errors import ConfigError

#: A coarser PLD grid keeps these tests fast; calibration uses the same grid as the accountant.
FAST_PLD = 1e-3
DELTA = 1e-5


def epsilon_after(method: str, sigma: float, sample_rate: float, steps: int) -> float:
    accountant = PrivacyAccountant(method, value_discretization_interval=FAST_PLD)
    accountant.step(sigma, sample_rate, num_steps=steps)
    return accountant.epsilon(DELTA)


@pytest.mark.parametrize("method", ["rdp", "pld"])
@pytest.mark.parametrize(("target", "sample_rate", "steps"), [(1.0, 0.01, 500), (6.2, 128 / 1437, 110),
                                                               (8.0, 0.5, 10)])
def test_the_answer_meets_the_target_and_sigma_minus_the_tolerance_does_not(
        method: str, target: float, sample_rate: float, steps: int) -> None:
    tolerance = 1e-3
    sigma = calibrate_noise_multiplier(target, delta=DELTA, sample_rate=sample_rate, steps=steps,
                                       accountant=method, tolerance=tolerance,
                                       value_discretization_interval=FAST_PLD)
    assert epsilon_after(method, sigma, sample_rate, steps) <= target
    assert epsilon_after(method, sigma - tolerance, sample_rate, steps) > target


def test_the_rdp_answer_matches_the_reference_setting() -> None:
    # sigma 1.1, q = 256/60000, 14100 steps spends epsilon 2.60 under RDP (test_accounting.py).
    sigma = calibrate_noise_multiplier(2.6, delta=DELTA, sample_rate=256 / 60000, steps=14100, accountant="rdp")
    assert sigma == pytest.approx(1.1, abs=0.005)


def test_pld_needs_less_noise_than_rdp() -> None:
    common = {"delta": DELTA, "sample_rate": 0.02, "steps": 200, "value_discretization_interval": FAST_PLD}
    rdp = calibrate_noise_multiplier(3.0, accountant="rdp", **common)
    pld = calibrate_noise_multiplier(3.0, accountant="pld", **common)
    assert pld < rdp


def test_epochs_count_the_sampler_s_batches() -> None:
    assert steps_for_epochs(10, 128 / 1437) == 10 * round(1437 / 128)
    assert steps_for_epochs(0.7, 0.1) == 7 and steps_for_epochs(0.75, 0.1) == 8
    by_epochs = calibrate_noise_multiplier(4.0, delta=DELTA, sample_rate=0.1, epochs=3, accountant="rdp")
    by_steps = calibrate_noise_multiplier(4.0, delta=DELTA, sample_rate=0.1, steps=30, accountant="rdp")
    assert by_epochs == by_steps


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 10, "epochs": 1.0}, "one of them"),
    ({}, "one of them"),
    ({"steps": 0}, "steps must be an int"),
    ({"steps": 10, "delta": 0.0}, "delta must be"),
    ({"steps": 10, "sample_rate": 1.5}, "sample_rate must be"),
    ({"steps": 10, "accountant": "moments"}, "accountant"),
    ({"steps": 10, "tolerance": 0.0}, "tolerance must be"),
    ({"epochs": -1.0}, "epochs must be"),
])
def test_bad_arguments_are_config_errors(kwargs: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {"delta": DELTA, "sample_rate": 0.1, **kwargs}
    with pytest.raises(ConfigError, match=match):
        calibrate_noise_multiplier(1.0, **arguments)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="target_epsilon"):
        calibrate_noise_multiplier(0.0, delta=DELTA, sample_rate=0.1, steps=10)


def test_dp_step_calibrates_and_keeps_the_plan_within_its_budget() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(max_grad_norm=0.5), sample_rate=0.1,
                  expected_batch_size=4.0, target_epsilon=5.0, delta=DELTA, epochs=2,
                  accountant=PrivacyAccountant("rdp", target_epsilon=5.0, target_delta=DELTA))
    expected = calibrate_noise_multiplier(5.0, delta=DELTA, sample_rate=0.1, steps=20, accountant="rdp")
    assert step.config.noise_multiplier == expected and step.config.max_grad_norm == 0.5
    for _ in range(20):  # the whole plan runs: the budget is the target the sigma was chosen for
        step(torch.randn(4, 3), torch.randn(4, 2))
    assert step.accountant.steps == 20 and step.epsilon(DELTA) <= 5.0


def test_dp_step_s_default_accountant_gets_the_target_as_its_budget() -> None:
    # (A small epsilon keeps the default, fine PLD grid cheap.)
    step = DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(), sample_rate=0.1,
                  expected_batch_size=2.0, target_epsilon=1.0, delta=DELTA, steps=3)
    assert (step.accountant.method.value, step.accountant.target_epsilon, step.accountant.target_delta) == \
        ("pld", 1.0, DELTA)
    assert step.config.noise_multiplier > 0


def test_dp_step_takes_delta_from_the_accountant_s_budget() -> None:
    accountant = PrivacyAccountant("rdp", target_epsilon=3.0, target_delta=1e-6)
    step = DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(), sample_rate=0.1,
                  expected_batch_size=2.0, target_epsilon=3.0, steps=10, accountant=accountant)
    assert step.config.noise_multiplier == calibrate_noise_multiplier(3.0, delta=1e-6, sample_rate=0.1, steps=10,
                                                                      accountant="rdp")


@pytest.mark.parametrize(("config", "kwargs", "match"), [
    (DPConfig(noise_multiplier=1.0), {"target_epsilon": 1.0, "delta": DELTA, "steps": 5}, "not both"),
    (DPConfig(), {"target_epsilon": 1.0, "steps": 5}, "needs delta"),
    (DPConfig(), {"epochs": 2.0}, "need target_epsilon"),
    (DPConfig(), {"target_epsilon": 1.0, "delta": DELTA}, "one of them"),
])
def test_dp_step_refuses_inconsistent_calibration_arguments(config: DPConfig, kwargs: dict[str, object],
                                                            match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=config, sample_rate=0.1, expected_batch_size=2.0,
               **kwargs)  # type: ignore[arg-type]
