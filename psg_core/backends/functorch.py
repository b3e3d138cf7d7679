"""The functorch backend: whole-model ``torch.func.vmap(grad(...))`` over ``functional_call``.

One vmapped item is one sample's K rows, so the model sees a K-row batch inside the transform and
the gradient it returns is already the gradient of that sample's loss: augmentation multiplicity
costs no per-sample memory beyond the usual ``(N, *param.shape)``. Any model made of
differentiable ops works, including modules with bare ``nn.Parameter`` s that no grad sampler
knows about.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.func import grad_and_value, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.stateless import _reparametrize_module

from psg_core.grad_sample.functorch_fallback import is_transform_limit, is_vmap_limit
from torch.utils._pytree import tree_flatten, tree_unflatten

from psg_core._module_hooks import ModuleHooks
from psg_core.backends.base import PerSampleOutput, parameters_kept, trainable_parameters
from psg_core.backends.capture import runs_in_fallback
from psg_core.grad_sample.embedding import _bag_call
from psg_core.errors import BatchLayoutError, ConfigError, PsgError, UnsupportedModuleError
from psg_core.layout import BatchLayout, ModelInputs
from psg_core.precision import no_autocast
from psg_core.provenance import BatchTracker
from psg_core.losses import LossFn
from psg_core.modes import LossReduction
from psg_core.support import NOT_VMAPPABLE, reject_batch_mixing, reject_fused

__all__ = ["functorch_per_sample", "check_functorch_support", "vmappable_attention", "reject_batch_mixing"]

logger = logging.getLogger(__name__)

_WHERE = "per_sample_gradients(mode='functorch')"


def check_functorch_support(module: nn.Module, *, where: str = _WHERE) -> None:
    """Raises :class:`UnsupportedModuleError` for layers ``vmap`` cannot treat per sample.

    BatchNorm in training mode mixes samples; fused recurrent layers have no batching rule in
    ``torch.func`` (see :mod:`psg_core.support`). Both name the offending module and the fix.
    """
    reject_batch_mixing(module, where=where)
    reject_fused(module, where=where, layer_types=NOT_VMAPPABLE,
                 why="a fused recurrent layer, which torch.func cannot vmap")
    for path, layer in module.named_modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse and layer.weight.requires_grad:
            raise UnsupportedModuleError(
                f"{where}: module '{path or '<root>'}' ({type(layer).__qualname__}) has sparse=True; torch.func "
                "computes no sparse gradients. Use mode='hooks' or 'ghost', or a dense embedding")


def _split(flat: list[Any], dims: dict[int, int], layout: BatchLayout) -> tuple[list[Any], list[int | None]]:
    """Batch tensors (``id -> batch axis`` in ``dims``) become ``(N, K, ...)``, batch moved first."""
    out: list[Any] = []
    in_dims: list[int | None] = []
    for value in flat:
        dim = dims.get(id(value)) if isinstance(value, torch.Tensor) else None
        if dim is None:
            out.append(value)
            in_dims.append(None)
        else:
            out.append(layout.fold(value, dim))  # (N, K, ...)
            in_dims.append(0)
    return out, in_dims


def _restore(flat: list[Any], in_dims: list[int | None], axes: list[int], spec: Any) -> Any:
    """Inside vmap: each batched leaf is ``(K, ...)``; put its batch axis back where it was."""
    return tree_unflatten(_restore_flat(flat, in_dims, axes), spec)


def _restore_flat(flat: list[Any], in_dims: list[int | None], axes: list[int]) -> list[Any]:
    return [v.movedim(0, a) if d == 0 and a else v for v, d, a in zip(flat, in_dims, axes)]


def functorch_per_sample(module: nn.Module, inputs: ModelInputs, targets: Any, loss_fn: LossFn, *,
                         layout: BatchLayout, reduction: LossReduction) -> PerSampleOutput:
    """Per-sample gradients and losses of ``module`` by whole-model ``vmap(grad(...))``.

    Args:
        module: the model; it is called through ``functional_call`` and not modified.
        inputs: positional and keyword model arguments; the batch tensors (see
            :meth:`psg_core.layout.ModelInputs.batch_tensors`) are split per sample, anything else
            is passed unchanged.
        targets: a tensor (or pytree of tensors) with ``N*K`` rows on their batch dimension.
        loss_fn: returns the unreduced loss of ``(outputs, targets)``.
        layout: rows, K and batch dimension (validated by the caller).
        reduction: each sample's loss is the mean or sum of the loss elements of its K rows.

    Returns:
        :class:`~psg_core.backends.base.PerSampleOutput` with ``(N, *shape)`` gradients of every
        trainable parameter and the ``(N,)`` per-sample losses.

    A model whose forward branches on the values of its inputs cannot run under ``vmap``; it then
    runs one sample at a time under ``grad`` (same result, N calls), and says so in the log once.
    Hugging Face models with ``sdpa`` attention run with their masks always built, on torch's
    math kernel (see :func:`vmappable_attention`): vmap batches them.

    >>> out = functorch_per_sample(nn.Linear(3, 1), ModelInputs((torch.randn(6, 3),), {}), torch.randn(6, 1),
    ...                            lambda o, t: (o - t) ** 2, layout=BatchLayout(6, 2, 0),
    ...                            reduction=LossReduction.MEAN)
    >>> out.grads["weight"].shape
    torch.Size([3, 1, 3])
    """
    check_functorch_support(module)
    params = trainable_parameters(module)
    batch = inputs.batch_tensors(layout)
    if any(dim < 0 for _, dim in batch):
        raise UnsupportedModuleError(
            f"{_WHERE}: module '<root>' ({type(module).__qualname__}) takes a PackedSequence or an "
            "EmbeddingBag's offsets, whose samples are not slices of one axis, so vmap cannot split "
            "them per sample; use mode='hooks' or 'ghost' (or pad the sequences, or pass 2-D bags)")
    if len(batch) > 1:
        _check_batch_inputs(module, inputs, batch, layout)
    flat_targets, tgt_spec = tree_flatten(targets)
    tgt_dims = {id(t): layout.target_dim(t) for t in flat_targets
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[layout.target_dim(t)] == layout.rows}
    if not tgt_dims:
        raise BatchLayoutError(f"{_WHERE}: targets must hold a tensor with {layout.rows} rows (N*K) on the batch "
                               f"dimension {layout.batch_dim}, like the inputs")
    flat_inputs, arg_spec = tree_flatten((inputs.args, inputs.kwargs))
    arg_axes = {id(t): dim for t, dim in batch}
    split_args, arg_in = _split(flat_inputs, arg_axes, layout)
    split_tgts, tgt_in = _split(flat_targets, tgt_dims, layout)
    axes_args = [arg_axes.get(id(v), 0) for v in flat_inputs]
    axes_tgts = [tgt_dims.get(id(v), 0) for v in flat_targets]
    detached = {name: p.detach() for name, p in params.items()}

    def sample_loss(sample_params: dict[str, torch.Tensor], sample_args: list[Any],
                    sample_targets: list[Any]) -> torch.Tensor:
        restored = _restore_flat(sample_args, arg_in, axes_args)
        where.sample_inputs = [v for v, d in zip(restored, arg_in) if d == 0]
        call_args, call_kwargs = tree_unflatten(restored, arg_spec)
        # The sample's parameters stay swapped in while the loss runs too: a loss that reads the
        # model's parameters itself (a tied output head computed in the loss) differentiates them.
        with _reparametrize_module(module, sample_params, tie_weights=True):
            outputs = module(*call_args, **call_kwargs)
            per_element = loss_fn(outputs, _restore(sample_targets, tgt_in, axes_tgts, tgt_spec))
        if per_element.dim() == 0:
            raise ConfigError("loss_fn: returned a scalar; it must return the unreduced loss "
                              "(e.g. nn.CrossEntropyLoss(reduction='none'))")
        # The K rows are this vmapped item's whole batch: reducing everything = the sample's loss.
        return per_element.mean() if reduction is LossReduction.MEAN else per_element.sum()

    where = _ModulePath(module)
    try:
        # vmap over autocast's casts mixes bf16 and fp32 in backward kernels (a dtype error on
        # attention): functorch runs in the parameters' precision, as ew does (psg_core.precision).
        with where, no_autocast(), parameters_kept(module), vmappable_attention(module):
            try:
                per_sample_grads, losses = vmap(grad_and_value(sample_loss), in_dims=(None, arg_in, tgt_in),
                                                randomness="different")(detached, split_args, split_tgts)
            except RuntimeError as err:
                # vmap cannot batch the model (data-dependent control flow, .item(), an in-place op
                # into an unbatched tensor, a data-dependent shape): one sample at a time instead.
                if not is_vmap_limit(err):
                    raise
                _warn_loop(module, where.failed, err)
                per_sample_grads, losses = _one_at_a_time(sample_loss, detached, split_args, arg_in,
                                                          split_tgts, tgt_in, layout.num_samples)
    except PsgError:
        raise
    except Exception as err:  # noqa: BLE001  (whatever torch.func raises, named by module)
        remedy = (" (mode='hooks' and mode='ghost' compute such a module's per-sample gradients with autograd, "
                  "one sample at a time)" if isinstance(err, RuntimeError) and is_transform_limit(err) else "")
        raise UnsupportedModuleError(f"{_WHERE}: module {where.failed or '<root>'} failed under torch.func: "
                                     f"{err}{remedy}") from err
    return PerSampleOutput(grads=dict(per_sample_grads), per_sample_losses=losses.detach(),
                           num_samples=layout.num_samples)


def _check_batch_inputs(module: nn.Module, inputs: ModelInputs, batch: list[tuple[torch.Tensor, int]],
                        layout: BatchLayout) -> None:
    """Several inputs have the batch's N*K rows: vmap would split each of them per sample. One that
    holds no samples (a ``(T,)`` position vector whose T equals N*K) would be split too, each
    sample given a slice of it: a wrong gradient and nothing inside vmap to show it. A forward pass
    (no gradients) under psg's batch tracker, these inputs marked as the batch, refuses where they
    pair rows of different samples or the output's rows mix samples, as hooks and ghost refuse;
    the message names ``batch_free``, which declares such an input."""
    # What a forward pass changes in place is put back (running statistics, a max_norm table's
    # renormalised rows): this pass only looks.
    state = list(module.buffers())
    state += [layer.weight for layer in module.modules()
              if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.max_norm is not None]
    with torch.no_grad():
        saved = [(t, t._version, t.clone()) for t in state]
        try:
            with parameters_kept(module), BatchTracker(
                    module, num_samples=layout.num_samples, augmentation_multiplicity=layout.augmentation_multiplicity,
                    on_meeting=lambda *_: None, meets_own=runs_in_fallback) as tracker:
                for tensor, dim in batch:
                    tracker.mark(tensor, dim)
                try:
                    tracker.check_outputs(module(*inputs.args, **inputs.kwargs), "the model's output")
                finally:
                    tracker.release()
        finally:
            for tensor, version, copy in saved:
                if tensor._version != version:  # written in place (an expanded buffer never is)
                    tensor.copy_(copy)


@contextlib.contextmanager
def vmappable_attention(module: nn.Module) -> Iterator[None]:
    """Where a Hugging Face config in ``module`` asks for ``sdpa`` attention: transformers builds
    every ``sdpa`` mask in the block (no skip), and torch runs its math attention kernel.

    Under ``sdpa``, transformers' mask utilities skip the mask where ``padding_mask.all()`` holds, a
    branch on the values of the batch that ``vmap`` cannot take (the whole model then ran one
    sample at a time), and torch's fused attention kernels have no batching rule (``vmap`` loops
    over them inside). With the mask always built the attention is the same (the skip only lets a
    kernel apply causality itself), and the math kernel's ops are batched. The swap is made in
    transformers' ``AttentionMaskInterface`` registry for the block (another thread's model built
    meanwhile gets the same attention with its mask built) and the model's code still sees
    ``sdpa``: some models branch on that name (Falcon's attention reads an additive mask
    otherwise). A Llama causal LM's functorch step went from 376 to 188 ms (one thread, batch
    16). Other implementations (eager, flash, flex) are left as they are.

    >>> class Config:
    ...     _attn_implementation_internal = "eager"
    >>> layer = nn.Linear(2, 2); layer.config = Config()
    >>> with vmappable_attention(layer):  # not sdpa: nothing to do
    ...     pass
    """
    sdpa = any(getattr(getattr(layer, "config", None), "_attn_implementation_internal", None) == "sdpa"
               for layer in module.modules())
    masking = sys.modules.get("transformers.masking_utils") if sdpa else None
    masks = getattr(masking, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    if masks is None or "sdpa" not in masks:
        yield
        return
    # torch's kernel choice is process-wide too: set by the first block, restored by the last
    with _MASK_LOCK:
        if _mask_users[0] == 0:
            original, math_kernel = masks["sdpa"], sdpa_kernel(SDPBackend.MATH)
            math_kernel.__enter__()
            _swapped[:] = [original, math_kernel]
            type(masks).register("sdpa", functools.partial(_mask_without_skips, original))
        _mask_users[0] += 1
    try:
        yield
    finally:
        with _MASK_LOCK:
            _mask_users[0] -= 1
            if _mask_users[0] == 0:
                original, math_kernel = _swapped
                type(masks).register("sdpa", original)
                math_kernel.__exit__(None, None, None)
                _swapped.clear()


def _mask_without_skips(original: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' sdpa mask function ``original``, told never to skip the mask (it is bound
    here: a thread still building a mask when the last block ends keeps a working function)."""
    return original(*args, **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})


