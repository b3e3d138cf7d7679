"""Gradient accumulation: one logical batch (the Poisson sample DP-SGD accounts) computed as several
physical batches (what fits in memory).

The clipped sums of the physical batches add up (:meth:`~psg_core.config.DPGradient.merge`), and
the privacy step runs once on the total: one budget check before the first physical batch, one
accounted step (charged before anything is released), noise once, one normalisation. Every
physical batch is clipped with the configuration the logical batch started with, the one its noise
is calibrated for. Per-sample gradients exist for one physical batch at a
time, so memory is bounded by the physical batch (plus one gradient-sized running sum and one norm
per sample). The released gradient is that of the whole logical batch in one call, up to floating
point summation order (and exactly the same noise for the same generator state).

>>> import torch
>>> from torch import nn
>>> from psg_core.config import DPConfig
>>> from psg_core.dp_step import DPStep
>>> model = nn.Linear(3, 1)
>>> step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0), sample_rate=0.01,
...               expected_batch_size=8.0)
>>> inputs, targets = torch.randn(8, 3), torch.randn(8, 1)
>>> stats = step.accumulate(split_batch(inputs, targets, max_samples=3))   # 3 + 3 + 2 samples
>>> stats.num_samples, step.accountant.steps
(8, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.rnn import PackedSequence

from psg_core.adaptive_clipping import (QuantileClipping, gradient_noise_multiplier, private_unclipped_fraction,
                                        updated_bound)
from psg_core.backends.base import trainable_parameters
from psg_core.config import DPConfig, DPGradient
from psg_core.errors import ConfigError
from psg_core.layout import BatchLayout, ModelInputs
from psg_core.privacy_step import PrivacyStep

if TYPE_CHECKING:
    from psg_core.dp_step import DPStep

__all__ = ["GradientAccumulator", "pad_batch", "split_batch"]


def split_batch(inputs: Any, targets: torch.Tensor, *, max_samples: int, augmentation_multiplicity: int = 1,
                batch_first: bool = True) -> Iterator[tuple[Any, torch.Tensor]]:
    """Physical batches of at most ``max_samples`` samples (K rows each, never split) of one batch.

    Inputs keep their form (a tensor, a tuple or list, a mapping of keyword arguments); the tensors
    that carry the batch (the batch's N*K rows on the batch dimension, as
    :class:`~psg_core.layout.ModelInputs` finds them) are cut into views, every other value goes whole
    to each physical batch. An empty batch gives one empty physical batch, so that it still makes
    one (noised, accounted) step.

    Args:
        inputs, targets: the logical batch, as for :func:`psg_core.dp_gradient`.
        max_samples: most samples (not rows) per physical batch, >= 1.
        augmentation_multiplicity: K, rows per sample.
        batch_first: the batch dimension is 0 (True) or 1 (False).

    >>> [x.shape[0] for x, _ in split_batch(torch.zeros(10, 2), torch.zeros(10), max_samples=2,
    ...                                     augmentation_multiplicity=2)]
    [4, 4, 2]
    """
    where = "split_batch"
    model_inputs = _parsed(inputs, targets, max_samples, "max_samples", where)
    if _holds_packed((model_inputs.args, model_inputs.kwargs)):
        raise ConfigError(f"{where}: a PackedSequence cannot be split into physical batches; pack each "
                          "physical batch on its own and pass them to DPStep.accumulate")
    layout = BatchLayout.of_call(model_inputs, targets, augmentation_multiplicity=augmentation_multiplicity,
                                 batch_first=batch_first, where=where)
    if layout.num_samples <= max_samples:
        yield inputs, targets
        return
    axes = {id(tensor): dim for tensor, dim in model_inputs.batch_tensors(layout)}
    target_dim = layout.target_dim(targets)
    K = layout.augmentation_multiplicity
    for start in range(0, layout.num_samples, max_samples):
        count = min(max_samples, layout.num_samples - start)
        yield (_map_batch(inputs, axes, lambda t, dim: t.narrow(dim, start * K, count * K)),  # (count*K, ...)
               targets.narrow(target_dim, start * K, count * K))


def pad_batch(inputs: Any, targets: torch.Tensor, *, multiple: int, augmentation_multiplicity: int = 1,
              batch_first: bool = True) -> tuple[Any, torch.Tensor, torch.Tensor, int] | None:
    """The batch padded to a multiple of ``multiple`` samples with copies of its first sample (its K
    rows), so that batches of varying sizes (Poisson sampling) come in a few shapes:
    ``(inputs, targets, mask, N)``, ``mask`` the ``(N',)`` bool of the real samples (the first N).
    A padding sample must weigh nothing: :class:`~psg_core.capture.CapturedStep` zeroes its loss
    (so its gradient, its norm, its share of the loss sum). Inputs keep their form (as in
    :func:`split_batch`). None where the batch cannot be padded so: no sample, a PackedSequence, a
    batch tensor whose batch is not a dimension of rows (an EmbeddingBag's offsets), targets
    without one row per batch row.

    >>> x, y, mask, n = pad_batch(torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 2]), multiple=4)
    >>> x.tolist(), y.tolist(), mask.tolist(), n
    ([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [0.0, 1.0]], [0, 1, 2, 0], [True, True, True, False], 3)
    """
    where = "pad_batch"
    model_inputs = _parsed(inputs, targets, multiple, "multiple", where)
    if _holds_packed((model_inputs.args, model_inputs.kwargs)):
        return None
    layout = BatchLayout.of_call(model_inputs, targets, augmentation_multiplicity=augmentation_multiplicity,
                                 batch_first=batch_first, where=where)
    samples, K = layout.num_samples, layout.augmentation_multiplicity
    found = model_inputs.batch_tensors(layout)
    target_dim = layout.target_dim(targets)
    if samples == 0 or any(dim < 0 for _, dim in found) or targets.dim() == 0 \
            or targets.shape[target_dim] != samples * K:
        return None
    padded = -(-samples // multiple) * multiple
    device = targets.device
    rows = torch.cat([torch.arange(samples * K), torch.arange(K).repeat(padded - samples)])  # (N'*K,)
    mask = torch.arange(padded) < samples  # (N',)
    if padded == samples:
        return inputs, targets, mask.to(device), samples
    axes = {id(tensor): dim for tensor, dim in found}
    padded_inputs = _map_batch(inputs, axes, lambda t, dim: t.index_select(dim, rows.to(t.device)))
    return padded_inputs, targets.index_select(target_dim, rows.to(device)), mask.to(device), samples


def _parsed(inputs: Any, targets: torch.Tensor, count: int, name: str, where: str) -> ModelInputs:
    """The inputs parsed, after checking ``count`` (an int >= 1, the argument ``name``) and the targets."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{where}: {name} must be an int >= 1, got {count!r}")
    if not isinstance(targets, torch.Tensor):
        raise ConfigError(f"{where}: targets must be a tensor, got {type(targets).__name__}")
    return ModelInputs.parse(inputs, where=where)


