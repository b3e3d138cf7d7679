from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from psg_core.errors import BatchLayoutError, ConfigError
from psg_core.grad_sample.conv import conv_unfold, conv_weight_factors
from tests.oracle import check_against_oracle

REDUCTIONS = ["mean", "sum"]

# torch warns that padding="same" with an even kernel copies the input; that asymmetric case is
# exactly what the "2d-same-dilated-zeros" config checks.
SAME_EVEN_KERNEL = pytest.mark.filterwarnings(
    "ignore:Using padding='same' with even kernel lengths:UserWarning")
KS = [1, 3]

# (id, layer factory, per-row input shape). Spatial sizes stay tiny: every case runs 4 times.
CONV_CASES: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("1d-plain", lambda: nn.Conv1d(3, 4, 3), (3, 7)),
    ("1d-stride-dil-groups-nobias",
     lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2, bias=False), (4, 8)),
    ("1d-same-even-kernel-reflect", lambda: nn.Conv1d(3, 5, 4, padding="same", padding_mode="reflect"), (3, 6)),
    ("1d-depthwise-circular", lambda: nn.Conv1d(4, 4, 3, padding=2, groups=4, padding_mode="circular"), (4, 6)),
    ("1d-valid", lambda: nn.Conv1d(2, 3, 3, padding="valid"), (2, 5)),
    ("2d-plain", lambda: nn.Conv2d(3, 4, 3), (3, 6, 5)),
    ("2d-tuple-everything",
     lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2), (4, 7, 6)),
    ("2d-depthwise-mult2-replicate-nobias",
     lambda: nn.Conv2d(3, 6, 3, padding=1, groups=3, padding_mode="replicate", bias=False), (3, 5, 5)),
    ("2d-same-dilated-zeros", lambda: nn.Conv2d(2, 3, (2, 4), padding="same", dilation=(2, 1)), (2, 6, 5)),
    ("2d-reflect-stride", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="reflect"), (2, 7, 6)),
    ("2d-circular-tuple", lambda: nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode="circular"), (2, 5, 6)),
    ("2d-same-replicate", lambda: nn.Conv2d(2, 2, (3, 2), padding="same", padding_mode="replicate"), (2, 5, 5)),
    ("3d-plain", lambda: nn.Conv3d(2, 3, 2), (2, 4, 5, 4)),
    ("3d-tuple-groups-replicate",
     lambda: nn.Conv3d(2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2,
                       padding_mode="replicate"), (2, 5, 6, 4)),
    ("3d-same-circular-depthwise",
     lambda: nn.Conv3d(2, 2, 3, padding="same", padding_mode="circular", groups=2, bias=False), (2, 4, 4, 5)),
    ("3d-reflect-stride", lambda: nn.Conv3d(2, 3, 3, stride=2, padding=1, padding_mode="reflect"), (2, 5, 5, 5)),
]

TRANSPOSE_CASES: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("t1d-plain", lambda: nn.ConvTranspose1d(3, 4, 3), (3, 5)),
    ("t1d-stride-pad-outpad-groups",
     lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (4, 5)),
    ("t1d-dilated-outpad-nobias",
     lambda: nn.ConvTranspose1d(2, 3, 3, stride=3, padding=2, output_padding=2, dilation=2, bias=False), (2, 4)),
    # output_padding >= stride (allowed because < dilation): trailing outputs meet no input.
    ("t1d-outpad-over-stride", lambda: nn.ConvTranspose1d(2, 3, 2, stride=1, dilation=3, output_padding=2), (2, 5)),
    ("t2d-plain", lambda: nn.ConvTranspose2d(3, 4, 3), (3, 4, 5)),
    ("t2d-tuple-everything",
     lambda: nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2),
                                dilation=(1, 2), groups=2), (4, 4, 3)),
    ("t2d-depthwise-dilated-nobias",
     lambda: nn.ConvTranspose2d(2, 2, 3, groups=2, dilation=2, output_padding=1, bias=False), (2, 4, 4)),
    ("t3d-stride-outpad", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2, output_padding=1), (2, 3, 2, 3)),
]


def _ids(cases: list[tuple[str, Any, Any]]) -> list[str]:
    return [case[0] for case in cases]


