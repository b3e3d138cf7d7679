"""A layer's output changed in place after the call, and layers whose outputs depend on each other.

``F.linear`` on a ``(B, T, d)`` input returns a view of its 2-D product; an in-place op on that view
(``nn.ReLU(inplace=True)``, ``out += residual``) moves it onto a new autograd node, and a gradient
hook on the view was lost: hooks returned a zero per-sample gradient for the Linear and ghost's norms
missed it, without an error. ew cannot differentiate it and says so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled, microbatch_oracle

N, T, D = 3, 4, 5


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.proj(x)
        out += x  # in place on the Linear's output view
        return out


class Pool(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(1)


def _models() -> dict[str, nn.Module]:
    return {
        "relu inplace": nn.Sequential(nn.Linear(D, 6), nn.ReLU(inplace=True), nn.Linear(6, 3), Pool()),
        "residual +=": nn.Sequential(Residual(), nn.Tanh(), nn.Linear(D, 3), Pool()),
        "slice mul_": nn.Sequential(nn.Linear(D, 6), _SliceScale(), nn.Linear(6, 3), Pool()),
    }


class _SliceScale(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h[..., :2].mul_(2.0)
        return h


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _data(K: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N * K, T, D, generator=g), torch.randint(0, 3, (N * K,), generator=g)


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int) -> dict[str, torch.Tensor]:
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    return microbatch_oracle(model, samples, lambda out, t: _loss(out, t).mean())


def _assert_matches(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int, mode: str,
                    expected: dict[str, torch.Tensor]) -> None:
    """hooks: per-sample gradients equal the oracle's; ghost: norms and clipped sum (no clipping)."""
    if mode == "hooks":
        got = per_sample_gradients(model, x, y, loss_fn=_loss, mode="hooks", augmentation_multiplicity=K)
        for key, value in expected.items():
            assert_close_scaled(got[key], value.to(got[key].dtype), name=key)
        return
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in expected.values()))
    out = dp_gradient(model, x, y, loss_fn=_loss,
                      config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9))
    assert_close_scaled(out.per_sample_norms, norms.to(torch.float32), name="norms")
    for key, value in expected.items():
        assert_close_scaled(out.grads[key], value.sum(0).to(torch.float32), name=key)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("name", list(_models()))
def test_a_layer_whose_output_view_is_changed_in_place(name: str, K: int, mode: str) -> None:
    torch.manual_seed(0)
    model = _models()[name]
    x, y = _data(K)
    _assert_matches(model, x, y, K, mode, _oracle(model, x, y, K))


@pytest.mark.parametrize("name", list(_models()))
def test_ew_refuses_it_with_the_remedy(name: str) -> None:
    x, y = _data(1)
    with pytest.raises(UnsupportedModuleError, match="changed in place"):
        per_sample_gradients(_models()[name], x, y, loss_fn=_loss, mode="ew")


# ------------------------------------------------------------------ outputs computed from each other
class Dependent(nn.Module):
    """No grad sampler (the torch.func fallback); its second output is computed from its first."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ self.w
        return y, torch.tanh(y)


class DependentNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = Dependent()
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, t = self.f(x)
        return self.head(y + 2.0 * t)


class CellLoop(nn.Module):
    """torch's nn.LSTMCell over time: it returns (h, c), h = o * tanh(c)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(D, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        h = c = x.new_zeros(x.shape[0], 6)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("make", [DependentNet, CellLoop], ids=["dependent", "lstm_cell"])
def test_a_layer_whose_outputs_depend_on_each_other(make: type[nn.Module], K: int, mode: str) -> None:
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N * K, T, D, generator=g) if make is CellLoop else torch.randn(N * K, D, generator=g)
    y = torch.randint(0, 3, (N * K,), generator=g)
    _assert_matches(model, x, y, K, mode, _oracle(model, x, y, K))
