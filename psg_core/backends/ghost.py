"""The ghost backend: per-sample gradient norms without per-sample gradients, then the clipped sum.

One backward pass of ``sum_n loss_n`` (sample n's loss over its K rows) with hooks that turn each
layer's activations ``a`` and output gradients ``g`` into per-sample squared norms:

* ``nn.Linear`` (and ``nn.Conv*`` through their im2col patches, per group): sample n's weight
  gradient is ``sum_t g_t a_t^T`` over its ``T = K * positions`` rows, and
  ``||sum_t g_t a_t^T||^2 = sum_{s,t} (a_s . a_t)(g_s . g_t)``, two ``(T, T)`` Gram matrices
  instead of the ``(d_out, d_in)`` gradient ("ghost norm", Li et al. 2022);
* ``nn.Embedding``: the same with ``a_s . a_t`` replaced by ``[token_s == token_t]``;
* per layer, whichever is cheaper: the Gram pair (``2 * G * T^2`` numbers) or the materialised
  per-sample gradient (``weight.numel()`` numbers per sample);
* every other layer (norms, attention biases, custom modules) materialises its small per-sample
  gradient through its registered grad sampler, or the per-layer ``torch.func`` fallback.

A module called several times (a recurrent cell, a shared block) concatenates its calls along the
T axis, so its norm is the norm of the summed gradient. The pass asks autograd only for the
gradients of the earliest hooked layer outputs, so no parameter gradient is computed in it, and the
graph is freed as it goes.

The clipped sum ``sum_n c_n grad(loss_n)`` then comes from what the pass kept ("book-keeping",
Bu et al. 2023), not from a second backward pass:

* a ghost layer keeps each call's activations and output gradients; its weight's sum is the
  layer's own weight gradient with output-gradient row r scaled by the factor of r's sample (one
  matmul, conv weight-gradient kernel or ``index_add``);
* every other parameter keeps its materialised per-sample gradient, contracted with the factors.

Each parameter may have its own factors, so ``per_layer`` clipping costs the same as ``flat`` and
``automatic``.

Per-sample gradients are never returned: ``per_sample_gradients(mode="ghost")`` raises; use
:func:`ghost_dp_gradient` (or :func:`psg_core.dp_gradient` with ``DPConfig(mode="ghost")``).
Parameters must be used through their own module's ``forward`` (as for the hooks backend).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from psg_core.backends.base import AbstractGradSampleModule, earliest_edges, on_output_grads, trainable_parameters
from psg_core.backends.capture import LayerCall, call_grad_samples, capture_call
from psg_core.backends.functorch import reject_batch_mixing
from psg_core.clipping import clip_factors
from psg_core.config import DPConfig, DPGradient
from psg_core.errors import BatchLayoutError, ConfigError, UnsupportedModuleError
from psg_core.grad_sample.conv import conv_weight_factors, conv_weight_sum
from psg_core.layout import BatchLayout, ModelInputs
from psg_core.losses import LossFn, as_unreduced, loss_batch_dim, per_sample_loss
from psg_core.modes import Clipping, GradSampleMode, LossReduction
from psg_core.provenance import BatchTracker, MeetingPoint

__all__ = ["GhostClippingModule", "ghost_dp_gradient", "ghost_norm_layers"]

_WHERE = "ghost_dp_gradient"
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_FUSED = (nn.RNNBase, nn.MultiheadAttention)
#: The layers of ghost_norm_layers(), as a type.
_GhostLayer = (nn.Linear | nn.Embedding | nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.ConvTranspose1d
               | nn.ConvTranspose2d | nn.ConvTranspose3d)


def ghost_norm_layers() -> tuple[type[nn.Module], ...]:
    """Layer types whose weight norm the ghost backend can get from Gram matrices."""
    return (nn.Linear, nn.Embedding, *_CONV)


def _is_ghost_layer(layer: nn.Module) -> TypeGuard[_GhostLayer]:
    """A ghost layer type whose forward is that type's own (a subclass with its own forward may
    compute anything, so it goes through its grad sampler like any other layer)."""
    return any(isinstance(layer, base) and type(layer).forward is base.forward for base in ghost_norm_layers())


# ------------------------------------------------------------------------------ weight factors
@dataclass
class _Factors:
    """One call's factors of sample n's weight gradient, with the K rows folded into T.

    ``dot``: ``grad[n, g] = right[n, g]^T @ left[n, g]`` with left ``(N, G, T, I)``, right
    ``(N, G, T, O)``. ``index``: an embedding, left ``(N, T)`` token ids and right ``(N, T, d)``.
    """

    kind: str
    left: torch.Tensor
    right: torch.Tensor


def _fold_rows(t: torch.Tensor, K: int) -> torch.Tensor:
    """``(N*K, ...)`` -> ``(N, K, ...)``."""
    return t.reshape(t.shape[0] // K, K, *t.shape[1:])


def _weight_factors(layer: _GhostLayer, a: torch.Tensor, g: torch.Tensor, K: int
                    ) -> tuple[_Factors, torch.Tensor | None]:
    """Weight factors and the (materialised, small) per-sample bias gradient of a ghost layer
    (one whose weight is trainable: see ``_GhostPasses._plan_ghost``).

    ``a`` and ``g`` are batch-first with ``N*K`` rows.
    """
    bias = getattr(layer, "bias", None)
    bias_grad = None
    if isinstance(layer, nn.Linear):
        n = a.shape[0] // K
        left = a.reshape(n, 1, -1, a.shape[-1])  # (N, 1, K*T, d_in)
        right = g.reshape(n, 1, -1, g.shape[-1])  # (N, 1, K*T, d_out)
        factors = _Factors("dot", left, right)
        if bias is not None and bias.requires_grad:
            bias_grad = g.reshape(n, -1, g.shape[-1]).sum(1)  # (N, d_out)
    elif isinstance(layer, nn.Embedding):
        if layer.scale_grad_by_freq:
            raise UnsupportedModuleError(
                f"{_WHERE}: Embedding with scale_grad_by_freq=True scales gradients by token counts "
                "over the whole batch, which mixes samples; per-sample gradients are undefined")
        n = a.shape[0] // K
        tokens = a.reshape(n, -1)  # (N, K*T)
        right = g.reshape(n, tokens.shape[1], -1)  # (N, K*T, d)
        if layer.padding_idx is not None:
            right = right * (tokens != layer.padding_idx).unsqueeze(-1).to(right.dtype)
        factors = _Factors("index", tokens, right)
    else:  # convolutions
        patches, other = conv_weight_factors(layer, a, g, K)  # (N, G, I, K*L), (N, G, O, K*L)
        factors = _Factors("dot", patches.transpose(-1, -2), other.transpose(-1, -2))  # (N, G, K*L, .)
        if bias is not None and bias.requires_grad:
            bias_grad = _fold_rows(g.flatten(2), K).sum((1, 3))  # (N, C_out)
    return factors, bias_grad


def _concat(parts: list[_Factors]) -> _Factors:
    if len(parts) == 1:
        return parts[0]
    axis = 2 if parts[0].kind == "dot" else 1
    return _Factors(parts[0].kind, torch.cat([p.left for p in parts], axis),
                    torch.cat([p.right for p in parts], axis))


def _ghost_sq_norm(f: _Factors, dtype: torch.dtype) -> torch.Tensor:
    """``(N,)`` squared Frobenius norms of the per-sample weight gradients, from Gram matrices."""
    right = f.right.to(dtype)
    if f.kind == "dot":
        left = f.left.to(dtype)
        gram_left = left @ left.transpose(-1, -2)  # (N, G, T, T)
        gram_right = right @ right.transpose(-1, -2)  # (N, G, T, T)
        return (gram_left * gram_right).sum((1, 2, 3)).clamp_min(0)
    same_token = f.left.unsqueeze(2) == f.left.unsqueeze(1)  # (N, T, T)
    gram_right = right @ right.transpose(-1, -2)  # (N, T, T)
    return (gram_right * same_token).sum((1, 2)).clamp_min(0)


def _weight_sum(layer: _GhostLayer, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``weight.shape``: the weight gradient summed over the rows of one call (``a`` and ``g``
    batch-first; ``g`` already scaled row by row)."""
    weight = layer.weight
    if isinstance(layer, nn.Linear):
        a2 = a.reshape(-1, a.shape[-1]).to(g.dtype)  # (rows*T, d_in)
        g2 = g.reshape(-1, g.shape[-1])  # (rows*T, d_out)
        return (g2.transpose(0, 1) @ a2).to(weight.dtype)  # (d_out, d_in)
    if isinstance(layer, nn.Embedding):
        tokens = a.reshape(-1)  # (rows*T,)
        out = g.new_zeros(weight.shape)  # (V, d)
        out.index_add_(0, tokens, g.reshape(tokens.shape[0], -1))
        if layer.padding_idx is not None:
            out[layer.padding_idx] = 0
        return out.to(weight.dtype)
    return conv_weight_sum(layer, a.to(g.dtype), g).to(weight.dtype)


