"""DP-SGD in-process, without the service: one call fills ``p.grad`` with the private gradient."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from psg_core.accounting import PrivacyAccountant
from psg_core.backends.base import trainable_parameters
from psg_core.config import DPConfig, DPGradient
from psg_core.dp import dp_gradient
from psg_core.errors import ConfigError
from psg_core.losses import LossFn
from psg_core.privacy_step import PrivacyStep

__all__ = ["DPStep"]


class DPStep:
    """Computes a DP-SGD gradient for ``model`` and stores it in ``p.grad``, so that any torch
    optimizer can step on it; keeps its own privacy ledger.

    Each call runs :func:`psg_core.dp_gradient` (clipped sum), adds Gaussian noise of std
    ``noise_multiplier * sensitivity`` once, normalises, overwrites ``p.grad`` of every trainable
    parameter, and records one step of ``(noise_multiplier, sample_rate)`` in its accountant.
    Everything but the clipped sum is :class:`~psg_core.privacy_step.PrivacyStep`, which the
    service's frontend runs too: with ``loss_reduction="mean"`` the noisy sum is divided by
    ``expected_batch_size`` (the fixed normaliser Poisson sampling calls for, not the realised
    batch size), the private analogue of a batch-mean gradient; with ``"sum"`` it is used as is.
    With a budget, a step that would exceed it raises
    :class:`~psg_core.errors.BudgetExhaustedError` before anything is computed.

    Args:
        model: the model to train.
        loss_fn: as for :func:`psg_core.dp_gradient`.
        config: the :class:`~psg_core.config.DPConfig` (backend, K, clipping, noise_multiplier).
        sample_rate: q, each example's probability of joining a batch (see
            :class:`~psg_core.sampling.PoissonBatchSampler`).
        expected_batch_size: ``q * dataset size``, the normaliser under mean reduction.
        accountant: the ledger to record steps in; default a new PLD accountant without budget.
        generator: a seeded ``torch.Generator`` for the noise; None uses torch's global one.
        secure_rng: draw the noise from a CSPRNG-seeded generator per step.

    >>> model = nn.Linear(3, 1)
    >>> step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0),
    ...               sample_rate=0.01, expected_batch_size=4.0,
    ...               accountant=PrivacyAccountant("rdp"))
    >>> stats = step(torch.randn(4, 3), torch.randn(4, 1))
    >>> model.weight.grad.shape, step.accountant.steps
    (torch.Size([1, 3]), 1)
    """

    def __init__(self, model: nn.Module, *, loss_fn: LossFn | nn.Module, config: DPConfig,
                 sample_rate: float, expected_batch_size: float,
                 accountant: PrivacyAccountant | None = None, generator: torch.Generator | None = None,
                 secure_rng: bool = False) -> None:
        where = "DPStep"
        if not isinstance(model, nn.Module):
            raise ConfigError(f"{where}: expected an nn.Module, got {type(model).__name__}")
        if not isinstance(config, DPConfig):
            raise ConfigError(f"{where}: config must be a DPConfig, got {type(config).__name__}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) \
                or not 0 < sample_rate <= 1:
            raise ConfigError(f"{where}: sample_rate must be a number in (0, 1], got {sample_rate!r}")
        if isinstance(expected_batch_size, bool) or not isinstance(expected_batch_size, (int, float)) \
                or not math.isfinite(expected_batch_size) or expected_batch_size <= 0:
            raise ConfigError(f"{where}: expected_batch_size must be a finite number > 0, got "
                              f"{expected_batch_size!r}")
        if generator is not None and secure_rng:
            raise ConfigError(f"{where}: pass either a generator or secure_rng=True, not both")
        if accountant is not None and not isinstance(accountant, PrivacyAccountant):
            raise ConfigError(f"{where}: accountant must be a PrivacyAccountant, got "
                              f"{type(accountant).__name__}")
        self.model = model
        self.loss_fn = loss_fn
        self.config = config
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.accountant = accountant if accountant is not None else PrivacyAccountant()
        self.generator = generator
        self.secure_rng = bool(secure_rng)

    def __call__(self, inputs: Any, targets: torch.Tensor) -> DPGradient:
        """Fills ``p.grad`` from one Poisson batch (possibly empty) and records the step.

        Returns:
            the :class:`~psg_core.config.DPGradient` statistics of the batch (clipped sum before
            noise, per-sample norms, loss sum, counts).
        """
        privacy = self._privacy_step()
        privacy.check_budget(self.accountant)
        result = dp_gradient(self.model, inputs, targets, loss_fn=self.loss_fn, config=self.config)
        released = privacy.noise_and_normalise(result.grads, generator=self.generator, secure_rng=self.secure_rng)
        for name, param in trainable_parameters(self.model).items():
            param.grad = released[name].to(param.dtype)  # (*param.shape)
        privacy.account(self.accountant)
        return result

    @property
    def normaliser(self) -> float:
        """What the noisy sum is divided by: ``expected_batch_size`` under mean reduction, else 1."""
        return self._privacy_step().normaliser

    def _privacy_step(self) -> PrivacyStep:
        # Built per call from the public attributes, which a caller may change between steps.
        return PrivacyStep.for_config(self.config, sample_rate=self.sample_rate,
                                      expected_batch_size=self.expected_batch_size)

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far by this helper's accountant (see :meth:`PrivacyAccountant.epsilon`)."""
        return self.accountant.epsilon(delta)
