"""The ghost-norm registry: how the ghost backend gets a layer's per-sample weight-gradient norms
without materialising the per-sample gradients.

Sample n's weight gradient of a Linear-like layer is ``sum_t g_t a_t^T`` over its ``T = K *
positions`` rows, and ``||sum_t g_t a_t^T||^2 = sum_{s,t} (a_s . a_t)(g_s . g_t)``: two ``(T, T)``
Gram matrices instead of the ``(d_out, d_in)`` gradient ("ghost norm", Li et al. 2022). A layer
family says how its gradient factors, beside its grad sampler, with :func:`register_ghost_norm`:

* ``factors(layer, activation, backprop, K)``: the :class:`GhostFactors` of each sample's weight
  gradient, and the ``(N, *shape)`` per-sample gradients of the layer's other trainable
  parameters (a bias: small, so materialised);
* ``weight_sum(layer, activation, backprop)``: the weight gradient summed over the rows, which
  with ``backprop`` scaled row by row is the clipped sum ("book-keeping", Bu et al. 2023);
* ``positions(layer, activation, output, batch_dim)``: the factor rows one input row
  contributes (sequence length, convolution positions), known at the forward call;
* ``is_cheaper(layer, positions)``: whether the Gram pair beats materialising the per-sample
  weight gradient (default: ``2 * T^2 <= weight.numel()``);
* optionally ``choose(layer, activation, backprop, K)``: the same question asked with a
  single-call layer's tensors in hand (the convolutions measure, see
  :mod:`psg_core.grad_sample.conv_strategy`); None defers to ``is_cheaper``.

``activation``, ``backprop`` are batch-first with ``N*K`` rows, sample-major.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from psg_core.errors import ConfigError
from psg_core.grad_sample._type_registry import LayerKey, LayerTypeRegistry

__all__ = ["FactorKind", "GhostFactors", "GhostNormEntry", "GhostNormRegistry", "GHOST_NORMS",
           "register_ghost_norm"]


class FactorKind(enum.Enum):
    """How :class:`GhostFactors` make a gradient."""

    #: ``grad[n] = sum_g right[n, g]^T @ left[n, g]`` (Linear, convolutions per group).
    DOT = "dot"
    #: a lookup table: ``grad[n][v] = sum_{t: left[n, t] == v} right[n, t]`` (Embedding).
    INDEX = "index"
    #: a lookup table with any number of entries per sample: ``left (2, M)`` holds each entry's
    #: sample and table row, ``grad[n][v] = sum_{m: left[:, m] == (n, v)} right[m]`` (EmbeddingBag).
    KEYED = "keyed"


@dataclass(frozen=True)
class GhostFactors:
    """One call's factors of each sample's weight gradient, the K rows folded into T.

    ``DOT``: ``left (N, G, T, I)``, ``right (N, G, T, O)``. ``INDEX``: ``left (N, T)`` token ids,
    ``right (N, T, d)`` output gradients (rows that get no gradient, e.g. padding, zeroed).
    ``KEYED``: ``left (2, M)`` (sample, token id) of M entries, ``right (M, d)``, ``samples`` N.
    """

    kind: FactorKind
    left: torch.Tensor
    right: torch.Tensor
    samples: int = 0

    @classmethod
    def dot(cls, left: torch.Tensor, right: torch.Tensor) -> GhostFactors:
        """``grad[n] = sum_g right[n, g]^T @ left[n, g]``: ``(N, G, T, I)`` and ``(N, G, T, O)``."""
        if left.dim() != 4 or right.dim() != 4 or left.shape[:3] != right.shape[:3]:
            raise ConfigError(f"GhostFactors.dot: expected (N, G, T, I) and (N, G, T, O), got "
                              f"{tuple(left.shape)} and {tuple(right.shape)}")
        return cls(FactorKind.DOT, left, right)

    @classmethod
    def index(cls, tokens: torch.Tensor, right: torch.Tensor) -> GhostFactors:
        """A lookup table's gradient: ``(N, T)`` token ids and their ``(N, T, d)`` gradients."""
        if tokens.dim() != 2 or right.dim() != 3 or tokens.shape != right.shape[:2]:
            raise ConfigError(f"GhostFactors.index: expected (N, T) and (N, T, d), got "
                              f"{tuple(tokens.shape)} and {tuple(right.shape)}")
        return cls(FactorKind.INDEX, tokens, right)

    @classmethod
    def keyed(cls, sample: torch.Tensor, tokens: torch.Tensor, right: torch.Tensor, samples: int) -> GhostFactors:
        """A lookup table's gradient from M entries: their ``(M,)`` samples and table rows and
        ``(M, d)`` gradients; ``samples`` is N. Entries that get no gradient carry zeros."""
        if sample.shape != tokens.shape or tokens.dim() != 1 or right.dim() != 2 \
                or right.shape[0] != tokens.shape[0]:
            raise ConfigError(f"GhostFactors.keyed: expected (M,), (M,) and (M, d), got {tuple(sample.shape)}, "
                              f"{tuple(tokens.shape)} and {tuple(right.shape)}")
        return cls(FactorKind.KEYED, torch.stack([sample, tokens]), right, samples)

    @staticmethod
    def concat(parts: Sequence[GhostFactors]) -> GhostFactors:
        """The factors of several calls of one layer, along T (the norm of the summed gradient)."""
        if len(parts) == 1:
            return parts[0]
        if parts[0].kind is FactorKind.KEYED:
            return GhostFactors(FactorKind.KEYED, torch.cat([p.left for p in parts], 1),
                                torch.cat([p.right for p in parts], 0), parts[0].samples)
        axis = 2 if parts[0].kind is FactorKind.DOT else 1
        return GhostFactors(parts[0].kind, torch.cat([p.left for p in parts], axis),
                            torch.cat([p.right for p in parts], axis))

    def sq_norms(self, dtype: torch.dtype) -> torch.Tensor:
        """``(N,)`` squared Frobenius norms of the per-sample weight gradients, from Gram matrices.

        >>> a, g = torch.randn(2, 1, 5, 3), torch.randn(2, 1, 5, 4)
        >>> grads = g.transpose(-1, -2) @ a  # (N, 1, 4, 3)
        >>> torch.allclose(GhostFactors.dot(a, g).sq_norms(torch.float32), grads.square().sum((1, 2, 3)))
        True
        """
        right = self.right.to(dtype)
        if self.kind is FactorKind.KEYED:
            return _keyed_sq_norms(self.left[0], self.left[1], right, self.samples)
        if self.kind is FactorKind.DOT:
            left = self.left.to(dtype)
            gram_left = left @ left.transpose(-1, -2)  # (N, G, T, T)
            gram_right = right @ right.transpose(-1, -2)  # (N, G, T, T)
            return (gram_left * gram_right).sum((1, 2, 3)).clamp_min(0)
        same_token = self.left.unsqueeze(2) == self.left.unsqueeze(1)  # (N, T, T)
        gram_right = right @ right.transpose(-1, -2)  # (N, T, T)
        return (gram_right * same_token).sum((1, 2)).clamp_min(0)


