"""DP-SGD in-process, without the service: one call fills ``p.grad`` with the private gradient.

A :class:`DPStep` takes its noise multiplier from its configuration or calibrates it from a target
epsilon (:func:`~psg_core.calibration.calibrate_noise_multiplier`), splits a logical batch into
physical ones when asked (:mod:`psg_core.accumulate`), and saves and resumes its ledger
(:meth:`DPStep.state_dict`).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from psg_core.accounting import PrivacyAccountant
from psg_core.accumulate import GradientAccumulator, split_batch
from psg_core.adaptive_clipping import QuantileClipping, gradient_noise_multiplier
from psg_core.calibration import calibrate_noise_multiplier
from psg_core.capture import CapturedStep
from psg_core.config import DPConfig, DPGradient
from psg_core.dp import dp_gradient
from psg_core.errors import ConfigError
from psg_core.losses import LossFn
from psg_core.modes import Clipping, GradSampleMode
from psg_core.privacy_step import PrivacyStep

__all__ = ["DPStep", "DP_STEP_STATE_VERSION"]

#: Version of :meth:`DPStep.state_dict`'s layout.
DP_STEP_STATE_VERSION = 1
_STATE_FORMAT = "psg_core.DPStep"

logger = logging.getLogger(__name__)


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
    :class:`~psg_core.errors.BudgetExhaustedError` before anything is computed; the step is
    charged (checked and recorded at once) before ``p.grad`` is written, so a budget spent
    meanwhile (an accountant shared with other steps) refuses it with ``p.grad`` left as it was.

    Noise is on request: with ``noise_multiplier = 0`` (DPConfig's default, without
    ``target_epsilon``) the released gradient carries no noise and the accountant's epsilon is
    infinite; the step logs a warning saying so, once per DPStep.

    Instead of ``config.noise_multiplier``, give ``target_epsilon`` with ``delta`` and the planned
    ``epochs`` or ``steps``: sigma is then the smallest that keeps epsilon within the target after
    the plan (:func:`~psg_core.calibration.calibrate_noise_multiplier`, with the accountant's method),
    ``config`` gets it, and a default accountant gets that budget, so a step past the plan that would
    exceed it is refused.

    Args:
        model: the model to train.
        loss_fn: as for :func:`psg_core.dp_gradient`.
        config: the :class:`~psg_core.config.DPConfig` (backend, K, clipping, noise_multiplier).
        sample_rate: q, each example's probability of joining a batch (see
            :class:`~psg_core.sampling.PoissonBatchSampler`).
        expected_batch_size: ``q * dataset size``, the normaliser under mean reduction.
        accountant: the ledger to record steps in; default a new PLD accountant (with the budget
            ``target_epsilon, delta`` when calibrating, else without).
        generator: a seeded ``torch.Generator`` for the noise; None uses torch's global one.
        secure_rng: draw the noise from a CSPRNG-seeded generator per step.
        target_epsilon: calibrate sigma for this epsilon (``config.noise_multiplier`` must be 0).
        delta: delta of ``target_epsilon`` (default: the accountant's ``target_delta``).
        epochs, steps: the planned run, one of the two (epochs count
            :func:`~psg_core.calibration.steps_for_epochs` steps).
        adaptive_clipping: a :class:`~psg_core.adaptive_clipping.QuantileClipping`: the bound
            (flat clipping, starting at ``config.max_grad_norm``) follows a private quantile of
            the per-sample norms, updated after every step into ``config.max_grad_norm``; the
            step stays accounted at ``config.noise_multiplier``, the gradient's noise being
            slightly larger to pay for the count (:mod:`psg_core.adaptive_clipping`).
        capture: compute each physical batch's clipped sum through a
            :class:`~psg_core.capture.CapturedStep` (recorded once per batch signature, then
            replayed without psg's per-step Python: for batches of a few fixed shapes; not with
            ``adaptive_clipping``, whose bound changes every step). Poisson batches vary in size:
            with ``max_physical_batch_size`` the last physical batch of each step is padded to that
            many samples, with ``pad_to_multiple`` every batch to a multiple of it (padding samples
            weigh nothing; not with ``mode="functorch"``), so that they come in few shapes.
        pad_to_multiple: with ``capture``, pad each (physical) batch to a multiple of this many
            samples (default: ``max_physical_batch_size`` when given, else no padding).
        cuda_graphs: with ``capture``, replay each checked graph as one CUDA graph on a GPU
            (:class:`~psg_core.capture.CapturedStep`'s ``cuda_graphs``).

    >>> model = nn.Linear(3, 1)
    >>> step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0),
    ...               sample_rate=0.01, expected_batch_size=4.0,
    ...               accountant=PrivacyAccountant("rdp"))
    >>> stats = step(torch.randn(4, 3), torch.randn(4, 1))
    >>> model.weight.grad.shape, step.accountant.steps
    (torch.Size([1, 3]), 1)
    >>> calibrated = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(), sample_rate=0.01,
    ...                     expected_batch_size=4.0, target_epsilon=8.0, delta=1e-5, steps=100,
    ...                     accountant=PrivacyAccountant("rdp"))
    >>> round(calibrated.config.noise_multiplier, 2)
    0.5
    """

    def __init__(self, model: nn.Module, *, loss_fn: LossFn | nn.Module, config: DPConfig,
                 sample_rate: float, expected_batch_size: float,
                 accountant: PrivacyAccountant | None = None, generator: torch.Generator | None = None,
                 secure_rng: bool = False, target_epsilon: float | None = None, delta: float | None = None,
                 epochs: float | None = None, steps: int | None = None,
                 adaptive_clipping: QuantileClipping | None = None, capture: bool = False,
                 pad_to_multiple: int | None = None, cuda_graphs: bool = False) -> None:
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
        if target_epsilon is not None:
            if config.noise_multiplier != 0:
                raise ConfigError(f"{where}: give config.noise_multiplier ({config.noise_multiplier}) or "
                                  "target_epsilon, not both")
            if delta is None:
                delta = accountant.target_delta if accountant is not None else None
                if delta is None:
                    raise ConfigError(f"{where}: target_epsilon needs delta")
            if accountant is None:
                accountant = PrivacyAccountant(target_epsilon=target_epsilon, target_delta=delta)
            sigma = calibrate_noise_multiplier(
                target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps, epochs=epochs,
                accountant=accountant.method,
                value_discretization_interval=accountant.value_discretization_interval)
            config = dataclasses.replace(config, noise_multiplier=sigma)
        elif (delta, epochs, steps) != (None, None, None):
            raise ConfigError(f"{where}: delta, epochs and steps calibrate the noise and need target_epsilon")
        if adaptive_clipping is not None:
            if not isinstance(adaptive_clipping, QuantileClipping):
                raise ConfigError(f"{where}: adaptive_clipping must be a QuantileClipping, got "
                                  f"{type(adaptive_clipping).__name__}")
            if config.clipping is not Clipping.FLAT:
                raise ConfigError(f"{where}: adaptive clipping moves one flat bound; got clipping="
                                  f"{config.clipping.value!r}")
            gradient_noise_multiplier(config.noise_multiplier, adaptive_clipping.count_noise_multiplier)
            if capture:
                raise ConfigError(f"{where}: adaptive clipping moves the bound every step, which a recorded step "
                                  "(capture=True) would hold fixed; use one or the other")
        if not isinstance(cuda_graphs, bool):
            raise ConfigError(f"{where}: cuda_graphs must be a bool, got {cuda_graphs!r}")
        if cuda_graphs and not capture:
            raise ConfigError(f"{where}: cuda_graphs replays a captured step as CUDA graphs; it needs capture=True")
        if pad_to_multiple is not None:
            if not capture:
                raise ConfigError(f"{where}: pad_to_multiple pads the batches of a captured step; it needs capture=True")
            if isinstance(pad_to_multiple, bool) or not isinstance(pad_to_multiple, int) or pad_to_multiple < 1:
                raise ConfigError(f"{where}: pad_to_multiple must be a positive int, got {pad_to_multiple!r}")
            if config.mode is GradSampleMode.FUNCTORCH:
                raise ConfigError(f"{where}: pad_to_multiple zeroes the padding samples' loss, which mode='functorch' "
                                  "computes sample by sample; use mode 'ghost', 'hooks' or 'ew'")
        self.model = model
        self.loss_fn = loss_fn
        self.config = config
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.accountant = accountant if accountant is not None else PrivacyAccountant()
        self.generator = generator
        self.secure_rng = bool(secure_rng)
        self.adaptive_clipping = adaptive_clipping
        #: With adaptive clipping: the last step's private estimate of the fraction left unclipped.
        self.unclipped_fraction: float | None = None
        #: Whether each physical batch's clipped sum goes through a :class:`~psg_core.capture.CapturedStep`.
        self.capture = bool(capture)
        #: With ``capture``: the multiple its batches are padded to (None: that of the call's
        #: ``max_physical_batch_size``, if any).
        self.pad_to_multiple = pad_to_multiple
        #: With ``capture``: whether its graphs replay as CUDA graphs on a GPU.
        self.cuda_graphs = cuda_graphs
        self._captured: CapturedStep | None = None
        self._physical: int | None = None  # the running call's max_physical_batch_size
        self._warned_without_noise = False

    def __call__(self, inputs: Any, targets: torch.Tensor, *,
                 max_physical_batch_size: int | None = None) -> DPGradient:
        """Fills ``p.grad`` from one Poisson batch (possibly empty) and records the step.

        Args:
            inputs, targets: the batch, as for :func:`psg_core.dp_gradient`.
            max_physical_batch_size: compute the batch in physical batches of at most this many
                samples (:func:`~psg_core.accumulate.split_batch`, then :meth:`accumulate`), so that
                per-sample gradients of more samples never exist at once; None = all at once.

        Returns:
            the :class:`~psg_core.config.DPGradient` statistics of the batch (clipped sum before
            noise, per-sample norms, loss sum, counts).
        """
        if max_physical_batch_size is None:
            return self.accumulate([(inputs, targets)])
        self._physical = max_physical_batch_size
        try:
            return self.accumulate(split_batch(inputs, targets, max_samples=max_physical_batch_size,
                                               augmentation_multiplicity=self.config.augmentation_multiplicity,
                                               batch_first=self.config.batch_first))
        finally:
            self._physical = None

    def accumulate(self, physical_batches: Iterable[tuple[Any, torch.Tensor]]) -> DPGradient:
        """One step over a logical batch given as physical batches ``(inputs, targets)``: their
        clipped sums add up, then noise once, normalisation, ``p.grad`` and one accounted step (see
        :class:`~psg_core.accumulate.GradientAccumulator`, which this drives).

        Returns:
            the statistics of the whole logical batch.
        """
        accumulator = GradientAccumulator(self)
        for inputs, targets in physical_batches:
            accumulator.add(inputs, targets)
        return accumulator.release()

    def clipped_sum(self, inputs: Any, targets: torch.Tensor, *, config: DPConfig | None = None) -> DPGradient:
        """:func:`psg_core.dp_gradient` of one physical batch with this step's model and loss, and
        ``config`` (default: this step's configuration; a
        :class:`~psg_core.accumulate.GradientAccumulator` passes its logical batch's): recorded once
        per batch signature and replayed with ``capture=True`` (:class:`~psg_core.capture.CapturedStep`,
        kept while the model, loss and configuration are)."""
        config = self.config if config is None else config
        if not self.capture:
            return dp_gradient(self.model, inputs, targets, loss_fn=self.loss_fn, config=config)
        pad = self.pad_to_multiple if self.pad_to_multiple is not None else (
            self._physical if config.mode is not GradSampleMode.FUNCTORCH else None)
        captured = self._captured
        if captured is None or captured.module is not self.model or captured.loss_fn is not self.loss_fn \
                or captured.config != config or captured.pad_to_multiple != pad \
                or captured.cuda_graphs != self.cuda_graphs:
            captured = self._captured = CapturedStep(self.model, loss_fn=self.loss_fn, config=config,
                                                     pad_to_multiple=pad, cuda_graphs=self.cuda_graphs)
        return captured(inputs, targets)

    def _warn_without_noise(self) -> None:
        """Logs, once per step object, that a step without noise was released (its accountant's
        epsilon is now infinite)."""
        if self._warned_without_noise:
            return
        self._warned_without_noise = True
        logger.warning("DPStep: noise_multiplier is 0, so the released gradients carry no noise and the "
                       "accountant's epsilon is infinite: these steps are not differentially private (set "
                       "config.noise_multiplier > 0, or target_epsilon to calibrate it)")

    @property
    def normaliser(self) -> float:
        """What the noisy sum is divided by: ``expected_batch_size`` under mean reduction, else 1."""
        return self.privacy_step().normaliser

    def privacy_step(self) -> PrivacyStep:
        """The :class:`~psg_core.privacy_step.PrivacyStep` of the current settings.

        Built per call from the public attributes, which a caller may change between steps.
        """
        return PrivacyStep.for_config(self.config, sample_rate=self.sample_rate,
                                      expected_batch_size=self.expected_batch_size)

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far by this helper's accountant (see :meth:`PrivacyAccountant.epsilon`)."""
        return self.accountant.epsilon(delta)

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The step's settings, its accountant's :meth:`~PrivacyAccountant.state_dict` and its
        generator's state, as JSON-serialisable values (versioned). Save it with the model's and the
        optimizer's state; :meth:`load_state_dict` resumes the ledger (and the noise stream) exactly.

        >>> import io
        >>> step = DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0),
        ...               sample_rate=0.01, expected_batch_size=4.0, accountant=PrivacyAccountant("rdp"))
        >>> _ = step(torch.randn(4, 3), torch.randn(4, 1))
        >>> buffer = io.BytesIO()
        >>> torch.save({"dp_step": step.state_dict()}, buffer)
        >>> _ = buffer.seek(0)
        >>> resumed = DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(), sample_rate=0.5,
        ...                  expected_batch_size=1.0)
        >>> resumed.load_state_dict(torch.load(buffer)["dp_step"])
        >>> resumed.accountant.steps, resumed.config.noise_multiplier, resumed.sample_rate
        (1, 1.0, 0.01)
        """
        generator = None
        if self.generator is not None:
            raw = self.generator.get_state().numpy().tobytes()
            generator = {"device": str(self.generator.device), "state": base64.b64encode(raw).decode("ascii")}
        return {"format": _STATE_FORMAT, "version": DP_STEP_STATE_VERSION, "config": _config_state(self.config),
                "sample_rate": self.sample_rate, "expected_batch_size": self.expected_batch_size,
                "secure_rng": self.secure_rng, "accountant": self.accountant.state_dict(),
                "generator": generator, "adaptive_clipping": None if self.adaptive_clipping is None else
                dataclasses.asdict(self.adaptive_clipping)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s settings, ledger and generator state (the model and the loss
        stay those given to the constructor). A saved generator state goes into this step's
        generator, or into a new one on the saved device when this step has none; everything is
        validated before anything changes.

        Raises:
            ConfigError: ``state`` is not a DPStep state of a version this code reads, or holds
                invalid values.
        """
        where = "DPStep.load_state_dict"
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ConfigError(f"{where}: not a DPStep state")
        if state.get("version") != DP_STEP_STATE_VERSION:
            raise ConfigError(f"{where}: state version {state.get('version')!r} is not supported (this code "
                              f"reads version {DP_STEP_STATE_VERSION})")
        try:
            config = DPConfig(**{**state["config"], "per_layer_max_grad_norms": _tuple_or_none(
                state["config"]["per_layer_max_grad_norms"])})
            adaptive = state.get("adaptive_clipping")
            adaptive = None if adaptive is None else QuantileClipping(**adaptive)
            checked = DPStep(self.model, loss_fn=self.loss_fn, config=config, sample_rate=state["sample_rate"],
                             expected_batch_size=state["expected_batch_size"],
                             secure_rng=bool(state["secure_rng"]) and self.generator is None,
                             adaptive_clipping=adaptive)
            accountant = PrivacyAccountant()
            accountant.load_state_dict(state["accountant"])
            generator = _generator(state["generator"], self.generator)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"{where}: malformed state ({type(err).__name__}: {err})") from None
        self.config, self.sample_rate = checked.config, checked.sample_rate
        self.expected_batch_size = checked.expected_batch_size
        self.secure_rng = bool(state["secure_rng"])
        self.adaptive_clipping = checked.adaptive_clipping
        self.accountant.load_state_dict(accountant.state_dict())
        if generator is not None:
            self.generator = generator


def _config_state(config: DPConfig) -> dict[str, Any]:
    """``config``'s fields as JSON values (enums by value, the bounds as a list)."""
    values = {item.name: getattr(config, item.name) for item in dataclasses.fields(config)}
    values = {name: value.value if hasattr(value, "value") else value for name, value in values.items()}
    bounds = values["per_layer_max_grad_norms"]
    values["per_layer_max_grad_norms"] = None if bounds is None else list(bounds)
    return values


def _tuple_or_none(values: Any) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)


def _generator(saved: Any, current: torch.Generator | None) -> torch.Generator | None:
    """The generator a saved state goes into (``current``, else a new one), with the state set;
    None when nothing was saved."""
    if saved is None:
        return None
    state = torch.frombuffer(bytearray(base64.b64decode(saved["state"], validate=True)), dtype=torch.uint8)
    generator = current if current is not None else torch.Generator(device=saved["device"])
    generator.set_state(state.clone())
    return generator
