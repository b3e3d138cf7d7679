"""The ew backend: torch's ExpandedWeights over the ``N*K`` rows, folded over K afterwards.

ExpandedWeights (``torch.nn.utils._expanded_weights``) swaps every trainable parameter for a
tensor subclass whose ops compute per-*row* gradients during the ordinary backward pass. psg runs
it with batch size ``N*K`` and ``loss_reduction="sum"`` and then sums each sample's K rows, so the
result matches the oracle semantics for both reductions. It works at the level of torch functions
(``F.linear``, ``F.conv2d``, ``F.embedding``, the norms, and torch's decompositions of
``nn.RNN``/``nn.GRU``), so a custom module built from those works without a grad sampler; anything
else raises :class:`~psg_core.errors.UnsupportedModuleError` naming the layer. Note that the
per-row gradients are ``(N*K, *param.shape)`` before folding: this backend pays K in memory.

Parameters are never replaced on the user's model: each call works on detached aliases of them
(same storage), so ``p.grad_sample`` only ever holds the folded ``(N, ...)`` result.
"""

from __future__ import annotations

import contextlib
import functools
import dataclasses
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.utils._expanded_weights.expanded_weights_impl import (HANDLED_FUNCTIONS, ExpandedWeight,
                                                                    expanded_weights_rnn_decomps)
from torch.nn.utils._expanded_weights.expanded_weights_utils import (forward_helper, set_grad_sample_if_exists,
                                                                     unpack_expanded_weight_or_tensor)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from psg_core.backends.base import (AbstractGradSampleModule, PerSampleOutput, check_rows, get_grad_sample,
                                   parameters_kept, set_grad_sample, trainable_parameters)
from psg_core._layout import ALWAYS_BATCH_FIRST
from psg_core._module_hooks import ModuleHooks
from psg_core.errors import BatchLayoutError, GradAccumulationError, PsgError, UnsupportedModuleError
from psg_core.layout import BatchLayout, ModelInputs, fold_rows, unwrap_batch_free
from psg_core.losses import LossFn, loss_batch_dim, per_sample_loss
from psg_core.modes import GradSampleMode, LossReduction
from psg_core.precision import no_autocast
from psg_core.provenance import BatchTracker, MeetingPoint, active_tracker
from psg_core.support import reject_batch_mixing

__all__ = ["ExpandedWeightsGradSampleModule", "ew_per_sample", "ew_supported_functions"]

logger = logging.getLogger(__name__)

_WHERE = "per_sample_gradients(mode='ew')"
# torch's own ExpandedWeights errors all name the feature; anything else is the model's own error.
_EW_ERROR = re.compile(r"Expanded ?Weights?", re.IGNORECASE)
#: torch's error for an in-place op on the view an ExpandedWeights function returned (or a view of it).
_EW_VIEW_IN_PLACE = re.compile(r"is a view and is being modified inplace\. This view was created inside a custom "
                               r"Function")


def ew_supported_functions() -> list[str]:
    """Names of the torch functions ExpandedWeights computes per-sample gradients for (this torch).

    >>> "linear" in ew_supported_functions()
    True
    """
    funcs = list(HANDLED_FUNCTIONS) + list(expanded_weights_rnn_decomps)
    return sorted({getattr(f, "__name__", str(f)) for f in funcs})


class _ModuleTracker:
    """Knows which submodule's forward is running, so torch's errors can name the layer."""

    def __init__(self, module: nn.Module) -> None:
        self._stack: list[tuple[str, nn.Module]] = []
        self._hooks = ModuleHooks()
        for path, layer in module.named_modules():
            label = f"'{path or '<root>'}' ({type(layer).__qualname__})"
            self._hooks.pre(layer, self._push(label))
            # Not always_call: when a forward raises, the stack keeps the failing module's path.
            self._hooks.forward(layer, self._pop)

    def _push(self, label: str) -> Any:
        def hook(layer: nn.Module, _args: Any) -> None:
            self._stack.append((label, layer))
        return hook

    def _pop(self, _layer: nn.Module, _args: Any, _output: Any) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def current(self) -> str | None:
        """The innermost module whose forward is running (path and type), or None."""
        return self._stack[-1][0] if self._stack else None

    @property
    def current_module(self) -> nn.Module | None:
        return self._stack[-1][1] if self._stack else None

    def remove(self) -> None:
        self._hooks.remove()