def _map_batch(value: Any, axes: dict[int, int], change: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
    """``value`` (a tensor, or mappings, tuples and lists holding them) with ``change(tensor, dim)``
    in place of each tensor that ``axes`` (by id) gives a batch dimension ``dim``; the rest as it is."""
    if isinstance(value, torch.Tensor):
        dim = axes.get(id(value))
        return value if dim is None else change(value, dim)
    if isinstance(value, Mapping):
        return {key: _map_batch(item, axes, change) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_map_batch(item, axes, change) for item in value)
    return value


def _holds_packed(value: Any) -> bool:
    if isinstance(value, PackedSequence):
        return True
    if isinstance(value, Mapping):
        return any(_holds_packed(item) for item in value.values())
    return isinstance(value, (tuple, list)) and any(_holds_packed(item) for item in value)


@dataclass(frozen=True)
class _Settings:
    """What one logical batch is clipped, noised, accounted and adapted with: the step's settings
    when its first physical batch arrived (``config`` is a frozen dataclass, so the snapshot is the
    object itself)."""

    config: DPConfig
    privacy: PrivacyStep
    adaptive: QuantileClipping | None
    expected_batch_size: float

    @classmethod
    def of(cls, step: DPStep) -> _Settings:
        config = step.config  # read once: the privacy step is that of the configuration clipped with
        return cls(config=config, privacy=PrivacyStep.for_config(config, sample_rate=step.sample_rate,
                                                                 expected_batch_size=step.expected_batch_size),
                   adaptive=step.adaptive_clipping, expected_batch_size=step.expected_batch_size)


class GradientAccumulator:
    """One logical batch of a :class:`~psg_core.dp_step.DPStep`, fed physical batch by physical batch.

    :meth:`add` computes a physical batch's clipped sum (:func:`psg_core.dp_gradient`) and adds it to
    the running total; :meth:`release` accounts one step, then adds noise once, normalises and fills
    ``p.grad``, as :class:`~psg_core.dp_step.DPStep` does for a batch given whole, and, with the
    step's ``adaptive_clipping``, moves its clipping bound (:mod:`psg_core.adaptive_clipping`).

    The settings of a logical batch are those of the step when its first physical batch arrives:
    the whole configuration (every physical batch is clipped with it, so a sample contributes at
    most the sensitivity the noise is calibrated for), sigma, sample rate, normaliser and adaptive
    clipping. A change of ``step.config`` (by the caller, or by another accumulator's release under
    adaptive clipping) applies from the next logical batch. The budget is checked at the first
    physical batch, before anything is computed, and charged at :meth:`release`, before anything
    is released.

    Args:
        step: the DPStep whose model, loss, configuration, accountant and generator are used.

    >>> import torch
    >>> from torch import nn
    >>> from psg_core.config import DPConfig
    >>> from psg_core.dp_step import DPStep
    >>> step = DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(), sample_rate=0.5,
    ...               expected_batch_size=4.0)
    >>> accumulator = GradientAccumulator(step)
    >>> for _ in range(3):
    ...     _ = accumulator.add(torch.randn(2, 3), torch.randn(2, 1))
    >>> accumulator.num_samples, accumulator.release().num_samples, step.accountant.steps
    (6, 6, 1)
    """

    def __init__(self, step: DPStep) -> None:
        self._step = step
        self._settings: _Settings | None = None
        self._total: DPGradient | None = None
        self._batches = 0

    @property
    def num_samples(self) -> int:
        """Samples added since the last release."""
        return 0 if self._total is None else self._total.num_samples

    @property
    def num_batches(self) -> int:
        """Physical batches added since the last release."""
        return self._batches

    def add(self, inputs: Any, targets: torch.Tensor) -> DPGradient:
        """Adds one physical batch's clipped sum, clipped with the logical batch's configuration
        (the step's at the first physical batch); returns that batch's own statistics.

        Raises:
            BudgetExhaustedError: on the first physical batch, when one more step would exceed the
                accountant's budget (nothing computed, nothing recorded).
        """
        step = self._step
        if self._settings is None:
            settings = _Settings.of(step)
            settings.privacy.check_budget(step.accountant)
            self._settings = settings
        part = step.clipped_sum(inputs, targets, config=self._settings.config)
        self._total = part if self._total is None else DPGradient.merge([self._total, part])
        self._batches += 1
        return part

    def release(self) -> DPGradient:
        """Account one step, then noise once, normalise and fill ``p.grad`` of every trainable
        parameter; the accumulator is then empty for the next logical batch, whether the release
        succeeded or raised.

        The step is charged first: the accountant checks the budget and records the step in one
        atomic operation, and only a charged step is released. The budget checked at the first
        :meth:`add` may be spent by then (an accountant shared with other steps or accumulators,
        threads); the release is then refused with nothing released.

        Returns:
            the statistics of the whole logical batch (clipped sum before noise, every sample's norm,
            loss sum, counts).

        Raises:
            BudgetExhaustedError: one more step would now exceed the accountant's budget: nothing
                recorded, ``p.grad`` left as it was, the logical batch discarded.
        """
        if self._total is None or self._settings is None:
            raise ConfigError("GradientAccumulator.release: no physical batch was added (an empty Poisson "
                              "batch is one add() of zero rows)")
        step, settings, total = self._step, self._settings, self._total
        self._settings, self._total, self._batches = None, None, 0
        privacy, adaptive = settings.privacy, settings.adaptive
        # Charge, then release: gradient and count together are one mechanism of sigma z.
        privacy.account(step.accountant)
        if privacy.noise_multiplier == 0:
            step._warn_without_noise()
        noising = privacy if adaptive is None else replace(privacy, noise_multiplier=gradient_noise_multiplier(
            privacy.noise_multiplier, adaptive.count_noise_multiplier))
        released = noising.noise_and_normalise(total.grads, generator=step.generator, secure_rng=step.secure_rng)
        for name, param in trainable_parameters(step.model).items():
            param.grad = released[name].to(param.dtype)  # (*param.shape)
        if adaptive is not None:
            # Flat clipping (DPStep checks): the sensitivity is the bound this batch was clipped at.
            fraction = private_unclipped_fraction(total.per_sample_norms, privacy.sensitivity,
                                                  count_noise_multiplier=adaptive.count_noise_multiplier,
                                                  expected_batch_size=settings.expected_batch_size,
                                                  generator=step.generator, secure_rng=step.secure_rng)
            bound = updated_bound(privacy.sensitivity, unclipped_fraction=fraction, clipping=adaptive)
            step.config = replace(step.config, max_grad_norm=bound)
            step.unclipped_fraction = fraction
        return total