def _keyed_sq_norms(sample: torch.Tensor, tokens: torch.Tensor, right: torch.Tensor, samples: int) -> torch.Tensor:
    """``(N,)``: ``sum_n sum_v ||sum_{m: (sample, token)_m = (n, v)} right[m]||^2``.

    Entries sorted by (sample, token) make each table row of each sample one run; the runs are
    summed into an ``(M, d)`` buffer (never the ``(N, V, d)`` gradient), with fixed shapes only:
    no count of distinct keys is read on the host.

    >>> right = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    >>> _keyed_sq_norms(torch.tensor([0, 0, 1]), torch.tensor([4, 4, 4]), right, 2).tolist()  # (1+2)^2, 3^2
    [9.0, 9.0]
    """
    count = tokens.shape[0]
    if count == 0:
        return right.new_zeros(samples)
    key = sample * (tokens.max() + 1) + tokens  # (M,), stays on the device
    key, order = key.sort()
    is_start = torch.ones_like(key, dtype=torch.bool)
    is_start[1:] = key[1:] != key[:-1]
    run = is_start.cumsum(0) - 1  # (M,) the run of each sorted entry
    sums = right.new_zeros(count, right.shape[1]).index_add_(0, run, right[order])  # (M, d), runs first
    run_sample = torch.zeros_like(run).scatter_(0, run, sample[order])  # (M,)
    return right.new_zeros(samples).index_add_(0, run_sample, sums.square().sum(1))


