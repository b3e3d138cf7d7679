from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import psg_core
from psg_core.errors import UnsupportedModuleError
from tests.oracle import check_against_oracle

REDUCTIONS = ["mean", "sum"]
KS = [1, 3]


def _randomise(model: nn.Module) -> nn.Module:
    """Moves affine parameters off their (1, 0) init so weight errors cannot hide."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model


# ----------------------------------------------------------------------------- LayerNorm, RMSNorm
@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_sequence(loss_reduction: str, K: int, batch_first: bool, bias: bool,
                             device: torch.device) -> None:
    torch.manual_seed(0)
    model = _randomise(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5, bias=bias, eps=1e-3),
                                     nn.Linear(5, 2)))
    shape = (2 * K, 3, 4) if batch_first else (3, 2 * K, 4)
    check_against_oracle(model, torch.randn(shape), torch.randn(*shape[:2], 2), K=K,
                         loss_reduction=loss_reduction, batch_first=batch_first, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_layer_norm_multi_dim_shape(loss_reduction: str, K: int, batch_first: bool, device: torch.device) -> None:
    torch.manual_seed(1)
    model = _randomise(nn.Sequential(nn.LayerNorm([3, 4]), nn.Linear(4, 2)))
    shape = (2 * K, 2, 3, 4) if batch_first else (2, 2 * K, 3, 4)
    check_against_oracle(model, torch.randn(shape), torch.randn(*shape[:3], 2), K=K,
                         loss_reduction=loss_reduction, batch_first=batch_first, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
def test_layer_norm_without_affine_and_2d_input(loss_reduction: str, K: int, device: torch.device) -> None:
    torch.manual_seed(2)
    model = _randomise(nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6, elementwise_affine=False),
                                     nn.Linear(6, 4), nn.LayerNorm(4)))
    grads = check_against_oracle(model, torch.randn(4 * K, 3), torch.randn(4 * K, 4), K=K,
                                 loss_reduction=loss_reduction, device=device)
    assert set(grads) == {"0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"}


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("eps", [None, 0.1])
@pytest.mark.parametrize("normalized_shape", [[4], [2, 4]])
def test_rms_norm(loss_reduction: str, K: int, batch_first: bool, eps: float | None,
                  normalized_shape: list[int], device: torch.device) -> None:
    torch.manual_seed(3)
    model = _randomise(nn.Sequential(nn.RMSNorm(normalized_shape, eps=eps), nn.Linear(4, 3)))
    shape = (2 * K, 3, 2, 4) if batch_first else (3, 2 * K, 2, 4)
    x = 0.3 * torch.randn(shape)  # small inputs, so eps=0.1 matters
    check_against_oracle(model, x, torch.randn(*shape[:3], 3), K=K, loss_reduction=loss_reduction,
                         batch_first=batch_first, device=device)


# ------------------------------------------------------------------------ GroupNorm, InstanceNorm
@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("spatial", [(5,), (3, 2)])
def test_group_norm(loss_reduction: str, K: int, groups: int, spatial: tuple[int, ...],
                    device: torch.device) -> None:
    torch.manual_seed(4)
    model = _randomise(nn.Sequential(nn.GroupNorm(groups, 4, eps=1e-3), nn.Flatten(),
                                     nn.Linear(4 * math.prod(spatial), 2)))
    x = torch.randn(2 * K, 4, *spatial)
    check_against_oracle(model, x, torch.randn(2 * K, 2), K=K, loss_reduction=loss_reduction, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("layer_type,spatial", [(nn.InstanceNorm1d, (5,)),
                                                (nn.InstanceNorm2d, (3, 2)),
                                                (nn.InstanceNorm3d, (2, 2, 3))])
@pytest.mark.parametrize("running_stats", ["none", "train", "eval"])
def test_instance_norm(loss_reduction: str, K: int, layer_type: type[nn.Module],
                       spatial: tuple[int, ...], running_stats: str, device: torch.device) -> None:
    torch.manual_seed(5)
    norm = layer_type(3, affine=True, track_running_stats=running_stats != "none")
    if running_stats == "eval":
        norm.train()(3.0 * torch.randn(8, 3, *spatial) + 1.0)  # non-trivial running statistics
        norm.eval()
    model = _randomise(nn.Sequential(norm, nn.Flatten(), nn.Linear(3 * math.prod(spatial), 2)))
    x = torch.randn(2 * K, 3, *spatial)
    check_against_oracle(model, x, torch.randn(2 * K, 2), K=K, loss_reduction=loss_reduction, device=device)


class _TimeMajorConvNorm(nn.Module):
    """A time-major model whose channel norm sees (B, C, T), as torch requires."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 4, bias=False)  # InstanceNorm would zero its bias gradient
        self.norm = norm
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).permute(1, 2, 0)  # (T, B, 4) -> (B, 4, T)
        return self.head(self.norm(h).permute(2, 0, 1))  # (T, B, 3)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("norm", ["group", "instance"])
