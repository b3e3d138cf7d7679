"""Python values <-> their ``psg.v1`` messages, written once for the client and the server.

Each message's "unset" convention (``proto/psg/v1/gradient_service.proto``: an empty string, a
zero, an absent optional) is read and written here and nowhere else:

* :class:`~psg_core.config.DPConfig` <-> ``DPSettings``
* :class:`PrivacyRequest` <-> ``PrivacySettings``
* :class:`StepReport` <-> ``StepStats``
* a parameter's ``(name, dtype, shape, requires_grad)`` <-> ``ParameterSpec``
* :class:`~psg_wire.adapters.LoraAdapter` <-> ``LoraSettings``
* :class:`WireDtypes` <-> ``WireSettings``
* :class:`~psg_core.adaptive_clipping.QuantileClipping` <-> ``AdaptiveClippingSettings``

>>> from psg_core.config import DPConfig
>>> config = DPConfig(mode="ghost", augmentation_multiplicity=4, noise_multiplier=1.1)
>>> dp_config_from_proto(dp_config_to_proto(config)) == config
True
>>> privacy_from_proto(privacy_to_proto(PrivacyRequest(delta=1e-5)))
PrivacyRequest(accountant=None, sample_rate=None, delta=1e-05, target_epsilon=None, steps=None, epochs=None)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from psg_core.adaptive_clipping import QuantileClipping
from psg_core.config import DPConfig
from psg_core.errors import ConfigError
from psg_wire.adapters import LoraAdapter
from psg_wire.codec import DTYPES, CodecError, dtype_name
from psg_wire.v1 import gradient_service_pb2 as pb

__all__ = [
    "WIRE_DTYPES",
    "PrivacyRequest",
    "StepReport",
    "WireDtypes",
    "adaptive_clipping_from_proto",
    "adaptive_clipping_to_proto",
    "dp_config_from_proto",
    "dp_config_to_proto",
    "lora_from_proto",
    "lora_to_proto",
    "parameter_spec_from_proto",
    "parameter_spec_to_proto",
    "privacy_from_proto",
    "privacy_to_proto",
    "step_stats_from_proto",
    "step_stats_to_proto",
    "wire_dtypes_from_proto",
    "wire_dtypes_to_proto",
]


# ------------------------------------------------------------------------------------ DPSettings
def dp_config_to_proto(config: DPConfig) -> pb.DPSettings:
    """``DPSettings`` carrying every field of ``config`` (none left to the server's defaults)."""
    return pb.DPSettings(mode=config.mode.value, augmentation_multiplicity=config.augmentation_multiplicity,
                         loss_reduction=config.loss_reduction.value, batch_first=config.batch_first,
                         max_grad_norm=config.max_grad_norm, clipping=config.clipping.value,
                         noise_multiplier=config.noise_multiplier,
                         per_layer_max_grad_norms=list(config.per_layer_max_grad_norms or ()))


def dp_config_from_proto(settings: pb.DPSettings) -> DPConfig:
    """The :class:`DPConfig` a ``DPSettings`` describes; unset fields take DPConfig's defaults.

    Raises :class:`~psg_core.errors.ConfigError` when the values are out of range (DPConfig
    validates them).
    """
    return DPConfig(mode=settings.mode or "hooks",
                    augmentation_multiplicity=settings.augmentation_multiplicity or 1,
                    loss_reduction=settings.loss_reduction or "mean",
                    batch_first=settings.batch_first if settings.HasField("batch_first") else True,
                    max_grad_norm=settings.max_grad_norm, clipping=settings.clipping or "flat",
                    noise_multiplier=settings.noise_multiplier,
                    per_layer_max_grad_norms=tuple(settings.per_layer_max_grad_norms) or None)


# ------------------------------------------------------------------------------- PrivacySettings
@dataclass(frozen=True)
class PrivacyRequest:
    """A session's privacy settings as the client asked for them; None = not given.

    The server fills what is not given (its default accountant, sample rate 1) and validates the
    rest; this type only carries the request across the wire.
    """

    #: "rdp" or "pld"; None = the server's default.
    accountant: str | None = None
    #: Poisson sampling rate q; None = 1 (full batch).
    sample_rate: float | None = None
    #: delta of the reported epsilon; needed when the session adds noise.
    delta: float | None = None
    #: Refuse steps past this epsilon; None = no budget.
    target_epsilon: float | None = None
    #: Noise calibration: choose sigma for ``target_epsilon`` after this many steps; None = not given.
    steps: int | None = None
    #: The same plan in epochs; None = not given.
    epochs: float | None = None


def privacy_to_proto(request: PrivacyRequest) -> pb.PrivacySettings:
    """``PrivacySettings`` of ``request`` (None travels as the field's zero value)."""
    return pb.PrivacySettings(accountant=request.accountant or "", sample_rate=request.sample_rate or 0.0,
                              delta=request.delta or 0.0, target_epsilon=request.target_epsilon or 0.0,
                              steps=request.steps or 0, epochs=request.epochs or 0.0)


def privacy_from_proto(settings: pb.PrivacySettings) -> PrivacyRequest:
    """The :class:`PrivacyRequest` of ``settings`` (a zero value reads as not given)."""
    return PrivacyRequest(accountant=settings.accountant or None, sample_rate=settings.sample_rate or None,
                          delta=settings.delta or None, target_epsilon=settings.target_epsilon or None,
                          steps=settings.steps or None, epochs=settings.epochs or None)


# ------------------------------------------------------------------------------------- StepStats
@dataclass(frozen=True)
class StepReport:
    """The statistics of one step, as ``StepStats`` carries them."""

    #: 1-based index of the step in its session.
    step: int
    param_version: int
    #: Samples (N, not rows) in the batch, dropped ones included.
    samples: int
    #: Mean over the kept samples (``samples - num_dropped``) of each sample's loss.
    mean_loss: float
    #: Kept samples' gradient norms before clipping, ``{quantile: norm}``.
    norm_quantiles: Mapping[float, float]
    #: Samples scaled down by clipping / ``samples``.
    fraction_clipped: float
    #: Epsilon after the step at the session's delta; +inf without noise.
    epsilon_spent: float
    budget_left: float
    #: Seconds the server spent on the step.
    server_seconds: float
    #: The reply to a part of a logical batch that is not its last: that part's statistics only.
    pending: bool = False
    #: Samples whose gradient was not finite, dropped from the sum (psg_core.clipping).
    num_dropped: int = 0
    #: Adaptive clipping only (None otherwise): the flat bound the step's samples were clipped at.
    clip_bound: float | None = None
    #: Adaptive clipping only (None otherwise and for a pending part): the next step's bound.
    next_clip_bound: float | None = None
    #: Adaptive clipping only (None otherwise and for a pending part): the released, noised
    #: estimate of the fraction of samples ``clip_bound`` left unclipped.
    unclipped_fraction: float | None = None


#: The optional fields of ``StepStats`` (unset = None in :class:`StepReport`).
_OPTIONAL_STATS = ("clip_bound", "next_clip_bound", "unclipped_fraction")


def step_stats_to_proto(report: StepReport) -> pb.StepStats:
    """``StepStats`` of ``report`` (quantiles in the mapping's order; None leaves a field unset)."""
    optional = {name: getattr(report, name) for name in _OPTIONAL_STATS if getattr(report, name) is not None}
    return pb.StepStats(step=report.step, param_version=report.param_version, samples=report.samples,
                        mean_loss=report.mean_loss,
                        norm_quantiles=[pb.NormQuantile(quantile=q, value=v)
                                        for q, v in report.norm_quantiles.items()],
                        fraction_clipped=report.fraction_clipped, epsilon_spent=report.epsilon_spent,
                        budget_left=report.budget_left, server_seconds=report.server_seconds,
                        pending=report.pending, num_dropped=report.num_dropped, **optional)


def step_stats_from_proto(stats: pb.StepStats) -> StepReport:
    """The :class:`StepReport` of ``stats``."""
    optional = {name: getattr(stats, name) if stats.HasField(name) else None for name in _OPTIONAL_STATS}
    return StepReport(step=stats.step, param_version=stats.param_version, samples=stats.samples,
                      mean_loss=stats.mean_loss,
                      norm_quantiles={q.quantile: q.value for q in stats.norm_quantiles},
                      fraction_clipped=stats.fraction_clipped, epsilon_spent=stats.epsilon_spent,
                      budget_left=stats.budget_left, server_seconds=stats.server_seconds,
                      pending=stats.pending, num_dropped=stats.num_dropped, **optional)


# --------------------------------------------------------------------------------- ParameterSpec
def parameter_spec_to_proto(name: str, dtype: torch.dtype, shape: Sequence[int], *,
                            requires_grad: bool) -> pb.ParameterSpec:
    """``ParameterSpec`` of one model parameter; :class:`CodecError` for a dtype the wire lacks."""
    return pb.ParameterSpec(name=name, dtype=dtype_name(dtype), shape=list(shape), requires_grad=requires_grad)


def parameter_spec_from_proto(spec: pb.ParameterSpec) -> tuple[torch.dtype, tuple[int, ...]]:
    """``(dtype, shape)`` of a ``ParameterSpec``: what a pushed tensor of that name must be."""
    dtype = DTYPES.get(spec.dtype)
    if dtype is None:
        raise CodecError(f"parameter_spec_from_proto: parameter {spec.name!r} has unknown dtype "
                         f"{spec.dtype[:40]!r}; supported: {', '.join(DTYPES)}")
    return dtype, tuple(spec.shape)


# ---------------------------------------------------------------------------------- LoraSettings
def lora_to_proto(adapter: LoraAdapter) -> pb.LoraSettings:
    """``LoraSettings`` of ``adapter`` (alpha None travels as 0).

    >>> lora_from_proto(lora_to_proto(LoraAdapter(rank=2, target_modules=("c_attn",))))
    LoraAdapter(rank=2, target_modules=('c_attn',), alpha=None)
    """
    return pb.LoraSettings(rank=adapter.rank, alpha=adapter.alpha or 0.0,
                           target_modules=list(adapter.target_modules))


def lora_from_proto(settings: pb.LoraSettings) -> LoraAdapter:
    """The :class:`LoraAdapter` of ``settings``; :class:`~psg_core.errors.ConfigError` when a value
    is out of range (a zero alpha reads as not given)."""
    return LoraAdapter(rank=settings.rank, target_modules=tuple(settings.target_modules),
                       alpha=settings.alpha or None)


# ---------------------------------------------------------------------------------- WireSettings
#: The reduced-precision dtypes a session may choose for the wire (``WireSettings``), by name.
WIRE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class WireDtypes:
    """The dtypes a session's floating tensors travel in, per direction; None = each tensor's own
    (exact). ``torch.bfloat16`` halves float32's bytes and rounds each value to 8 significant bits
    (a relative error of at most 2^-9)."""

    #: Parameters pushed to the server (the client casts them; the server casts them back).
    parameters: torch.dtype | None = None
    #: Gradients returned by the server (the client casts them back to each parameter's dtype).
    gradients: torch.dtype | None = None

    def __post_init__(self) -> None:
        for which in ("parameters", "gradients"):
            dtype = getattr(self, which)
            if dtype is not None and dtype not in WIRE_DTYPES.values():
                raise ConfigError(f"WireDtypes: {which} must be None or one of "
                                  f"{[f'torch.{name}' for name in WIRE_DTYPES]}, got {dtype}")


def wire_dtypes_to_proto(wire: WireDtypes) -> pb.WireSettings:
    """``WireSettings`` of ``wire`` (None travels as "")."""
    return pb.WireSettings(parameters_dtype=dtype_name(wire.parameters) if wire.parameters else "",
                           gradients_dtype=dtype_name(wire.gradients) if wire.gradients else "")


def wire_dtypes_from_proto(settings: pb.WireSettings) -> WireDtypes:
    """The :class:`WireDtypes` of ``settings``; :class:`~psg_core.errors.ConfigError` for a dtype
    that is not offered.

    >>> wire_dtypes_from_proto(pb.WireSettings(gradients_dtype="bfloat16"))
    WireDtypes(parameters=None, gradients=torch.bfloat16)
    """
    dtypes = {}
    for which, name in (("parameters", settings.parameters_dtype), ("gradients", settings.gradients_dtype)):
        if name and name not in WIRE_DTYPES:
            raise ConfigError(f"WireSettings: {which}_dtype must be '' (each tensor's own dtype) or one of "
                              f"{sorted(WIRE_DTYPES)}, got {name[:40]!r}")
        dtypes[which] = WIRE_DTYPES[name] if name else None
    return WireDtypes(**dtypes)


# ---------------------------------------------------------------------- AdaptiveClippingSettings
def adaptive_clipping_to_proto(clipping: QuantileClipping) -> pb.AdaptiveClippingSettings:
    """``AdaptiveClippingSettings`` of ``clipping`` (every field given)."""
    return pb.AdaptiveClippingSettings(target_quantile=clipping.target_quantile, learning_rate=clipping.learning_rate,
                                       count_noise_multiplier=clipping.count_noise_multiplier)


def adaptive_clipping_from_proto(settings: pb.AdaptiveClippingSettings) -> QuantileClipping:
    """The :class:`~psg_core.adaptive_clipping.QuantileClipping` of ``settings``: a zero
    ``target_quantile`` or ``learning_rate`` reads as QuantileClipping's default (0.5, 0.2);
    ``count_noise_multiplier`` has no default (its scale is the batch's).

    Raises:
        ConfigError: a value out of range, or no ``count_noise_multiplier``.

    >>> adaptive_clipping_from_proto(pb.AdaptiveClippingSettings(count_noise_multiplier=3.0))
    QuantileClipping(target_quantile=0.5, learning_rate=0.2, count_noise_multiplier=3.0)
    """
    if settings.count_noise_multiplier == 0:
        raise ConfigError("AdaptiveClippingSettings: count_noise_multiplier is required (> 0 and above half the "
                          "noise multiplier; the paper suggests about expected_batch_size / 20)")
    return QuantileClipping(target_quantile=settings.target_quantile or QuantileClipping.target_quantile,
                            learning_rate=settings.learning_rate or QuantileClipping.learning_rate,
                            count_noise_multiplier=settings.count_noise_multiplier)
