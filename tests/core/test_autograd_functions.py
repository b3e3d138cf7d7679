"""A layer that runs a custom ``torch.autograd.Function`` written without ``setup_context``.

torch.func refuses to transform such a function (vmap or grad), so the per-layer ``torch.func``
fallback could not compute the layer's per-sample gradients: hooks and ghost refused Hugging
Face's RecurrentGemma (its RG-LRU's ``SqrtBoundDerivative``) and SEW-D (its ``XDropout``,
``XSoftmax``). They now differentiate the same per-sample function with autograd, one sample at a
time, through the function's own ``backward``. The functions below give a ``backward`` that is not
the derivative of their ``forward``, so only a result that ran that ``backward`` equals the
oracle's (the microbatch oracle runs plain autograd too).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import psg_core
from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from psg_core.capture import CapturedStep
from tests.oracle import (assert_close_scaled, check_ghost_clipped, cross_entropy_rows, microbatch_oracle,
                          split_samples)

WIDTH, STEPS = 5, 3
HOWS = ["pointwise", "layer", "unit"]


class HalfSquare(torch.autograd.Function):
    """``x**2`` whose backward returns half its derivative (old style: ``forward(ctx, x)``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.square()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x


class BoundedSqrt(torch.autograd.Function):
    """``sqrt(x)`` whose derivative is bounded where ``x`` is small (RecurrentGemma's pattern)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sqrt()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / (2 * x.clamp(min=0.25).sqrt())


class Gate(nn.Module):
    """No grad sampler. ``pointwise``: its parameters meet the batch in pointwise ops only, so
    their per-sample gradients come from meeting points (autograd through the functions, always
    supported); else its weight meets the batch in a product, and its per-sample gradients come
    from the per-layer fallback."""

    def __init__(self, pointwise: bool) -> None:
        super().__init__()
        self.pointwise = pointwise
        self.weight = nn.Parameter(torch.randn(WIDTH) * 0.5 if pointwise else torch.randn(WIDTH, WIDTH) * 0.4)
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.weight if self.pointwise else x @ self.weight
        return HalfSquare.apply(h) + BoundedSqrt.apply(self.scale * x.square()) + x


@psg_core.unit_module
class Block(nn.Module):
    """A unit (its subtree computed as one call) whose forward runs the function between its own
    Linear child and a recurrence over time."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.decay = nn.Parameter(torch.rand(WIDTH) * 0.5 + 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        a = BoundedSqrt.apply(self.decay.expand_as(x[:, 0]))
        h, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a * h + HalfSquare.apply(self.proj(x[:, t]))
            out.append(h)
        return torch.stack(out, 1)


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.inner = Block() if how == "unit" else Gate(pointwise=how == "pointwise")
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        h = self.inner(torch.tanh(self.inp(x)))
        return self.head(h.mean(1))


def _batch(K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(3 * K, STEPS, WIDTH, generator=generator),
            torch.randint(0, 3, (3 * K,), generator=generator))


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int, reduction: str) -> dict[str, torch.Tensor]:
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows = cross_entropy_rows(out, target)
        return rows.mean() if reduction == "mean" else rows.sum()
    return microbatch_oracle(model, split_samples(x, y, K), loss)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 2])
def test_hooks_run_the_function_s_own_backward_per_sample(how: str, reduction: str, K: int) -> None:
    torch.manual_seed(1)
    model = Net(how)
    x, y = _batch(K)
    expected = _oracle(model, x, y, K, reduction)
    got = per_sample_gradients(model, x, y, loss_fn=cross_entropy_rows, mode="hooks",
                               augmentation_multiplicity=K, loss_reduction=reduction)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("K", [1, 2])
def test_grad_sample_module_runs_the_function_s_own_backward_per_sample(how: str, K: int) -> None:
    torch.manual_seed(2)
    model = Net(how)
    x, y = _batch(K)
    expected = _oracle(model, x, y, K, "mean")
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=K, strict=False)
    cross_entropy_rows(wrapped(x), y).mean().backward()
    for name, p in model.named_parameters():
        assert_close_scaled(p.grad_sample, expected[name], name=name)  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 2])
def test_ghost_norms_and_clipped_sum_run_the_function_s_own_backward(how: str, reduction: str, K: int) -> None:
    torch.manual_seed(3)
    model = Net(how)
    x, y = _batch(K)
    check_ghost_clipped(model, x, y, _oracle(model, x, y, K, reduction), K=K, loss=cross_entropy_rows,
                        loss_reduction=reduction)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_captured_step_replays_the_per_sample_loop(mode: str) -> None:
    torch.manual_seed(4)
    model = Net("unit")
    config = DPConfig(mode=mode, max_grad_norm=0.05, augmentation_multiplicity=2)
    step = CapturedStep(model, loss_fn=cross_entropy_rows, config=config)
    for seed in range(5):
        x, y = _batch(2, seed)
        got = step(x, y)
        expected = dp_gradient(model, x, y, loss_fn=cross_entropy_rows, config=config)
        for name, value in expected.grads.items():
            assert_close_scaled(got.grads[name], value, name=f"{name} ({step.last_path})")
    assert step.stats["replayed"] >= 2 and step.stats["refused"] == 0, step.stats


def test_functorch_mode_refuses_with_the_modes_that_compute_it() -> None:
    torch.manual_seed(5)
    x, y = _batch(1)
    with pytest.raises(UnsupportedModuleError, match=r"module 'inner' \(Gate\) failed under torch.func: .*"
                                                     r"setup_context.*mode='hooks' and mode='ghost'"):
        per_sample_gradients(Net("layer"), x, y, loss_fn=cross_entropy_rows, mode="functorch")


def test_a_function_that_fails_otherwise_still_fails_with_its_own_error() -> None:
    """Only torch.func's refusal to transform is taken over by the autograd loop: another error
    inside the layer reaches the caller, named by module."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.eye(WIDTH))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = HalfSquare.apply(x @ self.weight)
            if x.shape[0] == 1:  # one sample's run
                raise RuntimeError("only whole batches")
            return out

    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Broken(), nn.Flatten(), nn.Linear(STEPS * WIDTH, 3))
    x, y = _batch(1)
    with pytest.raises(UnsupportedModuleError, match="only whole batches"):
        per_sample_gradients(model, x, y, loss_fn=cross_entropy_rows, mode="hooks")