#: F.instance_norm's parameters, in order (modules pass some positionally, torch's dispatch as keywords).
_INSTANCE_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")


def _instance_norm_eval(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        running_mean: torch.Tensor, running_var: torch.Tensor, eps: float) -> torch.Tensor:
    """The forward an InstanceNorm with running statistics computes in eval() (what the module runs)."""
    return torch.instance_norm(input, weight, bias, running_mean, running_var, False, 0.0, eps,
                               torch.backends.cudnn.enabled)


class _InstanceNormRunningStats(torch.autograd.Function):
    """``F.instance_norm(..., use_input_stats=False)`` with per-sample gradients for ExpandedWeights.

    An InstanceNorm with ``track_running_stats=True`` in eval() normalises with its running
    statistics: a per-channel affine map of the input. torch's ExpandedWeights kernel for
    ``instance_norm`` differentiates it as if the input's own statistics had been used (the input
    gradient and the weight's per-sample gradient come out wrong, silently); this one is exact:
    with ``x_hat = (x - running_mean) / sqrt(running_var + eps)``, a row's weight gradient is
    ``sum(x_hat * g)`` and its bias gradient ``sum(g)`` over the row's spatial positions, and the
    input gradient is ``g * weight / sqrt(running_var + eps)``.
    """

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                eps: float, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        # Checks the ExpandedWeights' batch size against the input's, and runs the unexpanded op.
        output = forward_helper(_instance_norm_eval, (input, weight, bias, running_mean, running_var, eps), {})
        ctx.save_for_backward(input, running_mean, running_var)
        ctx.eps, ctx.weight, ctx.bias = eps, weight, bias
        return cast(torch.Tensor, output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, running_mean, running_var = ctx.saved_tensors
        channels = (1, -1) + (1,) * (input.dim() - 2)
        invstd = torch.rsqrt(running_var + ctx.eps).reshape(channels)
        grad_input = None
        if ctx.needs_input_grad[0]:
            weight = unpack_expanded_weight_or_tensor(ctx.weight)
            grad_input = grad_output * (invstd if weight is None else invstd * weight.reshape(channels))
        rows, num_channels = input.shape[0], input.shape[1]

        def per_row(value: torch.Tensor) -> torch.Tensor:  # (rows, C): summed over the spatial axes
            return value.reshape(rows, num_channels, -1).sum(-1)

        set_grad_sample_if_exists(
            ctx.weight, lambda _: per_row((input - running_mean.reshape(channels)) * invstd * grad_output))
        set_grad_sample_if_exists(ctx.bias, lambda _: per_row(grad_output))
        # The ExpandedWeights get no gradient through autograd: their per-row gradients are set above.
        return grad_input, None, None, None, None, None


class _ExpandedWeightsMode(TorchFunctionMode):
    """Watches the ops that receive ExpandedWeights during one forward pass.

    * With the batch on dim 1, only ``F.linear`` honours it inside ExpandedWeights; other
      per-sample ops would silently treat dim 0 as the batch, so they are refused. Linear layers
      that are batch-first whatever the model's layout (``ALWAYS_BATCH_FIRST``, e.g. the cells of
      psg's recurrent layers) get their batch on dim 0 for the call.
    * torch's per-sample embedding gradient ignores ``padding_idx`` (its rows get gradient), so
      the ops each parameter meets are recorded: a parameter used only by embeddings with one
      ``padding_idx`` gets that row zeroed afterwards; a mix is refused. ``scale_grad_by_freq``
      mixes samples and is refused.
    * An embedding with ``max_norm`` renormalises, in place, the weight rows of every token in the
      batch. Lookups read only their own tokens' rows, which are renormalised either way, but any
      other op on that weight (a tied output head) reads rows that other samples' tokens changed:
      a parameter used by such an embedding and by any op other than embeddings with the same
      ``max_norm`` and ``norm_type`` is refused.
    * ``instance_norm`` with running statistics (an InstanceNorm with ``track_running_stats=True``
      in eval()), whose torch kernel differentiates as if the input's statistics were used, runs
      :class:`_InstanceNormRunningStats` instead.
    """

    _BATCH_FIRST_ONLY = (set(HANDLED_FUNCTIONS) | set(expanded_weights_rnn_decomps)) - {F.linear}

    def __init__(self, tracker: _ModuleTracker, *, batch_first: bool, where: str,
                 expanded: dict[str, ExpandedWeight] | None = None) -> None:
        super().__init__()
        self._tracker = tracker
        self._batch_first = batch_first
        self._where = where
        self._expanded = expanded or {}  # to name a parameter in an error
        #: id(ExpandedWeight) -> the padding_idx of every op that used it (None for other ops).
        self.uses: dict[int, list[int | None]] = {}
        #: id(ExpandedWeight) -> the first op that used it, and the (max_norm, norm_type) with which
        #: it renormalised the weight (None for an op that does not); every later use must agree.
        self._first_read: dict[int, tuple[str | None, Any, tuple[float, float] | None]] = {}
        #: the modules whose ops received ExpandedWeights, in call order (to name them when the
        #: backward pass fails).
        self.modules: dict[str, None] = {}

    def _refuse(self, func: Any, why: str) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            f"{self._where}: module {self._tracker.current or '<unknown>'} calls "
            f"{getattr(func, '__name__', func)} {why}. Use mode='hooks' or 'functorch'")

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        expanded = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, ExpandedWeight)]
        if not expanded or not (func in HANDLED_FUNCTIONS or func in expanded_weights_rnn_decomps):
            return func(*args, **kwargs)
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            # Non-reentrant checkpointing recomputes the forward in the backward pass, where torch's
            # per-sample kernels see the recomputed call as well: the gradients come out wrong.
            raise self._refuse(func, "under saved-tensor hooks (torch.utils.checkpoint, or "
                               "torch.autograd.graph.saved_tensors_hooks), whose recomputed forward "
                               "ExpandedWeights do not handle")
        padding_idx, renorm = None, None
        if func is F.embedding:
            padding_idx = kwargs.get("padding_idx", args[2] if len(args) > 2 else None)
            max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
            if max_norm is not None:
                renorm = (float(max_norm), float(kwargs.get("norm_type", args[4] if len(args) > 4 else 2.0)))
            if kwargs.get("scale_grad_by_freq", args[5] if len(args) > 5 else False):
                raise self._refuse(func, "with scale_grad_by_freq=True, which scales gradients by token "
                                   "counts over the whole batch (samples mix)")
            if padding_idx is not None and padding_idx < 0:
                padding_idx += expanded[0].shape[0]
        batch = active_tracker()
        #: where the tracker followed the batch in the op's input (None: not known)
        followed = None
        if batch is not None:
            operands = [t for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor) and not isinstance(t, ExpandedWeight)]
            if operands and not any(batch.is_batched(t) for t in operands):
                raise self._refuse(func, "on an input that does not carry the batch (e.g. broadcast position "
                                   "ids or a (T, T) bucket matrix); ExpandedWeights would read its first axis "
                                   "as the batch")
            if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], ExpandedWeight):
                # ExpandedWeights read the input's first (or second) axis as the batch: not where its
                # rows mix samples.
                batch.check_rows(args[0], f"module {self._tracker.current or '<root>'} "
                                          f"({getattr(func, '__name__', func)})")
                axis = batch.batch_dim(args[0])
                followed = axis if axis is not None and axis >= 0 else None
        for ew in expanded:
            self._check_renorm(func, ew, renorm)
            self.uses.setdefault(id(ew), []).append(padding_idx)
        self.modules.setdefault(self._tracker.current or "<root>", None)
        # The axis torch's kernels take for the batch: the layout's, or 0 for a layer that fixes it.
        reads = 0 if self._batch_first or (func is F.linear and getattr(
            type(self._tracker.current_module), ALWAYS_BATCH_FIRST, False)) else 1
        if func is F.linear and followed is not None and followed == args[0].dim() - 1:
            followed = None  # the batch on the features the layer sums: its output mixes samples (refused there)
        if followed is not None and followed != reads and (func is F.linear or self._batch_first):
            # The model moved the batch (XLNet computes on (T, N, d)): a linear layer can be told
            # where it is; the other kernels read axis 0 only (and with batch_first=False they are
            # refused below).
            if func is not F.linear or followed > 1 or (followed == 1 and args[0].dim() < 3):
                raise self._refuse(func, f"on an input whose batch is on axis {followed}, where torch's "
                                   f"ExpandedWeights read axis {reads} as the batch")
            reads = followed
        if reads != (0 if self._batch_first else 1):
            for ew in expanded:
                ew.set_batch_first(reads == 0)  # read once, in the op's forward
            try:
                return func(*args, **kwargs)
            finally:
                for ew in expanded:
                    ew.set_batch_first(self._batch_first)
        if self._batch_first:
            if func is F.instance_norm:
                call = dict(zip(_INSTANCE_NORM_ARGS, args), **kwargs)
                if not call.get("use_input_stats", True) and call.get("running_mean") is not None \
                        and call.get("running_var") is not None:
                    return _InstanceNormRunningStats.apply(
                        call["input"], call["running_mean"], call["running_var"], float(call.get("eps", 1e-5)),
                        call.get("weight"), call.get("bias"))
            return func(*args, **kwargs)
        if func in self._BATCH_FIRST_ONLY:
            raise self._refuse(func, "with batch_first=False; torch's ExpandedWeights only honours a batch "
                               "on dimension 1 for linear layers (or use batch-first inputs)")
        return func(*args, **kwargs)

    def _check_renorm(self, func: Any, ew: ExpandedWeight, renorm: tuple[float, float] | None) -> None:
        """Refuses a weight that an embedding with ``max_norm`` renormalises in place and another op
        reads (see the class docstring); called before the op runs, for each of its ExpandedWeights."""
        first = self._first_read.get(id(ew))
        if first is None:
            self._first_read[id(ew)] = (self._tracker.current, func, renorm)
            return
        if first[2] == renorm:
            return
        first_op = f"{first[0] or '<root>'} ({getattr(first[1], '__name__', first[1])})"
        this_op = f"{self._tracker.current or '<root>'} ({getattr(func, '__name__', func)})"
        name = next((n for n, e in self._expanded.items() if e is ew), "<unknown>")
        embedding, other = (first_op, this_op) if first[2] is not None else (this_op, first_op)
        raise UnsupportedModuleError(
            f"{self._where}: parameter {name!r} is renormalised in place by an embedding with max_norm, "
            f"module {embedding}, and also read by module {other}. The embedding rescales the rows of every "
            "token in the batch, so what the other op reads depends on the other samples' tokens: a sample's "
            "gradient would not be its own. Untie the weight (give the other op its own parameter), or drop "
            "max_norm and renormalise the weight outside the per-sample step")

    def padding_rows(self, expanded: dict[str, ExpandedWeight]) -> dict[str, int]:
        """``{name: padding_idx}`` for parameters used only by embeddings with that padding_idx."""
        rows = {}
        for name, ew in expanded.items():
            uses = self.uses.get(id(ew), [])
            padding = {u for u in uses if u is not None}
            if not padding:
                continue
            if len(padding) > 1 or None in uses:
                raise UnsupportedModuleError(
                    f"{self._where}: parameter {name!r} is used by an embedding with padding_idx and by other "
                    "ops; torch's ExpandedWeights cannot leave its padding row out. Use mode='hooks' or "
                    "'functorch'")
            rows[name] = padding.pop()
        return rows


