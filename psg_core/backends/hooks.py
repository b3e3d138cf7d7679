"""The hooks backend: forward hooks keep activations, gradient hooks call the grad samplers."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from psg_core.backends.base import (AbstractGradSampleModule, PerSampleOutput, backward_to_edges, check_rows,
                                    earliest_edges, get_grad_sample, on_output_grads, set_grad_sample,
                                    trainable_parameters)
from psg_core._layout import ALWAYS_BATCH_FIRST
from psg_core.backends.capture import (LayerCall, call_grad_samples, capture_call, runs_in_fallback, runs_whole,
                                      separate_outputs)
from psg_core.errors import BatchLayoutError, ConfigError, GradAccumulationError, UnsupportedModuleError
from psg_core.grad_sample._utils import accumulating_into, takes_targets
from psg_core.grad_sample.registry import GRAD_SAMPLERS
from psg_core.layout import BatchLayout, ModelInputs
from psg_core.losses import LossFn, loss_batch_dim, per_sample_loss
from psg_core.modes import LossReduction
from psg_core.precision import layer_dtype, no_autocast, to_compute
from psg_core.provenance import BatchTracker, MeetingPoint, recomputing
from psg_core.support import FUSED, SAMPLE_MIXING, frequency_scaled, hooked_modules, is_unit, own_parameters

__all__ = ["GradSampleModule", "ALWAYS_BATCH_FIRST", "hooks_per_sample"]

logger = logging.getLogger(__name__)


def _always(_layer: nn.Module) -> bool:
    return True  # under force_functorch every layer's call runs again per sample


def _own_trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in own_parameters(module) if p.requires_grad]


#: Guards the wrappers' "which thread's pass is running" check and update (held for a few
#: instructions; one lock for all, so that a wrapper holds no lock and stays copyable).
_PASS_LOCK = threading.Lock()


class GradSampleModule(AbstractGradSampleModule):
    """Hooks-based per-sample gradients, with augmentation multiplicity K.

    The input batch holds ``N*K`` rows, sample-major (rows ``n*K .. n*K+K-1`` are the K copies of
    sample n). After ``loss.backward()`` each trainable parameter ``p`` of the wrapped module has
    ``p.grad_sample`` of shape ``(N, *p.shape)``: the gradient of sample n's loss, which is the
    ``loss_reduction`` (mean or sum) of its K rows' losses. ``p.grad`` is computed as usual.

    Args:
        module: the model to wrap. Hook state lives in this wrapper, never on ``module``.
        batch_first: whether the batch is dimension 0 (True) or 1 of every layer input.
        loss_reduction: ``"mean"`` or ``"sum"``, the reduction of the batch loss over rows.
        strict: raise :class:`~psg_core.errors.UnsupportedModuleError` at construction when a
            module with trainable parameters has no grad sampler; otherwise such modules use the
            per-layer ``torch.func`` fallback.
        force_functorch: compute every layer with the ``torch.func`` fallback.
        augmentation_multiplicity: K, the number of augmented copies per sample.

    >>> model = GradSampleModule(nn.Linear(4, 2), augmentation_multiplicity=2)
    >>> model(torch.randn(6, 4)).sum().backward()
    >>> model.weight.grad_sample.shape
    torch.Size([3, 2, 4])
    """

    def __init__(self, module: nn.Module, *, batch_first: bool = True,
                 loss_reduction: str | LossReduction = "mean", strict: bool = True,
                 force_functorch: bool = False, augmentation_multiplicity: int = 1) -> None:
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction,
                         augmentation_multiplicity=augmentation_multiplicity)
        self.strict = bool(strict)
        self.force_functorch = bool(force_functorch)
        self.validate(module, strict=strict, force_functorch=force_functorch, report_missing=strict)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooks_enabled = True
        self._capture_suspended = False
        self._accumulation_allowed = False
        self._forward_id = 0
        # (forward id, rows, layer) of the first layer a wrapped forward pass captured.
        self._pass_rows: tuple[int, int, str] | None = None
        # While recording_edges() is active: the gradient edges of every hooked output.
        self._edge_log: list[GradientEdge] | None = None
        # The batch trackers of the running forward pass (see psg_core.provenance).
        self._explicit_tracker: BatchTracker | None = None
        self._implicit_tracker: BatchTracker | None = None
        # id(parameter) -> forward passes whose contributions p.grad_sample currently holds.
        self._sources: dict[int, set[int]] = {}
        # id(parameter) -> the grad_sample tensor this wrapper summed itself (safe to add into).
        self._owned: dict[int, weakref.ref[torch.Tensor]] = {}
        # The thread whose forward pass through the model is running, and how deep (a pass may
        # call the model again): another thread's forward meanwhile is refused (see _new_pass).
        self._pass_thread: int | None = None
        self._pass_depth = 0
        self.add_hooks()

    # ----------------------------------------------------------------------------- lifecycle
    def add_hooks(self) -> None:
        """Installs the forward hooks (idempotent)."""
        if self._handles:
            return
        # Each call of the wrapped model is a new forward pass, whether it goes through this
        # wrapper or straight to the model (accumulation is told apart by pass).
        self._handles.append(self._module.register_forward_pre_hook(self._new_pass, with_kwargs=True))
        self._handles.append(self._module.register_forward_hook(self._end_pass, always_call=True))
        for _, layer in hooked_modules(self._module):
            if _own_trainable(layer) or (self.force_functorch and any(True for _ in layer.parameters(recurse=False))):
                self._handles.append(layer.register_forward_hook(self._capture, with_kwargs=True, prepend=True))

    def remove_hooks(self) -> None:
        """Removes every hook this wrapper installed; the model is left exactly as it was (a pass
        that a KeyboardInterrupt cut short in a direct call of the model is ended, as the thread's
        next call of the model ends it; see :meth:`forward`)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._abandon_pass()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*args, **kwargs)
        except BaseException:
            # torch runs a forward's always-call hooks (_end_pass) on an Exception only: after a
            # KeyboardInterrupt the pass would stay open, its batch tracker left active on this
            # thread (every later op through it) and the wrapper held for this thread.
            self._abandon_pass()
            raise

    def _abandon_pass(self) -> None:
        """Ends this thread's pass if it did not end (no-op after one that did, or where another
        thread's pass runs: a call _new_pass refused): its batch tracker is left, and the wrapper
        is free for any thread."""
        with _PASS_LOCK:
            if self._pass_thread != threading.get_ident():
                return
            self._pass_thread, self._pass_depth = None, 0
        self._end_tracking()

    def enable_hooks(self) -> None:
        """Turns per-sample gradient capture back on (it is on by default)."""
        self._hooks_enabled = True

    def disable_hooks(self) -> None:
        """Turns capture off without removing hooks: forward/backward behave like the bare model."""
        self._hooks_enabled = False

    def allow_grad_accumulation(self) -> None:
        """Lets several backward passes add into ``p.grad_sample`` until it is cleared."""
        self._accumulation_allowed = True

    def forbid_grad_accumulation(self) -> None:
        """A backward pass that would add to an uncleared ``p.grad_sample`` raises ValueError."""
        self._accumulation_allowed = False

    @contextlib.contextmanager
    def recording_edges(self) -> Iterator[list[GradientEdge]]:
        """Collects the gradient edges of the layer outputs hooked by forward passes in the block.

        ``torch.autograd.grad(loss, psg_core.backends.base.earliest_edges(edges))`` then fills
        ``p.grad_sample`` without computing any ``p.grad`` (the weight-gradient kernels of a plain
        ``backward()`` are skipped): what :func:`psg_core.per_sample_gradients` does.

        >>> from psg_core.backends.base import earliest_edges
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
        >>> model = GradSampleModule(net)
        >>> with model.recording_edges() as edges:
        ...     loss = model(torch.randn(5, 4)).sum()
        >>> _ = torch.autograd.grad(loss, earliest_edges(edges))
        >>> net[0].weight.grad_sample.shape, net[0].weight.grad
        (torch.Size([5, 3, 4]), None)
        """
        previous, self._edge_log = self._edge_log, []
        try:
            yield self._edge_log
        finally:
            self._edge_log = previous

    @contextlib.contextmanager
    def tracking(self, inputs: ModelInputs, layout: BatchLayout) -> Iterator[BatchTracker]:
        """Follows the batch from ``inputs`` through the forward passes (and the loss) run in the
        block; without it each forward pass of the wrapped model tracks itself, its rows counted
        on its first batch tensor."""
        tracker = self._new_tracker(layout, self._forward_id + 1)  # the next pass is the block's
        with tracker:
            for tensor, dim in inputs.batch_tensors(layout):
                tracker.mark(tensor, dim)
            previous, self._explicit_tracker = self._explicit_tracker, tracker
            try:
                yield tracker
            finally:
                self._explicit_tracker = previous
                tracker.release()

    def _new_tracker(self, layout: BatchLayout, forward_id: int, *, implicit: bool = False) -> BatchTracker:
        return BatchTracker(self._module, num_samples=layout.num_samples,
                            augmentation_multiplicity=layout.augmentation_multiplicity,
                            on_meeting=lambda point, view: self._on_meeting(point, view, layout, forward_id),
                            root_by_caller=implicit, meets_own=None if self.force_functorch else runs_in_fallback,
                            keeps_state=_always if self.force_functorch else runs_whole)

    def _new_pass(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        me = threading.get_ident()
        if self._pass_thread == me and not self._outer_call_running():
            # This thread's pass is open, but no call of the model runs on its stack: a direct
            # call cut short by a KeyboardInterrupt (torch ran no always-call hook). It ends here,
            # or its stale tracker would follow this pass and the wrapper stay held.
            self._abandon_pass()
        with _PASS_LOCK:
            if self._pass_thread is not None and self._pass_thread != me:
                raise ConfigError(
                    "GradSampleModule: a forward pass began in one thread while another thread's pass "
                    "through the same model was running; the wrapper follows one pass at a time (its "
                    "hooks fire for every call of the model) and keeps one batch's per-sample gradients "
                    "(p.grad_sample on the shared parameters). Give each thread its own model and "
                    "wrapper, take turns (a lock around forward and backward), or call "
                    "psg_core.per_sample_gradients / dp_gradient, which run one call per model at a time")
            self._pass_thread = me
            self._pass_depth += 1
            if self._pass_depth > 1:
                return  # the model called again inside its pass: the same pass, the same tracker
        self._forward_id += 1
        if (self._explicit_tracker is not None or not self._hooks_enabled or self._capture_suspended
                or not torch.is_grad_enabled() or self._implicit_tracker is not None):
            return
        inputs = ModelInputs.of_call(args, kwargs, self._call_free)
        rows = inputs.first_rows(self.batch_dim)
        if rows is None:
            return
        # Not validated here: each hooked layer checks its own rows against K (an EmbeddingBag
        # with offsets counts bags, not the tokens of its first input).
        layout = BatchLayout(rows=rows, augmentation_multiplicity=self.augmentation_multiplicity,
                             batch_dim=self.batch_dim)
        tracker = self._new_tracker(layout, self._forward_id, implicit=True)
        tracker.__enter__()
        self._implicit_tracker = tracker
        for tensor, dim in inputs.batch_tensors(layout):
            tracker.mark(tensor, dim)
        tracker.push_frame(module, "'<root>' (" + type(module).__qualname__ + ")", args, kwargs)

    def _outer_call_running(self) -> bool:
        """Whether a call of the wrapped model other than the one starting runs on this thread's
        stack (a pass calling the model again). Asked only while this thread holds a pass."""
        code = nn.Module._call_impl.__code__
        calls = 0
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code is code and frame.f_locals.get("self") is self._module:
                calls += 1
                if calls == 2:
                    return True
            frame = frame.f_back
        return False

    def _end_pass(self, module: nn.Module, args: Any, output: Any) -> None:
        with _PASS_LOCK:
            if self._pass_thread != threading.get_ident():
                return  # a call _new_pass refused (torch runs this hook after a pre-hook raised)
            self._pass_depth -= 1
            if self._pass_depth > 0:
                return  # a call inside the pass ended; the pass (and its tracker) goes on
            self._pass_thread = None
        self._end_tracking(output)

    def _end_tracking(self, output: Any = None) -> None:
        """Exits and releases the pass's own tracker (if it has one), first checking ``output``,
        when given and no exception is under way."""
        tracker, self._implicit_tracker = self._implicit_tracker, None
        if tracker is None:
            return
        try:
            if output is not None and sys.exc_info()[0] is None:
                # The loss is the caller's, out of sight: an output whose rows already mix
                # samples (an op after the last layer, a head reading a table the batch's
                # lookups renormalised) is refused here, before any per-sample gradient.
                tracker.check_outputs(output, "the model's output")
        finally:
            tracker.__exit__(None, None, None)
            tracker.release()

    def _on_meeting(self, point: MeetingPoint, view: torch.Tensor, layout: BatchLayout, forward_id: int) -> None:
        """A batch-free tensor computed from parameters meets the batch: its per-sample
        gradients come from the gradient arriving at the expanded view (see psg_core.provenance)."""
        scale = float(layout.num_samples) if self.loss_reduction is LossReduction.MEAN else 1.0

        def on_grads(grads: Any) -> None:
            if grads[0] is None or not self._hooks_enabled:
                return
            with no_autocast():  # the hook runs inside the caller's autocast region
                for param, grad_sample in point.per_sample_grads(grads[0], layout.num_samples,
                                                                 layout.augmentation_multiplicity).items():
                    self._store(param, grad_sample * scale if scale != 1.0 else grad_sample, forward_id)

        on_output_grads([view], on_grads)
        if self._edge_log is not None:
            self._edge_log.append(get_gradient_edge(view))

    # ----------------------------------------------------------------------------- validation
    @classmethod
    def is_supported(cls, module: nn.Module) -> bool:
        """Whether this single module (not its children) can get per-sample gradients by hooks."""
        if isinstance(module, SAMPLE_MIXING):
            return False
        return not _own_trainable(module) or GRAD_SAMPLERS.lookup(module) is not None

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False,
                 force_functorch: bool = False, report_missing: bool = True) -> list[UnsupportedModuleError]:
        """Checks that every trainable parameter of ``module`` can get a per-sample gradient.

        Returns the list of problems, or raises the first one when ``strict``. Layers that mix
        samples (BatchNorm in training or with trainable parameters) and fused recurrent and
        attention layers are always reported; use :func:`psg_core.fix_model` for them.
        ``report_missing=False`` (not ``strict``) leaves out the layers without a grad sampler (the
        torch.func fallback's; a wrapper built on every step has no use for the list).
        """
        errors: list[UnsupportedModuleError] = []
        for path, layer in hooked_modules(module):
            where = f"'{path or '<root>'}' ({type(layer).__qualname__})"
            if isinstance(layer, torch.jit.ScriptModule):
                errors.append(UnsupportedModuleError(
                    f"GradSampleModule: module {where} is a TorchScript module (torch.jit.script), whose calls "
                    "no forward hook can follow; pass the eager module (script the model after training)"))
                break
            if isinstance(layer, SAMPLE_MIXING) and layer.training:
                errors.append(UnsupportedModuleError(
                    f"GradSampleModule: module {where} is a BatchNorm in training mode, which mixes samples "
                    "of a batch, so per-sample gradients are undefined; call .eval() on it (its running "
                    "statistics then make it a per-sample affine map) or replace it with GroupNorm "
                    "(psg_core.fix_model does)"))
            elif frequency_scaled(layer) and not force_functorch:
                errors.append(UnsupportedModuleError(
                    f"GradSampleModule: module {where} has scale_grad_by_freq=True, which scales gradients "
                    "by token frequencies over the whole batch, so its grad sampler cannot give each sample "
                    "its own; use mode='functorch' (each sample alone) or scale_grad_by_freq=False"))
            elif isinstance(layer, FUSED) and _own_trainable(layer):
                errors.append(UnsupportedModuleError(
                    f"GradSampleModule: module {where} is a fused layer; swap it for its DP "
                    "rewrite with psg_core.fix_model"))
            elif ((report_missing or strict) and not force_functorch and _own_trainable(layer)
                  and GRAD_SAMPLERS.lookup(layer) is None and not is_unit(layer)):
                errors.append(UnsupportedModuleError(
                    f"GradSampleModule: module {where} has trainable parameters but no registered "
                    f"grad sampler; register one with @register_grad_sampler({type(layer).__name__}), "
                    "pass strict=False to use the torch.func fallback, or use mode='functorch'"))
        if strict and errors:
            raise errors[0]
        # Fused and sample-mixing layers are wrong under any setting.
        hard = [e for e in errors if "no registered grad sampler" not in str(e)]
        if hard:
            raise hard[0]
        return errors

    # ----------------------------------------------------------------------------- hooks
    @contextlib.contextmanager
    def _suspend_capture(self) -> Iterator[None]:
        previous, self._capture_suspended = self._capture_suspended, True
        try:
            yield
        finally:
            self._capture_suspended = previous

    def _capture(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> Any:
        # The hook's own tensor reads (requires_grad, shapes, detach) need no tracking: without
        # torch function dispatch they cost nanoseconds, not microseconds, per read.
        with torch._C.DisableTorchFunction():
            return self._capture_call(layer, args, kwargs, output)

    def _capture_call(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      output: Any) -> Any:
        """Records the call; returns the output that replaces the module's (see
        :func:`~psg_core.backends.capture.separate_outputs`), or None."""
        if not self._hooks_enabled or self._capture_suspended or not torch.is_grad_enabled() or recomputing():
            return None
        if not _own_trainable(layer):
            return None
        replaced = separate_outputs(output)
        captured = capture_call(layer, args, kwargs, output if replaced is None else replaced, self.batch_dim)
        if captured is None:
            return replaced
        call, outputs = captured
        if call.rows is None:
            raise UnsupportedModuleError(
                f"GradSampleModule: {type(layer).__qualname__} was called without a batched "
                "tensor as its first argument, so its rows cannot be attributed to samples")
        explicit = self._explicit_tracker
        if explicit is None or call.rows != explicit.num_samples * explicit.K:
            # (the batch's own N*K rows, of a validated layout, need no check)
            check_rows(call.rows, self.augmentation_multiplicity,
                       where=f"GradSampleModule ({type(layer).__qualname__})")
        if explicit is None:
            # The wrapper knows no N: every layer of one forward pass must see the same rows (a view
            # that folds another axis into the batch's, (N, C, T) -> (N*C, T), which the tracker
            # lost, would make its rows look like samples).
            first = self._pass_rows
            if first is None or first[0] != self._forward_id:
                self._pass_rows = (self._forward_id, call.rows, type(layer).__qualname__)
            elif first[1] != call.rows:
                raise BatchLayoutError(
                    f"GradSampleModule: {type(layer).__qualname__} was called with {call.rows} rows on its batch "
                    f"dimension, but {first[2]} saw {first[1]} in the same forward pass; psg cannot attribute both "
                    "to the same samples (an axis folded into the batch's?)")
        if explicit is not None and call.rows != explicit.num_samples * explicit.K:
            # The batch's rows are known (counted on the targets): a layer that sees another
            # number on its batch axis would get per-row gradients that are not per-sample.
            raise BatchLayoutError(
                f"per_sample_gradients: module {explicit.current_module()} was called with {call.rows} rows "
                f"on its batch dimension {call.batch_dim}, but the batch has {explicit.num_samples * explicit.K} "
                "(N*K); psg cannot attribute that layer's rows to samples")
        # Held only until this call's backward has used it, then released.
        held = [call]
        forward_id = self._forward_id

        def on_grads(grads: Any) -> None:
            if not held:
                raise UnsupportedModuleError(
                    f"GradSampleModule: a second backward pass through the same graph reached "
                    f"{type(layer).__qualname__} (retain_graph=True); run the forward pass again")
            captured = held.pop()
            self._on_backprops(captured, captured.output_grads(list(grads)), forward_id)

        on_output_grads(outputs, on_grads)
        if self._edge_log is not None:
            self._edge_log.extend([get_gradient_edge(t) for t in outputs])
        return replaced

    def _on_backprops(self, call: LayerCall, backprops: list[torch.Tensor | None], forward_id: int) -> None:
        if not self._hooks_enabled:
            return
        n_samples = (call.rows or 0) // self.augmentation_multiplicity
        # Mean reduction: sample n's loss is N times its share of the batch loss. Per-sample
        # gradients are linear in the backprops, so scale whichever tensor is smaller.
        scale = float(n_samples) if self.loss_reduction is LossReduction.MEAN else 1.0
        if scale != 1.0:
            backprop_size = sum(b.numel() for b in backprops if b is not None)
            grad_sample_size = n_samples * sum(p.numel() for p in _own_trainable(call.layer))
            if backprop_size <= grad_sample_size:
                # In the parameters' precision first: half-precision backprops times N may overflow.
                dtype = layer_dtype(call.layer)
                backprops = [to_compute(b, dtype) * scale if b is not None else None for b in backprops]
                scale = 1.0
        # A parameter this pass already has a per-sample gradient of, in a tensor of this
        # wrapper's (a tied weight's second owner): offered to the layer's own sampler, when it is
        # one that adds into it in place (psg_core.grad_sample._utils.adds_into_targets).
        entry = None if self.force_functorch else call.entry
        targets = self._addable_targets(call.layer, forward_id) \
            if scale == 1.0 and entry is not None and takes_targets(entry.fn) else {}
        with accumulating_into(targets) if targets else contextlib.nullcontext():
            grad_samples = call_grad_samples(call, backprops, self.augmentation_multiplicity,
                                             where="GradSampleModule", force_functorch=self.force_functorch,
                                             suspend=self._suspend_capture())
        # Storages autograd or the caller still use: a sampler's output that lies in one of them
        # (a bias's gradient may be the backprop itself) must never be added into in place.
        borrowed = {t.untyped_storage().data_ptr() for t in [*backprops, *call.args]
                    if isinstance(t, torch.Tensor)}
        for param, grad_sample in grad_samples.items():
            if not param.requires_grad or targets.get(id(param)) is grad_sample:
                continue  # (a target given back: the sampler added its part into it)
            if scale != 1.0:
                grad_sample = grad_sample * scale
            self._store(param, grad_sample, forward_id,
                        fresh=grad_sample.untyped_storage().data_ptr() not in borrowed)

    def _addable(self, param: torch.Tensor, existing: torch.Tensor, forward_id: int) -> bool:
        """Whether ``existing``, ``param``'s per-sample gradient, may be added into in place by another
        call of pass ``forward_id`` (a recurrent cell, a shared layer): this wrapper made it in
        that pass and nobody has seen it yet, and its elements do not share memory (torch.func
        returns an expanded zero for a parameter whose gradient is zero)."""
        key = id(param)
        owned = self._owned.get(key)
        return forward_id in self._sources.get(key, ()) and owned is not None and owned() is existing \
            and torch._debug_has_internal_overlap(existing) == 0

    def _addable_targets(self, layer: nn.Module, forward_id: int) -> dict[int, torch.Tensor]:
        """The layer's parameters whose per-sample gradient of this pass :meth:`_addable` allows
        adding into, by ``id``: what its sampler is offered (psg_core.grad_sample._utils.accumulating_into)."""
        targets = {}
        for param in _own_trainable(layer):
            if forward_id not in self._sources.get(id(param), ()):
                continue  # (the common case: no call of this pass has stored one yet)
            existing = get_grad_sample(param)
            if existing is not None and self._addable(param, existing, forward_id):
                targets[id(param)] = existing
        return targets

    def _store(self, param: torch.Tensor, grad_sample: torch.Tensor, forward_id: int, *,
               fresh: bool = False) -> None:
        existing = get_grad_sample(param)
        key = id(param)
        if existing is None:
            stored = grad_sample.to(param.dtype)
            set_grad_sample(param, stored)
            self._sources[key] = {forward_id}
            if fresh or stored is not grad_sample:
                # A tensor made for this pass alone (a tied weight's second owner adds into it in
                # place: one (N, *shape) tensor less).
                self._owned[key] = weakref.ref(stored)
            else:
                self._owned.pop(key, None)
            return
        sources = self._sources.setdefault(key, set())
        if forward_id not in sources and not self._accumulation_allowed:
            raise GradAccumulationError(
                "GradSampleModule: a second backward pass would add to p.grad_sample, which "
                "still holds the previous pass; clear it (model.zero_grad()) before the next "
                "backward, or call allow_grad_accumulation()")
        if existing.shape != grad_sample.shape:
            raise GradAccumulationError(
                f"GradSampleModule: cannot accumulate per-sample gradients of {existing.shape[0]} "
                f"and {grad_sample.shape[0]} samples; clear p.grad_sample between batches of "
                "different sizes")
        if self._addable(param, existing, forward_id):
            existing.add_(grad_sample)
            return
        # First sum (the sampler's output may alias autograd's buffers) or a new backward pass
        # (the caller may hold the previous tensor): a new tensor, owned by this wrapper.
        total = existing + grad_sample
        set_grad_sample(param, total)
        self._owned[key] = weakref.ref(total)
        sources.add(forward_id)


def hooks_per_sample(module: nn.Module, inputs: ModelInputs, targets: Any, loss_fn: LossFn, *,
                     layout: BatchLayout, reduction: LossReduction) -> PerSampleOutput:
    """Per-sample gradients and losses of ``module`` by the hooks backend (the layout validated).

    ``sum_n loss_n`` (each sample's loss already reduced over its K rows as asked) is
    backpropagated to the hooked layer outputs only, so every layer gets output gradients in
    per-sample scale and no ``p.grad`` is computed (nor touched).

    >>> out = hooks_per_sample(nn.Linear(3, 1), ModelInputs((torch.randn(6, 3),), {}), torch.randn(6, 1),
    ...                        lambda o, t: (o - t) ** 2, layout=BatchLayout(6, 2, 0),
    ...                        reduction=LossReduction.MEAN)
    >>> out.grads["weight"].shape
    torch.Size([3, 1, 3])
    """
    params = trainable_parameters(module)
    n_samples = layout.num_samples
    saved = {name: get_grad_sample(p) for name, p in params.items()}
    for p in params.values():
        set_grad_sample(p, None)
    wrapped = GradSampleModule(module, batch_first=layout.batch_dim == 0, loss_reduction=LossReduction.SUM,
                               strict=False, augmentation_multiplicity=layout.augmentation_multiplicity)
    try:
        with wrapped.recording_edges() as edges, wrapped.tracking(inputs, layout) as tracker:
            tracker.mark_targets(targets, layout)
            per_element = loss_fn(wrapped(*inputs.args, **inputs.kwargs), targets)
            if per_element.dim():
                tracker.check_rows(per_element, "the loss")
            loss_dim = loss_batch_dim(per_element, layout.batch_dim, tracker.batch_dim(per_element))
        losses = per_sample_loss(per_element, num_samples=n_samples, batch_dim=loss_dim, reduction=reduction)
        if edges and n_samples:
            # Gradients of the hooked layer outputs only: the hooks fill p.grad_sample.
            backward_to_edges(losses.sum(), edges, where="per_sample_gradients(mode='hooks')")
        grads = {}
        for name, p in params.items():
            gs = get_grad_sample(p)
            grads[name] = gs if gs is not None else torch.zeros(n_samples, *p.shape, dtype=p.dtype,
                                                                 device=p.device)
    finally:
        wrapped.remove_hooks()
        for name, p in params.items():
            set_grad_sample(p, saved[name])
    return PerSampleOutput(grads=grads, per_sample_losses=losses.detach(), num_samples=n_samples)
