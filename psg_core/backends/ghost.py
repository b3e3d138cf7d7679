"""The ghost backend: per-sample gradient norms without per-sample gradients, then the clipped sum.

One backward pass of ``sum_n loss_n`` (sample n's loss over its K rows) with hooks that turn each
layer's activations ``a`` and output gradients ``g`` into per-sample squared norms:

* a layer with a registered ghost norm (:mod:`psg_core.grad_sample.ghost_norm`, registered beside
  each family's grad sampler: ``nn.Linear``, transformers' ``Conv1D``, ``nn.Embedding``, the
  convolutions through their im2col patches): sample n's weight gradient is
  ``sum_t g_t a_t^T`` over its ``T = K * positions`` rows, and
  ``||sum_t g_t a_t^T||^2 = sum_{s,t} (a_s . a_t)(g_s . g_t)``, two ``(T, T)`` Gram matrices
  instead of the ``(d_out, d_in)`` gradient ("ghost norm", Li et al. 2022); an embedding has
  ``[token_s == token_t]`` for ``a_s . a_t``;
* per layer, whichever is cheaper (the family's cost rule): the Gram pair (``2 * G * T^2``
  numbers) or the materialised per-sample gradient (``weight.numel()`` numbers per sample); a
  family may decide with a single call's tensors in hand instead (the convolutions time the two,
  see :mod:`psg_core.grad_sample.conv_strategy`);
* every other layer (norms, attention biases, custom modules) materialises its small per-sample
  gradient through its registered grad sampler, or the per-layer ``torch.func`` fallback.

A module called several times (a recurrent cell, a shared block) concatenates its calls along the
T axis, so its norm is the norm of the summed gradient. A weight shared by several modules (GPT-2's
LM head tied to its token table) keeps its ghost norm when every owner's family declares where its
factors lie in the weight (:class:`~psg_core.grad_sample.ghost_norm.WeightLayout`): the owners'
factors are held until the last owner's are in, and the norm of their summed gradient is taken
with the cross terms between owners (:func:`~psg_core.grad_sample.ghost_norm.shared_sq_norms`:
an embedding table against a ``(V, d)`` LM head is an ``(N, T, T')`` gather, never the
``(N, V, d)`` gradient); the owners decide together, with the family cost rule over all their
rows. Otherwise (an owner without a ghost norm, a table of KEYED entries beside a matrix product,
a weight also reached through a batch-free tensor) the shared weight is materialised.

The pass asks autograd only for the gradients of the earliest hooked layer outputs, so no
parameter gradient is computed in it, and the graph is freed as it goes.

The clipped sum ``sum_n c_n grad(loss_n)`` then comes from what the pass kept ("book-keeping",
Bu et al. 2023), not from a second backward pass:

* a ghost layer keeps each call's activations and output gradients; its weight's sum is the
  layer's own weight gradient with output-gradient row r scaled by the factor of r's sample (its
  family's ``weight_sum``: one matmul or conv weight-gradient kernel); a lookup table's comes from
  the factors its norm used (each entry's gradient row, scaled, ``index_add``-ed into its table
  row); a weight shared by several ghost layers adds up its owners' sums;
* every other parameter keeps its materialised per-sample gradient, contracted with the factors.

Each parameter may have its own factors, so ``per_layer`` clipping costs the same as ``flat`` and
``automatic``.

Per-sample gradients are never returned: ``per_sample_gradients(mode="ghost")`` raises; use
:func:`ghost_dp_gradient` (or :func:`psg_core.dp_gradient` with ``DPConfig(mode="ghost")``).
Parameters must be used through their own module's ``forward`` (as for the hooks backend).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

import psg_core.native as native
from psg_core._host import host_float, host_int
from psg_core._module_hooks import ModuleHooks
from psg_core.backends.base import (AbstractGradSampleModule, backward_to_edges, on_output_grads,
                                    trainable_parameters)
from psg_core.backends.capture import (LayerCall, call_grad_samples, capture_call, runs_in_fallback, runs_whole,
                                      separate_outputs)
from psg_core.clipping import clip_factors, count_dropped, dropped_samples, kept_sum, weighted_sum, zero_dropped
from psg_core.config import DPConfig, DPGradient
from psg_core.errors import BatchLayoutError, ConfigError, UnsupportedModuleError
from psg_core.grad_sample.ghost_norm import (GHOST_NORMS, FactorKind, GhostFactors, GhostNormEntry, TensorMemo,
                                             WeightLayout, can_share, gram_dtype, shared_sq_norms)
from psg_core.layout import BatchLayout, ModelInputs
from psg_core.losses import LossFn, as_unreduced, loss_batch_dim, per_sample_loss
from psg_core.modes import Clipping, GradSampleMode, LossReduction
from psg_core.precision import (accumulation_dtype, as_dtype, at_least_single, compute_dtype, no_autocast, norm_dtype,
                                to_compute, with_loss_scale)
from psg_core.provenance import BatchTracker, MeetingPoint, recomputing
from psg_core.support import exclusive, hooked_modules, modules_of, own_parameters, reject_per_layer_unsupported

__all__ = ["GhostClippingModule", "ghost_dp_gradient", "ghost_norm_layers"]

_WHERE = "ghost_dp_gradient"


def ghost_norm_layers() -> tuple[type[nn.Module], ...]:
    """Layer types whose weight norm the ghost backend can get from Gram matrices: those
    registered with :func:`psg_core.register_ghost_norm` by type."""
    return tuple(GHOST_NORMS)


def _ghost_is_cheaper(layer: nn.Module, positions: int) -> bool:
    """The layer family's cost rule: Gram matrices over ``positions`` rows per sample, or the
    materialised per-sample weight (see :meth:`GhostNormEntry.is_cheaper`)."""
    norm = GHOST_NORMS.lookup(layer)
    return norm is not None and norm.is_cheaper(layer, positions)


# ------------------------------------------------------------------------------ bookkeeping
#: up to this many materialised norms, each is squared on its own (batching them costs ~4 ops)
_SQUARED_ONE_BY_ONE = 4

@dataclass
class _Call:
    """One forward call of a hooked layer, with its ghost norm and positions (None: not a
    ghost call)."""

    captured: LayerCall
    norm: GhostNormEntry | None
    positions: int | None

    @property
    def layer(self) -> nn.Module:
        return self.captured.layer


@dataclass
class _LayerState:
    #: the layer's own parameters (read once per pass, not per call)
    params: tuple[torch.Tensor, ...] = ()
    #: the precision its per-sample arithmetic runs in (:func:`~psg_core.precision.layer_dtype`)
    dtype: torch.dtype = torch.float32
    calls: list[_Call] = field(default_factory=list)
    arrived: int = 0
    ghost: bool | None = None  # decided at the first backward of the layer
    norm: GhostNormEntry | None = None  # set when ghost
    buffer: list[GhostFactors] = field(default_factory=list)
    #: a ghost layer's batch-first ``(activations, output gradients)`` per call (a lookup table's
    #: ``(factors, output gradients)``), kept for its weight's clipped sum once the clipping
    #: factors are known.
    kept: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    done: bool = False


class _GhostBookkeeping:
    """Forward hooks on every module with trainable parameters; in the one backward pass, the
    per-sample squared norms and what the clipped sums need; then the sums."""

    def __init__(self, module: nn.Module, layout: BatchLayout) -> None:
        self.K, self.rows, self.num_samples = layout.augmentation_multiplicity, layout.rows, layout.num_samples
        self.batch_dim = layout.batch_dim
        # Parameters reached through a batch-free tensor meeting the batch (see
        # psg_core.provenance): materialised, and their norms taken once the pass is over.
        self._via_meetings: set[torch.Tensor] = set()
        self._in_backward = False  # the gradient hooks act only inside backward()
        self._suspended = False
        self._module = module
        self._names: dict[int, str] | None = None  # module id -> path, listed when a message needs one
        self._layers: dict[nn.Module, _LayerState] = {}
        self._owners_left: dict[torch.Tensor, int] = {}  # counts down as owning layers finish
        self._owner_layers: dict[torch.Tensor, list[nn.Module]] = {}
        self._handles: list[Any] = []  # the output gradients' tensor hooks
        self._module_hooks = ModuleHooks()
        for _, layer in hooked_modules(module):
            params = own_parameters(layer)
            own = [p for p in params if p.requires_grad]
            if own:
                self._layers[layer] = _LayerState(params=params, dtype=compute_dtype(params))
                for p in own:
                    self._owners_left[p] = self._owners_left.get(p, 0) + 1
                    self._owner_layers.setdefault(p, []).append(layer)
                self._module_hooks.forward(layer, self._capture, with_kwargs=True, prepend=True)
        self._owners = dict(self._owners_left)
        # A weight of several modules: whether its owners take its norm from their factors
        # (decided once, at the first owner's backward), and each finished owner's factors.
        self._shared_plans: dict[torch.Tensor, bool] = {}
        self._shared_factors: dict[torch.Tensor, list[tuple[WeightLayout, GhostFactors]]] = {}
        self.edges: list[GradientEdge] = []
        # norms in (at least) fp32: the promotion of fp32 and the trainable parameters' dtypes
        self.norm_dtype = norm_dtype(p.dtype for p in self._owners_left)
        # (N,) per parameter, summed as the contributions come (a parameter no call reached has
        # none: zero norm, see sq_norm).
        self.sq_norms: dict[torch.Tensor, torch.Tensor] = {}
        # (N, *shape) per-sample gradients of the parameters that are not ghost weights.
        self._materialised: dict[torch.Tensor, torch.Tensor] = {}
        # (N,) norms, not squared, of the materialised parameters that have no other contribution:
        # squared together when the total is read (see total_sq_norm).
        self._norms: dict[torch.Tensor, torch.Tensor] = {}
        # The latest output gradient's Gram matrix, by the tensor it came from: layers fed one
        # output gradient (a DP LSTM's ih and hh, normed one after the other) compute it once;
        # one held at a time (a long sequence's Gram is large).
        self._grams = TensorMemo(capacity=1)
        # The latest activation's Gram matrix likewise: layers that read one input (an attention
        # block's query, key and value projections, normed one after the other) compute it once.
        self._left_grams = TensorMemo(capacity=1)

    def _name(self, layer: nn.Module) -> str:
        """``'path' (Type)`` of a layer, for messages (the names are listed at the first one asked:
        a model whose layers all take ghost norms never lists them)."""
        if self._names is None:
            self._names = {id(m): p for p, m in modules_of(self._module)}  # (the step's walk, when held)
        return f"'{self._names.get(id(layer), '?') or '<root>'}' ({type(layer).__qualname__})"

    def remove(self) -> None:
        """Removes the hooks and drops everything the pass held.

        The gradient hooks live on autograd nodes that ``self.edges`` keeps alive, and they refer
        back to this object: a cycle through C++ objects that Python's garbage collector cannot
        see, so it is cut here, or every step would leak its activations.
        """
        self._module_hooks.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.edges.clear()
        self._layers.clear()
        self._materialised.clear()
        self._norms.clear()
        self._shared_factors.clear()
        self._grams.clear()
        self._left_grams.clear()

    @contextlib.contextmanager
    def _suspend(self) -> Iterator[None]:
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    # ---------------------------------------------------------------------------- forward
    def _capture(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        with torch._C.DisableTorchFunction():  # the hook's own reads need no tracking (see hooks.py)
            return self._capture_call(layer, args, kwargs, output)

    def _capture_call(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """Records the call; returns the output that replaces the module's (see
        :func:`~psg_core.backends.capture.separate_outputs`), or None."""
        if self._suspended or not torch.is_grad_enabled() or recomputing():
            return None
        replaced = separate_outputs(output)
        if replaced is not None:
            output = replaced
        capture = capture_call(layer, args, kwargs, output, self.batch_dim)
        if capture is None:
            return replaced
        captured, outputs = capture
        if captured.rows != self.rows:
            raise BatchLayoutError(
                f"{_WHERE}: module {self._name(layer)} was called with {captured.rows} rows on its batch "
                f"dimension {captured.batch_dim}, but the batch has {self.rows} (N*K); the ghost backend needs "
                "every layer with trainable parameters to see the batch's rows")
        # Gram factors need the layer's one output gradient and its rows on the batch axis.
        # (not for a weight or bias computed at the call, a parametrization's: the family's factors
        # are those of the computed tensor, whose gradient no parameter receives)
        norm = GHOST_NORMS.lookup(layer) if captured.num_outputs == 1 and not captured.computed_weight else None
        if norm is not None and captured.custom_rows and not norm.whole_call:
            norm = None
        first = captured.args[0] if captured.args else None
        positions = (norm.positions(layer, first, output, captured.batch_dim)
                     if norm is not None and isinstance(first, torch.Tensor) else None)
        call = _Call(captured, norm if positions is not None else None, positions)
        self._layers[layer].calls.append(call)
        self.edges.extend(get_gradient_edge(t) for t in outputs)
        self._handles.append(on_output_grads(outputs, functools.partial(self._on_grads, call)))
        return replaced

    def _on_grads(self, call: _Call, grads: Any) -> None:
        if self._in_backward:
            with no_autocast():  # the hook runs inside the caller's autocast region
                self._norm_contribution(call, call.captured.output_grads(list(grads)))

    def on_meeting(self, point: MeetingPoint, view: torch.Tensor) -> None:
        """A batch-free tensor computed from parameters meets the batch (see BatchTracker)."""
        self._via_meetings.update(point.params)

        def on_grads(grads: Any) -> None:
            if self._in_backward and grads[0] is not None:
                with no_autocast():
                    for param, grad_sample in point.per_sample_grads(grads[0], self.num_samples, self.K).items():
                        self._add(param, grad_sample)

        self.edges.append(get_gradient_edge(view))
        self._handles.append(on_output_grads([view], on_grads))

    # ---------------------------------------------------------------------------- backward: norms
    def _plan_ghost(self, layer: nn.Module, state: _LayerState, call: _Call, grad: torch.Tensor | None) -> bool:
        """Gram factors for this layer's weight, or its materialised per-sample gradient?"""
        norm = state.calls[0].norm if state.calls else None
        weight = norm.weight(layer) if norm is not None else None
        owners = self._owners.get(weight, 0) if weight is not None else 0
        if norm is None or any(c.norm is None or c.captured.row_factor > 1 for c in state.calls) \
                or not isinstance(weight, nn.Parameter) or not weight.requires_grad or owners == 0 \
                or weight in self._via_meetings:
            return False  # no ghost norm (or frames merged into the rows: materialised)
        if owners > 1:  # a weight shared with other modules: its owners decide together
            plan = self._shared_plans.get(weight)
            if plan is None:
                plan = self._shared_plans[weight] = self._plan_shared(weight)
            chosen: bool | None = plan
        else:
            # A layer called once may choose with its tensors in hand (the convolutions measure).
            chosen = norm.choose(layer, *self._ghost_inputs(call, grad), self.K) \
                if norm.chooser is not None and len(state.calls) == 1 and grad is not None else None
            if chosen is None:
                chosen = _ghost_is_cheaper(layer, self.K * sum(c.positions or 0 for c in state.calls))
        if not chosen:
            return False
        state.norm = norm
        return True

    def _plan_shared(self, weight: nn.Parameter) -> bool:
        """Gram factors for a weight of several modules: every owner that was called has a ghost
        norm of that weight with a declared layout, the layouts meet (:func:`can_share`), and the
        family cost rule of each holds for the rows of all of them (the cross terms cost less
        than the owners' own Grams). A module's own ``choose`` is not asked: it sees one call."""
        called: list[tuple[nn.Module, GhostNormEntry]] = []
        positions = 0
        for owner in self._owner_layers[weight]:
            calls = self._layers[owner].calls
            if not calls:
                continue  # not called in this pass: no contribution
            norm = calls[0].norm
            if norm is None or any(c.norm is not norm for c in calls) or norm.weight(owner) is not weight:
                return False
            called.append((owner, norm))
            positions += sum(c.positions or 0 for c in calls)
        if not can_share([norm.layout for _, norm in called]):
            return False
        return all(_ghost_is_cheaper(owner, self.K * positions) for owner, _ in called)

    def _ghost_inputs(self, call: _Call, grad: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """A ghost call's batch-first ``(N*K, ...)`` input (the whole call for a ``whole_call``
        family) and output gradient, in the parameters' precision (autocast leaves
        half-precision gradients: see psg_core.precision)."""
        call.captured.check_unchanged(_WHERE)
        bd = call.captured.batch_dim
        dtype = self._layers[call.layer].dtype
        g = cast(torch.Tensor, call.captured.unmerge(grad))
        g = to_compute(g.movedim(bd, 0) if bd else g, dtype)  # (N*K, ...)
        if call.norm is not None and call.norm.whole_call:
            return call.captured, g
        a = call.captured.args[0]
        a = to_compute(a.movedim(bd, 0) if bd else a, dtype)  # (N*K, ...)
        return a, g

    def _norm_contribution(self, call: _Call, grads: list[torch.Tensor | None]) -> None:
        layer, state = call.layer, self._layers[call.layer]
        if state.done:
            raise ConfigError(f"{_WHERE}: module {self._name(layer)} received gradients after its "
                              "norms were computed; the model must be backpropagated once per pass")
        state.arrived += 1
        if state.ghost is None:
            state.ghost = self._plan_ghost(layer, state, call, grads[0])
        if state.ghost and state.norm is not None and grads[0] is not None:
            a, g = self._ghost_inputs(call, grads[0])  # (N*K, ...) each
            with no_autocast():
                factors, others = state.norm.fn(layer, a, g, self.K)
            for param, grad_sample in others.items():  # e.g. a bias, small: materialised
                if param.requires_grad:
                    if not any(param is own for own in state.params):
                        # a family's gradient of a tensor that is not one of the layer's parameters
                        # would be dropped here, and its share of the norm with it: never silently
                        raise UnsupportedModuleError(
                            f"{_WHERE}: module {self._name(layer)}: its ghost norm gave a gradient for a "
                            "tensor that is not one of its parameters (a computed weight or bias?); use "
                            "mode='hooks' for this model")
                    self._add(param, grad_sample)
            state.buffer.append(factors)
            # A lookup table's clipped sum comes from its factors (the entries and their gradient
            # rows), which its norm needed anyway; other families keep the call's input.
            state.kept.append((factors if state.norm.sums_from_factors else a, g))
        else:
            # Materialised per-sample gradients (the Gram matrices would be larger, or the layer
            # has none): the layer's grad sampler, e.g. a grouped-convolution weight gradient
            # for a convolution rather than its unfolded patches.
            grad_samples = call_grad_samples(call.captured, grads, self.K,
                                             where=f"{_WHERE} (module {self._name(layer)})",
                                             suspend=self._suspend())
            for param, grad_sample in grad_samples.items():
                if param.requires_grad:
                    self._add(param, grad_sample)
        if state.arrived == len(state.calls) and not any(p in self._via_meetings for p in state.params):
            self.finish_layer(layer)

    def _add_sq_norm(self, param: torch.Tensor, sq_norm: torch.Tensor) -> None:
        pending = self._norms.pop(param, None) if self._norms else None
        current = self.sq_norms.get(param) if pending is None else pending.square()
        sq_norm = as_dtype(sq_norm, self.norm_dtype)
        self.sq_norms[param] = sq_norm if current is None else current + sq_norm

    def sq_norm(self, param: torch.Tensor) -> torch.Tensor:
        """``(N,)`` squared norms of ``param``'s per-sample gradients (zeros where no call reached it)."""
        pending = self._norms.get(param) if self._norms else None
        if pending is not None:
            return pending.square()
        current = self.sq_norms.get(param)
        return torch.zeros(self.num_samples, dtype=self.norm_dtype, device=param.device) if current is None else current

    def total_sq_norm(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """``(N,)``: the sum of :meth:`sq_norm` over ``params``, the materialised parameters' norms
        squared together (one product for all of them, not one square each: on a GPU every op
        is a launch the host pays for)."""
        params = list(params)
        norms = [self._norms[p] for p in params if p in self._norms] if self._norms else []
        if len(norms) <= _SQUARED_ONE_BY_ONE:
            return torch.stack([self.sq_norm(p) for p in params], 1).sum(1)
        squared = [self.sq_norm(p) for p in params if p not in self._norms]
        stacked = torch.stack(norms, 1)  # (N, P')
        total = (stacked * stacked).sum(1)
        return total if not squared else torch.stack(squared, 1).sum(1) + total

    def _add(self, param: torch.Tensor, grad_sample: torch.Tensor) -> None:
        current = self._materialised.get(param)
        self._materialised[param] = grad_sample if current is None else current + grad_sample

    def finish_layer(self, layer: nn.Module) -> None:
        """All of a layer's calls are in (or the backward pass is over): turn what it holds
        into norms."""
        state = self._layers[layer]
        if state.done:
            return
        state.done = True
        norm = state.norm
        weight = norm.weight(layer) if norm is not None else None
        if state.buffer and norm is not None and weight is not None:  # only ghost layers buffer factors
            factors, state.buffer = GhostFactors.concat(state.buffer), []
            if self._owners[weight] > 1:  # normed with the other owners' once they are in
                self._shared_factors.setdefault(weight, []).append((cast(WeightLayout, norm.layout), factors))
            else:
                self._add_sq_norm(weight, factors.sq_norms(self.norm_dtype, self._grams, self._left_grams))
        for param in state.params:
            if not param.requires_grad:
                continue
            left = self._owners_left[param] - 1
            self._owners_left[param] = left
            if left:
                continue  # another owner is still to finish
            shared = self._shared_factors.pop(param, None) if self._shared_factors else None
            if shared:
                # (its cross terms' Grams in float64 too, see gram_dtype)
                self._add_sq_norm(param, shared_sq_norms(shared, param.shape, gram_dtype(self.norm_dtype)))
            grad_sample = self._materialised.get(param)
            if grad_sample is not None:
                flat = grad_sample.reshape(self.num_samples, -1)  # (N, numel)
                # a reduction in the norms' dtype: no (N, numel) product or cast, whose fresh pages
                # would cost more than the arithmetic (a CNN's materialised conv weights: 37 MB a step)
                norm = torch.linalg.vector_norm(flat, dim=1, dtype=self.norm_dtype)
                if param in self.sq_norms:  # it has Gram contributions too: summed squared
                    self._add_sq_norm(param, norm.square())
                else:  # squared with the others' when the total is read (total_sq_norm)
                    self._norms[param] = norm

    def backward(self, total_loss: torch.Tensor) -> None:
        """The one backward pass: ``total_loss`` through the hooked outputs only (no parameter
        gradient is computed, the graph is freed as it goes); leaves the squared norms and what
        :meth:`clipped_sums` needs."""
        self._in_backward = True
        try:
            if self.edges:
                backward_to_edges(total_loss, self.edges, where=_WHERE)
            with no_autocast():
                for layer in self._layers:
                    self.finish_layer(layer)
        finally:
            self._in_backward = False
            self._grams.clear()
            self._left_grams.clear()

    # ---------------------------------------------------------------------------- clipped sums
    def clipped_sums(self, factors: dict[torch.Tensor, torch.Tensor], dropped: torch.Tensor | None
                     ) -> dict[torch.Tensor, torch.Tensor]:
        """``sum_n factors[p][n] * grad_n(p)`` for every parameter, from what the pass kept.

        Materialised per-sample gradients are contracted with their factors; a ghost weight's
        sum is its layer's weight gradient with each output-gradient row scaled by its sample's
        factor ("book-keeping", Bu et al. 2023): one weight-gradient kernel per call instead of a
        second backward pass through the whole model. Frees what it used.

        Half-precision layers are scaled and summed in float32 (a factor, or a row times it, would
        underflow float16): the sums are in :func:`~psg_core.precision.accumulation_dtype` of
        their parameters' dtype, cast to it by the caller once.
        """
        sums: dict[torch.Tensor, torch.Tensor] = {}
        for param, grad_sample in self._materialised.items():
            sums[param] = weighted_sum(factors[param], zero_dropped(grad_sample, dropped))  # param.shape
        self._materialised = {}
        # Output gradients scaled by their rows' factors, by (gradient, factors): layers fed one
        # output gradient (a DP LSTM's ih and hh) under one factor vector scale it once.
        scaled_grads = TensorMemo(capacity=1)
        for layer, state in self._layers.items():
            norm = state.norm  # set for the ghost layers, the only ones that keep calls
            weight = norm.weight(layer) if norm is not None else None
            if not state.kept or norm is None or weight is None:
                continue
            sample_factors = factors[weight]
            for a, g, calls in _stacked_calls(state.kept):
                total = self._weight_sum(layer, norm, weight, a, g, calls, factors=sample_factors,
                                         dropped=dropped, scaled_grads=scaled_grads)
                # (a family's weight_sum returns the weight's dtype: the calls add up in float32)
                total = as_dtype(total, accumulation_dtype(weight.dtype))
                current = sums.get(weight)
                sums[weight] = total if current is None else current + total
            state.kept = []
        return sums

    def _weight_sum(self, layer: nn.Module, norm: GhostNormEntry, weight: torch.Tensor, a: Any, g: torch.Tensor,
                    calls: int, *, factors: torch.Tensor, dropped: torch.Tensor | None,
                    scaled_grads: TensorMemo) -> torch.Tensor:
        """``calls`` stacked calls' share of ``weight``'s clipped sum, from their kept input (a
        lookup table's factors) and output gradient, each sample's rows under its factor.

        A half-precision layer's rows are scaled in float32 (:func:`_scale_rows`), and its other
        operand is cast to float32 too: the family's kernel multiplies and sums in float32."""
        if isinstance(a, GhostFactors):
            return _table_sum(a, factors, dropped, weight)
        assert norm.weight_sum is not None  # every family but the tables has one
        scale = functools.partial(_scale_rows, factors=factors, K=self.K, calls=calls, dropped=dropped)
        floating = isinstance(a, torch.Tensor) and a.is_floating_point()
        if dropped is None and norm.linear_in_input and floating and a.numel() < g.numel():
            # The input's rows are fewer numbers to scale (a Linear widening its input, a recurrent
            # layer's input and state beside its gates' gradient, a first conv).
            return norm.weight_sum(layer, scale(a), as_dtype(g, accumulation_dtype(g.dtype)))
        scaled = scaled_grads.get(g, scale, id(factors), calls)
        if dropped is not None and floating:
            # an overflowing input row: inf * 0 would be NaN
            a = zero_dropped(a, dropped.repeat_interleave(self.K).repeat(calls))  # (calls*N*K,)
        return norm.weight_sum(layer, as_dtype(a, scaled.dtype) if floating else a, scaled)


def _scale_rows(g: torch.Tensor, *, factors: torch.Tensor, K: int, calls: int, dropped: torch.Tensor | None
                ) -> torch.Tensor:
    """Rows ``(calls*N*K, ...)`` of an output gradient or an input (``calls`` stacked calls, each
    ``N*K`` rows sample by sample) scaled by their sample's factor from ``(N,)`` ``factors`` (a
    dropped sample's rows zeroed): broadcast over a view that splits the rows, never a per-row
    copy of the factors. In :func:`~psg_core.precision.accumulation_dtype` (half-precision rows
    in float32: a factor below ~6e-5, or a row times it, would underflow float16)."""
    samples = factors.shape[0]
    dtype = accumulation_dtype(g.dtype)
    weights = as_dtype(factors, dtype)
    if calls == 1 and K == 1 and dropped is None:  # one row per sample
        return as_dtype(g, dtype) * weights.view((samples,) + (1,) * (g.dim() - 1))
    rows = g.unflatten(0, (calls, samples, K))  # a view: splitting one axis needs no copy
    shape = (1, samples, 1) + (1,) * (g.dim() - 1)
    if dropped is not None:
        rows = zero_dropped(rows.transpose(0, 1), dropped).transpose(0, 1)  # samples first for it
    return (as_dtype(rows, dtype) * weights.view(shape)).flatten(0, 2)


def _table_sum(factors: GhostFactors, sample_factors: torch.Tensor, dropped: torch.Tensor | None,
               weight: torch.Tensor) -> torch.Tensor:
    """``sum_n c_n grad_n`` of a lookup table from its INDEX or KEYED factors (a family with a
    table layout, :attr:`GhostNormEntry.sums_from_factors`): each entry's gradient
    row, scaled by its sample's factor (zero for a dropped sample: its rows may hold inf), added
    into the entry's table row. The ``(V, d)`` sum, in the weight's
    :func:`~psg_core.precision.accumulation_dtype` (a half-precision table's rows are scaled and
    added in float32: a factor below ~6e-5 would underflow float16)."""
    dtype = accumulation_dtype(factors.right.dtype)
    out_dtype = accumulation_dtype(weight.dtype)
    if factors.kind is FactorKind.KEYED and factors.source is not None and factors.weight is not None:
        # Weighted rows of the samples' own rows (EmbeddingBag: each token's bag gradient): each
        # entry's scale folds its weight and its sample's factor.
        entry_weight, sample_factors = as_dtype(factors.weight, dtype), as_dtype(sample_factors, dtype)
        right = as_dtype(factors.right, dtype)  # (N*K, d)
        if right.device.type == "cpu":
            # psg's native kernel: one pass over the entries, a dropped sample's (factor 0) left out
            total = native.keyed_table_sum(factors.left, factors.source, entry_weight, right,
                                           sample_factors, weight.shape[0])
            if total is not None:
                return as_dtype(total, out_dtype)
        if dropped is None:
            # One (M, d) buffer in all. Every sample's norm is finite here, so a row holding inf
            # or NaN has weight 0 in all of its sample's entries (an empty bag's): it adds
            # nothing, and must not add 0 * inf.
            right = torch.nan_to_num(right, nan=0.0, posinf=0.0, neginf=0.0)  # (N*K, d)
            scale = entry_weight * sample_factors[factors.left[0]]  # (M,)
            scaled = right.index_select(0, factors.source).mul_(scale[:, None])  # (M, d)
            total = right.new_zeros(weight.shape).index_add_(0, factors.left[1], scaled)  # (V, d)
            return as_dtype(total, out_dtype)
    if factors.kind is FactorKind.KEYED:
        samples, rows, right = factors.left[0], factors.left[1], factors.entries()  # (M,), (M,), (M, d)
    else:
        tokens, right = factors.left, factors.right  # (N, T), (N, T, d)
        samples = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(tokens).reshape(-1)
        rows, right = tokens.reshape(-1), right.reshape(-1, right.shape[-1])  # (N*T,), (N*T, d)
    right = as_dtype(right, dtype)
    scale = as_dtype(sample_factors, dtype)[samples][:, None]  # (M, 1)
    scaled = right * scale if dropped is None else torch.where(dropped[samples][:, None], 0, right * scale)
    total = right.new_zeros(weight.shape).index_add_(0, rows, scaled)  # (V, d)
    return as_dtype(total, out_dtype)


def _stacked_calls(kept: list[tuple[Any, torch.Tensor]]) -> Iterator[tuple[Any, torch.Tensor, int]]:
    """A layer's kept ``(input, output gradient)`` calls, those of one shape stacked along the rows:
    ``weight_sum`` is a sum over rows, so one kernel over ``calls * N*K`` rows replaces one small
    kernel and one accumulation per call (a recurrent cell's T steps). Yields ``(a, g, calls)``."""
    groups: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for a, g in kept:
        if not isinstance(a, torch.Tensor):  # a whole call (EmbeddingBag): summed one by one
            yield a, g, 1
            continue
        groups.setdefault((a.shape, a.dtype, g.shape, g.dtype), []).append((a, g))
    for group in groups.values():
        if len(group) == 1:
            yield group[0][0], group[0][1], 1
        else:
            yield torch.cat([a for a, _ in group]), torch.cat([g for _, g in group]), len(group)


# ------------------------------------------------------------------------------ entry point
def _check_supported(module: nn.Module) -> None:
    reject_per_layer_unsupported(module, where=_WHERE)


def _clip_factors(bookkeeping: _GhostBookkeeping, params: dict[str, nn.Parameter], config: DPConfig,
                  loss_scale: float = 1.0) -> tuple[dict[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Each parameter's ``(N,)`` clipping factors, the ``(N,)`` total norms and the ``(N,)`` bool
    of the samples scaled down."""
    names = list(params)
    layer_norms = total = None
    if config.clipping is Clipping.PER_LAYER:
        squared = torch.stack([bookkeeping.sq_norm(params[n]) for n in names], 1)  # (N, P)
        layer_norms = squared.sqrt() if loss_scale == 1.0 else squared.sqrt() / loss_scale
    else:  # the total norm from the squared ones, no per-layer norm taken
        summed = bookkeeping.total_sq_norm(params.values())  # (N,)
        total = summed.sqrt() if loss_scale == 1.0 else summed.sqrt() / loss_scale
    factors, norms, clipped = clip_factors(layer_norms, names, max_grad_norm=config.max_grad_norm,
                                           clipping=config.clipping,
                                           per_layer_max_grad_norms=config.per_layer_max_grad_norms, norms=total)
    by_param: dict[torch.Tensor, torch.Tensor]
    if config.clipping is Clipping.PER_LAYER:
        by_param = {params[n]: factors[:, i] for i, n in enumerate(names)}
    else:
        by_param = {p: factors for p in params.values()}
    return by_param, norms, clipped


@dataclass
class _Attempt:
    """One ghost pass at one loss scale (see :func:`~psg_core.precision.with_loss_scale`): the
    clipped sums of the samples it included, unscaled, in their parameters'
    :func:`~psg_core.precision.accumulation_dtype`, and per sample what merging passes needs."""

    grads: dict[str, torch.Tensor]
    norms: torch.Tensor  # (N,) float32
    clipped: torch.Tensor  # (N,) bool: scaled down (finite samples only)
    dropped: torch.Tensor | None  # (N,) bool: not finite, left out of the sums; None: none
    losses: torch.Tensor  # (N,) unscaled

    def merged(self, new: _Attempt, take: torch.Tensor) -> _Attempt:
        """This attempt with the ``take`` samples of ``new`` (a pass that summed only those)."""
        return _Attempt(grads={name: g + new.grads[name] for name, g in self.grads.items()},
                        norms=torch.where(take, new.norms, self.norms),
                        clipped=torch.where(take, new.clipped, self.clipped),
                        dropped=None if self.dropped is None else self.dropped & ~take, losses=self.losses)

    def result(self, params: dict[str, nn.Parameter]) -> DPGradient:
        return DPGradient(grads={name: as_dtype(g, params[name].dtype) for name, g in self.grads.items()},
                          per_sample_norms=self.norms, loss_sum=host_float(kept_sum(self.losses, self.dropped)),
                          num_samples=int(self.norms.shape[0]), num_clipped=host_int(self.clipped.sum()),
                          num_dropped=count_dropped(self.dropped))


def ghost_dp_gradient(module: nn.Module, inputs: Any, targets: Any, *, loss_fn: LossFn | nn.Module,
                      config: DPConfig, layout: BatchLayout | None = None) -> DPGradient:
    """Clipped sum of per-sample gradients by ghost clipping: norms first, then the sum.

    Equal (up to floating point) to clipping the per-sample gradients of any other backend with
    :func:`psg_core.clip_and_sum`, but it holds no ``(N, *param.shape)`` tensor for the layers
    where the Gram matrices are cheaper. ``config.mode`` is not consulted; ``noise_multiplier``
    is ignored (noise is added once per step, elsewhere). Under fp16 autocast the backward pass
    runs on a scaled loss (see :func:`psg_core.precision.with_loss_scale`): where a sample
    overflows, the pass is run again at lower scales, each summing only the samples still
    without a finite result (the others' factors 0), and the sums add up.

    Args:
        module: the model; ``p.grad`` and ``p.grad_sample`` are left untouched.
        inputs: a tensor, a tuple of positional arguments or a mapping of keyword arguments with
            ``N*K`` rows, sample-major.
        targets: ``N*K`` rows, same layout.
        loss_fn: returns the unreduced loss (a torch loss module of any reduction is accepted).
        config: K, reduction, batch_first, max_grad_norm and clipping rule.
        layout: the batch's layout when the caller validated it already (:func:`psg_core.dp_gradient`
            does, with ``inputs`` parsed into :class:`~psg_core.layout.ModelInputs`).

    Returns:
        :class:`~psg_core.config.DPGradient` keyed by ``named_parameters()`` names.

    >>> from psg_core.config import DPConfig
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> out = ghost_dp_gradient(model, torch.randn(6, 4), torch.randn(6, 1), loss_fn=nn.MSELoss(),
    ...                         config=DPConfig(mode="ghost", max_grad_norm=0.5, augmentation_multiplicity=2))
    >>> out.num_samples, out.per_sample_norms.shape, out.grads["0.weight"].shape
    (3, torch.Size([3]), torch.Size([8, 4]))
    """
    with exclusive(module):  # one thread at a time on a model (see psg_core.support.exclusive)
        attempt = with_loss_scale(
            lambda scale, pending: _ghost_dp_gradient(module, inputs, targets, loss_fn=loss_fn, config=config,
                                                      loss_scale=scale, pending=pending, layout=layout),
            lambda attempt: attempt.norms < math.inf,  # (a norm is >= 0: isfinite in one comparison)
            lambda kept, new, take: kept.merged(new, take))
        return attempt.result(trainable_parameters(module))


def _ghost_dp_gradient(module: nn.Module, inputs: Any, targets: Any, *, loss_fn: LossFn | nn.Module,
                       config: DPConfig, loss_scale: float, pending: torch.Tensor | None,
                       layout: BatchLayout | None) -> _Attempt:
    """One attempt of :func:`ghost_dp_gradient` with the backward pass's loss scaled by
    ``loss_scale``, summing the ``pending`` samples only (None: all)."""
    if not isinstance(config, DPConfig):
        raise ConfigError(f"{_WHERE}: config must be a DPConfig, got {type(config).__name__}")
    _check_supported(module)
    loss_fn = as_unreduced(loss_fn)
    model_inputs = ModelInputs.parse(inputs, where=_WHERE)
    if layout is None or not isinstance(inputs, ModelInputs):
        layout = BatchLayout.of_call(model_inputs, targets, augmentation_multiplicity=config.augmentation_multiplicity,
                                     batch_first=config.batch_first, where=_WHERE)
    num_samples = layout.num_samples
    params = trainable_parameters(module)
    if num_samples == 0 or not params:
        with torch.no_grad():
            losses = torch.zeros(0) if num_samples == 0 else at_least_single(per_sample_loss(
                loss_fn(module(*model_inputs.args, **model_inputs.kwargs), targets), num_samples=num_samples,
                batch_dim=layout.batch_dim, reduction=config.loss_reduction))
        return _Attempt(grads={n: torch.zeros_like(p) for n, p in params.items()},
                        norms=torch.zeros(num_samples), clipped=torch.zeros(num_samples, dtype=torch.bool),
                        dropped=None, losses=losses)
    bookkeeping = _GhostBookkeeping(module, layout)
    try:
        with BatchTracker(module, num_samples=num_samples, augmentation_multiplicity=layout.augmentation_multiplicity,
                          on_meeting=bookkeeping.on_meeting, meets_own=runs_in_fallback,
                          keeps_state=runs_whole) as tracker:
            for tensor, dim in model_inputs.batch_tensors(layout):
                tracker.mark(tensor, dim)
            tracker.mark_targets(targets, layout)
            per_element = loss_fn(module(*model_inputs.args, **model_inputs.kwargs), targets)
            if per_element.dim():
                tracker.check_rows(per_element, "the loss")
            loss_dim = loss_batch_dim(per_element, layout.batch_dim, tracker.batch_dim(per_element))
            tracker.release()
        # A half-precision loss is reduced and scaled in float32: float16 times the loss scale would
        # overflow (the gradient reaching it, the scale at most, is representable: INITIAL_LOSS_SCALE).
        losses = per_sample_loss(at_least_single(per_element), num_samples=num_samples, batch_dim=loss_dim,
                                 reduction=config.loss_reduction)  # (N,)
        bookkeeping.backward(losses.sum() * loss_scale if loss_scale != 1.0 else losses.sum())
        with no_autocast():
            factors, norms, clipped = _clip_factors(bookkeeping, params, config, loss_scale)
            dropped = dropped_samples(norms)  # not finite: factor 0, rows zeroed, counted
            # A later pass of with_loss_scale sums only the samples still pending (the others
            # were summed at a higher scale): left out like dropped ones.
            left_out = dropped if pending is None else ~pending if dropped is None else dropped | ~pending
            if loss_scale != 1.0:
                # the sums unscaled through their factors (shared by the parameters of flat clipping):
                # a sum of scaled rows could overflow a half-precision kernel's output
                unscaled: dict[int, torch.Tensor] = {}
                for f in factors.values():
                    if id(f) not in unscaled:
                        unscaled[id(f)] = f / loss_scale
                factors = {p: unscaled[id(f)] for p, f in factors.items()}
            sums = bookkeeping.clipped_sums(factors, left_out)
        summed = [sums.get(p) for p in params.values()]
    finally:
        bookkeeping.remove()
    grads = {}
    for (name, p), grad in zip(params.items(), summed):
        grad = torch.zeros_like(p) if grad is None else (grad.to_dense() if grad.is_sparse else grad)
        # contiguous: a clipped sum may be a transposed view (psg_core.gemm.mm_tn), made dense
        # here (by psg's tiled copy), once the pass's activations are freed
        grads[name] = native.contiguous(grad.detach() if grad.requires_grad else grad)
    return _Attempt(grads=grads, norms=as_dtype(norms.detach() if norms.requires_grad else norms, torch.float32),
                    clipped=clipped, dropped=dropped, losses=losses.detach())


class GhostClippingModule(AbstractGradSampleModule):
    """Wrapper for ``mode="ghost"``: computes clipped sums of per-sample gradients, never the
    per-sample gradients themselves (so ``p.grad_sample`` is never set).

    Forward passes and ``loss.backward()`` behave as for the bare model (ordinary ``p.grad``).
    :meth:`dp_gradient` runs ghost clipping on one batch: one backward pass with book-keeping.

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
