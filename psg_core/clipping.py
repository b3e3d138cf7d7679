"""Per-sample clipping and summation.

Three rules, all with bound ``C = max_grad_norm``:

* ``flat``: one L2 norm over every parameter of a sample; the sample is scaled by
  ``min(1, C / (norm + 1e-6))``.
* ``per_layer``: parameter ``i`` of a sample is scaled by ``min(1, C_i / (norm_i + 1e-6))`` with its
  own norm and bound; the default ``C_i = C / sqrt(P)`` for ``P`` parameters keeps the whole
  clipped gradient within ``sqrt(sum_i C_i^2) = C``.
* ``automatic``: every sample is scaled by ``C / (norm + 0.01)`` (Bu et al., 2022, "Automatic
  clipping"), so each contribution has norm just below ``C`` whatever its size.

Norms are computed in (at least) fp32 whatever the gradients' dtype, and reported in fp32; so are the
factors, and a half-precision gradient is multiplied by them and summed in fp32 too, the sum cast to
the gradients' dtype once (a factor cast to fp16 is 0 below ~6e-8: the bound must hold for what is
summed). A sample whose gradient is not finite is dropped (factor 0, counted in ``num_dropped``),
never summed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from psg_core._host import capturing, expect_zero, host_int
from psg_core.errors import ConfigError
from psg_core.modes import Clipping, parse_enum
from psg_core.precision import accumulation_dtype, as_dtype, norm_dtype as promoted_norm_dtype

__all__ = ["ClipResult", "clip_and_sum", "clip_factors", "weighted_sum", "dropped_samples", "zero_dropped", "count_dropped", "kept_sum", "FLAT_EPSILON",
           "AUTOMATIC_STABILITY"]

#: Added to the norm in the flat and per-layer factors so that a zero gradient gives factor 1.
FLAT_EPSILON = 1e-6
#: The stability constant gamma of automatic clipping, ``C * g / (norm + gamma)``.
AUTOMATIC_STABILITY = 0.01


@dataclass(frozen=True)
class ClipResult:
    """What :func:`clip_and_sum` returns."""

    #: ``{name: (*shape)}``: the sum over samples of the clipped per-sample gradients, in the
    #: dtype of the input gradients.
    grads: dict[str, torch.Tensor]
    #: ``(N,)`` fp32: each sample's L2 norm over all parameters, before clipping.
    per_sample_norms: torch.Tensor
    #: Number of clipped samples. flat: ``norm > C``; per_layer: ``norm_i > C_i`` for at least one
    #: parameter i; automatic: the samples scaled *down* (``C / (norm + 0.01) < 1``, i.e.
    #: ``norm > C - 0.01``); automatic clipping scales the others up.
    num_clipped: int
    #: ``(N,)`` fp32 for flat and automatic clipping: the factor each sample was multiplied by;
    #: ``(N, P)`` for per_layer clipping, one column per parameter in ``grads`` order.
    clip_factors: torch.Tensor
    #: Number of samples dropped because their gradient was not finite (NaN or infinity, e.g.
    #: from overflowing inputs): they contribute nothing, so one record cannot poison the sum.
    num_dropped: int = 0


def _check_per_sample(per_sample: Mapping[str, torch.Tensor]) -> int:
    if not isinstance(per_sample, Mapping) or not per_sample:
        raise ConfigError("clip_and_sum: per_sample must be a non-empty dict {name: (N, *shape) tensor}, "
                          f"got {type(per_sample).__name__} of length "
                          f"{len(per_sample) if isinstance(per_sample, Mapping) else 'n/a'}")
    sizes = set()
    for name, grad in per_sample.items():
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point() or grad.dim() < 1:
            raise ConfigError(f"clip_and_sum: per_sample[{name!r}] must be a floating tensor of shape "
                              f"(N, *param.shape), got {type(grad).__name__} "
                              f"{getattr(grad, 'dtype', '')} {tuple(getattr(grad, 'shape', ()))}")
        sizes.add(int(grad.shape[0]))
    if len(sizes) != 1:
        raise ConfigError(f"clip_and_sum: per-sample gradients disagree on N: "
                          f"{ {name: int(g.shape[0]) for name, g in per_sample.items()} }")
    return sizes.pop()


def _per_layer_bounds(names: Sequence[str], max_grad_norm: float,
                      per_layer_max_grad_norms: Sequence[float] | None) -> list[float]:
    if per_layer_max_grad_norms is None:
        return [max_grad_norm / math.sqrt(len(names))] * len(names)
    bounds = [float(c) for c in per_layer_max_grad_norms]
    if len(bounds) != len(names):
        raise ConfigError(f"clip_and_sum: per_layer_max_grad_norms has {len(bounds)} bounds for "
                          f"{len(names)} trainable parameters {list(names)}")
    if any(not math.isfinite(c) or c <= 0 for c in bounds):
        raise ConfigError(f"clip_and_sum: per_layer_max_grad_norms must be positive finite numbers, "
                          f"got {per_layer_max_grad_norms!r}")
    return bounds


#: elements of a half-precision ``(N, numel)`` gradient cast to float32 at a time by :func:`weighted_sum`
_UPCAST_CHUNK = 1 << 22


def weighted_sum(factors: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``sum_n factors[n] * grad[n]`` for ``(N,)`` factors and an ``(N, ...)`` gradient, without
    materialising the scaled (N, ...) tensor; multiplied and accumulated in
    :func:`~psg_core.precision.accumulation_dtype` (float32 for half precision: a factor cast to
    float16 is 0 below ~6e-8 and inexact below ~6e-5, and the bound ``C`` would not hold for what is
    summed), returned in the accumulation dtype (the caller casts once).

    >>> g = torch.full((4, 3), 1.0, dtype=torch.float16)
    >>> weighted_sum(torch.full((4,), 1e-8), g)  # each 1e-8 is 0 in float16
    tensor([4.0000e-08, 4.0000e-08, 4.0000e-08])
    """
    flat = grad.reshape(grad.shape[0], math.prod(grad.shape[1:]))  # (N, numel)
    dtype = accumulation_dtype(flat.dtype)
    weights = as_dtype(factors, dtype)
    width = max(1, _UPCAST_CHUNK // max(1, flat.shape[0]))
    if dtype == flat.dtype:
        summed = torch.mv(flat.t(), weights)  # (numel,): matmul's product, fewer dispatches
    elif flat.shape[1] <= width:
        summed = torch.mv(flat.to(dtype).t(), weights)
    else:  # half precision, large: a chunk of columns cast at a time (not a float32 copy of the whole)
        summed = torch.cat([torch.mv(flat[:, start:start + width].to(dtype).t(), weights)
                            for start in range(0, flat.shape[1], width)])
    return summed.reshape(grad.shape[1:])


def clip_factors(layer_norms: torch.Tensor | None, names: Sequence[str], *, max_grad_norm: float,
                 clipping: Clipping, per_layer_max_grad_norms: Sequence[float] | None = None,
                 norms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipping rule applied to per-sample, per-parameter norms (shared by every backend).

    Args:
        layer_norms: ``(N, P)`` L2 norm of each sample's gradient of each parameter (None when
            ``norms`` is given and clipping is not per_layer).
        names: the P parameter names (for per-layer bounds and messages).
        norms: the ``(N,)`` total norms when the caller has them (ghost clipping sums squared
            norms): the norms of ``layer_norms``' rows otherwise.

    Returns:
        ``(factors, norms, clipped)``: factors ``(N,)`` (``(N, P)`` for per_layer) to multiply each
        sample's gradient by, total norms ``(N,)`` and a ``(N,)`` bool of the samples scaled down.
    """
    if norms is None:
        if layer_norms is None:
            raise ConfigError("clip_factors: give layer_norms, or norms for flat or automatic clipping")
        norms = torch.linalg.vector_norm(layer_norms, dim=1)  # (N,)
    # A sample whose gradient is not finite (overflowing inputs or parameters) would make the sum
    # NaN, and its influence would not be bounded by C: it gets factor 0 (see dropped_samples).
    finite = norms < math.inf  # (N,): a norm is >= 0, so this is isfinite's answer in one comparison
    if clipping is Clipping.PER_LAYER:
        if layer_norms is None:
            raise ConfigError("clip_factors: per_layer clipping needs the per-layer norms")
        bounds = torch.tensor(_per_layer_bounds(names, max_grad_norm, per_layer_max_grad_norms),
                              dtype=layer_norms.dtype, device=layer_norms.device)  # (P,)
        factors = (bounds / (layer_norms + FLAT_EPSILON)).clamp(max=1.0)  # (N, P)
        factors = torch.where(finite[:, None], factors, 0.0)
        return factors, norms, (layer_norms > bounds).any(dim=1) & finite
    if clipping is Clipping.FLAT:
        factors = (max_grad_norm / (norms + FLAT_EPSILON)).clamp(max=1.0)  # (N,)
        return torch.where(finite, factors, 0.0), norms, (norms > max_grad_norm) & finite
    factors = max_grad_norm / (norms + AUTOMATIC_STABILITY)  # (N,)
    return torch.where(finite, factors, 0.0), norms, (factors < 1.0) & finite


def dropped_samples(norms: torch.Tensor) -> torch.Tensor | None:
    """``(N,)`` bool: the samples whose gradient is not finite, which clipping drops (factor 0,
    rows zeroed before the sum) and the results count in ``num_dropped``; None when there is
    none (the common case, decided with one device-to-host read per step). While a step is
    recorded (:mod:`psg_core.capture`), None: the recording takes the common path, and a replay
    whose batch drops a sample is discarded for the eager step (:func:`psg_core._host.expect_zero`)."""
    finite = norms < math.inf  # (a norm is >= 0: isfinite in one comparison)
    if capturing():
        expect_zero((~finite).sum())
        return None
    return None if bool(finite.all()) else ~finite


def zero_dropped(grad: torch.Tensor, dropped: torch.Tensor | None) -> torch.Tensor:
    """``grad`` ``(N, ...)`` with the rows of dropped samples set to 0 (``0 * inf`` is NaN)."""
    if dropped is None:
        return grad
    return torch.where(dropped.view(-1, *[1] * (grad.dim() - 1)), torch.zeros((), dtype=grad.dtype, device=grad.device),
                       grad)


def kept_sum(losses: torch.Tensor, dropped: torch.Tensor | None) -> torch.Tensor:
    """The sum of the ``(N,)`` per-sample ``losses`` of the samples :func:`dropped_samples` kept
    (a dropped sample's loss may be NaN), with no read of which those are."""
    return losses.sum() if dropped is None else torch.where(dropped, torch.zeros((), dtype=losses.dtype,
                                                                                 device=losses.device), losses).sum()


def count_dropped(dropped: torch.Tensor | None) -> int:
    """How many samples :func:`dropped_samples` dropped."""
    return 0 if dropped is None else host_int(dropped.sum())


def clip_and_sum(per_sample: Mapping[str, torch.Tensor], *, max_grad_norm: float,
                 clipping: Clipping | str = Clipping.FLAT,
                 per_layer_max_grad_norms: Sequence[float] | None = None) -> ClipResult:
    """Clips every sample's gradient and sums over samples.

    Args:
        per_sample: ``{name: (N, *param.shape)}`` per-sample gradients (e.g. from
            :func:`psg_core.per_sample_gradients`); all entries share N, which may be 0.
        max_grad_norm: C > 0, the per-sample L2 bound.
        clipping: ``"flat"``, ``"per_layer"`` or ``"automatic"`` (see the module docstring).
        per_layer_max_grad_norms: per_layer only: one bound per entry of ``per_sample``, in order;
            default ``C / sqrt(P)`` each.

    Returns:
        :class:`ClipResult` with the sums, the fp32 pre-clipping norms ``(N,)`` and the number of
        samples scaled down.

    >>> g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
    >>> out = clip_and_sum(g, max_grad_norm=1.0)
    >>> out.per_sample_norms, out.num_clipped
    (tensor([5.0000, 0.5000]), 1)
    >>> out.grads["w"]
    tensor([0.9000, 1.2000])
    """
    rule = Clipping(parse_enum(Clipping, clipping, what="clip_and_sum: clipping"))
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ConfigError(f"clip_and_sum: max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
    if per_layer_max_grad_norms is not None and rule is not Clipping.PER_LAYER:
        raise ConfigError(f"clip_and_sum: per_layer_max_grad_norms only applies to clipping='per_layer', "
                          f"got clipping={rule.value!r}")
    num_samples = _check_per_sample(per_sample)
    names = list(per_sample)
    first = per_sample[names[0]]
    norm_dtype = promoted_norm_dtype(g.dtype for g in per_sample.values())

    layer_norms = torch.stack([
        torch.linalg.vector_norm(per_sample[name].reshape(num_samples, math.prod(per_sample[name].shape[1:])),
                                 dim=1, dtype=norm_dtype)
        for name in names], dim=1)  # (N, P)
    factors, norms, clipped = clip_factors(layer_norms, names, max_grad_norm=float(max_grad_norm),
                                           clipping=rule, per_layer_max_grad_norms=per_layer_max_grad_norms)
    dropped = dropped_samples(norms)
    if rule is Clipping.PER_LAYER:
        grads = {name: as_dtype(weighted_sum(factors[:, i], zero_dropped(per_sample[name], dropped)),
                                per_sample[name].dtype) for i, name in enumerate(names)}
    else:
        grads = {name: as_dtype(weighted_sum(factors, zero_dropped(per_sample[name], dropped)), per_sample[name].dtype)
                 for name in names}
    return ClipResult(grads=grads, per_sample_norms=norms.to(torch.float32),
                      num_clipped=host_int(clipped.sum()), clip_factors=factors.to(torch.float32),
                      num_dropped=count_dropped(dropped))