def _ghost_is_cheaper(layer: _GhostLayer, positions: int) -> bool:
    """The 2T^2 vs p*d rule: two (T, T) Grams per group against one materialised weight."""
    groups = getattr(layer, "groups", 1)
    return 2 * groups * positions * positions <= layer.weight.numel()


def _row_positions(layer: nn.Module, args: tuple[Any, ...], output: Any, batch_dim: int) -> int | None:
    """Rows of the ghost factors one input row contributes (sequence length, conv positions)."""
    if not _is_ghost_layer(layer) or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if isinstance(layer, nn.Linear):
        return x.numel() // max(1, x.shape[batch_dim] * x.shape[-1])
    if isinstance(layer, nn.Embedding):
        return x.numel() // max(1, x.shape[batch_dim])
    if isinstance(layer, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return math.prod(x.shape[2:])
    return math.prod(output.shape[2:]) if isinstance(output, torch.Tensor) else None


# ------------------------------------------------------------------------------ bookkeeping
class _Phase(enum.Enum):
    NORMS = "norms"  # the backward pass: per-sample squared norms, kept activations and gradients
    OFF = "off"


@dataclass
class _Call:
    """One forward call of a hooked layer, with its ghost positions (None: not a ghost call)."""

    captured: LayerCall
    positions: int | None

    @property
    def layer(self) -> nn.Module:
        return self.captured.layer


@dataclass
class _LayerState:
    calls: list[_Call] = field(default_factory=list)
    arrived: int = 0
    ghost: bool | None = None  # decided at the first backward of the layer
    buffer: list[_Factors] = field(default_factory=list)
    #: a ghost layer's batch-first ``(activations, output gradients)`` per call, kept for its
    #: weight's clipped sum once the clipping factors are known.
    kept: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    done: bool = False


class _GhostPasses:
    """Forward hooks on every module with trainable parameters, the backward pass and the sums."""

    def __init__(self, module: nn.Module, layout: BatchLayout) -> None:
        self.K, self.rows, self.num_samples = layout.augmentation_multiplicity, layout.rows, layout.num_samples
        self.batch_dim = layout.batch_dim
        # Parameters reached through a batch-free tensor meeting the batch (see
        # psg_core.provenance): materialised, and their norms taken once the pass is over.
        self._via_meetings: set[torch.Tensor] = set()
        self.phase = _Phase.OFF
        self._suspended = False
        self._names = {id(m): f"'{p or '<root>'}' ({type(m).__qualname__})" for p, m in module.named_modules()}
        self._layers: dict[nn.Module, _LayerState] = {}
        self._owners_left: dict[torch.Tensor, int] = {}  # counts down as owning layers finish
        self._handles: list[Any] = []
        for _, layer in module.named_modules():
            own = [p for p in layer.parameters(recurse=False) if p.requires_grad]
            if own:
                self._layers[layer] = _LayerState()
                for p in own:
                    self._owners_left[p] = self._owners_left.get(p, 0) + 1
                self._handles.append(layer.register_forward_hook(self._capture, with_kwargs=True))
        self._owners = dict(self._owners_left)
        self.edges: list[GradientEdge] = []
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in self._owners_left), torch.float32)
        self.norm_dtype = dtype
        self.sq_norms = {p: torch.zeros(self.num_samples, dtype=dtype, device=p.device)
                         for p in self._owners_left}  # (N,) each
        # (N, *shape) per-sample gradients of the parameters that are not ghost weights.
        self._materialised: dict[torch.Tensor, torch.Tensor] = {}

    def remove(self) -> None:
        """Removes the hooks and drops everything the pass held.

        The gradient hooks live on autograd nodes that ``self.edges`` keeps alive, and they refer
        back to this object: a cycle through C++ objects that Python's garbage collector cannot
        see, so it is cut here, or every step would leak its activations.
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.edges.clear()
        self._layers.clear()
        self._materialised.clear()

    @contextlib.contextmanager
    def _suspend(self) -> Iterator[None]:
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    # ---------------------------------------------------------------------------- forward
    def _capture(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._suspended or not torch.is_grad_enabled():
            return
        capture = capture_call(layer, args, kwargs, output, self.batch_dim)
        if capture is None:
            return
        captured, outputs = capture
        if captured.rows != self.rows:
            raise BatchLayoutError(
                f"{_WHERE}: module {self._names[id(layer)]} was called with {captured.rows} rows on its batch "
                f"dimension {captured.batch_dim}, but the batch has {self.rows} (N*K); the ghost backend needs "
                "every layer with trainable parameters to see the batch's rows")
        ghost_ok = _is_ghost_layer(layer) and not captured.custom_rows and captured.num_outputs == 1
        call = _Call(captured, _row_positions(layer, captured.args, output, captured.batch_dim) if ghost_ok else None)
        self._layers[layer].calls.append(call)
        self.edges.extend(get_gradient_edge(t) for t in outputs)
        self._handles.append(on_output_grads(outputs, functools.partial(self._on_grads, call)))

    def _on_grads(self, call: _Call, grads: Any) -> None:
        if self.phase is _Phase.NORMS:
            self._norm_contribution(call, list(grads))

    def on_meeting(self, point: MeetingPoint, view: torch.Tensor) -> None:
        """A batch-free tensor computed from parameters meets the batch (see BatchTracker)."""
        self._via_meetings.update(point.params)

        def on_grads(grads: Any) -> None:
            if self.phase is _Phase.NORMS and grads[0] is not None:
                for param, grad_sample in point.per_sample_grads(grads[0], self.num_samples, self.K).items():
                    self._add(param, grad_sample)

        self.edges.append(get_gradient_edge(view))
        self._handles.append(on_output_grads([view], on_grads))

    # ---------------------------------------------------------------------------- pass 1
    def _plan_ghost(self, layer: nn.Module, state: _LayerState) -> bool:
        weight = getattr(layer, "weight", None)
        if any(c.positions is None for c in state.calls) or not isinstance(weight, nn.Parameter) \
                or not weight.requires_grad or self._owners.get(weight, 0) != 1 or weight in self._via_meetings:
            return False  # not a ghost layer, or a weight shared with another module
        positions = self.K * sum(c.positions or 0 for c in state.calls)
        # Every call has positions, which _capture sets for ghost layers only.
        return _ghost_is_cheaper(cast(_GhostLayer, layer), positions)

    def _norm_contribution(self, call: _Call, grads: list[torch.Tensor | None]) -> None:
        layer, state = call.layer, self._layers[call.layer]
        if state.done:
            raise ConfigError(f"{_WHERE}: module {self._names[id(layer)]} received gradients after its "
                              "norms were computed; the model must be backpropagated once per pass")
        state.arrived += 1
        if state.ghost is None:
            state.ghost = self._plan_ghost(layer, state)
        if state.ghost and call.positions is not None and grads[0] is not None:
            ghost_layer = cast(_GhostLayer, layer)  # _capture sets positions for ghost layers only
            bd = call.captured.batch_dim
            a = call.captured.args[0].movedim(bd, 0)  # (N*K, ...)
            g = cast(torch.Tensor, call.captured.unmerge(grads[0])).movedim(bd, 0)  # (N*K, ...)
            factors, bias_grad = _weight_factors(ghost_layer, a, g, self.K)
            if bias_grad is not None:  # a Linear or convolution with a bias (Embedding has none)
                self._add(getattr(ghost_layer, "bias"), bias_grad)
            state.buffer.append(factors)
            state.kept.append((a, g))
        else:
            # Materialised per-sample gradients (the Gram matrices would be larger, or the layer
            # has none): the layer's grad sampler, e.g. a grouped-convolution weight gradient
            # for a convolution rather than its unfolded patches.
            grad_samples = call_grad_samples(call.captured, grads, self.K,
                                             where=f"{_WHERE} (module {self._names[id(layer)]})",
                                             suspend=self._suspend())
            for param, grad_sample in grad_samples.items():
                if param.requires_grad:
                    self._add(param, grad_sample)
        if state.arrived == len(state.calls) and not any(p in self._via_meetings
                                                         for p in layer.parameters(recurse=False)):
            self.finish_layer(layer)

    def _add(self, param: torch.Tensor, grad_sample: torch.Tensor) -> None:
        current = self._materialised.get(param)
        self._materialised[param] = grad_sample if current is None else current + grad_sample

    def finish_layer(self, layer: nn.Module) -> None:
        """All of a layer's calls are in (or pass 1 is over): turn what it holds into norms."""
        state = self._layers[layer]
        if state.done:
            return
        state.done = True
        if state.buffer:
            factors, state.buffer = _concat(state.buffer), []
            weight = cast(_GhostLayer, layer).weight  # only ghost layers buffer factors
            self.sq_norms[weight] += _ghost_sq_norm(factors, self.norm_dtype)
        for param in layer.parameters(recurse=False):
            if not param.requires_grad:
                continue
            self._owners_left[param] -= 1
            grad_sample = self._materialised.get(param) if self._owners_left[param] == 0 else None
            if grad_sample is not None:
                flat = grad_sample.reshape(self.num_samples, -1)  # (N, numel)
                self.sq_norms[param] += torch.linalg.vector_norm(flat, dim=1, dtype=self.norm_dtype).square()

    def run_norm_pass(self, total_loss: torch.Tensor) -> None:
        """The one backward pass: ``total_loss`` through the hooked outputs only (no parameter
        gradient is computed, the graph is freed as it goes); leaves the squared norms."""
        self.phase = _Phase.NORMS
        try:
            if self.edges:
                torch.autograd.grad(total_loss, earliest_edges(self.edges), allow_unused=True)
            for layer in self._layers:
                self.finish_layer(layer)
        finally:
            self.phase = _Phase.OFF

    # ---------------------------------------------------------------------------- clipped sums
    def clipped_sums(self, factors: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """``sum_n factors[p][n] * grad_n(p)`` for every parameter, from what the pass kept.

        Materialised per-sample gradients are contracted with their factors; a ghost weight's
        sum is its layer's weight gradient with each output-gradient row scaled by its sample's
        factor ("book-keeping", Bu et al. 2023): one weight-gradient kernel per call instead of a
        second backward pass through the whole model. Frees what it used.
        """
        sums: dict[torch.Tensor, torch.Tensor] = {}
        for param, grad_sample in self._materialised.items():
            weights = factors[param].to(grad_sample.dtype)  # (N,)
            flat = grad_sample.reshape(self.num_samples, -1)  # (N, numel)
            sums[param] = (weights @ flat).view(param.shape)
        self._materialised = {}
        for layer, state in self._layers.items():
            if not state.kept:
                continue
            ghost_layer = cast(_GhostLayer, layer)  # only ghost layers keep calls
            row_factors = factors[ghost_layer.weight].repeat_interleave(self.K)  # (N*K,)
            for a, g in state.kept:
                scaled = g * row_factors.view(-1, *[1] * (g.dim() - 1)).to(g.dtype)  # (N*K, ...)
                total = _weight_sum(ghost_layer, a, scaled)
                current = sums.get(ghost_layer.weight)
                sums[ghost_layer.weight] = total if current is None else current + total
            state.kept = []
        return sums


# ------------------------------------------------------------------------------ entry point
def _check_supported(module: nn.Module) -> None:
    reject_batch_mixing(module, where=_WHERE)
    for path, layer in module.named_modules():
        if isinstance(layer, _FUSED) and any(p.requires_grad for p in layer.parameters(recurse=False)):
            raise UnsupportedModuleError(
                f"{_WHERE}: module '{path or '<root>'}' ({type(layer).__qualname__}) is a fused layer whose "
                "kernel hooks cannot see into; swap it for its DP rewrite with psg_core.fix_model")


def _clip_factors(passes: _GhostPasses, params: dict[str, nn.Parameter], config: DPConfig
                  ) -> tuple[dict[torch.Tensor, torch.Tensor], torch.Tensor, int]:
    """Each parameter's ``(N,)`` clipping factors, the ``(N,)`` total norms and the clip count."""
    names = list(params)
    layer_norms = torch.stack([passes.sq_norms[params[n]] for n in names], 1).sqrt()  # (N, P)
    factors, norms, clipped = clip_factors(layer_norms, names, max_grad_norm=config.max_grad_norm,
                                           clipping=config.clipping,
                                           per_layer_max_grad_norms=config.per_layer_max_grad_norms)
    by_param: dict[torch.Tensor, torch.Tensor]
    if config.clipping is Clipping.PER_LAYER:
        by_param = {params[n]: factors[:, i] for i, n in enumerate(names)}
    else:
        by_param = {p: factors for p in params.values()}
    return by_param, norms, int(clipped.sum().item())


def ghost_dp_gradient(module: nn.Module, inputs: Any, targets: Any, *, loss_fn: LossFn | nn.Module,
                      config: DPConfig) -> DPGradient:
    """Clipped sum of per-sample gradients by ghost clipping: norms first, then the sum.

    Equal (up to floating point) to clipping the per-sample gradients of any other backend with
    :func:`psg_core.clip_and_sum`, but it holds no ``(N, *param.shape)`` tensor for the layers
    where the Gram matrices are cheaper. ``config.mode`` is not consulted; ``noise_multiplier``
    is ignored (noise is added once per step, elsewhere).

    Args:
        module: the model; ``p.grad`` and ``p.grad_sample`` are left untouched.
        inputs: a tensor or tuple of positional arguments with ``N*K`` rows, sample-major.
        targets: ``N*K`` rows, same layout.
        loss_fn: returns the unreduced loss (a torch loss module of any reduction is accepted).
        config: K, reduction, batch_first, max_grad_norm and clipping rule.

    Returns:
        :class:`~psg_core.config.DPGradient` keyed by ``named_parameters()`` names.

    >>> from psg_core.config import DPConfig
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> out = ghost_dp_gradient(model, torch.randn(6, 4), torch.randn(6, 1), loss_fn=nn.MSELoss(),
    ...                         config=DPConfig(mode="ghost", max_grad_norm=0.5, augmentation_multiplicity=2))
    >>> out.num_samples, out.per_sample_norms.shape, out.grads["0.weight"].shape
    (3, torch.Size([3]), torch.Size([8, 4]))
    """
    if not isinstance(config, DPConfig):
        raise ConfigError(f"{_WHERE}: config must be a DPConfig, got {type(config).__name__}")
    _check_supported(module)
    loss_fn = as_unreduced(loss_fn)
    model_inputs = ModelInputs.parse(inputs, where=_WHERE)
    layout = BatchLayout.of_call(model_inputs, targets, augmentation_multiplicity=config.augmentation_multiplicity,
                                 batch_first=config.batch_first, where=_WHERE)
    num_samples = layout.num_samples
    params = trainable_parameters(module)
    if num_samples == 0 or not params:
        with torch.no_grad():
            loss_sum = 0.0 if num_samples == 0 else float(per_sample_loss(
                loss_fn(module(*model_inputs.args, **model_inputs.kwargs), targets), num_samples=num_samples,
                batch_dim=layout.batch_dim, reduction=config.loss_reduction).sum())
        return DPGradient(grads={n: torch.zeros_like(p) for n, p in params.items()},
                          per_sample_norms=torch.zeros(num_samples), loss_sum=loss_sum,
                          num_samples=num_samples, num_clipped=0)
    passes = _GhostPasses(module, layout)
    try:
        with BatchTracker(module, num_samples=num_samples, augmentation_multiplicity=layout.augmentation_multiplicity,
                          on_meeting=passes.on_meeting) as tracker:
            for tensor, dim in model_inputs.batch_tensors(layout):
                tracker.mark(tensor, dim)
            per_element = loss_fn(module(*model_inputs.args, **model_inputs.kwargs), targets)
            loss_dim = loss_batch_dim(per_element, layout.batch_dim, tracker.batch_dim(per_element))
            tracker.release()
        losses = per_sample_loss(per_element, num_samples=num_samples, batch_dim=loss_dim,
                                 reduction=config.loss_reduction)  # (N,)
        passes.run_norm_pass(losses.sum())
        factors, norms, num_clipped = _clip_factors(passes, params, config)
        sums = passes.clipped_sums(factors)
        summed = [sums.get(p) for p in params.values()]
    finally:
        passes.remove()
    grads = {}
    for (name, p), grad in zip(params.items(), summed):
        grad = torch.zeros_like(p) if grad is None else (grad.to_dense() if grad.is_sparse else grad)
        grads[name] = grad.detach()
    return DPGradient(grads=grads, per_sample_norms=norms.detach().to(torch.float32),
                      loss_sum=float(losses.detach().sum()), num_samples=num_samples, num_clipped=num_clipped)


class GhostClippingModule(AbstractGradSampleModule):
    """Wrapper for ``mode="ghost"``: computes clipped sums of per-sample gradients, never the
    per-sample gradients themselves (so ``p.grad_sample`` is never set).

    Forward passes and ``loss.backward()`` behave as for the bare model (ordinary ``p.grad``).
    :meth:`dp_gradient` runs the two ghost passes on one batch.

    >>> model = GhostClippingModule(nn.Linear(3, 2), augmentation_multiplicity=2, max_grad_norm=0.1)
    >>> out = model.dp_gradient(torch.randn(4, 3), torch.randn(4, 2), loss_fn=nn.MSELoss())
    >>> bool(out.grads["weight"].norm() <= 2 * 0.1 + 1e-5)
    True
    """

    def __init__(self, module: nn.Module, *, batch_first: bool = True,
                 loss_reduction: str | LossReduction = "mean", augmentation_multiplicity: int = 1,
                 max_grad_norm: float = 1.0, clipping: str | Clipping = Clipping.FLAT,
                 per_layer_max_grad_norms: tuple[float, ...] | None = None) -> None:
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction,
                         augmentation_multiplicity=augmentation_multiplicity)
        _check_supported(module)
        self.config = DPConfig(mode=GradSampleMode.GHOST, augmentation_multiplicity=augmentation_multiplicity,
                               loss_reduction=self.loss_reduction, batch_first=self.batch_first,
                               max_grad_norm=max_grad_norm, clipping=clipping,
                               per_layer_max_grad_norms=per_layer_max_grad_norms)

    def dp_gradient(self, inputs: Any, targets: Any, *, loss_fn: LossFn | nn.Module) -> DPGradient:
        """:func:`ghost_dp_gradient` of the wrapped model with this wrapper's configuration."""
        return ghost_dp_gradient(self._module, inputs, targets, loss_fn=loss_fn, config=self.config)

    def grad_samples(self) -> dict[str, torch.Tensor | None]:
        """Not available: ghost clipping never materialises per-sample gradients."""
        raise ConfigError("GhostClippingModule.grad_samples: mode 'ghost' never materialises per-sample "
                          "gradients; call .dp_gradient(inputs, targets, loss_fn=...) for the clipped sum, "
                          "or wrap with mode='hooks'/'functorch'/'ew'")