def test_channel_norms_in_time_major_model(loss_reduction: str, K: int, norm: str, device: torch.device) -> None:
    torch.manual_seed(6)
    layer = nn.GroupNorm(2, 4) if norm == "group" else nn.InstanceNorm1d(4, affine=True)
    model = _randomise(_TimeMajorConvNorm(layer))
    x = torch.randn(5, 2 * K, 2)  # (T, B, 2)
    check_against_oracle(model, x, torch.randn(5, 2 * K, 3), K=K, loss_reduction=loss_reduction,
                         batch_first=False, device=device)


def test_instance_norm_unbatched_input_is_rejected() -> None:
    model = psg_core.GradSampleModule(nn.InstanceNorm1d(3, affine=True))
    # Refused at the forward's output (the tracker reads the batch as channels) or by the sampler.
    with pytest.raises(UnsupportedModuleError, match="2-D input|mix samples"):
        model(torch.randn(3, 5)).sum().backward()


# ---------------------------------------------------------------------------------- shapes
# The device fixture holds no state between examples (a device, and TF32 off on CUDA).
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), K=st.integers(1, 3), extra=st.lists(st.integers(1, 3), max_size=2),
       # >= 2 features: LayerNorm of a single feature is identically 0 (no gradient to compare)
       normalized=st.lists(st.integers(2, 4), min_size=1, max_size=2), bias=st.booleans(),
       rms=st.booleans(), reduction=st.sampled_from(REDUCTIONS), seed=st.integers(0, 1000))
def test_trailing_norm_shapes(n: int, K: int, extra: list[int], normalized: list[int], bias: bool,
                              rms: bool, reduction: str, seed: int, device: torch.device) -> None:
    torch.manual_seed(seed)
    layer = nn.RMSNorm(normalized) if rms else nn.LayerNorm(normalized, bias=bias)
    model = _randomise(layer)
    shape = (n * K, *extra, *normalized)
    grads = check_against_oracle(model, torch.randn(shape), torch.randn(shape), K=K,
                                 loss_reduction=reduction, device=device)
    assert grads["weight"].shape == (n, *normalized)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("shape", [(6, 8, 5, 5), (6, 4, 7), (6, 6), (6, 4, 2, 3, 2)])
def test_group_norm_kernel_path_equals_the_normalised_product(shape: tuple[int, ...], K: int,
                                                             dtype: torch.dtype) -> None:
    """GroupNorm's per-sample gradients from torch's GroupNorm weight-gradient kernel (no
    activation-sized temporaries) equal sum g * x_hat and sum g, rows offset far from 0 included;
    a half-precision or non-contiguous call takes the product path."""
    from psg_core.grad_sample.norms import _channel_affine_grads, _group_norm_by_kernel
    gen = torch.Generator().manual_seed(K)
    layer = nn.GroupNorm(2, shape[1]).to(dtype)
    x = torch.randn(shape, generator=gen, dtype=dtype) * 3 + 20
    g = torch.randn(shape, generator=gen, dtype=dtype)
    got = _group_norm_by_kernel(layer, x, g, K)
    assert got is not None
    expected = _channel_affine_grads(layer.weight, layer.bias, torch.nn.functional.group_norm(x, 2, eps=layer.eps), g, K)
    for param, grad in expected.items():
        torch.testing.assert_close(got[param], grad, rtol=1e-4 if dtype is torch.float32 else 1e-10, atol=1e-4)
    assert _group_norm_by_kernel(layer, x.half(), g.half(), K) is None
    assert _group_norm_by_kernel(layer, x.transpose(0, 1).contiguous().transpose(0, 1), g, K) is None
