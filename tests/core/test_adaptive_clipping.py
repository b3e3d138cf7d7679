"""Adaptive (quantile) clipping in process: the noise split between gradient and count, the update
rule, its convergence to the target quantile, what DPStep noises and accounts, and checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from psg_core.accounting import PrivacyAccountant
from psg_core.adaptive_clipping import (QuantileClipping, gradient_noise_multiplier, private_unclipped_fraction,
                                        updated_bound)
from psg_core.config import DPConfig
from psg_core.dp import dp_gradient
from psg_core.dp_step import DPStep
from psg_core.errors import ConfigError
from psg_core.noise import add_noise


@pytest.mark.parametrize(("z", "count_sigma"), [(1.0, 10.0), (0.6, 0.4), (2.5, 3.0)])
def test_gradient_and_count_make_one_mechanism_of_the_accounted_sigma(z: float, count_sigma: float) -> None:
    sigma_g = gradient_noise_multiplier(z, count_sigma)
    assert sigma_g > z
    # The count's sensitivity is 1/2, so its noise multiplier is 2 * count_sigma.
    assert sigma_g ** -2 + (2 * count_sigma) ** -2 == pytest.approx(z ** -2)


def test_a_count_noise_that_would_spend_the_whole_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="must exceed half"):
        gradient_noise_multiplier(1.0, 0.5)
    assert gradient_noise_multiplier(0.0, 0.1) == 0.0  # no noise: nothing to share


def test_the_update_is_geometric_towards_the_target_quantile() -> None:
    clipping = QuantileClipping(target_quantile=0.7, learning_rate=0.3, count_noise_multiplier=1.0)
    assert updated_bound(2.0, unclipped_fraction=0.7, clipping=clipping) == 2.0
    assert updated_bound(2.0, unclipped_fraction=1.0, clipping=clipping) == pytest.approx(2.0 * math.exp(-0.09))
    assert updated_bound(2.0, unclipped_fraction=0.2, clipping=clipping) == pytest.approx(2.0 * math.exp(0.15))


def test_the_released_fraction_is_the_centred_count_plus_noise() -> None:
    norms = torch.tensor([0.1, 0.5, 0.9, 1.5, 3.0])  # 3 of 5 within the bound 1.0
    fraction = private_unclipped_fraction(norms, 1.0, count_noise_multiplier=2.0, expected_batch_size=4.0,
                                          generator=torch.Generator().manual_seed(3))
    noise = torch.normal(0.0, 2.0, size=(1,), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert fraction == pytest.approx((3 - 5 / 2 + noise.item() + 2.0) / 4.0)


@pytest.mark.parametrize("quantile", [0.3, 0.5, 0.9])
def test_the_bound_converges_to_the_target_quantile_of_the_norms(quantile: float) -> None:
    generator = torch.Generator().manual_seed(0)
    clipping = QuantileClipping(target_quantile=quantile, learning_rate=0.2, count_noise_multiplier=5.0)
    bound = 10.0
    for _ in range(400):
        norms = torch.rand(200, generator=generator) * 4.0  # uniform on [0, 4]: quantile q is 4q
        fraction = private_unclipped_fraction(norms, bound, count_noise_multiplier=clipping.count_noise_multiplier,
                                              expected_batch_size=200.0, generator=generator)
        bound = updated_bound(bound, unclipped_fraction=fraction, clipping=clipping)
    assert bound == pytest.approx(4.0 * quantile, abs=0.25)


def make_step(**kwargs: object) -> tuple[nn.Module, DPStep]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    arguments: dict[str, object] = {
        "config": DPConfig(max_grad_norm=0.05, noise_multiplier=1.2), "sample_rate": 0.05, "expected_batch_size": 8.0,
        "accountant": PrivacyAccountant("rdp"), "generator": torch.Generator().manual_seed(9),
        "adaptive_clipping": QuantileClipping(target_quantile=0.5, learning_rate=0.2, count_noise_multiplier=2.0)}
    arguments.update(kwargs)
    return model, DPStep(model, loss_fn=nn.MSELoss(), **arguments)  # type: ignore[arg-type]


def test_dp_step_noises_with_sigma_g_accounts_z_and_moves_the_bound() -> None:
    model, step = make_step()
    inputs, targets = torch.randn(8, 4), torch.randn(8, 2)
    clean = dp_gradient(model, inputs, targets, loss_fn=nn.MSELoss(), config=step.config)
    stats = step(inputs, targets)
    # The reference: the same generator draws the gradient's noise (sigma_g * C), then the count's.
    generator = torch.Generator().manual_seed(9)
    sigma_g = gradient_noise_multiplier(1.2, 2.0)
    expected = add_noise(clean.grads, noise_multiplier=sigma_g, sensitivity=0.05, generator=generator)
    fraction = private_unclipped_fraction(stats.per_sample_norms, 0.05, count_noise_multiplier=2.0,
                                          expected_batch_size=8.0, generator=generator)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name] / 8.0)
    assert step.accountant.history == [(1.2, 0.05, 1)]  # one mechanism at z
    assert step.unclipped_fraction == fraction
    assert step.config.max_grad_norm == pytest.approx(0.05 * math.exp(-0.2 * (fraction - 0.5)))
    assert stats.num_clipped == 8  # every sample clipped at 0.05: only the noise is counted


def test_accumulated_steps_adapt_once_per_logical_batch() -> None:
    _, whole = make_step()
    _, parts = make_step()
    inputs, targets = torch.randn(12, 4), torch.randn(12, 2)
    for _ in range(3):
        whole(inputs, targets)
        parts(inputs, targets, max_physical_batch_size=5)
    assert parts.config.max_grad_norm == pytest.approx(whole.config.max_grad_norm, rel=1e-6)
    assert parts.accountant.steps == whole.accountant.steps == 3


def test_the_bound_and_its_settings_survive_a_checkpoint() -> None:
    _, step = make_step()
    for _ in range(2):
        step(torch.randn(8, 4), torch.randn(8, 2))
    _, resumed = make_step(adaptive_clipping=None, config=DPConfig(max_grad_norm=1.0, noise_multiplier=1.2))
    resumed.load_state_dict(json.loads(json.dumps(step.state_dict())))
    assert resumed.adaptive_clipping == step.adaptive_clipping
    assert resumed.config.max_grad_norm == step.config.max_grad_norm != 0.05


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"config": DPConfig(clipping="per_layer", noise_multiplier=1.0)}, "one flat bound"),
    ({"config": DPConfig(clipping="automatic", noise_multiplier=1.0)}, "one flat bound"),
    ({"adaptive_clipping": QuantileClipping(count_noise_multiplier=0.5)}, "must exceed half"),
    ({"adaptive_clipping": "median"}, "QuantileClipping"),
])
def test_dp_step_refuses_what_adaptive_clipping_cannot_do(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_step(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"target_quantile": 1.0}, "target_quantile"), ({"learning_rate": 0.0}, "learning_rate"),
    ({"count_noise_multiplier": -1.0}, "count_noise_multiplier"),
])
def test_bad_settings_are_config_errors(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        QuantileClipping(**kwargs)