def _refuse_meeting(where: str, point: MeetingPoint, view: torch.Tensor) -> None:
    """ExpandedWeights computes per-sample gradients inside torch's layer ops only: a tensor
    computed from parameters without the batch that meets the batch (a bare Parameter, or a
    layer's output on batch-free input, multiplied with the batch) would get no per-sample
    gradient here."""
    raise UnsupportedModuleError(
        f"{where}: in module {point.where}, a tensor computed from trainable parameters without the batch "
        "meets the batch; ExpandedWeights computes per-sample gradients inside torch's layer ops only. "
        "Use mode='hooks' or 'ghost'")


@contextlib.contextmanager
def _expanded_forward(module: nn.Module, *, batch_first: bool, where: str, inputs: ModelInputs,
                      layout: BatchLayout, expanded: dict[str, ExpandedWeight] | None = None
                      ) -> Iterator[_ExpandedWeightsMode]:
    """Runs a forward with ExpandedWeights: torch's errors become psg errors naming the layer.

    The batch is followed through the forward (:class:`~psg_core.provenance.BatchTracker`), so an
    op that would read the first axis of an input without the batch as the batch (a position
    table on ``(1, T)`` ids, a bias on a ``(T, T)`` bucket matrix with T = N*K) is refused.
    """
    tracker = _ModuleTracker(module)
    mode = _ExpandedWeightsMode(tracker, batch_first=batch_first, where=where, expanded=expanded)
    batch = BatchTracker(module, num_samples=layout.num_samples, augmentation_multiplicity=layout.augmentation_multiplicity,
                         on_meeting=functools.partial(_refuse_meeting, where))
    try:
        with batch:
            for tensor, dim in inputs.batch_tensors(layout):
                batch.mark(tensor, dim)
            with mode:
                yield mode
            batch.release()
    except RuntimeError as err:
        if isinstance(err, PsgError):
            raise
        if _EW_VIEW_IN_PLACE.search(str(err)):
            raise UnsupportedModuleError(
                f"{where}: the output of an ExpandedWeights layer, a view, is changed in place (for example by "
                "nn.ReLU(inplace=True) or `out += residual` after a Linear on a sequence), which torch's "
                "ExpandedWeights cannot differentiate; make that op out of place, or use mode='hooks', 'ghost' "
                f"or 'functorch' ({err})") from err
        if not _EW_ERROR.search(str(err)):
            raise
        layer = tracker.current or "<unknown>"
        raise UnsupportedModuleError(
            f"{where}: module {layer} is not supported by torch's ExpandedWeights ({err}); it handles "
            f"{', '.join(ew_supported_functions())}. Use mode='hooks' (with a registered grad sampler) "
            "or mode='functorch'") from err
    finally:
        tracker.remove()


