"""Ghost clipping's norms hold against a crafted sample: one sample's share of the clipped sum
never exceeds the clipping bound, as with the materialised per-sample gradients of hooks.

Ghost takes a sample's squared norm as ``sum_{i,j} (a_i . a_j)(g_i . g_j)`` over its rows. Rows
that nearly cancel (tokens ``a`` and ``a + d``, output gradients ``+b`` and ``-b``) make that norm
tiny beside the terms it is computed from: in float32 the result was rounding noise, even 0, so
the crafted sample went unclipped and added 31 times the bound (an audit's measurement). The
Gram matrices are now computed in float64 (psg_core.grad_sample.ghost_norm.gram_dtype), on a CPU by
psg's native kernel where it builds (psg_core.native.gram64) and else in torch: both are tested.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psg_core import DPConfig, dp_gradient, native

D, C = 32, 1.0


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target) ** 2


class Tied(nn.Module):
    """One Linear layer called on the first half of the positions, then on the second (its weight
    shared by two calls: cross terms between them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2, D)
        return torch.cat([self.lin(x[:, :1]), self.lin(x[:, 1:])], 1)


def _model_and_layout(kind: str) -> tuple[nn.Module, str]:
    if kind == "linear":
        return nn.Linear(D, D, bias=False), "rows"
    if kind == "conv":
        return nn.Conv2d(D, D, kernel_size=1, bias=False), "image"
    return Tied(), "rows"


def _batch(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """``(B, 2, D)`` rows as the model takes them: as they are, or a ``(B, D, 1, 2)`` image."""
    return rows if layout == "rows" else rows.transpose(1, 2)[:, :, None, :]


@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("kind", ["linear", "conv", "tied"])
@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_a_sample_whose_rows_nearly_cancel_is_clipped(mode: str, kind: str, K: int, kernels: str) -> None:
    if kernels == "auto" and native.library() is None:
        pytest.skip(f"native kernels not built here: {native.build_error()}")
    with native.native_kernels(kernels):
        _check_crafted_sample_clipped(mode, kind, K)


def _check_crafted_sample_clipped(mode: str, kind: str, K: int) -> None:
    torch.manual_seed(0)
    model, layout = _model_and_layout(kind)
    config = DPConfig(mode=mode, max_grad_norm=C, augmentation_multiplicity=K)
    others = _batch(torch.randn(3 * K, 2, D), layout)
    with torch.no_grad():
        other_targets = model(others) + torch.randn_like(model(others))
    without = dp_gradient(model, others, other_targets, loss_fn=_mse, config=config).grads
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(10):
        a, d, b = (torch.randn(D, generator=generator) for _ in range(3))
        a, d, b = a * (1e4 / a.norm()), d * (0.1 / d.norm()), b * (2e4 / b.norm())
        crafted = _batch(torch.stack([a, a + d])[None].repeat(K, 1, 1), layout)  # its K copies alike
        with torch.no_grad():
            target = model(crafted)
        sign = torch.tensor([-1.0, 1.0]).view(1, 2, 1) if layout == "rows" else torch.tensor([-1.0, 1.0]).view(1, 1, 1, 2)
        target = target + sign * (b.view(1, 1, D) if layout == "rows" else b.view(1, D, 1, 1))
        out = dp_gradient(model, torch.cat([crafted, others]), torch.cat([target, other_targets]), loss_fn=_mse,
                          config=config)
        share = torch.sqrt(sum((out.grads[name] - without[name]).square().sum() for name in without))
        worst = max(worst, float(share) / C)
        assert float(out.per_sample_norms[0]) > C  # (its gradient, of norm about 30 C, is clipped)
    assert worst <= 1.0 + 1e-3, worst