#: ``factors(layer, activation, backprop, K) -> (GhostFactors, {other parameter: (N, *shape)})``.
FactorFn = Callable[..., tuple[GhostFactors, dict[torch.Tensor, torch.Tensor]]]
#: ``weight_sum(layer, activation, backprop) -> weight-shaped tensor`` (summed over the rows).
WeightSumFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``positions(layer, activation, output, batch_dim) -> int | None``.
PositionsFn = Callable[[Any, torch.Tensor, Any, int], int | None]
#: ``is_cheaper(layer, positions) -> bool`` with ``positions = K * sum over calls``.
CostRule = Callable[[Any, int], bool]
#: ``choose(layer, activation, backprop, K) -> bool | None``: Gram factors (True) or the
#: materialised gradient (False) for one call's tensors; None defers to the cost rule.
ChooseFn = Callable[[Any, torch.Tensor, torch.Tensor, int], bool | None]

_Factors = TypeVar("_Factors", bound=FactorFn)


@dataclass(frozen=True)
class GhostNormEntry:
    """A registered ghost norm (the pieces of :func:`register_ghost_norm`)."""

    fn: FactorFn
    layer_type: type[nn.Module]
    weight_sum: WeightSumFn
    positions: PositionsFn
    cost_rule: CostRule | None = None
    #: the attribute holding the parameter the factors describe.
    parameter: str = "weight"
    chooser: ChooseFn | None = None
    #: ``activation`` is the whole call (a :class:`~psg_core.backends.capture.LayerCall`: its
    #: args and kwargs), for layers whose rows are not their first input's (EmbeddingBag with
    #: offsets).
    whole_call: bool = False

    def weight(self, layer: nn.Module) -> torch.Tensor | None:
        """The parameter whose norm the factors give (None if the layer has none)."""
        value = getattr(layer, self.parameter, None)
        return value if isinstance(value, torch.Tensor) else None

    def is_cheaper(self, layer: nn.Module, positions: int) -> bool:
        """Whether the Gram pair (``2 * T^2`` numbers per group) costs less than the
        materialised per-sample weight (``weight.numel()`` per sample)."""
        if self.cost_rule is not None:
            return self.cost_rule(layer, positions)
        weight = self.weight(layer)
        return weight is not None and 2 * positions * positions <= weight.numel()

    def choose(self, layer: nn.Module, activation: torch.Tensor, backprop: torch.Tensor, K: int) -> bool | None:
        """Gram factors (True) or the materialised gradient (False) for a layer called once with
        these batch-first tensors; None when the family has no such choice (ask
        :meth:`is_cheaper`)."""
        return None if self.chooser is None else self.chooser(layer, activation, backprop, K)


class GhostNormRegistry(LayerTypeRegistry[GhostNormEntry]):
    """Maps layer types to ghost norms; lookup walks the class MRO (a subclass that overrides
    ``forward`` inherits none), and a type may be registered by its dotted name."""

    def __init__(self) -> None:
        super().__init__(what="ghost norm", decorator="register_ghost_norm")

    def register(self, *layer_types: LayerKey, weight_sum: WeightSumFn, positions: PositionsFn,
                 is_cheaper: CostRule | None = None, parameter: str = "weight",
                 replace: bool = False, choose: ChooseFn | None = None,
                 whole_call: bool = False) -> Callable[[_Factors], _Factors]:
        """Decorator registering a factor function; see :func:`register_ghost_norm`."""
        self.check_keys(layer_types)
        for name, piece in (("weight_sum", weight_sum), ("positions", positions)):
            if not callable(piece):
                raise ConfigError(f"register_ghost_norm: {name} must be callable, got {piece!r}")
        for name, optional in (("is_cheaper", is_cheaper), ("choose", choose)):
            if optional is not None and not callable(optional):
                raise ConfigError(f"register_ghost_norm: {name} must be callable or None, got {optional!r}")
        if not (isinstance(parameter, str) and parameter.isidentifier()):
            raise ConfigError(f"register_ghost_norm: parameter must be an attribute name, got {parameter!r}")

        def decorator(fn: _Factors) -> _Factors:
            self.add(layer_types, lambda layer_type: GhostNormEntry(
                fn, layer_type, weight_sum=weight_sum, positions=positions, cost_rule=is_cheaper,
                parameter=parameter, chooser=choose, whole_call=whole_call), replace=replace)
            return fn

        return decorator


