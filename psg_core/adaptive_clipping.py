"""Adaptive clipping: the clipping bound follows a private estimate of a quantile of the per-sample
gradient norms (Andrew et al., 2021, "Differentially Private Learning with Adaptive Clipping").

Each step, besides the noised gradient, releases the centred count of samples the bound left
unclipped, ``sum_i (1[norm_i <= C] - 1/2) + N(0, count_sigma^2)``: changing one sample changes it
by 1/2, so its noise multiplier is ``2 * count_sigma``. From it, the unclipped fraction is estimated
as ``(released + m/2) / m`` with m the expected batch size (unbiased under Poisson sampling), and
the bound moves geometrically towards the target quantile gamma::

    C <- C * exp(-learning_rate * (unclipped_fraction - gamma))

Privacy: the gradient (noise multiplier ``sigma_g``, sensitivity C) and the count (noise
multiplier ``2 * count_sigma``, sensitivity 1/2) are computed on the same Poisson sample, so
together they are one Gaussian mechanism whose noise multiplier z satisfies
``z^-2 = sigma_g^-2 + (2 * count_sigma)^-2``. The step is accounted as that one mechanism, at
``z = config.noise_multiplier`` (what :func:`~psg_core.calibration.calibrate_noise_multiplier`
chooses for a target epsilon); the gradient gets the slightly larger ``sigma_g`` that leaves room
for the count (:func:`gradient_noise_multiplier`). The released bound is a function of released
values only, so using it costs nothing more.

>>> clipping = QuantileClipping(target_quantile=0.5, learning_rate=0.2, count_noise_multiplier=10.0)
>>> round(gradient_noise_multiplier(1.0, clipping.count_noise_multiplier), 5)
1.00125
>>> round(updated_bound(1.0, unclipped_fraction=0.9, clipping=clipping), 4)   # too loose: shrink
0.9231
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from psg_core.errors import ConfigError
from psg_core.noise import secure_normal

__all__ = ["QuantileClipping", "gradient_noise_multiplier", "private_unclipped_fraction", "updated_bound"]


def _number(value: object, *, what: str, low: float, high: float = math.inf, open_high: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value < high if open_high else low < value <= high):
        raise ConfigError(f"QuantileClipping: {what} must be a number in ({low}, {high}{')' if open_high else ']'}, "
                          f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class QuantileClipping:
    """How the clipping bound adapts (see the module docstring). The bound starts at
    ``config.max_grad_norm``.

    Args:
        target_quantile: gamma, the fraction of samples the bound should leave unclipped (0.5: the
            median norm, the paper's default).
        learning_rate: eta of the geometric update (the paper's default 0.2).
        count_noise_multiplier: std of the noise on the unclipped count, in samples; must exceed
            half the step's noise multiplier. The paper suggests about ``expected_batch_size / 20``.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float = 1.0

    def __post_init__(self) -> None:
        _number(self.target_quantile, what="target_quantile", low=0.0, high=1.0)
        _number(self.learning_rate, what="learning_rate", low=0.0)
        _number(self.count_noise_multiplier, what="count_noise_multiplier", low=0.0)


def gradient_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """sigma_g, the gradient's noise multiplier that together with the count's makes one Gaussian
    mechanism of multiplier ``noise_multiplier`` (z): ``(z^-2 - (2 * count_sigma)^-2)^-1/2``; 0 when
    z is 0 (no noise: nothing private to share).

    Raises:
        ConfigError: ``count_noise_multiplier <= noise_multiplier / 2`` (the count alone would
            spend the whole budget).
    """
    if noise_multiplier == 0:
        return 0.0
    remaining = noise_multiplier ** -2 - (2 * count_noise_multiplier) ** -2
    if remaining <= 0:
        raise ConfigError(f"QuantileClipping: count_noise_multiplier ({count_noise_multiplier}) must exceed half the "
                          f"noise multiplier ({noise_multiplier}); the paper suggests expected_batch_size / 20")
    return remaining ** -0.5


def private_unclipped_fraction(per_sample_norms: torch.Tensor, clip_bound: float, *, count_noise_multiplier: float,
                               expected_batch_size: float, generator: torch.Generator | None = None,
                               secure_rng: bool = False) -> float:
    """The private estimate of the fraction of samples ``clip_bound`` leaves unclipped: the centred
    count ``sum_i (1[norm_i <= C] - 1/2)`` plus ``N(0, count_noise_multiplier^2)``, plus
    ``expected_batch_size / 2``, over ``expected_batch_size``.

    >>> g = torch.Generator().manual_seed(0)
    >>> round(private_unclipped_fraction(torch.tensor([0.5, 2.0, 0.1, 3.0]), 1.0, count_noise_multiplier=1e-9,
    ...                                  expected_batch_size=4, generator=g), 6)
    0.5
    """
    norms = per_sample_norms.detach().to(torch.float64).cpu()  # (N,)
    centred = float((norms <= clip_bound).to(torch.float64).sum().item()) - norms.numel() / 2
    if secure_rng:
        noise = float(secure_normal((1,), std=count_noise_multiplier).item())
    else:
        device = generator.device if generator is not None else torch.device("cpu")
        noise = float(torch.normal(0.0, count_noise_multiplier, size=(1,), generator=generator,
                                   dtype=torch.float64, device=device).item())
    return (centred + noise + expected_batch_size / 2) / expected_batch_size


def updated_bound(clip_bound: float, *, unclipped_fraction: float, clipping: QuantileClipping) -> float:
    """The next bound: ``C * exp(-learning_rate * (unclipped_fraction - target_quantile))``."""
    return clip_bound * math.exp(-clipping.learning_rate * (unclipped_fraction - clipping.target_quantile))
