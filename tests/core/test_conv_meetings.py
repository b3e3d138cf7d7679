"""A module that convolves the batch with its child's weight itself, through the functional API.

Hugging Face's Mamba-style mixers (Falcon-Mamba, Jamba, Falcon-H1, Bamba, ...) and short
convolutions (LFM) hold an ``nn.Conv1d`` child but never call it: their forward runs
``F.conv1d(x, self.conv1d.weight, self.conv1d.bias, groups=channels, padding=k - 1)``. The child's
grad sampler never sees the call, so psg meets the weight where it meets the batch: each batch row
convolves with its own copy (one grouped convolution), whose gradient is that row's. Every mode
gives the oracle's per-sample gradients (ghost: its norms and clipped sum); a convolution whose
input does not hold the batch on axis 0 stays refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.oracle import (assert_close_scaled, check_ghost_clipped, cross_entropy_rows, microbatch_oracle,
                          split_samples)

WIDTH, CHANNELS, STEPS, KERNEL = 3, 4, 5, 3


class ShortConv(nn.Module):
    """A causal short convolution over time, run on the child's parameters.

    ``how``: "depthwise" (Mamba: ``groups=channels``, the output cut to T steps), "dense" (one
    group), "no_bias" (the bias left out), "reshaped" (the weight kept as ``(C, k)`` by the caller
    and given back its middle axis, as ``causal_conv1d_fn(x, conv1d.weight.squeeze(1))`` does),
    "plain_bias" (the weight met, the bias a constant tensor), "frames" (each sample's two frames
    merged into the rows: ``(N*K*2, C, T)``), "conv2d" (a strided 2-D convolution on a 2-D map).
    """

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        groups = 1 if how in ("dense", "conv2d") else CHANNELS
        if how == "conv2d":
            self.conv: nn.Module = nn.Conv2d(CHANNELS, CHANNELS, KERNEL, stride=2, padding=1)
        else:
            self.conv = nn.Conv1d(CHANNELS, CHANNELS, KERNEL, groups=groups, padding=KERNEL - 1,
                                  bias=how != "no_bias")
        self.groups = groups
        self.in_proj = nn.Linear(WIDTH, CHANNELS)
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*K, T, d) or (N*K, 2, T, d) for frames
        h = self.in_proj(x)
        if self.how == "conv2d":  # (N*K, T, d) -> (N*K, C, T, T): an outer map
            grid = (h.unsqueeze(1) * h.unsqueeze(2)).permute(0, 3, 1, 2)
            out = F.conv2d(grid, self.conv.weight, self.conv.bias, stride=2, padding=1)
            return self.head(torch.tanh(out).mean((2, 3)))
        rows = h.shape[0]
        if self.how == "frames":
            h = h.reshape(rows * 2, STEPS, CHANNELS)  # two frames a row
        h = h.transpose(1, 2)  # (rows, C, T)
        weight, bias = self.conv.weight, self.conv.bias
        if self.how == "reshaped":
            weight = weight.squeeze(1).unsqueeze(1)  # (C, k) -> (C, 1, k)
        if self.how == "plain_bias":
            bias = torch.linspace(-1.0, 1.0, CHANNELS, dtype=h.dtype)
        out = F.conv1d(h, weight, bias, padding=KERNEL - 1, groups=self.groups)[..., :STEPS]
        out = torch.tanh(out.transpose(1, 2))  # (rows, T, C)
        if self.how == "frames":
            out = out.reshape(rows, 2 * STEPS, CHANNELS)
        return self.head(out.mean(1))


HOWS = ["depthwise", "dense", "no_bias", "reshaped", "plain_bias", "frames", "conv2d"]


_loss = cross_entropy_rows


def _case(how: str, K: int, reduction: str, N: int = 3) -> tuple[nn.Module, torch.Tensor, torch.Tensor,
                                                                   dict[str, torch.Tensor]]:
    torch.manual_seed(5)
    model = ShortConv(how)
    shape = (N * K, 2, STEPS, WIDTH) if how == "frames" else (N * K, STEPS, WIDTH)
    x, y = torch.randn(*shape), torch.randint(0, 2, (N * K,))
    reduce = (lambda t: t.mean()) if reduction == "mean" else (lambda t: t.sum())
    expected = microbatch_oracle(model, split_samples(x, y, K), lambda out, t: reduce(_loss(out, t)))
    return model, x, y, expected


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("how", HOWS)
def test_per_sample_gradients_match_the_oracle(how: str, mode: str, K: int, reduction: str) -> None:
    model, x, y, expected = _case(how, K, reduction)
    grads = per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode, augmentation_multiplicity=K,
                                 loss_reduction=reduction)
    assert set(grads) == set(expected)
    for name, ref in expected.items():
        assert ref.abs().max() > 0 or (how, name) == ("plain_bias", "conv.bias"), name  # (that bias unused)
        assert_close_scaled(grads[name], ref, name=f"{how}/{mode}/{name}")


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("how", HOWS)
def test_ghost_norms_and_clipped_sum_match_the_oracle(how: str, K: int) -> None:
    model, x, y, expected = _case(how, K, "mean")
    check_ghost_clipped(model, x, y, expected, K=K, loss=_loss)


@pytest.mark.parametrize("how", ["depthwise", "frames"])
def test_grad_sample_module_matches_the_oracle(how: str) -> None:
    model, x, y, expected = _case(how, 2, "mean")
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=2)
    try:
        _loss(wrapped(x), y).mean().backward()
        for name, p in model.named_parameters():
            assert_close_scaled(p.grad_sample, expected[name], name=name)  # type: ignore[attr-defined]
    finally:
        wrapped.remove_hooks()


class MixedConv(nn.Module):
    """The batch's rows laid out as the channels of one conv input, ``(1, N*K, L)``: a convolution
    with one group sums over them (it mixes samples)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 1, KERNEL, padding=1)
        self.head = nn.Linear(STEPS, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*K, T)
        weight = self.conv.weight.expand(1, x.shape[0], KERNEL)
        mixed = F.conv1d(x.unsqueeze(0), weight, padding=1)  # (1, 1, T): every row summed
        return self.head(x + mixed[0])


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_convolution_over_the_rows_as_channels_is_refused(mode: str) -> None:
    x, y = torch.randn(4, STEPS), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError, match=r"conv1d.*batch on axis 0"):
        if mode == "ghost":
            dp_gradient(MixedConv(), x, y, loss_fn=_loss, config=DPConfig(mode="ghost", max_grad_norm=1.0))
        else:
            per_sample_gradients(MixedConv(), x, y, loss_fn=_loss)


