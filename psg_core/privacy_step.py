"""The privacy half of a DP-SGD step, written once for :class:`~psg_core.dp_step.DPStep` and for the
gradient service's frontend.

A step is: check the budget -> compute the clipped sum -> account (the charge) -> add noise once ->
normalise -> release. The charge comes before the release: the budget checked before computing
may be spent meanwhile (an accountant shared with other steps, threads), and
:meth:`PrivacyStep.account` checks it again and records the step in one atomic operation, so a
refused step releases nothing and a released one is always recorded.
Computing the clipped sum is the caller's (one :func:`~psg_core.dp.dp_gradient` call in process;
shards on workers, merged on the frontend, in the service); :class:`PrivacyStep` does the rest, so
both paths release the same gradient and record the same ledger entry for the same batch.

>>> from psg_core.accounting import PrivacyAccountant
>>> from psg_core.config import DPConfig
>>> privacy = PrivacyStep.for_config(DPConfig(max_grad_norm=0.5, noise_multiplier=1.0), sample_rate=0.01,
...                                  expected_batch_size=4)
>>> accountant = PrivacyAccountant("rdp")
>>> privacy.check_budget(accountant)                      # before computing the clipped sum
>>> privacy.account(accountant)                           # after it, before releasing anything
>>> released = privacy.noise_and_normalise({"w": torch.zeros(3)},
...                                        generator=torch.Generator().manual_seed(0))
>>> released["w"].shape, accountant.steps
(torch.Size([3]), 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from psg_core.accounting import PrivacyAccountant
from psg_core.config import DPConfig
from psg_core.dp import l2_sensitivity
from psg_core.errors import ConfigError
from psg_core.modes import LossReduction
from psg_core.noise import add_noise, add_noise_, check_noise_arguments

__all__ = ["PrivacyStep"]


def _scaled_(grads: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``grads``' tensors multiplied by ``scale`` in place (returned by name): the dense float32 and
    float64 ones by one multi-tensor kernel (a launch or two on a GPU, not one per parameter), the
    same values as ``grad.mul_(scale)`` on each; the others by ``mul_`` (the multi-tensor kernel
    rounds half-precision products differently, and takes dense tensors only)."""
    batched = [g for g in grads.values() if _foreach_ok(g)]
    if batched:  # (the multi-tensor kernel refuses an empty list)
        torch._foreach_mul_(batched, scale)
    for grad in grads.values():
        if not _foreach_ok(grad):
            grad.mul_(scale)
    return dict(grads)


def _scaled(grads: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """:func:`_scaled_` into new tensors."""
    names = [n for n, g in grads.items() if _foreach_ok(g)]
    out = dict(zip(names, torch._foreach_mul([grads[n] for n in names], scale))) if names else {}
    return {n: out[n] if n in out else torch.mul(g, scale) for n, g in grads.items()}


def _foreach_ok(grad: torch.Tensor) -> bool:
    """Whether :func:`torch._foreach_mul_` gives ``grad.mul_``'s values (checked in the tests)."""
    return grad.layout is torch.strided and grad.dtype in (torch.float32, torch.float64)


@dataclass(frozen=True)
class PrivacyStep:
    """Everything a step does around the clipped sum: budget check, noise, normalisation, accounting.

    Build it with :meth:`for_config`. The accountant is an argument of :meth:`check_budget` and
    :meth:`account`, not a field, because its owner (a :class:`~psg_core.dp_step.DPStep`, a
    service session) keeps it across steps; None means the steps are not accounted.
    """

    #: sigma; the noise std per coordinate is ``noise_multiplier * sensitivity``.
    noise_multiplier: float
    #: The L2 bound on one sample's contribution to the clipped sum (:func:`~psg_core.dp.l2_sensitivity`).
    sensitivity: float
    #: q, each example's probability of joining a batch; what the accountant records with sigma.
    sample_rate: float
    #: What the noised sum is divided by: the expected batch size under mean reduction (the fixed
    #: normaliser Poisson sampling calls for, not the realised batch size), 1 under sum reduction.
    normaliser: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.normaliser) and self.normaliser > 0):
            raise ConfigError(f"PrivacyStep: normaliser must be a positive finite number, got {self.normaliser!r}")

    @classmethod
    def for_config(cls, config: DPConfig, *, sample_rate: float, expected_batch_size: float) -> PrivacyStep:
        """The privacy step of ``config`` for batches drawn at ``sample_rate`` with
        ``expected_batch_size`` samples on average.

        >>> PrivacyStep.for_config(DPConfig(loss_reduction="sum"), sample_rate=0.5,
        ...                        expected_batch_size=8).normaliser
        1.0
        """
        mean = config.loss_reduction is LossReduction.MEAN
        return cls(noise_multiplier=config.noise_multiplier, sensitivity=l2_sensitivity(config),
                   sample_rate=float(sample_rate), normaliser=float(expected_batch_size) if mean else 1.0)

    def check_budget(self, accountant: PrivacyAccountant | None) -> None:
        """Raises :class:`~psg_core.errors.BudgetExhaustedError` when one more step would exceed
        ``accountant``'s budget; records nothing. Call it before computing the clipped sum."""
        if accountant is not None:
            accountant.check_step(self.noise_multiplier, self.sample_rate)

    def noise_and_normalise(self, clipped_sum: Mapping[str, torch.Tensor], *,
                            generator: torch.Generator | None = None,
                            secure_rng: bool = False, in_place: bool = False) -> dict[str, torch.Tensor]:
        """``(clipped_sum + noise) / normaliser``: Gaussian noise of std ``noise_multiplier *
        sensitivity`` added once, then a multiplication by ``1 / normaliser`` (a division's value
        for a power of two, within one rounding otherwise, at a third less of a pass's time) (see :func:`~psg_core.noise.add_noise` for ``generator`` and
        ``secure_rng``). ``clipped_sum`` is not modified and the returned tensors are new, unless
        ``in_place``: then the result is written into ``clipped_sum``'s tensors and returned (for a
        caller that owns the sum and needs only the released gradient: no parameter-sized buffer
        per step, which on a CPU means no fresh pages to fault in). Same values either way."""
        scale = 1.0 / self.normaliser
        if in_place:
            sigma, bound = check_noise_arguments(clipped_sum, noise_multiplier=self.noise_multiplier,
                                                 sensitivity=self.sensitivity, generator=generator,
                                                 secure_rng=secure_rng)
            noised = clipped_sum if sigma == 0.0 else add_noise_(
                clipped_sum, noise_multiplier=sigma, sensitivity=bound, generator=generator, secure_rng=secure_rng)
            return _scaled_(noised, scale)
        if self.noise_multiplier == 0.0:
            # One pass per tensor (add_noise would copy, then the copy be divided).
            check_noise_arguments(clipped_sum, noise_multiplier=0.0, sensitivity=self.sensitivity,
                                  generator=generator, secure_rng=secure_rng)
            return _scaled(clipped_sum, scale)
        noised = add_noise(clipped_sum, noise_multiplier=self.noise_multiplier, sensitivity=self.sensitivity,
                           generator=generator, secure_rng=secure_rng)
        return _scaled_(noised, scale)

    def account(self, accountant: PrivacyAccountant | None) -> None:
        """Charges the step to ``accountant``: checks the budget and records the step in one atomic
        operation (:meth:`PrivacyAccountant.step`). Call it before releasing the step's gradient, and
        release only when it returns.

        Raises:
            BudgetExhaustedError: one more step would exceed the budget (nothing recorded).
        """
        if accountant is not None:
            accountant.step(self.noise_multiplier, self.sample_rate)
