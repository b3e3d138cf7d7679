"""Configuration and result types of a DP gradient step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from psg_core.errors import ConfigError
from psg_core.layout import check_multiplicity
from psg_core.modes import Clipping, GradSampleMode, LossReduction, parse_enum

__all__ = ["DPConfig", "DPGradient"]


@dataclass(frozen=True, init=False)
class DPConfig:
    """Everything that defines one DP-SGD gradient computation; validated on construction.

    The constructor takes each choice as its enum or its string value (typed that way, so
    ``DPConfig(mode="ghost")`` type-checks); the fields always hold the enums, so
    ``DPConfig(mode="ghost").mode`` is ``GradSampleMode.GHOST``.

    >>> DPConfig(max_grad_norm=1.0, noise_multiplier=1.1, augmentation_multiplicity=4).clipping
    <Clipping.FLAT: 'flat'>
    """

    mode: GradSampleMode = GradSampleMode.HOOKS
    #: K augmented copies per sample; their gradients are averaged (mean) before clipping.
    augmentation_multiplicity: int = 1
    loss_reduction: LossReduction = LossReduction.MEAN
    batch_first: bool = True
    #: C, the per-sample L2 norm bound.
    max_grad_norm: float = 1.0
    clipping: Clipping = Clipping.FLAT
    #: sigma; the noise std is sigma * C. Zero means no noise (not private, but useful to test).
    noise_multiplier: float = 0.0
    #: per_layer clipping only: one bound per trainable parameter, in named_parameters() order;
    #: None means C / sqrt(number of parameters) each, so the whole gradient stays within C.
    per_layer_max_grad_norms: tuple[float, ...] | None = field(default=None)

    def __init__(self, mode: GradSampleMode | str = GradSampleMode.HOOKS, augmentation_multiplicity: int = 1,
                 loss_reduction: LossReduction | str = LossReduction.MEAN, batch_first: bool = True,
                 max_grad_norm: float = 1.0, clipping: Clipping | str = Clipping.FLAT,
                 noise_multiplier: float = 0.0,
                 per_layer_max_grad_norms: tuple[float, ...] | None = None) -> None:
        set_ = object.__setattr__
        set_(self, "mode", mode)
        set_(self, "augmentation_multiplicity", augmentation_multiplicity)
        set_(self, "loss_reduction", loss_reduction)
        set_(self, "batch_first", batch_first)
        set_(self, "max_grad_norm", max_grad_norm)
        set_(self, "clipping", clipping)
        set_(self, "noise_multiplier", noise_multiplier)
        set_(self, "per_layer_max_grad_norms", per_layer_max_grad_norms)
        self._validate()

    def _validate(self) -> None:
        set_ = object.__setattr__
        set_(self, "mode", parse_enum(GradSampleMode, self.mode, what="DPConfig.mode"))
        set_(self, "clipping", parse_enum(Clipping, self.clipping, what="DPConfig.clipping"))
        set_(self, "loss_reduction", parse_enum(LossReduction, self.loss_reduction,
                                                what="DPConfig.loss_reduction"))
        check_multiplicity(self.augmentation_multiplicity, where="DPConfig")
        if not isinstance(self.max_grad_norm, (int, float)) or not math.isfinite(self.max_grad_norm) \
                or self.max_grad_norm <= 0:
            raise ConfigError(f"DPConfig: max_grad_norm must be a finite number > 0, got "
                              f"{self.max_grad_norm!r}")
        if not isinstance(self.noise_multiplier, (int, float)) or not math.isfinite(self.noise_multiplier) \
                or self.noise_multiplier < 0:
            raise ConfigError(f"DPConfig: noise_multiplier must be a finite number >= 0, got "
                              f"{self.noise_multiplier!r}")
        if self.per_layer_max_grad_norms is not None:
            norms = tuple(float(c) for c in self.per_layer_max_grad_norms)
            if not norms or any(not math.isfinite(c) or c <= 0 for c in norms):
                raise ConfigError("DPConfig: per_layer_max_grad_norms must be positive finite numbers, "
                                  f"got {self.per_layer_max_grad_norms!r}")
            if self.clipping is not Clipping.PER_LAYER:
                raise ConfigError("DPConfig: per_layer_max_grad_norms only applies to clipping='per_layer'")
            set_(self, "per_layer_max_grad_norms", norms)
        set_(self, "batch_first", bool(self.batch_first))
        set_(self, "max_grad_norm", float(self.max_grad_norm))
        set_(self, "noise_multiplier", float(self.noise_multiplier))


@dataclass
class DPGradient:
    """The result of :func:`psg_core.dp_gradient` on one batch (or one shard of it).

    ``grads`` is the *sum* of clipped per-sample gradients (no noise, no normalisation); shard
    results add up field by field (see :meth:`merge`).
    """

    grads: dict[str, torch.Tensor]
    #: (N,) per-sample gradient norms before clipping, fp32.
    per_sample_norms: torch.Tensor
    #: sum over samples of each sample's loss (reduction over its K rows).
    loss_sum: float
    num_samples: int
    num_clipped: int
    #: samples whose gradient was not finite, dropped from the sum (see psg_core.clipping).
    num_dropped: int = 0

    @staticmethod
    def merge(parts: list[DPGradient]) -> DPGradient:
        """Sums shard results in the given order (so the sum is deterministic)."""
        if not parts:
            raise ConfigError("DPGradient.merge: nothing to merge")
        grads = {name: t.clone() for name, t in parts[0].grads.items()}
        for part in parts[1:]:
            if part.grads.keys() != grads.keys():
                raise ConfigError("DPGradient.merge: shards disagree on parameter names")
            for name, t in part.grads.items():
                grads[name] += t
        return DPGradient(
            grads=grads,
            per_sample_norms=torch.cat([p.per_sample_norms for p in parts]),
            loss_sum=float(sum(p.loss_sum for p in parts)),
            num_samples=sum(p.num_samples for p in parts),
            num_clipped=sum(p.num_clipped for p in parts),
            num_dropped=sum(p.num_dropped for p in parts),
        )
