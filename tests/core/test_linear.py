from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.oracle import check_against_oracle

REDUCTIONS = ["mean", "sum"]
KS = [1, 3]


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_2d(loss_reduction: str, K: int, bias: bool, device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4, bias=bias), nn.Tanh(), nn.Linear(4, 3))
    x = torch.randn(4 * K, 5)
    y = torch.randn(4 * K, 3)
    check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_linear_sequence(loss_reduction: str, K: int, batch_first: bool, device: torch.device) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    shape = (3 * K, 7, 6) if batch_first else (7, 3 * K, 6)
    x = torch.randn(shape)
    y = torch.randn(*shape[:2], 2)
    check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction, batch_first=batch_first, device=device)


# The device fixture holds no state between examples (a device, and TF32 off on CUDA).
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 4), K=st.integers(1, 3), d_in=st.integers(1, 6), d_out=st.integers(1, 5),
       extra=st.lists(st.integers(1, 3), max_size=2), reduction=st.sampled_from(REDUCTIONS))
def test_linear_shapes(n: int, K: int, d_in: int, d_out: int, extra: list[int], reduction: str,
                       device: torch.device) -> None:
    torch.manual_seed(n * 100 + K)
    model = nn.Linear(d_in, d_out)
    x = torch.randn(n * K, *extra, d_in)
    y = torch.randn(n * K, *extra, d_out)
    check_against_oracle(model, x, y, K=K, loss_reduction=reduction, device=device)
