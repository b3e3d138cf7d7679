"""Which tensors carry the batch: followed through the forward pass, never guessed from a size.

:class:`BatchTracker` is a ``TorchFunctionMode`` active while a backend runs the model's forward
pass. The caller's batch tensors are marked at the start (see :class:`psg_core.layout.ModelInputs`);
every torch function that receives a batched tensor returns batched tensors, with the position of
the batch axis followed through the common shape ops (views, transposes, indexing, broadcasting,
matmul, reductions, concatenation). Everything else is *batch-free*: a broadcast position-id row,
T5's ``(T, T)`` bucket matrix, a mask built from ``arange``.

Two things follow from that knowledge:

* A hooked layer called with batch-free inputs (GPT-2's position embedding on ``(1, T)`` ids)
  gets no per-row gradient from its grad sampler, even when one of its sizes equals N*K: its
  output simply stays batch-free.
* Where a batch-free tensor that depends on trainable parameters meets a batched one in a
  broadcasting op (``inputs_embeds + position_embeds``, ``scores + position_bias``), the tracker
  expands it explicitly to the op's shape. The gradient that arrives at the expanded view is then
  per row; summed over each sample's K rows it is that sample's cotangent, and one batched VJP
  (``torch.autograd.grad(..., is_grads_batched=True)``) over the small batch-free subgraph gives
  the per-sample gradients of its parameters. Any other op where that happens raises a
  :class:`~psg_core.errors.UnsupportedModuleError` naming the module: never a silent sum.

Inside the forward of a layer that owns trainable parameters and was called with the batch, the
layer's own parameters meeting the batch is what its grad sampler is for, so it is not a meeting
point.

An op that combines different samples' rows (a reduction, cumulative op, sort or softmax along the
batch axis, a permutation or partial selection of the rows, a product contracting the batch axis,
pairs of rows from two batched operands) marks its outputs :data:`MIXED`, and so does every op fed
one. A hooked layer or a loss that receives a mixed tensor raises
:class:`~psg_core.errors.UnsupportedModuleError` naming the op and module where the samples met:
per-sample gradients are the gradients of each sample alone, which such a forward pass does not
compute. Mixing that never reaches a value (``bool(mask.all())`` to pick a code path) is harmless.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from psg_core._layout import STATE_BATCH_AXIS
from psg_core._module_hooks import ModuleHooks
from psg_core.errors import UnsupportedModuleError
from psg_core.support import (CallState, call_state, is_unit, known_rowwise, modules_of, own_parameters,
                              trainable_parameters)

__all__ = ["rowwise", "rowwise_module", "is_rowwise", "BatchTracker", "MeetingPoint", "active_tracker", "UNKNOWN",
           "MIXED", "GROUPED", "PERMUTED"]

#: The batch axis of a batched tensor whose layout the tracker could not follow.
UNKNOWN = -1
#: The "axis" of a tensor whose values mix samples: an op reduced, reordered, selected or paired the
#: batch's rows (``x - x.mean(0)``, ``cumsum(x, 0)``, ``x.flip(0)``, ``x[mask]``, ``h @ h.T``). A
#: sample's gradient computed alone differs from its share of such a batch: a layer or a loss that
#: receives one is refused (:meth:`BatchTracker.check_rows`), never given a silent answer.
MIXED = -2
#: The "axis" of rows a boolean mask picked from every sample (``h[mask]``): grouped by sample, in
#: order, but how many each sample has is data. A view that gives them back one leading row per
#: batch row (``h[eos].view(B, -1, d)``, as BART's and T5's classification heads do) restores the
#: batch axis; a layer or a loss that receives them as they are is refused.
GROUPED = -3
#: The "axis" of the batch's rows reordered by a sort of the batch (``lengths.sort()``, then
#: ``x.index_select(0, indices)``: what ``pack_padded_sequence(..., enforce_sorted=False)`` does).
#: Packing them is allowed (a PackedSequence keeps its order, and the DP recurrent layers restore
#: it); anything else computed from them mixes samples.
PERMUTED = -4
#: MIXED, where two batched operands put their batch axes on different output axes (internal: the
#: tensor is marked MIXED; the message says what may have caused it).
_PAIRED = -5

_TLS = threading.local()
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
_PLAIN = (torch.Tensor, nn.Parameter)


def active_tracker() -> BatchTracker | None:
    """The tracker of the forward pass running in this thread, if any."""
    stack = getattr(_TLS, "stack", None)
    return stack[-1] if stack else None


_ROWWISE: dict[type, bool] = {}


def rowwise_module(cls: type[nn.Module]) -> type[nn.Module]:
    """Declares that modules of class ``cls`` compute each row of their outputs (axis 0) from the
    same row of their inputs alone, however they get there: the routed experts of a mixture of
    experts sort, gather and scatter the rows of all samples by expert, which the tracker would
    take for mixing. Their calls run untracked and their outputs get their inputs' batch axis.
    Their own trainable parameters (the experts' weights) get per-sample gradients in hooks and
    ghost from one grouped call on per-sample copies of the experts (Hugging Face's experts, see
    :mod:`psg_core.grad_sample.experts`), else from the per-layer ``torch.func`` fallback run on
    each sample's rows alone; one of their submodules may own trainable parameters only where the
    class is also a
    :func:`~psg_core.support.unit_module` (its subtree computed as one call). Returns ``cls``
    (usable as a decorator).

    Hugging Face's routed experts (every class built on transformers' experts interface: Mixtral,
    Qwen2/3-MoE, OLMoE, DeepSeek, ...) and Longformer's and LED's self-attention (global tokens
    gathered across the batch, padded slots given zero weight) are row-wise already.

    >>> class Doubler(nn.Module):
    ...     def forward(self, x):
    ...         order = x[:, 0].argsort()
    ...         return (x[order] * 2)[order.argsort()]
    >>> rowwise_module(Doubler) is Doubler
    True
    """
    _ROWWISE[cls] = True
    return cls


def is_rowwise(layer: nn.Module) -> bool:
    """Whether ``layer``'s class is row-wise (:func:`rowwise_module`, or known so:
    :func:`~psg_core.support.known_rowwise`)."""
    cls = type(layer)
    known = _ROWWISE.get(cls)
    if known is None:
        known = _ROWWISE[cls] = known_rowwise(cls)
    return known


def rowwise(fn: Callable[..., Any], *tensors: torch.Tensor) -> Any:
    """``fn(*tensors)`` for row-wise math on batch-first tensors that reads no parameter (a
    recurrent cell's gates), without following the batch op by op: when every input carries the
    batch on axis 0 (one row per entry), the outputs are declared so too. Anything else (an
    input without the batch, another axis, no tracker) runs ``fn`` tracked as usual.

    A recurrent layer runs a dozen such ops per time step; tracking each costs more than the op.
    """
    tracker = active_tracker()
    if tracker is None or any(tracker._batched.get(t) != (0, 1) for t in tensors):
        return fn(*tensors)
    with torch._C.DisableTorchFunction():
        out = fn(*tensors)
    for t in _tensors(out, []):
        tracker.mark(t, 0)
    return out


_METADATA: set[Any] = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__,
    torch.Tensor.is_contiguous, torch.Tensor.data_ptr, torch.Tensor.item, torch.Tensor.tolist,
    torch.Tensor.element_size, torch.Tensor.__bool__, torch.Tensor.__format__, torch.Tensor.__repr__,
}
# Property getters (``t.shape``, ``t.dtype``, ...) reach the mode as ``Tensor.<name>.__get__``.
_METADATA.update(getattr(torch.Tensor, name).__get__ for name in (
    "shape", "dtype", "device", "ndim", "requires_grad", "grad_fn", "is_leaf", "layout", "is_sparse",
    "is_cuda", "data", "grad"))

#: The getters of a tensor's torch.Size, and the factories of a constant tensor of a given size
#: (see BatchTracker._follow_size).
_SHAPES = frozenset({torch.Tensor.size, getattr(torch.Tensor, "shape").__get__})
_FACTORIES = frozenset({"zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_full", "new_empty"})

# Pointwise ops that broadcast their operands: where a batch-free operand meets the batch it can
# be expanded to the output's shape without changing the result.
_POINTWISE = {
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "where",
    "maximum", "minimum", "addcmul", "addcdiv", "lerp", "pow", "masked_fill", "clamp", "fmod",
    "remainder", "atan2", "hypot", "copysign", "xlogy",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__",
    "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__pow__", "__rpow__", "__matmul__",
    "add_", "sub_", "mul_", "div_", "masked_fill_",
}
#: Where a layer without a grad sampler may meet the batch with its own parameters as meeting
#: points (see ``meets_own`` of :class:`BatchTracker`): elementwise, broadcasting.
_OWN_MEETS = (_POINTWISE - {"__matmul__"}) | {"layer_norm"}  # and a write into masked rows
_MATMUL = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm"}
# Products where a batch-free operand may meet the batch (see BatchTracker._meet_product).
_PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm"}
_CAT = {"cat", "concat", "concatenate"}
_CONVS = {"conv1d", "conv2d", "conv3d"}
_PERMUTING = {"transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis", "mT", "T", "flip",
              "rot90", "roll", "__getitem__", "gather", "index_select", "take_along_dim", "sort", "argsort"}
_VIEW = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "contiguous"}
_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "prod", "std", "var",
           "nansum", "nanmean", "argmax", "argmin", "all", "any", "count_nonzero"}



class _TensorMap:
    """``tensor -> value`` by identity, holding no tensor alive; cheaper than torch's
    WeakIdKeyDictionary on the per-op path (one dict lookup and one weakref call).

    An entry whose tensor died may be found again under a recycled ``id``: the weak reference is
    compared on every lookup, so it never answers for another tensor.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        #: id(tensor) -> (weak reference, value); read directly on the per-op path.
        self.entries: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def get(self, tensor: torch.Tensor, default: Any = None) -> Any:
        entry = self.entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return default
        return entry[1]

    def __contains__(self, tensor: torch.Tensor) -> bool:
        entry = self.entries.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def __getitem__(self, tensor: torch.Tensor) -> Any:
        return self.entries[id(tensor)][1]

    def __setitem__(self, tensor: torch.Tensor, value: Any) -> None:
        self.entries[id(tensor)] = (weakref.ref(tensor), value)

    def discard(self, tensor: torch.Tensor) -> None:
        if tensor in self:
            del self.entries[id(tensor)]

    def clear(self) -> None:
        self.entries.clear()


def _tensors(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in a torch function's arguments (tensors, and lists/tuples/dicts of them)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:  # a tensor or a scalar item is handled here: no call per argument
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif isinstance(item, (list, tuple, dict)):
                _tensors(item, out)
    elif isinstance(value, dict):
        _tensors(list(value.values()), out)
    return out


@dataclass
class _Frame:
    module: nn.Module
    path: str
    #: the module owns trainable parameters and was called with the batch: its own parameters
    #: meeting the batch are its grad sampler's business.
    own: frozenset[int] | None
    #: the versions of the call's positional tensor arguments when it started (an in-place change
    #: during the call shows as a newer version).
    versions: tuple[int, ...] = ()
    #: a row-wise module's call (see :func:`rowwise_module`), run untracked: the batch rows its
    #: inputs hold on axis 0 (each input may merge another number of entries into a row) and the
    #: first input's entries per row (its outputs get theirs from their own axis 0).
    rowwise: tuple[int, int] | None = None
    #: the layer has no grad sampler of its own (see ``meets_own`` of :class:`BatchTracker`): where
    #: its own parameters meet the batch in broadcasting pointwise ops, they are meeting points,
    #: held in ``pending`` until the call ends.
    meet_own: bool = False
    pending: list[tuple[MeetingPoint, torch.Tensor]] = field(default_factory=list)
    #: one of its own parameters met the batch otherwise (a product, a child's op): the layer's
    #: call is differentiated whole (the torch.func fallback), its pending meetings dropped.
    opaque: bool = False
    #: the call ended with its own parameters' per-sample gradients all from meeting points.
    resolved: bool = False
    #: the state the call began with, for a backend that runs the whole call again per sample
    #: (see ``keeps_state`` of :class:`BatchTracker`; empty: none kept).
    state: CallState = CallState()


@dataclass
class MeetingPoint:
    """A batch-free tensor, computed from trainable parameters, meeting the batch in one op."""

    #: the batch-free tensor, as the op received it.
    source: torch.Tensor
    #: the shape of the view of it the op received instead (the op's broadcast shape); the view
    #: itself goes to ``on_meeting`` only, so that the gradient hook on it does not refer back to it.
    shape: tuple[int, ...]
    #: the batch axis of the view.
    batch_dim: int
    #: ``source`` has a size-1 (or no) axis where the view has the batch.
    broadcast: bool
    #: the trainable parameters ``source`` depends on.
    params: list[torch.Tensor]
    where: str
    #: entries of the view's batch axis per batch row (see :meth:`BatchTracker.merged`).
    merged: int = 1

    def per_sample_cotangent(self, grad: torch.Tensor, num_samples: int, K: int) -> torch.Tensor:
        """``(N, *source.shape)``: the gradient of each sample's loss w.r.t. ``source`` through
        this op, from ``grad`` (the gradient of the summed loss w.r.t. the expanded view)."""
        g = grad.movedim(self.batch_dim, 0)  # (N*K*merged, ...)
        rest = g.shape[1:]
        K = K * self.merged  # entries of the batch axis per sample
        padded = (1,) * (len(self.shape) - self.source.dim()) + tuple(self.source.shape)
        if self.broadcast:
            per_sample = g.reshape(num_samples, K, *rest).sum(1).unsqueeze(1 + self.batch_dim)
        else:
            # source has a row per batch row: sample n's cotangent is zero outside its K rows.
            blocks = g.reshape(num_samples, K, *rest)  # (N, K, ...)
            full = g.new_zeros(num_samples, num_samples, K, *rest)  # (N, N, K, ...)
            index = torch.arange(num_samples, device=g.device)
            full[index, index] = blocks
            per_sample = full.reshape(num_samples, num_samples * K, *rest).movedim(1, 1 + self.batch_dim)
        per_sample = per_sample.sum_to_size(num_samples, *padded)
        return per_sample.reshape(num_samples, *self.source.shape)

    def per_sample_grads(self, grad: torch.Tensor, num_samples: int, K: int
                         ) -> dict[torch.Tensor, torch.Tensor]:
        """``{param: (N, *param.shape)}`` through this meeting point (one batched VJP; none where
        the op received the parameter itself, or a view of it with its elements in their order)."""
        cotangent = self.per_sample_cotangent(grad, num_samples, K).to(self.source.dtype)
        if len(self.params) == 1 and (self.source is self.params[0] or whole_view(self.source, self.params[0])):
            # A layer scale, a norm's weight (gamma * x): the VJP of the identity or of a reshape.
            param = self.params[0]
            return {param: cotangent.reshape(num_samples, *param.shape).to(param.dtype)}
        grads: Sequence[torch.Tensor | None]
        try:
            grads = torch.autograd.grad([self.source], self.params, grad_outputs=[cotangent],
                                        retain_graph=True, allow_unused=True, is_grads_batched=True)
        except RuntimeError as err:
            if "use_reentrant=True" in str(err):
                raise UnsupportedModuleError(
                    f"per-sample gradients: in module {self.where}, a tensor computed from trainable parameters "
                    "without the batch under torch.utils.checkpoint(use_reentrant=True) meets the batch; its "
                    "per-sample gradients need torch.autograd.grad, which reentrant checkpointing refuses: pass "
                    "use_reentrant=False") from err
            # A batch-free subgraph with an op vmap has no rule for: one VJP per sample.
            rows = [torch.autograd.grad([self.source], self.params, grad_outputs=[c], retain_graph=True,
                                        allow_unused=True) for c in cotangent]
            grads = [None if rows[0][i] is None else torch.stack([cast(torch.Tensor, r[i]) for r in rows])
                     for i in range(len(self.params))]
        return {p: g.to(p.dtype) for p, g in zip(self.params, grads) if g is not None}


def whole_view(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view`` is a view of the whole of ``base`` holding its elements in their order (a
    reshape: ``gamma[:, None, None]``, a 3-D ``F.linear`` output of its 2-D product), so that a
    gradient of one is a gradient of the other reshaped."""
    return (view._base is base and view.numel() == base.numel() and view.dtype == base.dtype
            and view.is_contiguous() and base.is_contiguous() and view.storage_offset() == base.storage_offset())


def _batch_axis_after_view(shape_in: Sequence[int], bd: int, merged: int, shape_out: Sequence[int]
                           ) -> tuple[int, int]:
    """Where the batch axis lands after a reshape, and how many entries of that axis each batch row
    then spans (a view that merges the batch with the following axes, e.g. ``(N, T, d) ->
    (N*T, d)``, keeps it outermost); ``(UNKNOWN, 1)`` when the view splits it."""
    rows = shape_in[bd] // merged if merged else 0
    if rows == 0:
        return UNKNOWN, 1
    before = math.prod(shape_in[:bd])
    acc = 1
    for j, size in enumerate(shape_out):
        if acc == before:
            if size == 1 and rows > 1:
                continue
            if size >= rows and size % rows == 0:
                return j, size // rows
            return UNKNOWN, 1
        if acc > before:
            break
        acc *= size
    return UNKNOWN, 1


def arg_versions(args: Sequence[Any]) -> tuple[int, ...]:
    """The version counters of the tensors in ``args`` (read without the torch function mode: each
    ``_version`` read would otherwise be a call of the tracker)."""
    with torch._C.DisableTorchFunction():
        return tuple(a._version for a in args if isinstance(a, torch.Tensor))


@dataclass
class _Computed:
    """An op's result computed by the meeting that rewrote it (see ``BatchTracker._meet_linear``)."""

    value: torch.Tensor


def _saved_tensors_hook() -> str:
    """The qualified name of the innermost saved-tensor pack hook ('' for none)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return "" if top is None else getattr(top[0], "__qualname__", "")


def _checkpointing() -> bool:
    """Whether a non-reentrant activation checkpoint (``torch.utils.checkpoint``) is recording the
    tensors autograd saves: its region's forward is being run for the first time."""
    return _saved_tensors_hook().startswith("_checkpoint_hook.")


def recomputing() -> bool:
    """Whether a non-reentrant activation checkpoint is recomputing its region in the backward
    pass: the layer calls it makes are not the forward pass's (their outputs' gradients are never
    taken; the forward's own calls were captured), so the backends capture none of them.

    >>> recomputing()
    False
    """
    return _saved_tensors_hook().startswith("_recomputation_hook.")


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as it is (the pack and unpack of an identity saved-tensor hook)."""
    return tensor


def _fill_where_met(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], met_args: tuple[Any, ...],
                    met_kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | _Computed:
    """``masked_fill(input, mask, value)`` whose tensor ``value`` (0-d: the op takes no other) met
    the batch: its meeting view has the output's shape, which the op refuses, so the fill is
    computed as ``where(mask, value, input)`` (the same values; in place for ``masked_fill_``)."""
    names = ("input", "mask", "value")
    call, met = dict(zip(names, args), **kwargs), dict(zip(names, met_args), **met_kwargs)
    value = met.get("value")
    if not isinstance(value, torch.Tensor) or value is call.get("value"):
        return met_args, met_kwargs  # the value did not meet the batch: the op as it is
    target = met["input"]
    filled = torch.where(met["mask"], value.to(target.dtype), target)
    if name == "masked_fill_":
        filled = call["input"].copy_(filled)
    return _Computed(filled)


_NO_STATE = CallState()


def _mask_rows(index: Any, target: torch.Tensor) -> bool:
    """Whether ``index`` is a boolean mask over ``target``'s leading axes (``x[mask] = value``)."""
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool and 0 < index.dim() <= target.dim() \
        and tuple(index.shape) == tuple(target.shape[:index.dim()])


def _index_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``index_select``'s index, given by position or keyword."""
    return kwargs.get("index", args[2] if len(args) > 2 else None)


def _holding(tensor: torch.Tensor, state: tuple[int, int]) -> str:
    """Where ``tensor`` holds the batch, for messages."""
    axis, merged = state
    where = f"axis {axis}" if axis >= 0 else {UNKNOWN: "an axis psg lost", MIXED: "no axis (rows mixed)"}.get(
        axis, "rows a mask or sort regrouped")
    return f"shape {tuple(tensor.shape)}: the batch on {where}, {merged} entries per row"


def _own_params(layer: nn.Module) -> frozenset[int]:
    """ids of the layer's own trainable parameters."""
    return frozenset(id(p) for p in own_parameters(layer) if p.requires_grad)


def _only_mask(args: tuple[Any, ...], kwargs: dict[str, Any], sources: dict[int, Any]) -> bool:
    """Whether the only batch-free operands of an attention call are its mask."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    return isinstance(mask, torch.Tensor) and set(sources) == {id(mask)}


#: The keywords an op's axis comes by: ``dim``, ``dims`` (``flip``, ``roll``) and numpy's ``axis``,
#: which torch takes as an alias of ``dim`` (the keyword reaches the tracker as written).
_DIM_KEYWORDS = ("dim", "dims", "axis")


def _dim_kwarg(kwargs: dict[str, Any], default: Any) -> Any:
    """An op's axis given by keyword (:data:`_DIM_KEYWORDS`: ``torch.cat(parts, axis=1)``,
    ``x.mean(axis=2)``), else ``default``.

    >>> _dim_kwarg({"axis": 1}, 0), _dim_kwarg({"dims": (0, 2)}, 0), _dim_kwarg({}, 0)
    (1, (0, 2), 0)
    """
    for key in _DIM_KEYWORDS:
        if key in kwargs:
            return kwargs[key]
    return default


def _dims_arg(args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> tuple[int, ...] | None:
    dim = _dim_kwarg(kwargs, args[1] if len(args) > 1 and not isinstance(args[1], (bool, torch.Tensor)) else None)
    if dim is None:
        return None
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if not all(isinstance(d, int) for d in dims):
        return None
    return tuple(d % ndim if ndim else 0 for d in dims)


class BatchTracker(TorchFunctionMode):
    """Follows the batch through one forward pass (see the module docstring).

    Args:
        module: the model; hooks on its submodules keep the stack of running modules (to name a
            layer in errors, and to know whose parameters a grad sampler covers).
        num_samples: N.
        augmentation_multiplicity: K.
        root_by_caller: the caller enters and leaves the root module's frame itself.
        on_meeting: called with each :class:`MeetingPoint` and the expanded view the op receives,
            as the forward pass finds them; the backend hooks the gradient of the view and calls
            ``point.per_sample_grads`` with it.
        meets_own: which layers have no grad sampler of their own (the backend's torch.func
            fallback would differentiate their whole call per sample). Where such a layer's own
            parameters meet the batch only in broadcasting pointwise ops (a layer scale
            ``gamma * x``, an RMSNorm's ``weight * x_hat``, a bias added), those ops are meeting
            points and the call needs no fallback (:meth:`met_own`); any other use keeps the
            fallback for the whole call.
        keeps_state: which layers (with trainable parameters) the backend differentiates by
            running their whole call again per sample: each call's state is kept as it began
            (:meth:`state_of_call`, :func:`~psg_core.support.call_state`).

    >>> from psg_core.layout import ModelInputs
    >>> emb = nn.Embedding(10, 4)
    >>> ids = torch.randint(0, 10, (3, 5))
    >>> with BatchTracker(emb, num_samples=3, augmentation_multiplicity=1, on_meeting=lambda *_: None) as tracker:
    ...     tracker.mark(ids, 0)
    ...     out = emb(ids) + emb(torch.arange(5)[None])
    >>> tracker.batch_dim(out), tracker.is_batched(emb(torch.arange(5)))
    (0, False)
    """

    def __init__(self, module: nn.Module, *, num_samples: int, augmentation_multiplicity: int,
                 on_meeting: Callable[[MeetingPoint, torch.Tensor], None], root_by_caller: bool = False,
                 meets_own: Callable[[nn.Module], bool] | None = None,
                 keeps_state: Callable[[nn.Module], bool] | None = None) -> None:
        super().__init__()
        self._meets_own = meets_own
        self._keeps_state = keeps_state
        #: an op inside an activation checkpoint is being met (see _meet_checkpointed)
        self._in_checkpoint = False
        self._stateful: dict[nn.Module, bool] = {}  # keeps_state's answer per layer
        #: the layers ``meets_own`` picked (hooked to resolve their calls' meetings)
        self._own_meeters: set[nn.Module] = set()
        # The root module's call is already under way (the tracker starts in its forward
        # pre-hook): the caller pushes and pops its frame, and no hook is added to it, since
        # torch iterates the root's hooks while the tracker would remove them.
        self._root_by_caller = root_by_caller
        self.num_samples = num_samples
        self.K = augmentation_multiplicity
        self._on_meeting = on_meeting
        # tensor -> (batch axis or UNKNOWN, entries of that axis per batch row: more than 1 when a
        # view merged the batch with the axes after it, (N, T, d) -> (N*T, d)).
        self._batched = _TensorMap()
        self._origin = _TensorMap()  # batch-free tensor -> frozenset of param ids
        # batch-free tensor -> (base, tiles, base's version, its version): it equals
        # ``base.repeat(tiles, 1, ...)``, copies of one block along axis 0 (DeBERTa's relative-position
        # keys, tiled once per batch row), while neither version moves (see _tiled).
        self._tiles = _TensorMap()
        self._mixed_by = _TensorMap()  # MIXED tensor -> where its samples met (for messages)
        # Index tensors known to put rows back in the batch's order (a PackedSequence's sorted and
        # unsorted indices, which torch's pack and pad functions apply): see trust_order.
        self._orders = _TensorMap()
        # Tables an Embedding with max_norm renormalised in place at the batch's tokens: their rows
        # looked up by those tokens are each sample's own; any other use mixes samples.
        self._renormed = _TensorMap()
        # ``torch.arange(n)`` results the forward made (0, 1, ..., n-1) -> their version then: an
        # index known to be the identity without reading it (see _is_range).
        self._ranges = _TensorMap()
        # A batched tensor's shape, as the torch.Size object its ``size()`` or ``shape`` returned
        # (kept alive: the id is the key) -> the tensor's batch state: a factory given that very
        # object (``torch.zeros(input_ids.size())``, Hugging Face's default token type ids) makes
        # a constant tensor of the batch's shape, whose rows hold the batch as the tensor's did.
        self._sizes: dict[int, tuple[torch.Size, tuple[int, int]]] = {}
        self._params: dict[int, nn.Parameter] = {id(p): p for p in trainable_parameters(module).values()}
        self._frames: list[_Frame] = []
        #: inside a row-wise module's call (its ops are not followed).
        self._suspended = False
        # one pre-hook and one forward hook per module (and a row-wise or own-meeting one where
        # needed), taken off at exit
        self._hooks = ModuleHooks()
        self._paths: dict[nn.Module, str] = {}  # each hooked module's path in the model
        # layer -> (label, ids of its own trainable parameters, row-wise), read at its first call
        self._info: dict[nn.Module, tuple[str, frozenset[int], bool]] = {}
        self._module = module
        self.meetings: list[MeetingPoint] = []

    # ------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> BatchTracker:
        hooks = self._hooks
        unit: str | None = None  # the path of the unit whose subtree the walk is in
        for path, layer in modules_of(self._module):
            if layer is self._module and self._root_by_caller:
                continue
            self._paths[layer] = path
            hooks.pre(layer, self._push_hook, with_kwargs=True)
            hooks.forward(layer, self._pop, always_call=True)
            if unit is not None and not (unit == "" or path.startswith(unit + ".")):
                unit = None
            if unit is None and is_unit(layer) and layer._modules:
                unit = path
            if is_rowwise(layer):
                # Ahead of every hook (the backends' were registered before the tracker's): a
                # backend capturing the call must find its outputs holding the batch.
                hooks.forward(layer, self._rowwise_outputs, prepend=True)
            elif (self._meets_own is not None and (unit is None or unit == path) and self._layer_info(layer)[1]
                  and self._meets_own(layer)):
                # (not inside a unit, which computes its subtree's parameters from its whole call)
                # Ahead of the backends' hooks too: they ask met_own() when capturing the call.
                self._own_meeters.add(layer)
                hooks.forward(layer, self._resolve_own, prepend=True)
        stack = getattr(_TLS, "stack", None)
        if stack is None:
            stack = _TLS.stack = []
        stack.append(self)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _TLS.stack.pop()
        self._hooks.remove()
        self._paths.clear()
        self._info.clear()
        self._frames.clear()
        self._own_meeters.clear()
        self._suspended = False

    def release(self) -> None:
        """Drops every tensor the tracker refers to (meeting points hold autograd graphs)."""
        self.meetings.clear()
        self._batched.clear()
        self._origin.clear()
        self._tiles.clear()
        self._mixed_by.clear()
        self._orders.clear()
        self._renormed.clear()
        self._ranges.clear()
        self._sizes.clear()

    # ------------------------------------------------------------------------------ queries
    def mark(self, tensor: torch.Tensor, batch_dim: int) -> None:
        """Declares ``tensor`` a batch tensor with its batch on ``batch_dim``."""
        self._batched[tensor] = (batch_dim, 1)

    def same_rows(self, copy: torch.Tensor, source: torch.Tensor) -> None:
        """Declares ``copy`` (made from ``source`` outside the tracker's sight, row for row) to hold
        the batch as ``source`` does."""
        for table in (self._batched, self._origin, self._mixed_by):
            value = table.get(source)
            if value is not None:
                table[copy] = value

    def trust_order(self, *indices: torch.Tensor | None) -> None:
        """Declares index tensors that put rows back in the batch's order: a PackedSequence's
        ``unsorted_indices``, which torch's ``pad_packed_sequence`` applies to the rows it unpacks
        in the sequence's sorted order. Selecting rows on the batch axis with one keeps the batch
        axis; with any other index it reorders samples."""
        for index in indices:
            if isinstance(index, torch.Tensor):
                self._orders[index] = True

    def mark_targets(self, targets: Any, layout: Any) -> None:
        """Declares the targets batched (their rows on ``layout.target_dim``), so that a loss that
        combines samples through them (a count of the batch's tokens) is seen too."""
        if isinstance(targets, torch.Tensor) and targets.dim():
            self.mark(targets, layout.target_dim(targets))

    def is_batched(self, value: Any) -> bool:
        """Whether ``value`` is a tensor that carries the batch (or a structure holding one)."""
        if isinstance(value, torch.Tensor):  # (the common case: no list built)
            return value in self._batched
        return any(t in self._batched for t in _tensors(value, []))

    def batch_dim(self, tensor: torch.Tensor) -> int | None:
        """The batch axis of a batched tensor (UNKNOWN when it could not be followed), None when
        the tensor is batch-free."""
        entry = self._batched.get(tensor)
        return None if entry is None else entry[0]

    def state(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """``(batch axis, entries per row)`` of a batched tensor (:meth:`batch_dim` and
        :meth:`merged` in one lookup), None when it is batch-free."""
        return self._batched.get(tensor)  # type: ignore[no-any-return]

    def merged(self, tensor: torch.Tensor) -> int:
        """How many entries of its batch axis each batch row spans (1 unless a view merged the batch
        with the following axes, as ``hidden.reshape(-1, d)`` does)."""
        entry = self._batched.get(tensor)
        return 1 if entry is None else int(entry[1])

    def check_rows(self, tensor: torch.Tensor, consumer: str) -> None:
        """Raises :class:`~psg_core.errors.UnsupportedModuleError` when ``tensor``'s rows are not its
        samples' own (:data:`MIXED`, :data:`PERMUTED`, :data:`GROUPED`); ``consumer`` (a layer, "the
        loss") names the receiver in the message. An axis the tracker lost (:data:`UNKNOWN`) passes."""
        entry = self._batched.get(tensor)
        if entry is None:
            return
        if entry[0] == MIXED:
            raise UnsupportedModuleError(
                f"per-sample gradients: {consumer} receives values that mix samples: "
                f"{self._mixed_by.get(tensor, 'an op combined rows of different samples')}. A sample's "
                "gradient is the gradient of its own rows alone, which this forward pass does not compute "
                "(and its clipping bound would not bound what the sample contributes); keep ops along the "
                "batch axis out of the model and the loss, or apply them per sample")
        if entry[0] == PERMUTED:
            raise UnsupportedModuleError(
                f"per-sample gradients: {consumer} receives the batch's rows reordered by a sort of the "
                "batch; row i is no longer sample i's. Pack them (pack_padded_sequence) for a DP "
                "recurrent layer, or keep the batch's order")
        if entry[0] == GROUPED:
            raise UnsupportedModuleError(
                f"per-sample gradients: {consumer} receives rows that a boolean mask picked from every "
                "sample into one axis (h[mask]); how many belong to each sample is data psg does not "
                "read. Keep the batch axis (mask by multiplying, or view the picked rows back to one "
                "row per sample)")

    def check_outputs(self, value: Any, consumer: str) -> None:
        """:meth:`check_rows` for every tensor of a model's output (tensors, lists, tuples, dicts),
        but 0-dim ones: a loss the model reduced over the batch itself (Hugging Face's ``loss``)."""
        for tensor in _tensors(value, []):
            if tensor.dim():
                self.check_rows(tensor, consumer)

    def modified_in_call(self, layer: nn.Module, versions: tuple[int, ...]) -> bool:
        """Whether ``layer``'s running call (the innermost frame) changed one of its positional
        tensor arguments in place: ``versions`` (:func:`arg_versions` of them now) differ from
        their versions when the call started."""
        frame = self._frames[-1] if self._frames else None
        if frame is None or frame.module is not layer or not frame.versions:
            return False
        return len(versions) == len(frame.versions) and versions != frame.versions

    def current_module(self) -> str:
        """The innermost running module, for messages."""
        return self._frames[-1].path if self._frames else "<outside any module>"

    # ------------------------------------------------------------------------------ module stack
    def _layer_info(self, layer: nn.Module) -> tuple[str, frozenset[int], bool]:
        """``(label, ids of its own trainable parameters, row-wise)`` of a hooked layer, read once
        per tracker (a recurrent cell runs T times)."""
        info = self._info.get(layer)
        if info is None:
            path = self._paths.get(layer, "?")
            with _NO_SUBCLASS():
                own_params = _own_params(layer)
            info = self._info[layer] = (f"'{path or '<root>'}' ({type(layer).__qualname__})", own_params,
                                        is_rowwise(layer))
        return info

    def _push_hook(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        label, own_params, row_wise = self._layer_info(layer)
        self.push_frame(layer, label, args, kwargs, own_params, row_wise)

    def push_frame(self, layer: nn.Module, label: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   own_params: frozenset[int] | None = None, row_wise: bool | None = None) -> None:
        """Enters ``layer``'s forward (done by hooks; by hand for a call already under way when
        the tracker started)."""
        if own_params is None:
            with _NO_SUBCLASS():
                own_params = _own_params(layer)
        state_axis = getattr(type(layer), STATE_BATCH_AXIS, None)
        if state_axis is not None and args and self.is_batched(args[0]):
            state = args[1] if len(args) > 1 else kwargs.get("hx")
            for leaf in tree_flatten(state)[0]:
                if isinstance(leaf, torch.Tensor):
                    self._batched[leaf] = (state_axis, 1)
        covered = own_params if own_params and self.is_batched((args, kwargs)) else None
        if row_wise is None:
            row_wise = is_rowwise(layer)
        rowwise = self._rowwise_call(layer, label, args, kwargs) if row_wise and not self._suspended else None
        meet_own = covered is not None and layer in self._own_meeters
        kept = _NO_STATE
        if own_params and self._keeps_state is not None:
            keeps = self._stateful.get(layer)
            if keeps is None:
                keeps = self._stateful[layer] = self._keeps_state(layer)
            if keeps:
                kept = call_state(layer, args, kwargs)
        # (the calls of layers with parameters are captured: only they need the versions)
        self._frames.append(_Frame(layer, label, covered, arg_versions(args) if own_params else (), rowwise,
                                   meet_own=meet_own, state=kept))
        if rowwise is not None:
            self._suspended = True

    def _rowwise_call(self, layer: nn.Module, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> tuple[int, int] | None:
        """The batch rows a row-wise module's batched inputs hold on axis 0 (the same in each: an
        input's axis 0 over its entries per row) and the first one's entries per row (None: the
        call holds no batch, and is tracked as usual); refuses a call whose inputs hold the batch
        otherwise, or a module whose submodules own trainable parameters and is no unit."""
        tensors = _tensors([args, kwargs], [])
        states = [self._batched.get(t) for t in tensors]
        batched = [(t, state) for t, state in zip(tensors, states) if state is not None]
        if not batched:
            return None
        # Each input's batch rows: its axis 0 over its entries per row (DBRX's experts take the
        # states as (B, T, d) and the routing as (B*T, k): B rows either way).
        rows = {t.shape[0] // state[1] if t.dim() and t.shape[0] % state[1] == 0 else -1 for t, state in batched}
        if any(state[0] != 0 for _, state in batched) or len(rows) != 1 or -1 in rows:
            raise UnsupportedModuleError(
                f"per-sample gradients: module {label} is declared row-wise (each output row computed from "
                "the same row of its inputs), but its inputs do not all hold the batch's rows on axis 0 "
                f"({'; '.join(_holding(t, state) for t, state in batched)})")
        if any(self._origin_of(t) for t, state in zip(tensors, states) if state is None):
            raise UnsupportedModuleError(
                f"per-sample gradients: module {label} is declared row-wise, but it is also given a tensor "
                "computed from trainable parameters without the batch")
        with _NO_SUBCLASS():
            inner = [f"{path}.{name}" for path, sub in layer.named_children()
                     for name, p in sub.named_parameters() if p.requires_grad]
        if inner and not is_unit(layer):
            # Its own parameters are computed on its call (the torch.func fallback); its
            # submodules' calls run untracked, so nothing would compute theirs.
            raise UnsupportedModuleError(
                f"per-sample gradients: module {label} is row-wise and its submodules own trainable "
                f"parameters ({', '.join(inner[:3])}{', ...' if len(inner) > 3 else ''}), which psg cannot "
                "follow inside its untracked call: declare its class a unit too (psg_core.unit_module), "
                "freeze them, or use mode='functorch'")
        return int(rows.pop()), int(batched[0][1][1])

    def pop_frame(self) -> None:
        """Leaves the innermost module's forward."""
        if self._frames:
            self._frames.pop()

    def _rowwise_outputs(self, layer: nn.Module, _args: Any, output: Any) -> None:
        """A row-wise call's outputs hold the batch on axis 0 as its inputs did (run before the
        backends' hooks and :meth:`_pop`), with as many entries per row as axis 0 holds per batch
        row: an output may flatten each row's entries onto axis 0 (Llama 4's experts block returns
        ``(N*K*T, d)`` for ``(N*K, T, d)``); one whose axis 0 is no whole multiple of the rows
        holds the batch nowhere psg can tell (mixed)."""
        frame = self._frames[-1] if self._frames else None
        if frame is not None and frame.module is layer and frame.rowwise is not None:
            rows, merged = frame.rowwise
            for t in _tensors(output, []):
                if not t.dim():
                    continue
                if not rows:  # an empty batch: as the (first) input
                    self._batched[t] = (0, merged)
                elif t.shape[0] % rows == 0 and t.shape[0]:
                    self._batched[t] = (0, t.shape[0] // rows)
                else:
                    self._mark_mixed([t], f"module {frame.path}, declared row-wise, returns {t.shape[0]} entries "
                                          f"on axis 0 for {rows} batch rows")

    def _resolve_own(self, layer: nn.Module, _args: Any, _output: Any) -> None:
        """At the end of a call of a layer without a grad sampler: its pending meeting points go to
        the backend when its own parameters met the batch in nothing else (run before the
        backends' hooks, which then skip the call, and before :meth:`_pop`)."""
        frame = self._frames[-1] if self._frames else None
        if frame is None or frame.module is not layer or not frame.meet_own:
            return
        pending, frame.pending = frame.pending, []
        if frame.opaque or not pending:
            return
        for point, view in pending:
            self.meetings.append(point)
            self._on_meeting(point, view)
        frame.resolved = True

    def state_of_call(self, layer: nn.Module) -> CallState:
        """The state the call of ``layer`` now ending began with, where ``keeps_state`` kept it."""
        frame = self._frames[-1] if self._frames else None
        return frame.state if frame is not None and frame.module is layer else _NO_STATE

    def met_own(self, layer: nn.Module) -> bool:
        """Whether the call of ``layer`` now ending got its own parameters' per-sample gradients
        from meeting points (see ``meets_own``): the backend leaves the call alone."""
        frame = self._frames[-1] if self._frames else None
        return frame is not None and frame.module is layer and frame.resolved

    def _pop(self, _layer: nn.Module, _args: Any, output: Any) -> None:
        if not self._frames:
            return
        frame = self._frames.pop()
        if frame.rowwise is not None:
            self._suspended = False

    # ------------------------------------------------------------------------------ the mode
    def _origin_of(self, tensor: torch.Tensor) -> frozenset[int]:
        known = self._origin.get(tensor)
        if known is not None:
            return known  # type: ignore[no-any-return]
        return frozenset((id(tensor),)) if id(tensor) in self._params else frozenset()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if func in _METADATA or self._suspended:
            out = func(*args, **kwargs)
            if func in _SHAPES and not self._suspended and not kwargs and len(args) == 1:
                self._note_size(args[0], out)
            return out
        if func is torch.Tensor.type_as and len(args) == 2 and not kwargs and isinstance(args[1], torch.Tensor):
            # ``x.type_as(other)`` reads only other's dtype (Gemma 3n casts a batch-free tensor
            # made of parameters by a batched one's): the cast of x alone, no meeting with other.
            return self.__torch_function__(torch.Tensor.to, types, (args[0],),
                                           {"device": args[1].device, "dtype": args[1].dtype})
        leaves = _tensors(args, [])
        if kwargs:
            _tensors(kwargs, leaves)
        # The book-keeping reads tensor attributes; tensor subclasses (ExpandedWeights) must not
        # see those reads, only the op itself (plain tensors need no guard: no context per op).
        plain = True
        for t in leaves:
            if type(t) not in _PLAIN:
                plain = False
                break
        if plain:
            before = self._before(func, args, kwargs, leaves)
        else:
            with _NO_SUBCLASS():
                before = self._before(func, args, kwargs, leaves)
        batched, origin, name, args, kwargs, computed = before
        out = func(*args, **kwargs) if computed is None else computed
        if plain:
            self._after(func, args, kwargs, leaves, batched, origin, name, out)
        else:
            with _NO_SUBCLASS():
                self._after(func, args, kwargs, leaves, batched, origin, name, out)
        return out

    def _before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[torch.Tensor]
                ) -> tuple[list[tuple[torch.Tensor, tuple[int, int]]], frozenset[int], str, tuple[Any, ...],
                           dict[str, Any], torch.Tensor | None]:
        """An op's batched operands (or the trainable parameters its operands come from) and the
        arguments to run it with (a meeting may rewrite them, or compute the op itself)."""
        entries = self._batched.entries
        batched: list[tuple[torch.Tensor, tuple[int, int]]] = []
        for t in leaves:
            entry = entries.get(id(t))
            if entry is not None and entry[0]() is t:
                batched.append((t, entry[1]))
        if not batched:
            origin = frozenset().union(*(self._origin_of(t) for t in leaves)) if leaves else frozenset()
            return batched, origin, "", args, kwargs, None
        name = getattr(func, "__name__", "")
        if torch.is_grad_enabled():
            if len(batched) == 1:  # (the common case: one batched operand, no generator per leaf)
                only = batched[0][0]
                free = [t for t in leaves if t is not only and t.requires_grad]
            else:
                free = [t for t in leaves if t.requires_grad and not any(t is b for b, _ in batched)]
            if free:
                if _checkpointing():
                    return self._meet_checkpointed(func, name, args, kwargs, free, batched)
                met = self._meet(func, name, args, kwargs, free, [b for b, _ in batched])
                if isinstance(met, _Computed):
                    return batched, frozenset(), name, args, kwargs, met.value  # the op, rewritten
                args, kwargs = met
        return batched, frozenset(), name, args, kwargs, None

    def _meet_checkpointed(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                           free: list[torch.Tensor], batched: list[tuple[torch.Tensor, tuple[int, int]]]
                           ) -> tuple[list[tuple[torch.Tensor, tuple[int, int]]], frozenset[int], str,
                                      tuple[Any, ...], dict[str, Any], torch.Tensor | None]:
        """:meth:`_meet` inside a non-reentrant activation checkpoint's forward. The backward pass
        recomputes the region without the tracker, and torch matches the tensors the recomputed ops
        save, one by one, with those the first forward saved (their shapes checked): a meeting's
        rewritten op saves an expanded operand where the recomputed op saves the parameter's tensor.
        So the rewritten op is computed with its saved tensors kept as they are (outside the
        checkpoint, in memory until the backward), and the op as the model wrote it is computed
        too, under the checkpoint, and dropped: the checkpoint's record of what this op saves is
        the recomputation's, and the dropped tensors are not looked for again."""
        with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            self._in_checkpoint = True
            try:
                met = self._meet(func, name, args, kwargs, free, [b for b, _ in batched])
            finally:
                self._in_checkpoint = False
            if not isinstance(met, _Computed) and met[0] is args and met[1] is kwargs:
                return batched, frozenset(), name, args, kwargs, None  # not rewritten: the op as it is
            if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
                # (the op as written, run again in place, would write the tensor a second time)
                raise self._cannot(name, self.current_module(), "it writes in place inside an activation checkpoint, "
                                   "whose recomputation the rewritten op would not match; write it out of place "
                                   "(x = x * w)")
            value = met.value if isinstance(met, _Computed) else func(*met[0], **met[1])
        func(*args, **kwargs)  # (dropped: the checkpoint's record of what the recomputed op saves)
        return batched, frozenset(), name, args, kwargs, value

    def _after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[torch.Tensor],
               batched: list[tuple[torch.Tensor, tuple[int, int]]], origin: frozenset[int], name: str,
               out: Any) -> None:
        """Records where an op's result holds the batch (or which parameters it comes from)."""
        if batched:
            self._follow(name, args, kwargs, batched, out)
            return
        if origin:
            # Inside a no-grad region too: a custom autograd.Function's forward (or a reentrant
            # checkpoint) runs without grad and returns its result, which the Function then
            # attaches to the graph: its origin is known from here only.
            record_all = not torch.is_grad_enabled()
            for t in _tensors(out, []):
                if t.requires_grad or record_all:
                    self._origin[t] = origin
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                self._note_tiles(getattr(func, "__name__", ""), args, out)
        elif isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            # A constant tiled once per batch row too (CPM-Ant's positions, ``arange(T).repeat(B, 1)``
            # from the batch's size): the per-layer fallback gives each sample its rows' tiles, as
            # it gives each sample its rows of a constant expanded over the batch.
            op = getattr(func, "__name__", "")
            if op == "repeat" or (self._tiles.entries and args[0] in self._tiles):
                self._note_tiles(op, args, out)
        if self._sizes and isinstance(out, torch.Tensor) and getattr(func, "__name__", "") in _FACTORIES:
            self._follow_size(func, args, kwargs, out)  # (a parameter's new_zeros too: origin above)
        if self._orders.entries and isinstance(out, torch.Tensor) and leaves and leaves[0] in self._orders \
                and getattr(func, "__name__", "") in _COPIES:
            self._orders[out] = True  # the same order on another device or dtype
        if func is torch.arange and isinstance(out, torch.Tensor):
            self._note_range(args, kwargs, out)

    def _note_range(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        """Remembers an ``arange`` that made ``0, 1, ..., n-1`` (Python ints: no value read)."""
        start, end, step = (0, args[0], 1) if len(args) == 1 else (
            args[0], args[1], args[2] if len(args) > 2 else kwargs.get("step", 1)) if len(args) > 1 else (
            kwargs.get("start", 0), kwargs.get("end"), kwargs.get("step", 1))
        if all(type(v) is int for v in (start, end, step)) and start == 0 and step == 1 and out.dim() == 1 \
                and not out.is_floating_point() and not out.is_complex() and out.numel() == end:
            self._ranges[out] = out._version

    def _is_range(self, index: torch.Tensor, rows: int) -> bool:
        """Whether ``index`` holds ``0, 1, ..., rows-1`` in order: known without a read for an
        ``arange`` the forward made, untouched since, or a contiguous view of all of it (an
        unsqueezed one); read otherwise (a host read, and a value a recorded step may not bake)."""
        base = index if index in self._ranges else index._base
        if base is not None and index.numel() == rows == base.numel():
            version = self._ranges.get(base)
            if version is not None and base._version == version and index.is_contiguous() \
                    and index.storage_offset() == base.storage_offset():
                return True
        return bool(torch.equal(index.reshape(-1), torch.arange(rows, device=index.device, dtype=index.dtype)))

    # ------------------------------------------------------------------------------ meetings
    def _meet(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              free: list[torch.Tensor], batched: list[torch.Tensor]
              ) -> tuple[tuple[Any, ...], dict[str, Any]] | _Computed:
        frame = self._frames[-1] if self._frames else None
        # The layer's own parameters as met points (a layer without a sampler, in pointwise ops)
        meet_own = frame is not None and frame.meet_own and not frame.opaque
        if meet_own and name not in _OWN_MEETS and not (name == "__setitem__" and len(args) == 3
                                                        and _mask_rows(args[1], args[0]) and not self._in_checkpoint):
            meet_own = False
        if frame is not None and frame.own is not None and all(id(t) in frame.own for t in free):
            if not meet_own:
                if frame.meet_own:
                    frame.opaque = True  # its own parameters in a product: the whole call per sample
                return args, kwargs  # the layer's own parameters as they are (the common case, below)
        sources: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}
        own: set[int] = set()  # the sources that are the layer's own (pending meetings)
        where = frame.path if frame is not None else "<root>"
        for t in free:
            origin = self._origin_of(t)
            if not origin:
                continue  # depends on no trainable parameter (an input that requires grad)
            if frame is not None and frame.own is not None and origin <= frame.own:
                if meet_own:
                    sources[id(t)] = (t, origin)
                    own.add(id(t))
                elif frame.meet_own:
                    frame.opaque = True
                continue  # the layer's own parameters: its grad sampler's business
            if frame is not None and frame.own is not None and origin & frame.own:
                raise UnsupportedModuleError(
                    f"per-sample gradients: module {frame.path} combines its own parameters with a "
                    "tensor computed from other trainable parameters without the batch; psg cannot "
                    "split that gradient per sample")
            # An enclosing layer's own parameters, passed down to this one: the enclosing layer's
            # grad sampler (or its torch.func fallback, which differentiates its whole forward)
            # gives their per-sample gradients; a meeting point here would count them again.
            owner = next((f for f in reversed(self._frames[:-1]) if f.own is not None and origin & f.own), None)
            if owner is not None:
                if origin <= cast(frozenset, owner.own):
                    if owner.meet_own:
                        owner.opaque = True  # used by a child: the owner's call is differentiated whole
                    continue
                raise UnsupportedModuleError(
                    f"per-sample gradients: in module {where}, a tensor computed from the parameters "
                    f"of the enclosing module {owner.path} and from other trainable parameters without the "
                    "batch meets the batch; psg cannot split that gradient per sample")
            sources[id(t)] = (t, origin)
        if own and len(own) < len(sources):
            # The layer's own parameters and other parameters' tensors in one op: the own ones as
            # the layer's (the whole call per sample), the others met as usual.
            cast(_Frame, frame).opaque = True
            sources = {i: v for i, v in sources.items() if i not in own}
            own = set()
        if not sources:
            return args, kwargs
        if name.endswith("_") and not name.endswith("__") and args and isinstance(args[0], torch.Tensor) \
                and id(args[0]) in sources:
            raise self._cannot(name, where, "the op writes the batch's values in place into the batch-free tensor; "
                                            "write it out of place (x = x + batched)")
        if name in _POINTWISE:
            shape = torch.broadcast_shapes(*(t.shape for t in batched + [s for s, _ in sources.values()]))
            out_bd, merged = self._broadcast_axis(batched, len(shape))
            if out_bd is None and own:
                cast(_Frame, frame).opaque = True  # the layer's own: its whole call per sample
                return args, kwargs
            if out_bd is None:
                raise self._cannot(name, where, "the batch axis of its batched operand is unknown")
        elif name == "__setitem__" and len(args) == 3 and not kwargs and args[0] is batched[0] \
                and _mask_rows(args[1], args[0]) and id(args[2]) in sources and not self._in_checkpoint:
            # ``x[mask] = value`` with a boolean mask over x's leading axes (batched, or a constant:
            # wav2vec2's and WavLM's SpecAugment draws it with numpy) and a value made of parameters
            # (the masked time steps set to ``masked_spec_embed``): computed as
            # ``x.copy_(where(mask, value, x))``, each row's copy of the value met there (not inside
            # an activation checkpoint, whose recomputation would write the value a second time: a
            # layer's own value sends its call to the fallback there, as before).
            shape = tuple(args[0].shape)
            out_bd, merged = self._batched[args[0]]
            if out_bd < 0:
                raise self._cannot(name, where, "the batch axis of the tensor it writes is unknown")
        elif name == "expand_as" and len(args) == 2 and not kwargs and id(args[0]) in sources \
                and len(batched) == 1 and args[1] is batched[0]:
            # ``table(positions).expand_as(embeddings)`` (XLM, Flaubert): the batch-free operand
            # broadcast to the batch's shape, as a pointwise op against the batch broadcasts it.
            shape = tuple(args[1].shape)
            out_bd, merged = self._broadcast_axis(batched, len(shape))
            if out_bd is None:
                raise self._cannot(name, where, "the batch axis of the tensor it is expanded as is unknown")
        elif name == "scaled_dot_product_attention" and _only_mask(args, kwargs, sources):
            # An additive float mask (T5's position bias) is broadcast onto the (..., Tq, Tk) scores.
            query, key = args[0], kwargs["key"] if "key" in kwargs else args[1]
            shape = (*query.shape[:-1], key.shape[-2])
            out_bd, merged = self._broadcast_axis([query], len(shape))
            if out_bd is None:
                raise self._cannot(name, where, "the batch axis of its query is unknown")
        elif name in _PRODUCTS and not kwargs and len(args) == 2 and len(batched) == 1:
            x, right = batched[0], args[1]
            if x.dim() == 2 and self._batched[x][0] == 0 and args[0] is x and name != "__rmatmul__" \
                    and isinstance(right, torch.Tensor) and right.dim() == 2 and id(right) in sources:
                # x @ W on (N*K, d) rows: a linear layer with weight W.T
                weight = right.t()
                return self._meet_linear((x, weight), {}, {**sources, id(weight): (weight, sources[id(right)][1])},
                                         x, where)
            return self._meet_product(name, args, sources, x, where), kwargs
        elif name == "linear" and len(batched) == 1 and args and args[0] is batched[0]:
            return self._meet_linear(args, kwargs, sources, batched[0], where)
        elif name == "layer_norm" and len(batched) == 1 and args and args[0] is batched[0]:
            return self._meet_layer_norm(args, kwargs, batched[0])
        elif name == "einsum" and not kwargs and len(batched) == 1:
            return self._meet_einsum(args, sources, batched[0], where), kwargs
        elif name in _CONVS and len(batched) == 1 and args and args[0] is batched[0]:
            return self._meet_conv(func, name, args, kwargs, sources, batched[0], where)
        elif name in _CAT:
            dim = _dim_kwarg(kwargs, args[1] if len(args) > 1 else 0)
            ref = batched[0]
            bd = self._batched[ref][0]
            if bd < 0 or dim % ref.dim() == bd:
                raise self._cannot(name, where, "it concatenates along the batch axis (or an unknown one)")
            shape, out_bd, merged = None, bd, self.merged(ref)
        else:
            raise self._cannot(name, where, "only broadcasting pointwise ops and concatenation are supported "
                                            "there")

        def expand(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or id(value) not in sources:
                return value
            source, origin = sources[id(value)]
            return self._meeting_view(source, shape if shape is not None else tuple(source.shape), out_bd, merged,
                                      origin, where, pending=cast(_Frame, frame).pending if own else None)

        met_args, met_kwargs = tree_map(expand, args), tree_map(expand, kwargs)
        if name in ("masked_fill", "masked_fill_"):
            return _fill_where_met(name, args, kwargs, met_args, met_kwargs)
        if name == "__setitem__":
            target, mask, value = met_args
            mask = mask.view(*mask.shape, *[1] * (target.dim() - mask.dim()))
            # (the statement discards what the op returns; the computed value only marks it done)
            return _Computed(target.copy_(torch.where(mask, value.to(target.dtype), target)))
        return met_args, met_kwargs

    def _meet_product(self, name: str, args: tuple[Any, ...], sources: dict[int, tuple[torch.Tensor, frozenset[int]]],
                      x: torch.Tensor, where: str) -> tuple[Any, ...]:
        """A matrix product of the batch ``x`` and a batch-free operand computed from parameters,
        where the batch is on one of the product's batch dimensions: the operand is expanded along
        them (matmul's own broadcasting), so that each batch row multiplies its own copy, whose
        gradient is that row's. An operand tiled once per batch row (``base.repeat(rows, 1, 1)``,
        as DeBERTa's relative-position keys are) is rebuilt from the tile: each sample's cotangent is
        then one tile's, not a copy of the whole operand per sample.

        A product that contracts the batch's rows (``x @ W`` on ``(N, d)`` rows) is a layer's job:
        refused, as before."""
        bd, merged = self._batched[x]
        if bd < 0 or bd >= x.dim() - 2:
            raise self._cannot(name, where, "its batched operand holds the batch on a matrix axis, not on a "
                                            "batch dimension of the product (a weight computed from "
                                            "parameters, applied to the batch's rows: use a layer such as "
                                            "nn.Linear for it)")
        out = []
        for value in args:
            if not isinstance(value, torch.Tensor) or id(value) not in sources:
                out.append(value)
                continue
            source, origin = sources[id(value)]
            if not 2 <= value.dim() <= x.dim():
                raise self._cannot(name, where, f"its batch-free operand has {value.dim()} dimensions, the "
                                                f"batched one {x.dim()}")
            tiled = self._tiled(value)
            rows = x.shape[bd]
            if tiled is not None and bd == 0 and value.dim() == x.dim() and value.shape[0] == rows \
                    and merged % tiled[0].shape[0] == 0:
                base = tiled[0]  # (s, *rest): entry r of the operand is base[r % s]
                rest = tuple(base.shape[1:])
                block = base if merged == base.shape[0] else base.repeat(merged // base.shape[0], *[1] * len(rest))
                # (1, merged, *rest): what every batch row multiplies
                expanded = self._meeting_view(block.unsqueeze(0), (rows // merged, merged, *rest), 0, 1, origin, where)
                operand = expanded.reshape(rows, *rest)
                self._batched[operand] = (0, merged)
                out.append(operand)
                continue
            target = (*torch.broadcast_shapes(tuple(x.shape[:-2]), tuple(value.shape[:-2])), *value.shape[-2:])
            out.append(self._meeting_view(source, target, bd, merged, origin, where))
        return tuple(out)

    def _meet_linear(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                     sources: dict[int, tuple[torch.Tensor, frozenset[int]]], x: torch.Tensor, where: str
                     ) -> _Computed:
        """``F.linear(x, W, b)`` with ``W`` (and maybe ``b``) computed from parameters without the
        batch (a tied output projection, ``F.linear(h, embedding.weight)``): computed as
        ``x @ W.T + b`` with ``W.T`` met as a product's operand (an extra axis for 2-D rows), and
        ``b`` as an add's."""
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        bd, merged = self._batched[x]
        if not isinstance(weight, torch.Tensor) or bd < 0 or bd >= x.dim() - 1:
            raise self._cannot("linear", where, "its batched input does not hold the batch on a leading axis")
        rows = x.unsqueeze(-2) if x.dim() == 2 else x  # (N*K, 1, d): the rows on a batch dimension
        self._batched[rows] = (bd, merged)
        transposed = weight.t()
        if id(weight) in sources:
            sources = {**sources, id(transposed): (transposed, sources[id(weight)][1])}
        operand = self._meet_product("matmul", (rows, transposed), sources, rows, where)[1]
        out = torch.matmul(rows, operand)
        if rows is not x:
            out = out.squeeze(-2)
        if bias is not None:
            self._batched[out] = (bd, merged)
            if id(bias) in sources:
                met = self._meet(torch.add, "add", (out, bias), {}, [bias], [out])
                out = torch.add(*cast(tuple, met)[0])
            else:
                out = out + bias
        return _Computed(out)

    def _meet_conv(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   sources: dict[int, tuple[torch.Tensor, frozenset[int]]], x: torch.Tensor, where: str
                   ) -> _Computed:
        """``F.conv{1,2,3}d(x, W, b, ...)`` with ``W`` (or ``b``) computed from parameters without the
        batch: a module that convolves with its child's weight itself (Mamba-style mixers call
        ``F.conv1d(x, self.conv1d.weight, ...)``, a short convolution on ``conv.weight``). Computed
        as one grouped convolution in which each of the batch's ``R`` entries (axis 0) has its own
        copy of ``W`` and ``b`` (meeting views, ``(R, *W.shape)``), so that each copy's gradient is
        that entry's: ``groups * R`` groups over ``x`` seen as ``(1, R * C, ...)``."""
        call = dict(zip(("input", "weight", "bias", "stride", "padding", "dilation", "groups"), args), **kwargs)
        weight, bias, groups = call.get("weight"), call.get("bias"), int(call.get("groups", 1))
        bd, merged = self._batched[x]
        spatial = {"conv1d": 1, "conv2d": 2, "conv3d": 3}[name]
        if bd != 0 or x.dim() != spatial + 2 or not isinstance(weight, torch.Tensor):
            raise self._cannot(name, where, "its input does not hold the batch on axis 0 of a batched "
                                            f"(N, C, {'...' if spatial > 1 else 'L'}) input")
        rows = x.shape[0]

        def per_row(value: torch.Tensor) -> torch.Tensor:
            if id(value) in sources:
                source, origin = sources[id(value)]
                return self._meeting_view(source, (rows, *source.shape), 0, merged, origin, where)
            return value.expand(rows, *value.shape)

        weights = per_row(weight)
        biases = per_row(bias) if isinstance(bias, torch.Tensor) else None
        options = {k: call[k] for k in ("stride", "padding", "dilation") if k in call}
        flat = x.reshape(1, rows * x.shape[1], *x.shape[2:])  # (1, R*C, ...): one sample of R*C channels
        out = func(flat, weights.reshape(rows * weight.shape[0], *weight.shape[1:]),
                   None if biases is None else biases.reshape(-1), groups=groups * rows, **options)
        out = out.reshape(rows, weight.shape[0], *out.shape[2:])
        self._batched[out] = (0, merged)
        return _Computed(out)

    def _meet_layer_norm(self, args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor) -> _Computed:
        """``F.layer_norm(x, shape, w, b)`` with ``w`` or ``b`` computed from parameters without the
        batch (a LayerNorm subclass without a grad sampler: ConvNeXt's channels-first one) computed
        as ``layer_norm(x, shape) * w + b``, the affine ops met as pointwise ones."""
        call = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args), **kwargs)
        out = torch.nn.functional.layer_norm(x, call["normalized_shape"], None, None, call.get("eps", 1e-5))
        state = self._batched[x]
        self._batched[out] = state
        for op, name, operand in ((torch.mul, "mul", call.get("weight")), (torch.add, "add", call.get("bias"))):
            if operand is None:
                continue
            if isinstance(operand, torch.Tensor) and operand.requires_grad:
                met = self._meet(op, name, (out, operand), {}, [operand], [out])
                out = met.value if isinstance(met, _Computed) else op(*met[0], **met[1])
            else:
                out = op(out, operand)
            self._batched[out] = state
        return _Computed(out)

    def _meet_einsum(self, args: tuple[Any, ...], sources: dict[int, tuple[torch.Tensor, frozenset[int]]],
                     x: torch.Tensor, where: str) -> tuple[Any, ...]:
        """``einsum`` of the batch ``x`` and batch-free operands computed from parameters (relative
        positions in Transformer-XL-style attention): each batch-free operand gets the batch's letter
        as a new leading axis, expanded over the batch's rows, so each row multiplies its own copy.
        Refused when the batch's letter is summed over, or the equation uses ``...``."""
        equation = args[0] if args and isinstance(args[0], str) else None
        operands = list(args[1][0:] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
        if equation is None or "..." in equation or "->" not in equation:
            raise self._cannot("einsum", where, "only explicit equations (with '->' and no '...') are supported there")
        lhs, rhs = equation.replace(" ", "").split("->")
        terms = lhs.split(",")
        bd, merged = self._batched[x]
        index = next((i for i, t in enumerate(operands) if t is x), None)
        if index is None or len(terms) != len(operands) or bd < 0 or bd >= len(terms[index]):
            raise self._cannot("einsum", where, "the batch axis of its batched operand is unknown")
        letter = terms[index][bd]
        if letter not in rhs or any(letter in terms[i] for i, t in enumerate(operands) if i != index):
            raise self._cannot("einsum", where, "the batch's letter is summed over or shared with another operand")
        new_operands = list(operands)
        for i, value in enumerate(operands):
            if not isinstance(value, torch.Tensor) or id(value) not in sources:
                continue
            source, origin = sources[id(value)]
            new_operands[i] = self._meeting_view(source.unsqueeze(0), (x.shape[bd], *source.shape), 0, merged,
                                                 origin, where)
            terms[i] = letter + terms[i]
        return (",".join(terms) + "->" + rhs, *new_operands)

    def _note_size(self, tensor: Any, size: Any) -> None:
        """Records the ``torch.Size`` a batched tensor's ``size()`` or ``shape`` returned, with the
        tensor's batch state (a known axis only)."""
        if isinstance(tensor, torch.Tensor) and type(size) is torch.Size:
            entry = self._batched.get(tensor)
            if entry is not None and entry[0] >= 0 and entry[0] < len(size):
                self._sizes[id(size)] = (size, entry)

    def _follow_size(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        """A factory's constant result holds the batch where its size is a batched tensor's own
        ``torch.Size`` object (the same object, not equal numbers: a shape written out in numbers
        says nothing about where the batch is): every row is the same value, which the per-sample
        computation (the model on one sample) makes for its own rows, so each row is its sample's."""
        name = func.__name__
        first = 1 if name.startswith("new_") else 0  # a tensor method's self comes first
        if len(args) > first + 1 + name.endswith("full"):
            return  # sizes given one by one (torch.zeros(n, t)): numbers
        size = args[first] if len(args) > first else kwargs.get("size")
        known = self._sizes.get(id(size)) if size is not None else None
        if known is not None and known[0] is size and tuple(out.shape) == tuple(size):
            self._batched[out] = known[1]

    def _note_tiles(self, name: str, args: tuple[Any, ...], out: torch.Tensor) -> None:
        """Records a batch-free tensor made of copies of one block along axis 0 (``repeat`` on that
        axis alone), and keeps the record through a transpose of the other axes."""
        src = args[0]
        if name == "repeat":
            sizes = args[1:]
            if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
                sizes = tuple(sizes[0])
            if len(sizes) >= src.dim() >= 1 and all(type(n) is int for n in sizes) and sizes[0] > 1 \
                    and all(n == 1 for n in sizes[1:]):
                # (more sizes than axes: the block gets leading axes of one, as repeat reads it:
                # CPM-Ant's positions, ``arange(T).repeat(B, 1)``)
                block = src if len(sizes) == src.dim() else src.view((1,) * (len(sizes) - src.dim()) + src.shape)
                self._tiles[out] = (block, sizes[0], src._version, out._version)
            return
        tiled = self._tiled(src)
        if tiled is None:
            return
        base = tiled[0]
        if name == "contiguous" and out is not src:
            self._tiles[out] = (base, tiled[1], base._version, out._version)
        elif name in ("view", "reshape") and src.dim() >= 2 and out.dim() == src.dim() - 1 \
                and out.shape[0] == src.shape[0] * src.shape[1] and out.shape[1:] == src.shape[2:]:
            # axes 0 and 1 merged ((B, H, T, T) -> (B*H, T, T), WavLM's position bias): still tiles
            # of the block with its first two axes merged
            view = base.reshape(base.shape[0] * base.shape[1], *base.shape[2:])
            self._tiles[out] = (view, tiled[1], view._version, out._version)
        elif name in ("transpose", "swapaxes", "swapdims") and len(args) == 3 \
                and all(type(d) is int for d in args[1:]):
            d0, d1 = args[1] % src.dim(), args[2] % src.dim()
            if d0 and d1:
                view = base.transpose(d0, d1)
                self._tiles[out] = (view, tiled[1], view._version, out._version)

    def tiles(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """``(tiles, rows per tile)`` of a batch-free tensor made of copies of one block along axis 0
        (``block.repeat(tiles, 1, ...)``, then maybe its first two axes merged), None otherwise."""
        tiled = self._tiled(tensor)
        return None if tiled is None else (tiled[1], int(tiled[0].shape[0]))

    def _tiled(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """``(base, tiles)`` when ``tensor`` is still ``base.repeat(tiles, 1, ...)``: neither was
        changed in place since (an in-place op bumps the version of a tensor and of its views)."""
        record = self._tiles.get(tensor)
        if record is None:
            return None
        base, tiles, base_version, version = record
        if base._version != base_version or tensor._version != version or base.dim() != tensor.dim() \
                or base.shape[0] * tiles != tensor.shape[0] or base.shape[1:] != tensor.shape[1:]:
            return None
        return base, tiles

    def _meeting_view(self, source: torch.Tensor, target: Sequence[int], batch_dim: int, merged: int,
                      origin: frozenset[int], where: str,
                      pending: list[tuple[MeetingPoint, torch.Tensor]] | None = None) -> torch.Tensor:
        """``source`` (batch-free, computed from the parameters ``origin``) expanded to ``target``,
        whose ``batch_dim`` holds the batch's rows (``merged`` entries each): registered as a meeting
        point, whose gradient hook the backend installs on the returned view."""
        padded = (1,) * (len(target) - source.dim()) + tuple(source.shape)
        expanded = source.expand(*target)
        point = MeetingPoint(source=source, shape=tuple(expanded.shape), batch_dim=batch_dim,
                             broadcast=padded[batch_dim] == 1 and target[batch_dim] != 1,
                             params=[self._params[i] for i in sorted(origin)], where=where, merged=merged)
        self._batched[expanded] = (batch_dim, merged)
        if pending is not None:
            pending.append((point, expanded))  # the layer's own: decided when its call ends
            return expanded
        self.meetings.append(point)
        self._on_meeting(point, expanded)
        return expanded

    def _broadcast_axis(self, batched: list[torch.Tensor], ndim: int) -> tuple[int | None, int]:
        for t in batched:
            bd = self._batched[t][0]
            if bd >= 0:
                return int(bd) + ndim - t.dim(), self.merged(t)
        return None, 1

    def _cannot(self, name: str, where: str, why: str) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            f"per-sample gradients: in module {where}, a tensor computed from trainable parameters "
            f"without the batch (e.g. from broadcast position ids) meets the batch in {name}, where "
            f"psg cannot attribute its gradient to samples: {why}. If the module reads its submodules' "
            "parameters itself in such an op (F.multi_head_attention_forward on q_proj.weight, a functional "
            "convolution), declare its class one unit, psg_core.unit_module(cls): torch.func then runs its whole "
            "call per sample")

    # ------------------------------------------------------------------------------ batch axes
    def _follow(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                batched: list[tuple[torch.Tensor, tuple[int, int]]], out: Any) -> None:
        if name == "__setitem__":
            self._follow_setitem(args, batched)
            return
        outs = [out] if isinstance(out, torch.Tensor) else _tensors(out, [])
        if not outs:
            return
        if name == "embedding" and self._follow_embedding(args, kwargs, batched, outs):
            return
        if name == "_pack_padded_sequence" and args and isinstance(args[0], torch.Tensor):
            # (data, batch_sizes) in the packed order: not an axis of rows; the lengths only shape it.
            state = self._batched.get(args[0])
            if state is not None and state[0] == MIXED:
                self._mark_mixed(outs, self._mixed_by.get(args[0]))
            else:
                for t in outs:
                    self._batched[t] = (UNKNOWN, 1)
            return
        known: tuple[torch.Tensor, tuple[int, int]] | None = None
        permuted = False
        for item in batched:
            axis = item[1][0]
            if axis >= 0:
                if known is None:
                    known = item
            elif axis == MIXED:  # computed from values that mix samples: mixed too
                self._mark_mixed(outs, self._mixed_by.get(item[0]))
                return
            elif axis == PERMUTED:
                permuted = True
        if permuted:
            self._follow_permuted(name, args, kwargs, batched, outs)
            return
        if name == "_pad_packed_sequence":  # (padded, lengths) from a PackedSequence's data
            batch_first = args[2] if len(args) > 2 else kwargs.get("batch_first", False)
            for t in outs:
                self._batched[t] = ((0 if batch_first else 1) if t.dim() > 1 else 0, 1)
            return
        # Follow an operand whose axis is known (another may be one the tracker lost).
        if known is None:
            grouped = next((t for t, entry in batched if entry[0] == GROUPED), None)
            for t in outs:
                if all(t is not b for b, _ in batched):  # in place: keeps its state
                    self._batched[t] = self._after_grouped(name, grouped, t) if grouped is not None else (UNKNOWN, 1)
            return
        first, (bd, merged) = known
        if name == "repeat_interleave" and args and args[0] is first and len(outs) == 1:
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
            dim = _dim_kwarg(kwargs, args[2] if len(args) > 2 else None)
            if isinstance(repeats, int) and not isinstance(repeats, bool) and repeats > 0 \
                    and isinstance(dim, int) and dim % first.dim() == bd:
                # Each row repeated in place (per-head masks, (B, T, S) -> (B*H, T, S)): every
                # sample keeps its own rows, now ``repeats`` entries per row.
                self._batched[outs[0]] = (bd, merged * repeats)
                return
        for t in outs:
            if name in _VIEW:
                axis, kept = _batch_axis_after_view(first.shape, bd, merged, t.shape)
            else:
                axis = self._axis(name, args, kwargs, first, bd, t, batched)
                kept = merged if axis >= 0 else 1
            if axis == MIXED or axis == _PAIRED:
                why = _paired(name) if axis == _PAIRED else _describe(name)
                self._mark_mixed([t], f"{why} in module {self.current_module()}")
            elif axis == PERMUTED:
                self._batched[t] = (PERMUTED, 1)
            elif t is not first:  # in place: keeps its axis
                self._batched[t] = (axis, kept)

    def _follow_embedding(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                          batched: list[tuple[torch.Tensor, tuple[int, int]]], outs: list[torch.Tensor]) -> bool:
        """An Embedding lookup with ``max_norm`` scales the table's rows at every sample's tokens in
        place: a sample's own lookups read only rows it selected itself (scaled the same alone), but
        the table as a whole (a tied output head) now depends on all of them. Returns whether the
        lookup was followed here."""
        if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
            return False
        indices, table = (args[1], args[0]) if args[0].is_floating_point() else (args[0], args[1])
        found = self._batched.get(indices)
        if found is None or found[0] < 0 or any(t is not indices and t is not table for t, _ in batched):
            return False
        max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 and table is args[1] else None)
        if max_norm is None and table not in self._renormed:
            return False
        for t in outs:
            self._batched[t] = found  # each sample's rows, of the table scaled at its own tokens
        if max_norm is not None:
            self._renormed[table] = True
            self._mark_mixed([table], f"an Embedding with max_norm in module {self.current_module()} "
                                      "renormalises the table's rows at every sample's tokens in place, so the "
                                      "table used as a whole (a tied output head) depends on all of them")
        return True

    def _follow_permuted(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                         batched: list[tuple[torch.Tensor, tuple[int, int]]], outs: list[torch.Tensor]) -> None:
        """Rows reordered by a sort of the batch (PERMUTED) may be selected by that order, copied
        and inverted (what packing does); any other use mixes samples."""
        index = None
        if name == "index_select":
            index = _index_arg(args, kwargs)
        elif name == "__getitem__" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            index = args[1]
        source = self._batched.get(args[0]) if isinstance(index, torch.Tensor) else None
        if source is not None and isinstance(index, torch.Tensor):
            if source[0] >= 0 and index in self._orders:  # a PackedSequence's rows put back in order
                for t in outs:
                    self._batched[t] = source
                return
            if source[0] >= 0 and self._batched.get(index, (None,))[0] == PERMUTED and (
                    (name == "__getitem__" and source[0] == 0)
                    or (name == "index_select"
                        and _along_dims("index_select", args, kwargs, args[0].dim()) == (source[0],))):
                # Packing selects the rows in the sorted order, on the batch axis (1 when time-major).
                for t in outs:
                    self._batched[t] = (PERMUTED, 1)
                return
        if name in _COPIES or name in ("empty_like", "scatter_", "sort", "argsort"):
            for t in outs:
                self._batched[t] = (PERMUTED, 1)
            return
        self._mark_mixed(outs, f"'{name}' in module {self.current_module()} uses the batch's rows as a sort "
                               "reordered them")

    def _mark_mixed(self, tensors: list[torch.Tensor], why: str | None) -> None:
        if self.num_samples * self.K <= 1:
            # One row: nothing to mix, only an axis the tracker could not follow (a reduction or an
            # index over a batch of one).
            for t in tensors:
                self._batched[t] = (UNKNOWN, 1)
            return
        for t in tensors:
            self._batched[t] = (MIXED, 1)
            if why is not None:
                self._mixed_by[t] = why

    def _after_grouped(self, name: str, grouped: torch.Tensor, t: torch.Tensor) -> tuple[int, int]:
        """Rows a mask picked (GROUPED) stay so through row-wise ops; a view with one leading row per
        batch row gives the batch axis back."""
        rows = self.num_samples * self.K
        if name in _VIEW and t.dim() and t.shape[0] == rows and rows:
            return 0, 1
        if t.dim() and grouped.dim() and t.shape[0] == grouped.shape[0] and name not in _PERMUTING:
            return GROUPED, 1
        return UNKNOWN, 1

    def _follow_setitem(self, args: tuple[Any, ...], batched: list[tuple[torch.Tensor, tuple[int, int]]]) -> None:
        """``target[index] = value``: the target mixes samples when the value does, or when batched
        rows are written into a batched target at other rows."""
        if len(args) < 3 or not isinstance(args[0], torch.Tensor):
            return
        target, index, value = args[0], args[1], args[2]
        for t, entry in batched:
            if entry[0] == MIXED and t is not target:
                self._mark_mixed([target], self._mixed_by.get(t))
                return
        entry = self._batched.get(target)
        if entry is None and isinstance(value, torch.Tensor):
            self._written_rows(target, index, value)
            return
        if entry is None or entry[0] < 0 or not (isinstance(value, torch.Tensor) and value in self._batched):
            return
        if self._index_axis(target, entry[0], index) < 0:
            self._mark_mixed([target], f"an assignment into selected rows of the batch in module "
                                       f"{self.current_module()}")

    def _written_rows(self, target: torch.Tensor, index: Any, value: torch.Tensor) -> None:
        """A batch-free tensor the model created, written with the batch's rows in place
        (``out = torch.zeros(B, d + 1); out[:, :d] = h``): it holds the batch on the axis the rows
        went to, when the index keeps that axis whole (slices only). Anything else leaves it
        batch-free, and the layers that read it refuse it."""
        state = self._batched.get(value)
        if state is None or state[0] < 0:
            return
        items = index if isinstance(index, tuple) else (index,)
        if any(not (isinstance(i, slice) or i is Ellipsis) for i in items) or sum(i is Ellipsis for i in items) > 1:
            return
        if Ellipsis in items:
            at = items.index(Ellipsis)
            items = items[:at] + (slice(None),) * (target.dim() - len(items) + 1) + items[at + 1:]
        items = items + (slice(None),) * (target.dim() - len(items))
        if len(items) != target.dim():
            return
        axis = state[0] + target.dim() - value.dim()  # the value broadcasts into the written view
        if axis < 0 or value.shape[state[0]] != target.shape[axis] \
                or items[axis].indices(target.shape[axis]) != (0, target.shape[axis], 1):
            return
        self._batched[target] = (axis, state[1])

    def _agree(self, axis: int, x: torch.Tensor, operands: list[tuple[torch.Tensor, tuple[int, int]]],
               axis_of: Callable[[torch.Tensor, int], int]) -> int:
        """``axis`` (the output's batch axis as ``x`` puts it), or MIXED when another batched operand
        puts its batch on another output axis (_PAIRED: an outer sum or product pairs rows of two
        samples)."""
        if axis < 0:
            return axis
        for t, (b, _) in operands:
            if b == GROUPED and t.dim() and t.numel() > 1:
                return MIXED  # rows a mask picked, lined up against the batch's
            if t is x or b < 0 or t.dim() <= b or t.shape[b] == 1:
                continue
            if axis_of(t, b) != axis:
                return _PAIRED
        return axis

    def _axis(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor, bd: int,
              out: torch.Tensor, operands: list[tuple[torch.Tensor, tuple[int, int]]]) -> int:
        nd_in, nd_out = x.dim(), out.dim()
        self_arg = args[0] if args else None
        if name in _POINTWISE and name not in _MATMUL or (name in ("max", "min") and len(args) > 1
                                                          and isinstance(args[1], torch.Tensor)):
            return self._agree(bd + nd_out - nd_in, x, operands, lambda t, b: b + nd_out - t.dim())
        if nd_out == 0 and x.shape[bd] > 1:
            return MIXED  # the batch reduced to one number
        if name in _ALONG_BATCH:
            along = self._along_batch(name, args, kwargs, x, bd, out, operands)
            if along is not None:
                return along
        if name in ("__getitem__", "index_select") and self_arg is not x and len(operands) == 1 \
                and x.dtype not in (torch.bool, torch.uint8):
            # A batch-free table looked up by the batch's indices (DeepSeek V4's token -> expert
            # table, ``tid2eid[input_ids]``): each output row is its index's row's lookup.
            if name == "__getitem__" and len(args) == 2 and args[1] is x:
                return bd  # the index's axes lead the output's
            dims = _along_dims(name, args, kwargs, nd_out) if name == "index_select" else None
            if dims is not None and x.dim() == 1 and _index_arg(args, kwargs) is x:
                return dims[0]  # the looked-up axis
        if name in _MATMUL:
            return self._matmul_axis(name, args, x, bd, out, operands)
        if name == "einsum":
            return self._einsum_axis(args, x, bd, operands)
        if name in ("unfold", "stft", "istft") and self_arg is x:
            return _windows_axis(name, args, kwargs, x, bd, out)
        if name not in _PERMUTING and nd_out == nd_in and out.shape == x.shape:
            return bd  # same shape, no axis moved: activations, norms, dropout, ...
        if name in ("transpose", "swapaxes", "swapdims") and self_arg is x and len(args) >= 3:
            d0, d1 = args[1] % nd_in, args[2] % nd_in
            return d1 if bd == d0 else d0 if bd == d1 else bd
        if name == "t" and nd_in == 2:
            return 1 - bd
        if name == "permute" and self_arg is x:
            order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            order = [d % nd_in for d in order]
            return order.index(bd) if bd in order else UNKNOWN
        if name == "movedim" and self_arg is x and len(args) >= 3 and isinstance(args[1], int):
            src, dst = args[1] % nd_in, args[2] % nd_in
            order = [d for d in range(nd_in) if d != src]
            order.insert(dst, src)
            return order.index(bd)
        if name == "unsqueeze" and self_arg is x:
            d = args[1] if len(args) > 1 else _dim_kwarg(kwargs, None)
            d = d % (nd_in + 1)
            return bd + 1 if d <= bd else bd
        if name == "squeeze" and self_arg is x:
            removed = [i for i in range(nd_in) if x.shape[i] == 1]
            dims = _dims_arg(args, kwargs, nd_in)
            if dims is not None:
                removed = [i for i in removed if i in dims]
            return UNKNOWN if bd in removed else bd - sum(1 for i in removed if i < bd)
        if name == "__getitem__" and self_arg is x:
            return self._index_axis(x, bd, args[1])
        if name in _REDUCE:
            dims = _dims_arg(args, kwargs, nd_in)
            if dims is None or bd in dims:
                return MIXED  # over the batch axis (or every axis)
            keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
            return bd if keep else bd - sum(1 for d in dims if d < bd)
        if name in _CAT:
            dim = _dim_kwarg(kwargs, args[1] if len(args) > 1 else 0)
            parts = args[0] if args and isinstance(args[0], (list, tuple)) else ()
            if isinstance(dim, int) and dim % nd_in == bd and len(parts) > 1:
                return MIXED  # rows appended to the batch's: no longer one per sample
            return self._agree(bd, x, operands, lambda t, b: b)
        if name == "stack":
            dim = _dim_kwarg(kwargs, args[1] if len(args) > 1 else 0) % (nd_in + 1)
            return self._agree(bd + 1 if dim <= bd else bd, x, operands, lambda t, b: b + 1 if dim <= b else b)
        if name in ("unbind",):
            dim = _dim_kwarg(kwargs, args[1] if len(args) > 1 else 0) % nd_in
            return MIXED if dim == bd else bd - (1 if dim < bd else 0)
        if name in ("split", "chunk", "tensor_split", "split_with_sizes"):
            dim = _dim_kwarg(kwargs, args[2] if len(args) > 2 else 0) % nd_in
            return MIXED if dim == bd else bd
        if name == "repeat":
            sizes = args[1:] if len(args) > 1 else tuple(kwargs.get("repeats", ()))
            if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
                sizes = tuple(sizes[0])
            if len(sizes) >= nd_in and sizes[bd + len(sizes) - nd_in] != 1:
                return MIXED  # the batch tiled: rows [x_0 .. x_B-1, x_0 ..], no longer sample-major
            return bd + nd_out - nd_in
        if name in ("expand", "expand_as", "broadcast_to"):
            return bd + nd_out - nd_in
        if name in ("embedding",) and len(args) > 0 and args[0] is x:
            return bd
        if name == "one_hot" and self_arg is x:
            return bd
        if nd_out == nd_in and out.shape[bd] == x.shape[bd]:
            # Shape-preserving along the batch (activations, norms, linear, convolutions, attention).
            return bd
        return UNKNOWN

    def _along_batch(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor, bd: int,
                     out: torch.Tensor, operands: list[tuple[torch.Tensor, tuple[int, int]]]) -> int | None:
        """The output axis of ops that work along given axes (MIXED when the batch axis is one of
        them) and of the ops that combine samples by nature; None for every other op."""
        nd_in, nd_out = x.dim(), out.dim()
        if name in _ALONG_DIM:
            if not args or args[0] is not x:
                return None  # the batched tensor is an index or a source, not the input
            dims = _along_dims(name, args, kwargs, nd_in)
            if name == "index_select" and dims == (bd,) and self._orders.entries:
                index = _index_arg(args, kwargs)
                if isinstance(index, torch.Tensor) and index in self._orders:
                    return bd  # a PackedSequence's order, or back
            if name in ("sort", "argsort") and dims == (bd,) and nd_in == 1:
                return PERMUTED  # a sort of per-sample values (lengths): its order may pack the batch
            if name == "index_select" and dims == (bd,):
                index = _index_arg(args, kwargs)
                if isinstance(index, torch.Tensor) and index.dim() == 1 and index.shape[0] == x.shape[bd] \
                        and self._is_range(index, x.shape[bd]):
                    return bd  # every row in its place
            if dims is None or bd in dims:
                return MIXED
            if nd_out == nd_in:
                return bd if out.shape[bd] == x.shape[bd] else UNKNOWN
            if nd_out == nd_in - len(dims):
                return bd - sum(1 for d in dims if d < bd)
            return UNKNOWN
        if name in ("linear", "bilinear") and args and args[0] is x and nd_in > 1 and bd == nd_in - 1:
            return MIXED  # the batch on the features a layer contracts
        if name in _CONVOLUTIONS and args and args[0] is x and nd_in > 2 and bd != 0:
            return MIXED  # the batch on the channels a convolution contracts, or on positions it slides over
        if name == "batch_norm":
            training = kwargs.get("training", args[5] if len(args) > 5 else False)
            return MIXED if training and bd != 1 else None  # statistics over the batch (and positions)
        if name in ("layer_norm", "rms_norm"):
            shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
            width = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 0
            return MIXED if args and args[0] is x and bd >= nd_in - width else None
        if name in ("group_norm", "instance_norm", "local_response_norm"):
            return MIXED if args and args[0] is x and bd != 0 else None
        if name in ("pdist", "cov", "corrcoef"):
            return MIXED
        if name == "cdist" and len(args) >= 2:
            if bd >= nd_in - 1 or x.dim() < 2:
                return MIXED  # the feature axis, contracted
            axis = (nd_out - 2 if args[0] is x else nd_out - 1) if bd == nd_in - 2 else bd + nd_out - nd_in
            def cdist_axis(t: torch.Tensor, b: int) -> int:
                if b >= t.dim() - 1:
                    return MIXED
                if b == t.dim() - 2:
                    return nd_out - 2 if args[0] is t else nd_out - 1
                return b + nd_out - t.dim()
            return self._agree(axis, x, operands, cdist_axis)
        if name in ("cross_entropy", "nll_loss") and args and args[0] is x:
            reduction = kwargs.get("reduction", args[6] if name == "cross_entropy" and len(args) > 6 else "mean")
            if reduction != "none" or (nd_in > 1 and bd == 1):
                return MIXED  # over the batch, or along the class axis
            return bd if bd == 0 else bd - 1
        return None

    def _index_axis(self, x: torch.Tensor, bd: int, index: Any) -> int:
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, list) for i in items):
            try:
                items = tuple(torch.as_tensor(i) if isinstance(i, list) else i for i in items)
            except (TypeError, ValueError, RuntimeError):
                return UNKNOWN
        if any(isinstance(i, torch.Tensor) for i in items):
            return self._gather_axis(x, bd, items)
        if any(i is Ellipsis for i in items):
            pos = items.index(Ellipsis)
            consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
            items = items[:pos] + (slice(None),) * (x.dim() - consumed) + items[pos + 1:]
        src, out_axis = 0, 0
        for item in items:
            if item is None:
                out_axis += 1
                continue
            if src == bd:
                # An int picks one sample's row; a slice other than every row keeps some rows only.
                if isinstance(item, slice) and item.indices(x.shape[bd]) == (0, x.shape[bd], 1):
                    return out_axis
                return MIXED
            if not isinstance(item, int):
                out_axis += 1
            src += 1
        return out_axis + (bd - src)

    def _gather_axis(self, x: torch.Tensor, bd: int, items: tuple[Any, ...]) -> int:
        """Advanced indexing ``x[..., rows_index, ...]`` keeps the batch only where the index on the
        batch axis is ``arange(rows)`` along one axis (how mask utilities pick each row): its
        values are checked, not its size. Any other index on the batch axis (a mask, a permutation,
        some rows) mixes samples; an index on other axes only keeps the batch where it was."""
        if any(i is Ellipsis for i in items):
            return UNKNOWN
        src_pos = 0
        covered: dict[int, tuple[int, ...]] = {}  # item position -> the source axes it indexes
        for p, item in enumerate(items):
            if item is None:
                covered[p] = ()
                continue
            width = item.dim() if isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8) else 1
            covered[p] = tuple(range(src_pos, src_pos + width))
            src_pos += width
        if src_pos > x.dim():
            return UNKNOWN
        tensor_pos = [p for p, i in enumerate(items) if isinstance(i, torch.Tensor)]
        on_batch = [p for p in tensor_pos if bd in covered[p]]
        if not on_batch:
            before = [items[p] for p in range(len(items)) if covered[p] and covered[p][0] < bd]
            if any(i is None for i in items) or not all(isinstance(i, slice) for i in before):
                return UNKNOWN
            if tensor_pos != list(range(tensor_pos[0], tensor_pos[-1] + 1)) or any(
                    isinstance(items[p], int) for p in range(len(items))):
                return UNKNOWN
            if covered[tensor_pos[0]] and bd < covered[tensor_pos[0]][0]:
                return bd  # the index axes come after the batch's
            shape = torch.broadcast_shapes(*(items[p].shape for p in tensor_pos))
            indexed = sum(len(covered[p]) for p in tensor_pos)
            return bd - indexed + len(shape)
        index = items[on_batch[0]]
        if index.dtype in (torch.bool, torch.uint8):
            # the rows a mask picks, from every sample, in one axis (grouped by sample, in order)
            return GROUPED if len(on_batch) == 1 and covered[on_batch[0]][0] == 0 else MIXED
        if index.is_floating_point():
            return UNKNOWN
        if len(items) == 1 and index.dim() == 1 and index in self._orders:
            return bd  # a PackedSequence's order, or back
        if len(items) > x.dim() or any(i is None for i in items):
            return UNKNOWN
        if tensor_pos != list(range(tensor_pos[0], tensor_pos[-1] + 1)):
            return UNKNOWN
        if not all(isinstance(items[p], slice) and items[p] == slice(None) for p in range(len(items))
                   if p not in tensor_pos):
            return UNKNOWN
        shape = torch.broadcast_shapes(*(items[p].shape for p in tensor_pos))
        rows = x.shape[bd]
        axes = [a for a, size in enumerate(index.shape) if size != 1]
        if len(axes) != 1 or index.shape[axes[0]] != rows:
            return MIXED
        if not self._is_range(index, rows):
            return MIXED  # a permutation of the rows
        return tensor_pos[0] + axes[0] + len(shape) - index.dim()

    def _matmul_axis(self, name: str, args: tuple[Any, ...], x: torch.Tensor, bd: int, out: torch.Tensor,
                     operands: list[tuple[torch.Tensor, tuple[int, int]]]) -> int:
        if len(args) < 2:
            return UNKNOWN
        if name == "baddbmm":
            if args[0] is x:
                return self._agree(bd + out.dim() - x.dim(), x, operands,
                                   lambda t, b: _product_axis(t, b, args[1], args[2], out))
            a, b = args[1], args[2]
        elif name == "__rmatmul__":
            a, b = args[1], args[0]
        else:
            a, b = args[0], args[1]
        return self._agree(_product_axis(x, bd, a, b, out), x, operands,
                           lambda t, k: _product_axis(t, k, a, b, out) if t is a or t is b else k + out.dim() - t.dim())

    def _einsum_axis(self, args: tuple[Any, ...], x: torch.Tensor, bd: int,
                     operands: list[tuple[torch.Tensor, tuple[int, int]]]) -> int:
        if not args or not isinstance(args[0], str):
            return UNKNOWN
        tensors = list(args[1][0:] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
        equation = args[0].replace(" ", "")
        if "..." in equation:
            return UNKNOWN
        lhs, arrow, rhs = equation.partition("->")
        terms = lhs.split(",")
        if not arrow:
            letters = lhs.replace(",", "")
            rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        if len(terms) != len(tensors):
            return UNKNOWN

        def axis_of(t: torch.Tensor, b: int) -> int:
            where = [k for k, s in enumerate(tensors) if s is t]
            if not where or b >= len(terms[where[0]]):
                return UNKNOWN
            letter = terms[where[0]][b]
            return rhs.index(letter) if letter in rhs else MIXED  # a summed letter contracts the batch

        return self._agree(axis_of(x, bd), x, operands, axis_of)


def _product_axis(t: torch.Tensor, b: int, a: Any, other: Any, out: torch.Tensor) -> int:
    """Where ``t``'s batch axis ``b`` lands in ``out = a @ other`` (``t`` is ``a`` or ``other``):
    MIXED when the product contracts it."""
    if t is a:
        if t.dim() == 1 or b == t.dim() - 1:
            return MIXED
        if b == t.dim() - 2:
            return out.dim() - (2 if isinstance(other, torch.Tensor) and other.dim() >= 2 else 1)
        return b + out.dim() - t.dim()
    if t.dim() == 1 or b == t.dim() - 2:
        return MIXED
    if b == t.dim() - 1:
        return out.dim() - 1
    return b + out.dim() - t.dim()


#: Ops that work along given axes of their input: the position of that argument (after the input
#: itself; None: the op has none) and its default (``ALL``: every axis, as a flattened op or a
#: reduction without ``dim``; ``IMPLICIT``: softmax's legacy choice by rank).
_ALL, _IMPLICIT = "all", "implicit"
_ALONG_DIM: dict[str, tuple[int | None, Any]] = {
    "softmax": (1, _IMPLICIT), "log_softmax": (1, _IMPLICIT), "softmin": (1, _IMPLICIT),
    "cumsum": (1, _ALL), "cumprod": (1, _ALL), "cummax": (1, _ALL), "cummin": (1, _ALL),
    "logcumsumexp": (1, _ALL), "sort": (1, -1), "argsort": (1, -1), "msort": (None, 0),
    "topk": (2, -1), "kthvalue": (2, -1), "median": (1, _ALL), "nanmedian": (1, _ALL), "mode": (1, -1),
    "normalize": (2, 1), "glu": (1, -1), "diff": (2, -1), "cosine_similarity": (2, 1),
    "flip": (1, _ALL), "fliplr": (None, 1), "flipud": (None, 0), "roll": (2, _ALL), "rot90": (2, (0, 1)),
    "index_select": (1, _ALL), "gather": (1, _ALL), "take_along_dim": (2, _ALL), "narrow": (1, _ALL),
    "select": (1, _ALL), "repeat_interleave": (2, _ALL), "index_add": (1, _ALL), "index_copy": (1, _ALL),
    "index_fill": (1, _ALL), "scatter": (1, _ALL), "scatter_add": (1, _ALL), "scatter_reduce": (1, _ALL),
    "index_add_": (1, _ALL), "index_copy_": (1, _ALL), "index_fill_": (1, _ALL), "scatter_": (1, _ALL),
    "scatter_add_": (1, _ALL), "scatter_reduce_": (1, _ALL), "unique_consecutive": (None, _ALL),
}
_CONVOLUTIONS = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                 "conv_tbc", "convolution", "_convolution"}
#: The ops :meth:`BatchTracker._along_batch` knows.
_ALONG_BATCH = frozenset(_ALONG_DIM) | _CONVOLUTIONS | {
    "linear", "bilinear", "batch_norm", "layer_norm", "rms_norm", "group_norm", "instance_norm",
    "local_response_norm", "pdist", "cov", "corrcoef", "cdist", "cross_entropy", "nll_loss"}
_COPIES = {"to", "cpu", "cuda", "clone", "contiguous", "long", "int", "detach"}


def _windows_axis(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor, bd: int,
                  out: torch.Tensor) -> int:
    """Ops that cut an axis into windows: ``Tensor.unfold(dim, size, step)`` (a new window axis at
    the end; the batch stays where it is unless it is the axis cut), ``F.unfold`` (im2col,
    ``(N, C, *spatial) -> (N, C*k, L)``) and ``stft``/``istft`` (the last axis is the signal): the
    batch keeps its axis when it is a leading one, and windows across it mix samples."""
    nd_in, nd_out = x.dim(), out.dim()
    dimension = args[1] if len(args) >= 2 else kwargs.get("dimension")
    if name == "unfold" and type(dimension) is int and nd_out == nd_in + 1:  # Tensor.unfold
        return MIXED if dimension % max(nd_in, 1) == bd else bd
    if name == "unfold":  # F.unfold: (N, C, *spatial) -> (N, C * prod(kernel), L)
        return 0 if bd == 0 and nd_in >= 3 and nd_out == 3 else MIXED
    # stft on (B, T) -> (B, F, frames[, 2]); istft back: the batch leads, the signal is the last axis
    return bd if nd_in >= 2 and bd < nd_in - (1 if name == "stft" else 2) and bd == 0 else MIXED


def _along_dims(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> tuple[int, ...] | None:
    """The axes ``name`` works along (normalised), None for every axis."""
    position, default = _ALONG_DIM[name]
    value = _dim_kwarg(kwargs, None)
    if value is None and position is not None and len(args) > position:
        value = args[position]
    if value is None:
        if default == _ALL:
            return None
        if default == _IMPLICIT:
            value = 0 if ndim in (0, 1, 3) else 1
        else:
            value = default
    dims = value if isinstance(value, (tuple, list, torch.Size)) else (value,)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    return tuple(d % ndim if ndim else 0 for d in dims)


def _paired(name: str) -> str:
    return (f"'{name}' lines up two batched operands whose batch axes differ, pairing rows of different "
            "samples (or an input whose size on the batch dimension equals N*K by coincidence was taken "
            "for a batch tensor: declare it with psg_core.batch_free(tensor), or build it in the model)")


def _describe(name: str) -> str:
    return (f"'{name}' reorders, selects or combines the rows of different samples (along the batch axis, "
            "or pairing two batched operands)")