def _expand(params: dict[str, nn.Parameter], rows: int, batch_first: bool
            ) -> tuple[dict[str, torch.Tensor], dict[str, ExpandedWeight]]:
    """Detached aliases of the parameters (they receive ``grad_sample``) and their ExpandedWeights."""
    aliases = {name: p.detach().requires_grad_(True) for name, p in params.items()}
    expanded = {name: ExpandedWeight(alias, rows, "sum") for name, alias in aliases.items()}
    if not batch_first:
        for ew in expanded.values():
            ew.set_batch_first(False)
    return aliases, expanded


def _call_expanded(module: nn.Module, expanded: dict[str, ExpandedWeight], args: Any, kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with each trainable parameter's ExpandedWeight in its place, and
    the model's own Parameters put back afterwards whatever happens (see
    :func:`~psg_core.backends.base.parameters_kept`: torch's restore leaves the ExpandedWeight in a
    submodule registered twice, ``nn.Sequential(l, act, l)``)."""
    with parameters_kept(module):
        return functional_call(module, cast("dict[str, torch.Tensor]", expanded), args, kwargs)


def _take_per_row(alias: torch.Tensor, padding_row: int | None) -> torch.Tensor | None:
    """Pops the ``(N*K, ...)`` per-row gradients ExpandedWeights left on ``alias``."""
    per_row = get_grad_sample(alias)
    set_grad_sample(alias, None)
    if per_row is not None and padding_row is not None:
        per_row[:, padding_row] = 0
    return per_row


def ew_per_sample(module: nn.Module, inputs: ModelInputs, targets: Any, loss_fn: LossFn, *,
                  layout: BatchLayout, reduction: LossReduction) -> PerSampleOutput:
    """Per-sample gradients and losses of ``module`` with torch's ExpandedWeights.

    Same arguments and result as :func:`psg_core.backends.functorch.functorch_per_sample`; the
    model is not modified (``p.grad`` and ``p.grad_sample`` are untouched).

    >>> out = ew_per_sample(nn.Linear(3, 1), ModelInputs((torch.randn(6, 3),), {}), torch.randn(6, 1),
    ...                     lambda o, t: (o - t) ** 2, layout=BatchLayout(6, 3, 0), reduction=LossReduction.SUM)
    >>> out.grads["bias"].shape
    torch.Size([2, 1])
    """
    batch_dim, batch_first, K = layout.batch_dim, layout.batch_dim == 0, layout.augmentation_multiplicity
    rows, num_samples = layout.rows, layout.num_samples
    _reject_unsupported(module, where=_WHERE)
    params = trainable_parameters(module)
    aliases, expanded = _expand(params, rows, batch_first)
    # ExpandedWeights' per-sample kernels do not follow autocast's casts (fp32 weights beside
    # half-precision inputs fail on CUDA): ew runs the forward in the parameters' precision.
    with _expanded_forward(module, batch_first=batch_first, where=_WHERE, inputs=inputs, layout=layout,
                           expanded=expanded) as watcher, no_autocast():
        outputs = _call_expanded(module, expanded, inputs.args, inputs.kwargs)
        tracker = active_tracker()
        if tracker is not None:
            tracker.mark_targets(targets, layout)
        per_element = loss_fn(outputs, targets)  # followed too: a loss that mixes samples is refused
        if tracker is not None and per_element.dim():
            tracker.check_rows(per_element, "the loss")
    padding_rows = watcher.padding_rows(expanded)
    batch_dim = loss_batch_dim(per_element, batch_dim)
    if per_element.dim() <= batch_dim or per_element.shape[batch_dim] != rows:
        raise BatchLayoutError(f"{_WHERE}: loss_fn must return the unreduced loss with {rows} rows on "
                               f"dimension {batch_dim}, got shape {tuple(per_element.shape)}")
    losses = per_sample_loss(per_element, num_samples=num_samples, batch_dim=batch_dim,
                             reduction=reduction)  # (N,)
    if expanded:
        # Backward of sum_n loss_n: each row's gradient is already weighted as its sample's loss
        # needs, so folding over K gives d loss_n / d theta for both reductions. The subclass'
        # __torch_function__ would refuse autograd.grad itself, hence the guard.
        with torch._C.DisableTorchFunctionSubclass():
            try:
                torch.autograd.grad(losses.sum(), list(expanded.values()), allow_unused=True)
            except RuntimeError as err:
                raise UnsupportedModuleError(
                    f"{_WHERE}: torch's ExpandedWeights failed in the backward pass ({err}); the modules "
                    f"that ran its per-sample ops: {', '.join(watcher.modules) or '<none>'}. Use mode='hooks' "
                    "or 'functorch'") from err
    grads = {}
    for name, alias in aliases.items():
        per_row = _take_per_row(alias, padding_rows.get(name))
        param = params[name]
        grads[name] = (fold_rows(per_row, K).sum(1) if per_row is not None
                       else torch.zeros(num_samples, *param.shape, dtype=param.dtype, device=param.device))
    return PerSampleOutput(grads=grads, per_sample_losses=losses.detach(), num_samples=num_samples)


def _reject_unsupported(module: nn.Module, *, where: str) -> None:
    """What ExpandedWeights cannot run: layers that mix samples (see
    :func:`~psg_core.support.reject_batch_mixing`) and ``torch.compile``'d modules, whose traced
    graphs ExpandedWeights' parameter swap breaks (a raw TorchDynamo error)."""
    reject_batch_mixing(module, where=where)
    for path, layer in module.named_modules():
        if type(layer).__name__ == "OptimizedModule" and type(layer).__module__.startswith("torch._dynamo"):
            raise UnsupportedModuleError(
                f"{where}: module '{path or '<root>'}' is a torch.compile'd module, which torch's ExpandedWeights "
                "cannot run; use mode='hooks' or 'ghost' (or the module before torch.compile)")