#: The process-wide registry the ghost backend asks.
GHOST_NORMS = GhostNormRegistry()


def register_ghost_norm(*layer_types: LayerKey, weight_sum: WeightSumFn, positions: PositionsFn,
                        is_cheaper: CostRule | None = None, parameter: str = "weight",
                        replace: bool = False, choose: ChooseFn | None = None,
                        whole_call: bool = False) -> Callable[[_Factors], _Factors]:
    """Registers how the ghost backend gets per-sample norms of ``layer_types``' weight.

    The decorated function is ``factors(layer, activation, backprop, K)``: from the layer's
    first input and its output gradient (batch-first, ``N*K`` rows) it returns the
    :class:`GhostFactors` of each sample's weight gradient (summed over its K rows) and a dict of
    ``(N, *shape)`` per-sample gradients of the layer's other trainable parameters. A layer
    without a ghost norm (or one where the Gram matrices would be larger) gets its per-sample
    gradients materialised through its grad sampler instead.

    Args:
        layer_types: ``nn.Module`` subclasses, or dotted names ``"package.module.Class"``.
        weight_sum: ``(layer, activation, backprop) -> weight.shape``, the weight gradient
            summed over all rows (``backprop`` arrives scaled by each row's clipping factor).
        positions: ``(layer, activation, output, batch_dim) -> int | None``, the factor rows T
            one input row contributes (None: no ghost norm for this call).
        is_cheaper: ``(layer, positions) -> bool``; default ``2 * positions**2 <= weight.numel()``.
        parameter: the attribute holding the weight the factors describe.
        replace: override an existing registration instead of raising :class:`ConfigError`.
        choose: ``(layer, activation, backprop, K) -> bool | None``, asked instead of
            ``is_cheaper`` when the layer is called once per pass, with that call's tensors
            (None: ask ``is_cheaper``).
        whole_call: ``factors``, ``weight_sum`` and ``choose`` get the whole call (a
            :class:`~psg_core.backends.capture.LayerCall`: ``.args``, ``.kwargs``) in place of the
            first input, and the layer may count its rows itself (EmbeddingBag with offsets).

    A layer ``y = x @ W`` (weight ``(d_in, d_out)``), with its grad sampler and its ghost norm:

    >>> import psg_core
    >>> class RightMatmul(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.randn(6, 4))
    ...     def forward(self, x):
    ...         return x @ self.weight
    >>> @psg_core.register_grad_sampler(RightMatmul, k_aware=True)
    ... def right_matmul_grad_sample(layer, activations, backprops, K):
    ...     x, g = activations[0], backprops  # (N*K, d_in), (N*K, d_out)
    ...     return {layer.weight: torch.einsum("nki,nko->nio", x.view(-1, K, 6), g.view(-1, K, 4))}
    >>> def right_matmul_sum(layer, x, g):
    ...     return x.T @ g  # (d_in, d_out)
    >>> def right_matmul_positions(layer, x, output, batch_dim):
    ...     return 1  # one factor row per input row
    >>> @psg_core.register_ghost_norm(RightMatmul, weight_sum=right_matmul_sum,
    ...                               positions=right_matmul_positions)
    ... def right_matmul_factors(layer, x, g, K):
    ...     n = x.shape[0] // K
    ...     return GhostFactors.dot(x.view(n, 1, K, 6), g.view(n, 1, K, 4)), {}
    >>> model = nn.Sequential(RightMatmul(), nn.Tanh())
    >>> config = psg_core.DPConfig(mode="ghost", augmentation_multiplicity=2, max_grad_norm=1e6)
    >>> x, y = torch.randn(8, 6), torch.randn(8, 4)
    >>> ghost = psg_core.dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=config)
    >>> hooks = psg_core.per_sample_gradients(model, x, y, loss_fn=nn.MSELoss(), augmentation_multiplicity=2)
    >>> torch.allclose(ghost.per_sample_norms, hooks["0.weight"].flatten(1).norm(dim=1), atol=1e-6)
    True
    >>> GHOST_NORMS.unregister(RightMatmul); psg_core.GRAD_SAMPLERS.unregister(RightMatmul)
    """
    return GHOST_NORMS.register(*layer_types, weight_sum=weight_sum, positions=positions,
                                is_cheaper=is_cheaper, parameter=parameter, replace=replace, choose=choose,
                                whole_call=whole_call)
