"""PrivacyStep: the budget check, noise, normalisation and accounting shared by DPStep and the service."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from psg_core.accounting import PrivacyAccountant
from psg_core.config import DPConfig
from psg_core.dp import dp_gradient
from psg_core.dp_step import DPStep
from psg_core.errors import BudgetExhaustedError, ConfigError
from psg_core.noise import add_noise
from psg_core.privacy_step import PrivacyStep


@pytest.mark.parametrize(("config", "sensitivity", "normaliser"), [
    (DPConfig(max_grad_norm=0.5), 0.5, 8.0),
    (DPConfig(max_grad_norm=0.5, loss_reduction="sum"), 0.5, 1.0),
    (DPConfig(max_grad_norm=0.5, clipping="automatic"), 0.5, 8.0),
    (DPConfig(max_grad_norm=2.0, clipping="per_layer"), 2.0, 8.0),
    (DPConfig(clipping="per_layer", per_layer_max_grad_norms=(3.0, 4.0)), 5.0, 8.0),
])
def test_for_config_takes_the_l2_sensitivity_and_the_normaliser(config: DPConfig, sensitivity: float,
                                                                 normaliser: float) -> None:
    privacy = PrivacyStep.for_config(config, sample_rate=0.1, expected_batch_size=8)
    assert privacy.sensitivity == pytest.approx(sensitivity)
    assert privacy.normaliser == normaliser and privacy.sample_rate == 0.1


def test_noise_and_normalise_is_add_noise_divided_by_the_normaliser() -> None:
    config = DPConfig(clipping="per_layer", per_layer_max_grad_norms=(3.0, 4.0), noise_multiplier=0.7)
    privacy = PrivacyStep.for_config(config, sample_rate=0.5, expected_batch_size=4)
    clean = {"w": torch.randn(3, 2), "b": torch.randn(3)}
    before = {name: t.clone() for name, t in clean.items()}
    released = privacy.noise_and_normalise(clean, generator=torch.Generator().manual_seed(1))
    expected = add_noise(clean, noise_multiplier=0.7, sensitivity=5.0, generator=torch.Generator().manual_seed(1))
    for name in clean:
        assert torch.equal(released[name], expected[name] / 4.0)
        assert torch.equal(clean[name], before[name])  # the clipped sum is left alone


@pytest.mark.parametrize("sigma", [0.0, 1.5])
def test_in_place_release_has_the_same_values_and_reuses_the_sums_tensors(sigma: float) -> None:
    privacy = PrivacyStep(noise_multiplier=sigma, sensitivity=0.5, sample_rate=0.1, normaliser=8.0)
    sums = {"w": torch.randn(4, 3), "b": torch.randn(3, dtype=torch.float64)}
    originals = {name: t.clone() for name, t in sums.items()}
    copied = privacy.noise_and_normalise(sums, generator=torch.Generator().manual_seed(7))
    for name, t in sums.items():  # the default leaves the sum alone and returns new tensors
        assert torch.equal(t, originals[name]) and copied[name].data_ptr() != t.data_ptr()
    released = privacy.noise_and_normalise(sums, generator=torch.Generator().manual_seed(7), in_place=True)
    for name, t in sums.items():
        assert released[name] is t  # written into the caller's tensor
        assert torch.equal(released[name], copied[name])  # bit for bit the same release
        assert released[name].dtype == originals[name].dtype
    if sigma == 0.0:
        torch.testing.assert_close(released["w"], originals["w"] / 8.0, rtol=0, atol=0)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("normaliser", [8.0, 3.0, 1000.0])
def test_release_is_each_tensor_times_the_reciprocal_bit_for_bit_in_every_dtype(
        device: torch.device, in_place: bool, normaliser: float) -> None:
    # The release scales all tensors in one multi-tensor call where that rounds as mul_ does
    # (float32, float64) and by mul_ elsewhere: the values of a per-tensor mul_, in every dtype.
    privacy = PrivacyStep(noise_multiplier=0.0, sensitivity=0.5, sample_rate=0.1, normaliser=normaliser)
    generator = torch.Generator().manual_seed(3)
    sums = {f"p{i}": torch.randn(257, 3, generator=generator).to(device=device, dtype=dtype)
            for i, dtype in enumerate([torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float32])}
    sums["transposed"] = torch.randn(5, 9, generator=generator).to(device).t()
    sums["sparse"] = torch.randn(4, 3, generator=generator).to(device).relu().to_sparse()
    expected = {name: t.clone().mul_(1.0 / normaliser) for name, t in sums.items()}
    released = privacy.noise_and_normalise(sums, in_place=in_place)
    assert list(released) == list(sums)
    for name, t in expected.items():
        assert released[name].dtype == t.dtype and released[name].layout == t.layout, name
        assert torch.equal(released[name].to_dense(), t.to_dense()), name
    assert privacy.noise_and_normalise({}, in_place=in_place) == {}


@pytest.mark.parametrize("in_place", [False, True])
def test_release_without_noise_still_checks_its_arguments(in_place: bool) -> None:
    privacy = PrivacyStep(noise_multiplier=0.0, sensitivity=0.5, sample_rate=0.1, normaliser=8.0)
    with pytest.raises(ConfigError, match="not both"):
        privacy.noise_and_normalise({"w": torch.ones(2)}, generator=torch.Generator(), secure_rng=True,
                                    in_place=in_place)
    with pytest.raises(ConfigError, match="floating"):
        privacy.noise_and_normalise({"w": torch.ones(2, dtype=torch.long)}, in_place=in_place)


def test_budget_check_and_accounting_go_to_the_given_accountant() -> None:
    privacy = PrivacyStep.for_config(DPConfig(noise_multiplier=1.5), sample_rate=0.05, expected_batch_size=2)
    privacy.check_budget(None)
    privacy.account(None)  # no accountant: nothing to record
    accountant = PrivacyAccountant("rdp", target_epsilon=1.0, target_delta=1e-5)
    allowed = accountant.steps_within_budget(noise_multiplier=1.5, sample_rate=0.05)
    accountant.step(1.5, 0.05, num_steps=allowed - 1)
    privacy.check_budget(accountant)
    privacy.account(accountant)
    assert accountant.history == [(1.5, 0.05, allowed)]
    with pytest.raises(BudgetExhaustedError):
        privacy.check_budget(accountant)


def test_dp_step_is_dp_gradient_followed_by_the_privacy_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    config = DPConfig(clipping="per_layer", per_layer_max_grad_norms=(0.1, 0.2, 0.3, 0.4), noise_multiplier=1.1)
    step = DPStep(model, loss_fn=nn.MSELoss(), config=config, sample_rate=0.02, expected_batch_size=6,
                  accountant=PrivacyAccountant("rdp"), generator=torch.Generator().manual_seed(3))
    step(x, y)
    privacy = PrivacyStep.for_config(config, sample_rate=0.02, expected_batch_size=6)
    assert privacy.sensitivity == pytest.approx(math.sqrt(0.01 + 0.04 + 0.09 + 0.16))
    clean = dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=config)
    expected = privacy.noise_and_normalise(clean.grads, generator=torch.Generator().manual_seed(3))
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name])
    assert step.normaliser == privacy.normaliser == 6.0
    assert step.accountant.history == [(1.1, 0.02, 1)]


@pytest.mark.parametrize("normaliser", [0.0, -2.0, float("inf"), float("nan")])
def test_a_normaliser_that_is_not_a_positive_finite_number_is_refused(normaliser: float) -> None:
    with pytest.raises(ConfigError, match="normaliser must be a positive finite number"):
        PrivacyStep(noise_multiplier=1.0, sensitivity=1.0, sample_rate=0.1, normaliser=normaliser)


def test_an_odd_normaliser_releases_the_sum_times_its_reciprocal() -> None:
    privacy = PrivacyStep(noise_multiplier=0.0, sensitivity=1.0, sample_rate=0.1, normaliser=3.0)
    sums = {"w": torch.randn(50, dtype=torch.float64)}
    released = privacy.noise_and_normalise(sums)
    torch.testing.assert_close(released["w"], sums["w"] / 3.0, rtol=1e-15, atol=0)


def test_a_dp_step_without_noise_warns_once_that_its_gradients_are_not_private(
        caplog: pytest.LogCaptureFixture) -> None:
    """noise_multiplier = 0 is allowed (noise is on request), but it releases un-noised gradients
    and makes epsilon infinite: a DPStep says so, once per step object."""
    def make(sigma: float) -> DPStep:
        return DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=sigma),
                      sample_rate=0.01, expected_batch_size=4.0, accountant=PrivacyAccountant("rdp"))

    x, y = torch.randn(4, 3), torch.randn(4, 1)
    with caplog.at_level("WARNING", logger="psg_core"):
        step = make(0.0)
        step(x, y)
        step(x, y, max_physical_batch_size=2)
        assert step.epsilon(1e-5) == math.inf
        records = [r for r in caplog.records if "no noise" in r.getMessage()]
        assert len(records) == 1 and records[0].levelname == "WARNING"
        assert "infinite" in records[0].getMessage()
        make(0.0)(x, y)  # another step object warns again
        assert len([r for r in caplog.records if "no noise" in r.getMessage()]) == 2
        caplog.clear()
        make(1.0)(x, y)
        assert not caplog.records