def _run_layer_case(make: Callable[[], nn.Module], row_shape: tuple[int, ...], K: int,
                    loss_reduction: str, device: torch.device, *, n_samples: int = 2, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = make()
    x = torch.randn(n_samples * K, *row_shape)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize(("name", "make", "row_shape"), CONV_CASES, ids=_ids(CONV_CASES))
@SAME_EVEN_KERNEL
def test_conv_oracle(name: str, make: Callable[[], nn.Module], row_shape: tuple[int, ...], K: int,
                     loss_reduction: str, device: torch.device) -> None:
    _run_layer_case(make, row_shape, K, loss_reduction, device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize(("name", "make", "row_shape"), TRANSPOSE_CASES, ids=_ids(TRANSPOSE_CASES))
def test_conv_transpose_oracle(name: str, make: Callable[[], nn.Module], row_shape: tuple[int, ...],
                               K: int, loss_reduction: str, device: torch.device) -> None:
    _run_layer_case(make, row_shape, K, loss_reduction, device)


class _DeconvToSize(nn.Module):
    """Calls a transposed conv with ``output_size``, which picks its output padding at call time."""

    def __init__(self) -> None:
        super().__init__()
        self.deconv = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.deconv(x, output_size=[2 * x.shape[2], 2 * x.shape[3]])


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
def test_conv_transpose_output_size(K: int, loss_reduction: str, device: torch.device) -> None:
    _run_layer_case(_DeconvToSize, (2, 3, 4), K, loss_reduction, device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("layer_type", ["conv2d", "conv_transpose1d"])
def test_conv_frozen_weight(layer_type: str, K: int, loss_reduction: str, device: torch.device) -> None:
    torch.manual_seed(3)
    if layer_type == "conv2d":
        layer: nn.Module = nn.Conv2d(2, 3, 3, padding=1)
        x = torch.randn(2 * K, 2, 5, 5)
    else:
        layer = nn.ConvTranspose1d(2, 3, 3, stride=2)
        x = torch.randn(2 * K, 2, 5)
    layer.weight.requires_grad_(False)
    with torch.no_grad():
        y = torch.randn_like(layer(x))
    actual = check_against_oracle(layer, x, y, K=K, loss_reduction=loss_reduction, device=device)
    assert set(actual) == {"bias"}
    assert getattr(layer.weight, "grad_sample", None) is None


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding="same", padding_mode="reflect"), nn.ReLU(),
        )
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _cross_entropy(reduction: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda out, target: F.cross_entropy(out, target, reduction=reduction)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
def test_cnn_end_to_end(K: int, loss_reduction: str, device: torch.device) -> None:
    torch.manual_seed(4)
    model = _SmallCNN()
    x = torch.randn(3 * K, 1, 8, 8)
    y = torch.randint(0, 3, (3 * K,))
    actual = check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction, loss=_cross_entropy,
                                  device=device)
    assert actual["features.0.weight"].shape == (3, 4, 1, 3, 3)


# The device fixture holds no state between examples (a device, and TF32 off on CUDA).
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), K=st.integers(1, 3), groups=st.integers(1, 2), c_in_per=st.integers(1, 2),
       c_out_per=st.integers(1, 2), kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       stride=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)), padding=st.integers(0, 1),
       spatial=st.tuples(st.integers(3, 7), st.integers(3, 7)), bias=st.booleans(),
       padding_mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
       reduction=st.sampled_from(REDUCTIONS))
def test_conv2d_shapes(n: int, K: int, groups: int, c_in_per: int, c_out_per: int,
                       kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
                       padding: int, spatial: tuple[int, int], bias: bool, padding_mode: str,
                       reduction: str, device: torch.device) -> None:
    for size, k, d in zip(spatial, kernel, dilation):
        assume(size + 2 * padding >= d * (k - 1) + 1)
    torch.manual_seed(n * 10 + K)
    layer = nn.Conv2d(groups * c_in_per, groups * c_out_per, kernel, stride=stride, padding=padding,
                      dilation=dilation, groups=groups, bias=bias, padding_mode=padding_mode)
    x = torch.randn(n * K, groups * c_in_per, *spatial)
    with torch.no_grad():
        y = torch.randn_like(layer(x))
    check_against_oracle(layer, x, y, K=K, loss_reduction=reduction, device=device)


@pytest.mark.parametrize(("name", "make", "row_shape"), CONV_CASES, ids=_ids(CONV_CASES))
@SAME_EVEN_KERNEL
def test_conv_unfold_reproduces_forward(name: str, make: Callable[[], nn.Module],
                                        row_shape: tuple[int, ...]) -> None:
    torch.manual_seed(5)
    layer = make()
    x = torch.randn(3, *row_shape)
    patches = conv_unfold(layer, x)  # (B, G, I, L)
    groups = layer.groups
    weight = layer.weight.detach().reshape(groups, layer.out_channels // groups, -1)  # (G, O, I)
    out = torch.einsum("goi,bgil->bgol", weight, patches).reshape(3, layer.out_channels, -1)
    expected = layer(x).detach()
    if layer.bias is not None:
        expected = expected - layer.bias.detach().reshape(1, -1, *([1] * (expected.dim() - 2)))
    torch.testing.assert_close(out, expected.flatten(2), rtol=1e-5, atol=1e-5)


def test_conv_unfold_matches_torch_unfold() -> None:
    torch.manual_seed(6)
    layer = nn.Conv2d(4, 2, (2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)
    x = torch.randn(2, 4, 6, 7)
    reference = F.unfold(x, (2, 3), dilation=(1, 2), padding=(1, 0), stride=(2, 1))  # (B, C*k, L)
    torch.testing.assert_close(conv_unfold(layer, x), reference.reshape(2, 2, 12, -1))


@pytest.mark.parametrize(("name", "make", "row_shape"), TRANSPOSE_CASES, ids=_ids(TRANSPOSE_CASES))
def test_conv_weight_factors_transpose_per_row(name: str, make: Callable[[], nn.Module],
                                               row_shape: tuple[int, ...]) -> None:
    torch.manual_seed(7)
    layer = make()
    x = torch.randn(2, *row_shape)
    grad_out = torch.randn_like(layer(x))
    patches, other = conv_weight_factors(layer, x, grad_out)
    per_row = torch.einsum("rgil,rgol->rgoi", patches, other).reshape(2, *layer.weight.shape)
    for row in range(2):
        out = layer(x[row:row + 1])
        (expected,) = torch.autograd.grad(out, layer.weight, grad_out[row:row + 1])
        torch.testing.assert_close(per_row[row], expected, rtol=1e-5, atol=1e-5)


def test_conv_unbatched_input_is_rejected() -> None:
    layer = nn.Conv2d(2, 3, 3)
    with pytest.raises(BatchLayoutError, match="conv_unfold: Conv2d needs a batched input of 4 dims"):
        conv_unfold(layer, torch.randn(2, 5, 5))


def test_conv_unfold_rejects_other_layers() -> None:
    with pytest.raises(ConfigError, match="conv_unfold: expected nn.Conv1d/2d/3d, got ConvTranspose2d"):
        conv_unfold(nn.ConvTranspose2d(2, 3, 3), torch.randn(1, 2, 5, 5))
