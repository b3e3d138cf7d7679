"""add_noise: calibration, reproducibility, secure randomness, dtypes, validation."""

from __future__ import annotations

import math

import pytest
import torch

from psg_core.errors import ConfigError
from psg_core.noise import add_noise, add_noise_, secure_generator


def pooled_noise(noised: dict[str, torch.Tensor], clean: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(noised[k].double() - clean[k].double()).flatten() for k in clean])


@pytest.mark.parametrize(("sigma", "C"), [(1.1, 1.0), (0.5, 3.0), (4.0, 0.05)])
def test_noise_statistics_with_fixed_seed(sigma: float, C: float) -> None:
    clean = {"w": torch.randn(300, 200), "b": torch.randn(40_000)}  # 100k coordinates
    noised = add_noise(clean, noise_multiplier=sigma, sensitivity=C,
                       generator=torch.Generator().manual_seed(1234))
    noise = pooled_noise(noised, clean)
    std = sigma * C
    n = noise.numel()
    # mean ~ N(0, std^2 / n): 5 standard errors; sample std has standard error ~ std / sqrt(2n).
    assert abs(noise.mean().item()) < 5 * std / math.sqrt(n)
    assert abs(noise.std().item() - std) < 5 * std / math.sqrt(2 * n)
    # Gaussian shape: fraction within one std ~ 0.6827 (binomial standard error ~ 0.0015).
    within = (noise.abs() < std).double().mean().item()
    assert abs(within - 0.6827) < 0.01
    # coordinates are independent: no correlation between neighbours.
    corr = torch.corrcoef(torch.stack([noise[:-1], noise[1:]]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(n)


def test_same_seed_same_noise_different_seed_different_noise() -> None:
    clean = {"w": torch.zeros(5, 4), "b": torch.zeros(3)}

    def draw(seed: int) -> dict[str, torch.Tensor]:
        return add_noise(clean, noise_multiplier=1.0, sensitivity=1.0,
                         generator=torch.Generator().manual_seed(seed))

    first, again, other = draw(7), draw(7), draw(8)
    for name in clean:
        assert torch.equal(first[name], again[name])
        assert not torch.equal(first[name], other[name])
    # different parameters get different noise from the one stream.
    assert not torch.equal(first["w"].flatten()[:3], first["b"])


def test_inputs_are_not_modified_and_zero_sigma_copies() -> None:
    clean = {"w": torch.randn(4, 3)}
    before = clean["w"].clone()
    noised = add_noise(clean, noise_multiplier=2.0, sensitivity=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(clean["w"], before)
    assert not torch.equal(noised["w"], before)
    silent = add_noise(clean, noise_multiplier=0.0, sensitivity=1.0)
    assert torch.equal(silent["w"], before)
    assert silent["w"].data_ptr() != clean["w"].data_ptr()


def test_secure_rng_is_fresh_per_call_and_calibrated() -> None:
    clean = {"w": torch.zeros(50_000)}
    first = add_noise(clean, noise_multiplier=2.0, sensitivity=0.5, secure_rng=True)["w"]
    second = add_noise(clean, noise_multiplier=2.0, sensitivity=0.5, secure_rng=True)["w"]
    assert not torch.equal(first, second)
    for draw in (first, second):
        assert abs(draw.std().item() - 1.0) < 5 / math.sqrt(2 * draw.numel())
        assert abs(draw.mean().item()) < 5 / math.sqrt(draw.numel())
    # the global generator is neither used nor advanced.
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    add_noise(clean, noise_multiplier=1.0, sensitivity=1.0, secure_rng=True)
    assert torch.equal(torch.rand(3), expected)


def test_secure_generator_seeds_differ() -> None:
    seeds = {secure_generator().initial_seed() for _ in range(8)}
    assert len(seeds) == 8


def test_global_generator_when_no_generator_given() -> None:
    clean = {"w": torch.zeros(10)}
    torch.manual_seed(11)
    first = add_noise(clean, noise_multiplier=1.0, sensitivity=1.0)["w"]
    torch.manual_seed(11)
    assert torch.equal(add_noise(clean, noise_multiplier=1.0, sensitivity=1.0)["w"], first)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtype_shape_and_device_are_kept(dtype: torch.dtype) -> None:
    clean = {"w": torch.zeros(200, 100, dtype=dtype)}
    noised = add_noise(clean, noise_multiplier=1.0, sensitivity=2.0, generator=torch.Generator().manual_seed(3))
    out = noised["w"]
    assert out.dtype == dtype and out.shape == (200, 100) and out.device == clean["w"].device
    assert abs(out.double().std().item() - 2.0) < 0.05
    # the same seed gives the same noise in every dtype (drawn in fp32 or wider, then cast).
    reference = add_noise({"w": torch.zeros(200, 100)}, noise_multiplier=1.0, sensitivity=2.0,
                          generator=torch.Generator().manual_seed(3))["w"]
    if dtype is not torch.float64:
        assert torch.equal(out, reference.to(dtype))


def test_validation_errors() -> None:
    clean = {"w": torch.zeros(3)}
    for bad in (-0.1, math.inf, math.nan, True, "1"):
        with pytest.raises(ConfigError, match="add_noise: noise_multiplier"):
            add_noise(clean, noise_multiplier=bad, sensitivity=1.0)  # type: ignore[arg-type]
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ConfigError, match="add_noise: sensitivity"):
            add_noise(clean, noise_multiplier=1.0, sensitivity=bad)
    with pytest.raises(ConfigError, match="either a generator or secure_rng"):
        add_noise(clean, noise_multiplier=1.0, sensitivity=1.0, generator=torch.Generator(), secure_rng=True)
    with pytest.raises(ConfigError, match="must be a torch.Generator"):
        add_noise(clean, noise_multiplier=1.0, sensitivity=1.0, generator=42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"grads\['i'\] must be a floating tensor"):
        add_noise({"i": torch.zeros(3, dtype=torch.int64)}, noise_multiplier=1.0, sensitivity=1.0)


def test_secure_normal_is_standard_normal() -> None:
    from psg_core.noise import secure_normal

    draw = secure_normal((200_001,), std=3.0)
    assert draw.shape == (200_001,) and draw.dtype == torch.float64
    assert abs(draw.std().item() - 3.0) < 5 * 3.0 / math.sqrt(2 * draw.numel())
    assert abs(draw.mean().item()) < 5 * 3.0 / math.sqrt(draw.numel())
    # tails of a Gaussian: about 4.55% beyond 2 sigma, 0.27% beyond 3 sigma.
    beyond2 = (draw.abs() > 6.0).double().mean().item()
    beyond3 = (draw.abs() > 9.0).double().mean().item()
    assert abs(beyond2 - 0.0455) < 0.003 and abs(beyond3 - 0.0027) < 0.0008
    assert secure_normal((0, 3), std=1.0).shape == (0, 3)


def test_max_grad_norm_is_a_deprecated_alias_of_sensitivity() -> None:
    clean = {"w": torch.zeros(50)}
    expected = add_noise(clean, noise_multiplier=1.0, sensitivity=0.7, generator=torch.Generator().manual_seed(2))
    with pytest.warns(DeprecationWarning, match="max_grad_norm is deprecated; pass sensitivity"):
        old = add_noise(clean, noise_multiplier=1.0, max_grad_norm=0.7, generator=torch.Generator().manual_seed(2))
    assert torch.equal(old["w"], expected["w"])
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="add_noise: max_grad_norm must be"):
        add_noise(clean, noise_multiplier=1.0, max_grad_norm=0.0)
    with pytest.raises(ConfigError, match="pass sensitivity only"):
        add_noise(clean, noise_multiplier=1.0, sensitivity=1.0, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="sensitivity is required"):
        add_noise(clean, noise_multiplier=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_add_noise_in_place_is_add_noise_written_into_the_sums(dtype: torch.dtype) -> None:
    """Same draws in the same order, bit for bit the same values, in the caller's tensors."""
    grads = {"w": torch.randn(5, 3).to(dtype), "b": torch.randn(3).to(dtype)}
    expected = add_noise(grads, noise_multiplier=1.3, sensitivity=0.7, generator=torch.Generator().manual_seed(2))
    tensors = {name: t for name, t in grads.items()}
    out = add_noise_(grads, noise_multiplier=1.3, sensitivity=0.7, generator=torch.Generator().manual_seed(2))
    for name, t in out.items():
        assert t is tensors[name] and t.dtype == dtype
        assert torch.equal(t, expected[name])


def test_add_noise_in_place_checks_its_arguments_and_leaves_the_sums_without_noise() -> None:
    grads = {"w": torch.ones(3)}
    with pytest.raises(ConfigError, match="sensitivity"):
        add_noise_(grads, noise_multiplier=1.0, sensitivity=0.0)
    assert torch.equal(add_noise_(grads, noise_multiplier=0.0, sensitivity=1.0)["w"], torch.ones(3))
