"""The microbatch oracle every per-sample gradient test compares against.

Sample n's gradient is computed by running the model on sample n's K rows alone, with the same
loss reduction over those rows; that is the definition every backend must match.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from tests.devices import to_device

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
Batch = tuple[tuple[Any, ...], torch.Tensor]


def mse_loss(reduction: str) -> LossFn:
    """MSE against a target of the output's shape, with the given reduction."""
    return lambda out, target: F.mse_loss(out, target, reduction=reduction)


def cross_entropy_rows(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Unreduced cross-entropy, one value per row (class-index targets)."""
    return F.cross_entropy(out, target, reduction="none")


def as_args(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def split_samples(inputs: Any, targets: torch.Tensor, K: int, *, batch_dim: int = 0,
                  target_batch_dim: int | None = None) -> list[Batch]:
    """Cuts a sample-major batch into per-sample microbatches of K rows each."""
    args = as_args(inputs)
    tdim = batch_dim if target_batch_dim is None else target_batch_dim
    rows = args[0].shape[batch_dim]
    out = []
    for n in range(rows // K):
        sample_args = tuple(a.narrow(batch_dim, n * K, K) if isinstance(a, torch.Tensor) else a
                            for a in args)
        out.append((sample_args, targets.narrow(tdim, n * K, K)))
    return out


def microbatch_oracle(model: nn.Module, samples: Sequence[Batch], loss_fn: LossFn,
                      dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """``{name: (N, *shape)}``: gradient of each sample's loss, one sample at a time.

    Runs in float64 on a copy of the model so the reference is more precise than what it checks.
    """
    ref = copy.deepcopy(model).to(dtype)
    for layer in ref.modules():  # the reference is the bare model: no wrapper's hooks or outputs
        layer._forward_hooks.clear()
        layer._forward_hooks_with_kwargs.clear()
        layer._forward_pre_hooks.clear()
        layer._backward_hooks.clear()
        for p in layer.parameters(recurse=False):
            p.grad_sample = None
    params = {name: p for name, p in ref.named_parameters() if p.requires_grad}
    per_name: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for args, target in samples:
        args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
        target = target.to(dtype) if target.is_floating_point() else target
        loss = loss_fn(ref(*args), target)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (name, p), g in zip(params.items(), grads):
            per_name[name].append(torch.zeros_like(p) if g is None else g)
    return {name: (torch.stack(gs) if gs else torch.zeros(0, *params[name].shape, dtype=dtype,
                                                          device=params[name].device))
            for name, gs in per_name.items()}


def hooks_grad_samples(model: nn.Module, inputs: Any, targets: torch.Tensor, loss_fn: LossFn, *,
                       K: int, loss_reduction: str, batch_first: bool,
                       **wrap_kwargs: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-sample gradients from the hooks backend, and the ordinary batch gradient."""
    for p in model.parameters():
        p.grad, p.grad_sample = None, None
    wrapped = psg_core.GradSampleModule(model, batch_first=batch_first, loss_reduction=loss_reduction,
                                        augmentation_multiplicity=K, **wrap_kwargs)
    loss = loss_fn(wrapped(*as_args(inputs)), targets)
    loss.backward()
    grad_samples = {name: p.grad_sample for name, p in model.named_parameters() if p.requires_grad}
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    wrapped.remove_hooks()
    return grad_samples, grads


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "",
                        rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Compares after dividing both by the reference's largest magnitude (fp32 tolerances by default).

    ``atol`` is for entries near zero: a float32 sum whose terms cancel keeps an error of a few
    ulps of its terms (an EmbeddingBag row's -5.7e-8 computed as 0 where the largest entry is 0.05:
    1.1e-6 after scaling)."""
    assert actual is not None, f"{name}: missing"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    expected = expected.detach().to("cpu", torch.float64)  # an oracle computed on another device too
    scale = expected.abs().max().item() if expected.numel() else 1.0
    scale = scale if scale > 0 else 1.0
    torch.testing.assert_close(actual.detach().to("cpu", torch.float64) / scale, expected / scale, rtol=rtol,
                               atol=atol, msg=lambda m: f"{name}: {m}")


def check_mode(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, K: int, mode: str,
               loss: LossFn) -> None:
    """``mode``'s result on a single-input batch equals the oracle's: per-sample gradients for
    hooks, functorch and ew; for ghost the unclipped sum of dp_gradient. ``loss`` is unreduced."""
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(x.shape[0] // K)]
    expected = microbatch_oracle(model, samples, lambda out, t: loss(out, t).mean())
    if mode == "ghost":
        got = psg_core.dp_gradient(model, x, y, loss_fn=loss, config=psg_core.DPConfig(
            mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9)).grads
        expected = {name: g.sum(0) for name, g in expected.items()}
    else:
        got = psg_core.per_sample_gradients(model, x, y, loss_fn=loss, mode=mode, augmentation_multiplicity=K)
    for name, value in expected.items():
        assert_close_scaled(got[name], value.to(got[name].dtype), name=name)


def check_ghost_clipped(model: nn.Module, inputs: Any, targets: torch.Tensor, expected: dict[str, torch.Tensor], *,
                        K: int, loss: LossFn, bound: float = 0.05, loss_reduction: str = "mean") -> None:
    """Ghost's per-sample norms and clipped sum (dp_gradient, clipping bound ``bound``: small enough
    to clip every sample of a test model) equal those of the oracle's per-sample gradients
    ``expected``; ``loss`` is unreduced."""
    reference = psg_core.clip_and_sum({n: g.float() for n, g in expected.items()}, max_grad_norm=bound)
    result = psg_core.dp_gradient(model, inputs, targets, loss_fn=loss, config=psg_core.DPConfig(
        mode="ghost", augmentation_multiplicity=K, loss_reduction=loss_reduction, max_grad_norm=bound))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    assert set(result.grads) == set(reference.grads)
    for name, ref in reference.grads.items():
        assert_close_scaled(result.grads[name], ref, name=name)


def check_against_oracle(model: nn.Module, inputs: Any, targets: torch.Tensor, *, K: int,
                         loss_reduction: str, batch_first: bool = True,
                         loss: Callable[[str], LossFn] = mse_loss,
                         samples: Sequence[Batch] | None = None,
                         target_batch_dim: int | None = None,
                         device: torch.device | str | None = None,
                         **wrap_kwargs: Any) -> dict[str, torch.Tensor]:
    """The standard layer test: hooks grad samples equal the oracle, and their sum (sum
    reduction) or mean (mean reduction) equals the ordinary batch gradient.

    ``device``: where both run; the model (in place), the inputs, the targets and the given
    ``samples`` are moved there first (tests/devices.py). None leaves them where they are.
    """
    if device is not None:
        model, inputs, targets = to_device(model, device), to_device(inputs, device), to_device(targets, device)
        samples = None if samples is None else to_device(list(samples), device)
    batch_dim = 0 if batch_first else 1
    if samples is None:
        samples = split_samples(inputs, targets, K, batch_dim=batch_dim,
                                target_batch_dim=target_batch_dim)
    expected = microbatch_oracle(model, samples, loss(loss_reduction))
    actual, grads = hooks_grad_samples(model, inputs, targets, loss(loss_reduction), K=K,
                                       loss_reduction=loss_reduction, batch_first=batch_first,
                                       **wrap_kwargs)
    assert set(actual) == set(expected)
    for name in expected:
        assert_close_scaled(actual[name], expected[name], name=name)
        total = actual[name].sum(0) if loss_reduction == "sum" else actual[name].mean(0)
        if grads[name] is not None and actual[name].shape[0]:
            assert_close_scaled(total, grads[name], name=f"{name} (vs batch gradient)")
    return actual