def _output_tensors(value: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a forward's output: in tuples, lists, mappings of any kind and dataclasses
    (an output class the pytree does not know, such as a model's own ``ModelOutput``, would hide
    them, and the backward pass would then fill no gradient at all).

    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Out:
    ...     logits: torch.Tensor
    ...     extra: dict
    >>> [t.shape for t in _output_tensors(Out(torch.zeros(2), {"h": torch.ones(3)}), [])]
    [torch.Size([2]), torch.Size([3])]
    """
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, Mapping):
        for item in value.values():
            _output_tensors(item, found)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _output_tensors(item, found)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _output_tensors(getattr(value, field.name), found)
    return found


class ExpandedWeightsGradSampleModule(AbstractGradSampleModule):
    """ExpandedWeights-based wrapper: after ``loss.backward()`` every trainable ``p`` has
    ``p.grad_sample`` of shape ``(N, *p.shape)`` (folded over the K copies) and ``p.grad`` as usual.

    The contract is the one of :class:`~psg_core.GradSampleModule`: the loss must be the mean
    (``loss_reduction="mean"``) or sum of the unreduced losses of all ``N*K`` rows. Each forward
    runs the model through ``functional_call`` with ExpandedWeights standing in for the trainable
    parameters; the per-row gradients are folded when the backward pass ends.

    Args:
        module: the model; it is not modified.
        batch_first: batch on dimension 0 (True) or 1 (only linear layers support 1, as in torch).
        loss_reduction: ``"mean"`` or ``"sum"``.
        augmentation_multiplicity: K.

    >>> model = ExpandedWeightsGradSampleModule(nn.Linear(4, 2), augmentation_multiplicity=2)
    >>> model(torch.randn(6, 4)).sum().backward()
    >>> model.weight.grad_sample.shape
    torch.Size([3, 2, 4])
    """

    def __init__(self, module: nn.Module, *, batch_first: bool = True,
                 loss_reduction: str | LossReduction = "mean", augmentation_multiplicity: int = 1) -> None:
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction,
                         augmentation_multiplicity=augmentation_multiplicity)
        _reject_unsupported(module, where=type(self).__name__)
        self._accumulation_allowed = False
        # Forwards whose outputs received gradients in the running backward:
        # (num_samples, aliases, embedding padding rows).
        self._pending: list[tuple[int, dict[str, torch.Tensor], dict[str, int]]] = []
        self._callback_queued = False

    def allow_grad_accumulation(self) -> None:
        """Lets several backward passes add into ``p.grad_sample`` until it is cleared."""
        self._accumulation_allowed = True

    def forbid_grad_accumulation(self) -> None:
        """A backward pass that would add to an uncleared ``p.grad_sample`` raises ValueError."""
        self._accumulation_allowed = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs, free = unwrap_batch_free(args, kwargs)
        params = trainable_parameters(self._module)
        if not torch.is_grad_enabled() or not params:
            return self._module(*args, **kwargs)
        where = type(self).__name__
        inputs = ModelInputs.of_call(args, kwargs, free)
        rows = inputs.first_rows(self.batch_dim)
        if rows is None:
            raise BatchLayoutError(f"{where}: the inputs hold no tensor with a batch dimension {self.batch_dim}")
        num_samples = check_rows(rows, self.augmentation_multiplicity, where=where)
        if num_samples == 0:
            return self._module(*args, **kwargs)
        aliases, expanded = _expand(params, rows, self.batch_first)
        layout = BatchLayout(rows=rows, augmentation_multiplicity=self.augmentation_multiplicity, batch_dim=self.batch_dim)
        with _expanded_forward(self._module, batch_first=self.batch_first, where=where,
                               inputs=inputs, layout=layout, expanded=expanded) as watcher, \
                no_autocast():  # see ew_per_sample
            output = _call_expanded(self._module, expanded, args, kwargs)
            batch = active_tracker()
            if batch is not None:  # the loss is the caller's: see GradSampleModule._end_pass
                batch.check_outputs(output, "the model's output")
        entry = (num_samples, aliases, watcher.padding_rows(expanded))

        def on_output_grad(grad: torch.Tensor) -> None:
            if not any(item is entry for item in self._pending):
                self._pending.append(entry)
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._collect)

        for tensor in _output_tensors(output, []):
            if tensor.requires_grad:
                tensor.register_hook(on_output_grad)
        return output

    def _collect(self) -> None:
        """End of a backward pass: fold the per-row gradients into ``p.grad_sample`` and ``p.grad``."""
        pending, self._pending, self._callback_queued = self._pending, [], False
        K = self.augmentation_multiplicity
        params = trainable_parameters(self._module)
        folded: dict[str, torch.Tensor] = {}
        for num_samples, aliases, padding_rows in pending:
            scale = float(num_samples) if self.loss_reduction is LossReduction.MEAN else 1.0
            for name, alias in aliases.items():
                per_row = _take_per_row(alias, padding_rows.get(name))  # (N*K, *shape)
                param = params.get(name)
                if per_row is None or param is None:  # unused, or frozen since the forward
                    continue
                # Per-row gradients are exact (reduction "sum"), so their sum is the batch gradient.
                batch_grad = per_row.sum(0).to(param.dtype)
                param.grad = batch_grad if param.grad is None else param.grad + batch_grad
                sample = fold_rows(per_row, K).sum(1) * scale  # (N, *shape)
                if name in folded:
                    if folded[name].shape != sample.shape:
                        raise GradAccumulationError(
                            f"{type(self).__name__}: one backward pass covers forwards of "
                            f"{folded[name].shape[0]} and {sample.shape[0]} samples; per-sample "
                            "gradients of different batches cannot be added")
                    sample = folded[name] + sample
                folded[name] = sample
        for name, sample in folded.items():
            self._store(params[name], sample.to(params[name].dtype))

    def _store(self, param: nn.Parameter, grad_sample: torch.Tensor) -> None:
        existing = get_grad_sample(param)
        if existing is None:
            set_grad_sample(param, grad_sample)
            return
        if not self._accumulation_allowed:
            raise GradAccumulationError(
                f"{type(self).__name__}: a second backward pass would add to p.grad_sample, which still "
                "holds the previous pass; clear it (model.zero_grad()) before the next backward, or call "
                "allow_grad_accumulation()")
        if existing.shape != grad_sample.shape:
            raise GradAccumulationError(
                f"{type(self).__name__}: cannot accumulate per-sample gradients of {existing.shape[0]} and "
                f"{grad_sample.shape[0]} samples; clear p.grad_sample between batches of different sizes")
        set_grad_sample(param, existing + grad_sample)