@pytest.mark.parametrize("how", HOWS)
def test_ew_is_right_or_refuses(how: str) -> None:
    """torch's ExpandedWeights takes the functional convolution on the child's weight itself: right
    where it can, a PsgError where it cannot (a view of the weight, the frames merged into the rows)."""
    model, x, y, expected = _case(how, 2, "mean")
    try:
        grads = per_sample_gradients(model, x, y, loss_fn=_loss, mode="ew", augmentation_multiplicity=2)
    except psg_core.PsgError as err:
        assert how in ("reshaped", "frames"), err
        return
    for name, ref in expected.items():
        assert_close_scaled(grads[name], ref, name=f"{how}/ew/{name}")


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_recorded_step_replays_the_met_convolution(mode: str) -> None:
    """psg_core.CapturedStep records the grouped convolution of the met kernel; its replays on new
    batches give dp_gradient's clipped sum."""
    from psg_core.capture import CapturedStep

    torch.manual_seed(6)
    model = ShortConv("depthwise")
    config = DPConfig(mode=mode, max_grad_norm=0.05, augmentation_multiplicity=2)
    step = CapturedStep(model, loss_fn=_loss, config=config)
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(6, STEPS, WIDTH, generator=generator), torch.randint(0, 2, (6,), generator=generator)
        got = step(x, y)
        expected = dp_gradient(model, x, y, loss_fn=_loss, config=config)
        for name, value in expected.grads.items():
            assert_close_scaled(got.grads[name], value, name=f"{name} ({step.last_path})")
    assert step.stats["replayed"] >= 2 and step.stats["refused"] == 0, step.stats
