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
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from psg_core._layout import STATE_BATCH_AXIS
from psg_core.errors import UnsupportedModuleError
from psg_core.support import own_parameters

__all__ = ["rowwise", "BatchTracker", "MeetingPoint", "active_tracker", "UNKNOWN"]

#: The batch axis of a batched tensor whose layout the tracker could not follow.
UNKNOWN = -1

_TLS = threading.local()
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
_PLAIN = (torch.Tensor, nn.Parameter)
_NULL = contextlib.nullcontext()  # reusable and reentrant: one for every tracked op


def active_tracker() -> BatchTracker | None:
    """The tracker of the forward pass running in this thread, if any."""
    stack = getattr(_TLS, "stack", None)
    return stack[-1] if stack else None


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
_MATMUL = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm"}
_CAT = {"cat", "concat", "concatenate"}
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
        """``{param: (N, *param.shape)}`` through this meeting point (one batched VJP)."""
        cotangent = self.per_sample_cotangent(grad, num_samples, K).to(self.source.dtype)
        grads: Sequence[torch.Tensor | None]
        try:
            grads = torch.autograd.grad([self.source], self.params, grad_outputs=[cotangent],
                                        retain_graph=True, allow_unused=True, is_grads_batched=True)
        except RuntimeError:
            # A batch-free subgraph with an op vmap has no rule for: one VJP per sample.
            rows = [torch.autograd.grad([self.source], self.params, grad_outputs=[c], retain_graph=True,
                                        allow_unused=True) for c in cotangent]
            grads = [None if rows[0][i] is None else torch.stack([cast(torch.Tensor, r[i]) for r in rows])
                     for i in range(len(self.params))]
        return {p: g.to(p.dtype) for p, g in zip(self.params, grads) if g is not None}


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


def _own_params(layer: nn.Module) -> frozenset[int]:
    """ids of the layer's own trainable parameters."""
    return frozenset(id(p) for p in own_parameters(layer) if p.requires_grad)