_MASK_LOCK = threading.Lock()
#: how many vmappable_attention blocks run now (the registry holds the swapped function while > 0)
_mask_users = [0]
#: transformers' own sdpa mask function and torch's math-kernel setting, while the swap lasts
_swapped: list[Any] = []

_warned: set[type[nn.Module]] = set()


def _warn_loop(module: nn.Module, where: str | None, err: BaseException) -> None:
    if type(module) not in _warned:
        _warned.add(type(module))
        reason = " ".join(str(err).split())[:160]
        if "data-dependent control flow" in reason or ".item()" in reason:
            reason = "it branches on input values"
        logger.warning("%s: vmap cannot batch %s (module %s: %s); computing one sample at a time", _WHERE,
                       type(module).__qualname__, where or "<root>", reason)


def _one_at_a_time(sample_loss: Any, params: dict[str, torch.Tensor], args: list[Any], arg_in: list[int | None],
                   tgts: list[Any], tgt_in: list[int | None], num_samples: int
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``vmap``'s result computed by a loop over samples (for forwards ``vmap`` cannot batch)."""
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    losses = []
    step = grad_and_value(sample_loss)
    for n in range(num_samples):
        sample_args = [v[n] if d == 0 else v for v, d in zip(args, arg_in)]
        sample_tgts = [v[n] if d == 0 else v for v, d in zip(tgts, tgt_in)]
        g, loss = step(params, sample_args, sample_tgts)
        for name in params:
            grads[name].append(g[name])
        losses.append(loss)
    return {name: torch.stack(gs) for name, gs in grads.items()}, torch.stack(losses)


class _ModulePath:
    """Remembers the innermost module whose forward raised, to name it in errors; and refuses an
    EmbeddingBag given a sample's slice of the batch as 1-D tokens with offsets (see
    :meth:`_check_bag`)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._stack: list[str] = []
        self.failed: str | None = None
        self._hooks = ModuleHooks()
        #: The per-sample slices of the model's batch inputs in the call under way.
        self.sample_inputs: list[Any] = []

    def __enter__(self) -> _ModulePath:
        try:
            for path, layer in self._module.named_modules():
                label = f"'{path or '<root>'}' ({type(layer).__qualname__})"
                self._hooks.pre(layer, lambda _m, _a, label=label: self._stack.append(label))
                self._hooks.forward(layer, self._pop, always_call=True)
                if isinstance(layer, nn.EmbeddingBag):
                    self._hooks.pre(layer, functools.partial(self._check_bag, label), with_kwargs=True)
        except BaseException:
            self.__exit__()  # no hook left on the model
            raise
        return self

    def _check_bag(self, label: str, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """1-D tokens with offsets, one of them a sample's slice of a batch input: the offsets are
        positions in the whole batch's token list, which vmap does not split with them (a sample
        got the wrong tokens, or all of them; torch's CPU kernel rejects such offsets, its CUDA
        kernel reads them). Offsets the model builds itself from a sample's tokens are fine."""
        tokens, offsets, _ = _bag_call(list(args), kwargs)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or offsets is None:
            return
        if any(t is tokens or t is offsets for t in self.sample_inputs):
            raise UnsupportedModuleError(
                f"{_WHERE}: module {label} takes 1-D tokens with offsets from the batch: the offsets "
                "are positions in the whole batch's token list, which vmap cannot split per sample; "
                "use mode='hooks' or 'ghost' (or pass 2-D bags)")

    def _pop(self, _m: nn.Module, _a: Any, _o: Any) -> None:
        if self._stack:
            label = self._stack.pop()
            if self.failed is None and sys.exc_info()[0] is not None:
                self.failed = label

    def __exit__(self, *exc: Any) -> None:
        self._hooks.remove()
