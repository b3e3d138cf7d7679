"""The functorch backend: whole-model ``torch.func.vmap(grad(...))`` over ``functional_call``.

One vmapped item is one sample's K rows, so the model sees a K-row batch inside the transform and
the gradient it returns is already the gradient of that sample's loss: augmentation multiplicity
costs no per-sample memory beyond the usual ``(N, *param.shape)``. Any model made of
differentiable ops works, including modules with bare ``nn.Parameter`` s that no grad sampler
knows about.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from psg_core.api import PerSampleOutput, batch_rows, register_backend
from psg_core.backends.base import check_rows, trainable_parameters
from psg_core.errors import BatchLayoutError, ConfigError, UnsupportedModuleError
from psg_core.losses import LossFn
from psg_core.modes import GradSampleMode, LossReduction

__all__ = ["functorch_per_sample", "check_functorch_support", "reject_batch_mixing"]

logger = logging.getLogger(__name__)

_WHERE = "per_sample_gradients(mode='functorch')"


def reject_batch_mixing(module: nn.Module, *, where: str) -> None:
    """Raises :class:`UnsupportedModuleError` naming the first BatchNorm in training mode.

    It normalises with statistics of the whole batch, so a sample's gradient depends on the other
    samples and per-sample gradients are undefined (even when its own affine parameters are frozen).
    """
    for path, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training:
            raise UnsupportedModuleError(
                f"{where}: module '{path or '<root>'}' ({type(layer).__qualname__}) is a BatchNorm in "
                "training mode, which mixes the samples of a batch, so per-sample gradients are "
                "undefined; call .eval() on it or replace it with GroupNorm (psg_core.fix_model does)")


def check_functorch_support(module: nn.Module, *, where: str = _WHERE) -> None:
    """Raises :class:`UnsupportedModuleError` for layers ``vmap`` cannot treat per sample.

    BatchNorm in training mode mixes samples (see :func:`reject_batch_mixing`); fused recurrent
    layers have no batching rule in ``torch.func``. Both name the offending module and the fix.
    """
    reject_batch_mixing(module, where=where)
    for path, layer in module.named_modules():
        name = f"'{path or '<root>'}' ({type(layer).__qualname__})"
        if isinstance(layer, nn.RNNBase) and any(p.requires_grad for p in layer.parameters()):
            raise UnsupportedModuleError(
                f"{where}: module {name} is a fused recurrent layer, which torch.func cannot vmap; swap "
                "it for its DP rewrite with psg_core.fix_model")


def _is_batched(value: Any, batch_dim: int, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > batch_dim and value.shape[batch_dim] == rows


def _split_samples(values: Any, *, batch_dim: int, rows: int, num_samples: int, K: int
                   ) -> tuple[list[Any], list[int | None], Any]:
    """Flattens a pytree; batched tensors become ``(N, K, ...)`` with the batch moved first."""
    flat, spec = tree_flatten(values)
    in_dims: list[int | None] = []
    out: list[Any] = []
    for value in flat:
        if _is_batched(value, batch_dim, rows):
            rows_first = value.movedim(batch_dim, 0)  # (N*K, ...)
            out.append(rows_first.reshape(num_samples, K, *rows_first.shape[1:]))  # (N, K, ...)
            in_dims.append(0)
        else:
            out.append(value)
            in_dims.append(None)
    return out, in_dims, spec


def _restore(flat: list[Any], in_dims: list[int | None], spec: Any, batch_dim: int) -> Any:
    """Inside vmap: each batched leaf is ``(K, ...)``; put its batch axis back on ``batch_dim``."""
    return tree_unflatten([v.movedim(0, batch_dim) if d == 0 and batch_dim else v
                           for v, d in zip(flat, in_dims)], spec)


def functorch_per_sample(module: nn.Module, args: tuple[Any, ...], targets: Any, loss_fn: LossFn, *,
                         K: int, reduction: LossReduction, batch_first: bool) -> PerSampleOutput:
    """Per-sample gradients and losses of ``module`` by whole-model ``vmap(grad(...))``.

    Args:
        module: the model; it is called through ``functional_call`` and not modified.
        args: positional model arguments; tensors with ``N*K`` rows on the batch dimension are
            split per sample, anything else (non-tensors, unbatched tensors) is passed unchanged.
        targets: a tensor (or pytree of tensors) with ``N*K`` rows on the batch dimension.
        loss_fn: returns the unreduced loss of ``(outputs, targets)``.
        K: augmentation multiplicity.
        reduction: each sample's loss is the mean or sum of the loss elements of its K rows.
        batch_first: batch on dimension 0 (True) or 1 of inputs, targets and the loss.

    Returns:
        :class:`~psg_core.api.PerSampleOutput` with ``(N, *shape)`` gradients of every trainable
        parameter and the ``(N,)`` per-sample losses.

    >>> out = functorch_per_sample(nn.Linear(3, 1), (torch.randn(6, 3),), torch.randn(6, 1),
    ...                            lambda o, t: (o - t) ** 2, K=2, reduction=LossReduction.MEAN,
    ...                            batch_first=True)
    >>> out.grads["weight"].shape
    torch.Size([3, 1, 3])
    """
    batch_dim = 0 if batch_first else 1
    check_functorch_support(module)
    rows = batch_rows(args, batch_dim, where=_WHERE)
    num_samples = check_rows(rows, K, where=_WHERE)
    params = trainable_parameters(module)
    flat_targets = tree_flatten(targets)[0]
    if not any(_is_batched(t, batch_dim, rows) for t in flat_targets):
        raise BatchLayoutError(f"{_WHERE}: targets must hold a tensor with {rows} rows (N*K) on the batch "
                               f"dimension {batch_dim}, like the inputs")
    if num_samples == 0:
        first = next(iter(params.values()), None)
        device = first.device if first is not None else torch.device("cpu")
        grads = {name: torch.zeros(0, *p.shape, dtype=p.dtype, device=device) for name, p in params.items()}
        return PerSampleOutput(grads=grads, per_sample_losses=torch.zeros(0, device=device), num_samples=0)

    flat_args, arg_dims, arg_spec = _split_samples(args, batch_dim=batch_dim, rows=rows,
                                                   num_samples=num_samples, K=K)
    flat_tgts, tgt_dims, tgt_spec = _split_samples(targets, batch_dim=batch_dim, rows=rows,
                                                   num_samples=num_samples, K=K)
    detached = {name: p.detach() for name, p in params.items()}

    def sample_loss(sample_params: dict[str, torch.Tensor], sample_args: list[Any],
                    sample_targets: list[Any]) -> torch.Tensor:
        call_args = _restore(sample_args, arg_dims, arg_spec, batch_dim)
        outputs = functional_call(module, sample_params, tuple(call_args))
        per_element = loss_fn(outputs, _restore(sample_targets, tgt_dims, tgt_spec, batch_dim))
        if per_element.dim() == 0:
            raise ConfigError("loss_fn: returned a scalar; it must return the unreduced loss "
                              "(e.g. nn.CrossEntropyLoss(reduction='none'))")
        # The K rows are this vmapped item's whole batch: reducing everything = the sample's loss.
        return per_element.mean() if reduction is LossReduction.MEAN else per_element.sum()

    per_sample_grads, losses = vmap(grad_and_value(sample_loss), in_dims=(None, arg_dims, tgt_dims),
                                    randomness="different")(detached, flat_args, flat_tgts)
    return PerSampleOutput(grads=dict(per_sample_grads), per_sample_losses=losses.detach(),
                           num_samples=num_samples)


@register_backend(GradSampleMode.FUNCTORCH)
def _functorch_backend(module: nn.Module, args: tuple[Any, ...], targets: Any, loss_fn: LossFn, *,
                       K: int, reduction: LossReduction, batch_first: bool) -> PerSampleOutput:
    return functorch_per_sample(module, args, targets, loss_fn, K=K, reduction=reduction,
                                batch_first=batch_first)