def _only_mask(args: tuple[Any, ...], kwargs: dict[str, Any], sources: dict[int, Any]) -> bool:
    """Whether the only batch-free operands of an attention call are its mask."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    return isinstance(mask, torch.Tensor) and set(sources) == {id(mask)}


def _dims_arg(args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> tuple[int, ...] | None:
    dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], (bool, torch.Tensor)) else None)
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
                 on_meeting: Callable[[MeetingPoint, torch.Tensor], None], root_by_caller: bool = False) -> None:
        super().__init__()
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
        self._params: dict[int, nn.Parameter] = {id(p): p for p in module.parameters() if p.requires_grad}
        self._frames: list[_Frame] = []
        self._handles: list[Any] = []
        self._module = module
        self.meetings: list[MeetingPoint] = []

    # ------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> BatchTracker:
        for path, layer in self._module.named_modules():
            if layer is self._module and self._root_by_caller:
                continue
            label = f"'{path or '<root>'}' ({type(layer).__qualname__})"
            self._handles.append(layer.register_forward_pre_hook(self._push(layer, label), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._pop, always_call=True))
        stack = getattr(_TLS, "stack", None)
        if stack is None:
            stack = _TLS.stack = []
        stack.append(self)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _TLS.stack.pop()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._frames.clear()

    def release(self) -> None:
        """Drops every tensor the tracker refers to (meeting points hold autograd graphs)."""
        self.meetings.clear()
        self._batched.clear()
        self._origin.clear()

    # ------------------------------------------------------------------------------ queries
    def mark(self, tensor: torch.Tensor, batch_dim: int) -> None:
        """Declares ``tensor`` a batch tensor with its batch on ``batch_dim``."""
        self._batched[tensor] = (batch_dim, 1)

    def is_batched(self, value: Any) -> bool:
        """Whether ``value`` is a tensor that carries the batch (or a structure holding one)."""
        return any(t in self._batched for t in _tensors(value, []))

    def batch_dim(self, tensor: torch.Tensor) -> int | None:
        """The batch axis of a batched tensor (UNKNOWN when it could not be followed), None when
        the tensor is batch-free."""
        entry = self._batched.get(tensor)
        return None if entry is None else entry[0]

    def merged(self, tensor: torch.Tensor) -> int:
        """How many entries of its batch axis each batch row spans (1 unless a view merged the batch
        with the following axes, as ``hidden.reshape(-1, d)`` does)."""
        entry = self._batched.get(tensor)
        return 1 if entry is None else int(entry[1])

    def current_module(self) -> str:
        """The innermost running module, for messages."""
        return self._frames[-1].path if self._frames else "<outside any module>"

    # ------------------------------------------------------------------------------ module stack
    def _push(self, layer: nn.Module, label: str) -> Callable[..., None]:
        with _NO_SUBCLASS():  # once per tracker and layer, not per call (a recurrent cell runs T times)
            own_params = _own_params(layer)

        def hook(_layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.push_frame(layer, label, args, kwargs, own_params)
        return hook

    def push_frame(self, layer: nn.Module, label: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   own_params: frozenset[int] | None = None) -> None:
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
        self._frames.append(_Frame(layer, label, covered))

    def pop_frame(self) -> None:
        """Leaves the innermost module's forward."""
        if self._frames:
            self._frames.pop()

    def _pop(self, _layer: nn.Module, _args: Any, _output: Any) -> None:
        if self._frames:
            self._frames.pop()

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
        if func in _METADATA:
            return func(*args, **kwargs)
        leaves = _tensors(args, [])
        if kwargs:
            _tensors(kwargs, leaves)
        # The book-keeping reads tensor attributes; tensor subclasses (ExpandedWeights) must not
        # see those reads, only the op itself.
        plain = all(type(t) in _PLAIN for t in leaves)
        with _NULL if plain else _NO_SUBCLASS():
            entries = self._batched.entries
            batched: list[tuple[torch.Tensor, tuple[int, int]]] = []
            for t in leaves:
                entry = entries.get(id(t))
                if entry is not None and entry[0]() is t:
                    batched.append((t, entry[1]))
            if not batched:
                origin = frozenset().union(*(self._origin_of(t) for t in leaves)) if leaves else frozenset()
            else:
                name = getattr(func, "__name__", "")
                if torch.is_grad_enabled():
                    free = [t for t in leaves if t.requires_grad and not any(t is b for b, _ in batched)]
                    if free:
                        args, kwargs = self._meet(func, name, args, kwargs, free, [b for b, _ in batched])
        out = func(*args, **kwargs)
        with _NULL if plain else _NO_SUBCLASS():
            if not batched:
                if origin:
                    for t in _tensors(out, []):
                        if t.requires_grad:
                            self._origin[t] = origin
            else:
                self._follow(name, args, kwargs, batched, out)
        return out

    # ------------------------------------------------------------------------------ meetings
    def _meet(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              free: list[torch.Tensor], batched: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        frame = self._frames[-1] if self._frames else None
        if frame is not None and frame.own is not None and all(id(t) in frame.own for t in free):
            return args, kwargs  # the layer's own parameters as they are (the common case, below)
        sources: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}
        for t in free:
            origin = self._origin_of(t)
            if not origin:
                continue  # depends on no trainable parameter (an input that requires grad)
            if frame is not None and frame.own is not None and origin <= frame.own:
                continue  # the layer's own parameters: its grad sampler's business
            if frame is not None and frame.own is not None and origin & frame.own:
                raise UnsupportedModuleError(
                    f"per-sample gradients: module {frame.path} combines its own parameters with a "
                    "tensor computed from other trainable parameters without the batch; psg cannot "
                    "split that gradient per sample")
            sources[id(t)] = (t, origin)
        if not sources:
            return args, kwargs
        where = frame.path if frame is not None else "<root>"
        if name in _POINTWISE:
            shape = torch.broadcast_shapes(*(t.shape for t in batched + [s for s, _ in sources.values()]))
            out_bd, merged = self._broadcast_axis(batched, len(shape))
            if out_bd is None:
                raise self._cannot(name, where, "the batch axis of its batched operand is unknown")
        elif name == "scaled_dot_product_attention" and _only_mask(args, kwargs, sources):
            # An additive float mask (T5's position bias) is broadcast onto the (..., Tq, Tk) scores.
            query, key = args[0], kwargs["key"] if "key" in kwargs else args[1]
            shape = (*query.shape[:-1], key.shape[-2])
            out_bd, merged = self._broadcast_axis([query], len(shape))
            if out_bd is None:
                raise self._cannot(name, where, "the batch axis of its query is unknown")
        elif name in _CAT:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            ref = batched[0]
            bd = self._batched[ref][0]
            if bd == UNKNOWN or dim % ref.dim() == bd:
                raise self._cannot(name, where, "it concatenates along the batch axis (or an unknown one)")
            shape, out_bd, merged = None, bd, self.merged(ref)
        else:
            raise self._cannot(name, where, "only broadcasting pointwise ops and concatenation are supported "
                                            "there")

        def expand(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or id(value) not in sources:
                return value
            source, origin = sources[id(value)]
            target = shape if shape is not None else tuple(source.shape)
            padded = (1,) * (len(target) - source.dim()) + tuple(source.shape)
            expanded = source.expand(*target)
            point = MeetingPoint(source=source, shape=tuple(expanded.shape), batch_dim=out_bd,
                                 broadcast=padded[out_bd] == 1 and target[out_bd] != 1,
                                 params=[self._params[i] for i in sorted(origin)], where=where,
                                 merged=merged)
            self._batched[expanded] = (out_bd, merged)
            self.meetings.append(point)
            self._on_meeting(point, expanded)
            return expanded

        return tree_map(expand, args), tree_map(expand, kwargs)

    def _broadcast_axis(self, batched: list[torch.Tensor], ndim: int) -> tuple[int | None, int]:
        for t in batched:
            bd = self._batched[t][0]
            if bd != UNKNOWN:
                return int(bd) + ndim - t.dim(), self.merged(t)
        return None, 1

    def _cannot(self, name: str, where: str, why: str) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            f"per-sample gradients: in module {where}, a tensor computed from trainable parameters "
            f"without the batch (e.g. from broadcast position ids) meets the batch in {name}, where "
            f"psg cannot attribute its gradient to samples: {why}")

    # ------------------------------------------------------------------------------ batch axes
    def _follow(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                batched: list[tuple[torch.Tensor, tuple[int, int]]], out: Any) -> None:
        outs = [out] if isinstance(out, torch.Tensor) else _tensors(out, [])
        if not outs:
            return
        # Follow an operand whose axis is known (another may be a batch-wide scalar like mask.all()).
        first, (bd, merged) = batched[0]
        if bd == UNKNOWN:
            for t, entry in batched:
                if entry[0] != UNKNOWN:
                    first, (bd, merged) = t, entry
                    break
        batched_tensors: list[torch.Tensor] | None = None
        for t in outs:
            if t is first:
                continue  # in place: keeps its axis
            if bd == UNKNOWN:
                self._batched[t] = (UNKNOWN, 1)
            elif name in _VIEW:
                self._batched[t] = _batch_axis_after_view(first.shape, bd, merged, t.shape)
            else:
                if batched_tensors is None:
                    batched_tensors = [b for b, _ in batched]
                axis = self._axis(name, args, kwargs, first, bd, t, batched_tensors)
                self._batched[t] = (axis, merged if axis != UNKNOWN else 1)

    def _axis(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor, bd: int,
              out: torch.Tensor, batched: list[torch.Tensor]) -> int:
        if bd == UNKNOWN:
            return UNKNOWN
        nd_in, nd_out = x.dim(), out.dim()
        self_arg = args[0] if args else None
        if name in _POINTWISE and name not in _MATMUL:
            return bd + nd_out - nd_in
        if name not in _PERMUTING and nd_out == nd_in and out.shape == x.shape:
            return bd  # same shape, no axis moved: activations, norms, dropout, softmax, ...
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
            d = args[1] if len(args) > 1 else kwargs["dim"]
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
        if name in _MATMUL:
            return self._matmul_axis(args, x, bd, out)
        if name in _REDUCE:
            dims = _dims_arg(args, kwargs, nd_in)
            if dims is None or bd in dims:
                return UNKNOWN if nd_out else UNKNOWN
            keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
            return bd if keep else bd - sum(1 for d in dims if d < bd)
        if name in _CAT:
            return bd
        if name == "stack":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % (nd_in + 1)
            return bd + 1 if dim <= bd else bd
        if name in ("unbind",):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % nd_in
            return UNKNOWN if dim == bd else bd - (1 if dim < bd else 0)
        if name in ("split", "chunk", "tensor_split", "split_with_sizes"):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0) % nd_in
            return UNKNOWN if dim == bd else bd
        if name in ("expand", "expand_as", "repeat", "broadcast_to"):
            return bd + nd_out - nd_in
        if name in ("embedding",) and len(args) > 0 and args[0] is x:
            return bd
        if name == "_pad_packed_sequence":  # (padded, lengths) from a PackedSequence's data
            batch_first = args[2] if len(args) > 2 else kwargs.get("batch_first", False)
            return (0 if batch_first else 1) if out.dim() > 1 else 0
        if nd_out == nd_in and out.shape[bd] == x.shape[bd]:
            # Shape-preserving along the batch (activations, norms, linear, convolutions, attention).
            return bd
        return UNKNOWN

    @staticmethod
    def _index_axis(x: torch.Tensor, bd: int, index: Any) -> int:
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, list) for i in items):
            return UNKNOWN
        if any(isinstance(i, torch.Tensor) for i in items):
            return BatchTracker._gather_axis(x, bd, items)
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
                # An int picks one row; a slice other than ``:`` keeps only some rows.
                return out_axis if item == slice(None) else UNKNOWN
            if not isinstance(item, int):
                out_axis += 1
            src += 1
        return out_axis + (bd - src)

    @staticmethod
    def _gather_axis(x: torch.Tensor, bd: int, items: tuple[Any, ...]) -> int:
        """Advanced indexing ``x[..., rows_index, ...]`` keeps the batch only where the index on the
        batch axis is ``arange(rows)`` along one axis (how mask utilities pick each row): its
        values are checked, not its size."""
        if len(items) > x.dim() or any(i is None or i is Ellipsis for i in items):
            return UNKNOWN
        tensor_pos = [p for p, i in enumerate(items) if isinstance(i, torch.Tensor)]
        if bd not in tensor_pos or tensor_pos != list(range(tensor_pos[0], tensor_pos[-1] + 1)):
            return UNKNOWN
        if not all(isinstance(items[p], slice) and items[p] == slice(None) for p in range(len(items))
                   if p not in tensor_pos):
            return UNKNOWN
        index = items[bd]
        if index.dtype in (torch.bool, torch.uint8) or index.is_floating_point():
            return UNKNOWN
        shape = torch.broadcast_shapes(*(items[p].shape for p in tensor_pos))
        rows = x.shape[bd]
        axes = [a for a, size in enumerate(index.shape) if size != 1]
        if len(axes) != 1 or index.shape[axes[0]] != rows:
            return UNKNOWN
        if not torch.equal(index.reshape(-1), torch.arange(rows, device=index.device, dtype=index.dtype)):
            return UNKNOWN
        return tensor_pos[0] + axes[0] + len(shape) - index.dim()

    def _matmul_axis(self, args: tuple[Any, ...], x: torch.Tensor, bd: int, out: torch.Tensor) -> int:
        a, b = (args[0], args[1]) if len(args) >= 2 else (None, None)
        if x is a:
            if bd == x.dim() - 2 or (x.dim() == 1):
                return out.dim() - 2 if x.dim() >= 2 else UNKNOWN
            if bd < x.dim() - 2:
                return bd + out.dim() - x.dim()
        if x is b and isinstance(b, torch.Tensor):
            if bd < b.dim() - 2:
                return bd + out.dim() - b.dim()
            if bd == b.dim() - 1 and b.dim() >= 2:
                return out.dim() - 1
        return UNKNOWN


