"""Mixed precision: every backend under torch.autocast, against the fp32 oracle.

Per-sample gradients, norms and clipped sums are computed in the parameters' precision (fp32
here) from autocast's half-precision gradients; every returned gradient has its parameter's
dtype; under fp16 the backward pass runs on a scaled loss. Tolerance: relative to the largest
entry of the fp32 result, 5e-2 — the error of autocast's own forward (plain autograd on the same
CNN differs from fp32 by 2e-2 in bf16, 1.2e-2 in fp16).

Every case runs on each device of tests/devices.py (the ``device`` fixture): on CUDA, bf16 and
fp16 autocast run on the GPU's half-precision kernels, against an fp32 reference computed there
with TF32 off.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from psg_core import DPConfig, dp_gradient, per_sample_gradients
from psg_core.precision import INITIAL_LOSS_SCALE, with_loss_scale

TOLERANCE = 5e-2


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 5))


def _transformer() -> nn.Module:
    layer = psg_core.fix_model(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0))
    return nn.Sequential(nn.Embedding(30, 16), layer, nn.Flatten(), nn.Linear(16 * 5, 5))


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.rnn = psg_core.DPLSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "cnn": (_cnn, lambda rows: torch.randn(rows, 3, 6, 6)),
    "transformer": (_transformer, lambda rows: torch.randint(0, 30, (rows, 5))),
    "lstm": (_LSTM, lambda rows: torch.randint(0, 30, (rows, 5))),
}


def _loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), labels, reduction="none")


def _case(name: str, device: torch.device, K: int = 2) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    build, batch = MODELS[name]
    rows = 4 * K
    return build().to(device), batch(rows).to(device), torch.randint(0, 5, (rows,), device=device)


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], model: nn.Module) -> None:
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    scale = max(float(g.abs().max()) for g in expected.values())
    for name, ref in expected.items():
        assert actual[name].dtype == dtypes[name], name
        assert bool(torch.isfinite(actual[name]).all()), name
        torch.testing.assert_close(actual[name], ref, rtol=0, atol=TOLERANCE * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew"])
def test_per_sample_gradients_under_autocast(mode: str, name: str, dtype: torch.dtype, device: torch.device) -> None:
    model, x, y = _case(name, device)
    expected = per_sample_gradients(model, x, y, loss_fn=_loss, mode="hooks", augmentation_multiplicity=2)
    with torch.autocast(device.type, dtype=dtype):
        actual = per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode, augmentation_multiplicity=2)
    _assert_close(actual, expected, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
def test_dp_gradient_under_autocast(mode: str, name: str, dtype: torch.dtype, device: torch.device) -> None:
    model, x, y = _case(name, device)
    bound = 0.05
    config = DPConfig(mode=mode, augmentation_multiplicity=2, max_grad_norm=bound)
    expected = dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode="hooks", augmentation_multiplicity=2,
                                                                        max_grad_norm=bound))
    with torch.autocast(device.type, dtype=dtype):
        actual = dp_gradient(model, x, y, loss_fn=_loss, config=config)
    _assert_close(actual.grads, expected.grads, model)
    assert actual.per_sample_norms.dtype == torch.float32
    torch.testing.assert_close(actual.per_sample_norms, expected.per_sample_norms, rtol=TOLERANCE, atol=0)
    # The clipping bound holds for what was summed: every clipped sample contributes at most C.
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in actual.grads.values()))
    assert float(total) <= actual.num_samples * bound * (1 + 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grad_sample_module_under_autocast(dtype: torch.dtype, device: torch.device) -> None:
    model, x, y = _case("cnn", device)
    expected = per_sample_gradients(model, x, y, loss_fn=_loss, augmentation_multiplicity=2)
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=2)
    try:
        with torch.autocast(device.type, dtype=dtype):
            loss = _loss(wrapped(x), y).mean()
        loss.backward()
        _assert_close({n: p.grad_sample for n, p in model.named_parameters()}, expected, model)
    finally:
        wrapped.remove_hooks()


def test_fp16_loss_scale_backs_off_on_overflow(device: torch.device) -> None:
    """Gradients of ~1e3 overflow float16 at the first scale: the scale drops until they fit."""
    torch.manual_seed(1)
    model = nn.Linear(8, 3).to(device)
    x, y = (30 * torch.randn(8, 8)).to(device), torch.randn(8, 3).to(device)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 100 * F.mse_loss(out.float(), target, reduction="none")

    expected = per_sample_gradients(model, x, y, loss_fn=loss, loss_reduction="sum")
    with torch.autocast(device.type, dtype=torch.float16):
        actual = per_sample_gradients(model, x, y, loss_fn=loss, loss_reduction="sum")
        ghost = dp_gradient(model, x, y, loss_fn=loss, config=DPConfig(mode="ghost", loss_reduction="sum",
                                                                       max_grad_norm=1e9))
    _assert_close(actual, expected, model)
    _assert_close(ghost.grads, {n: g.sum(0) for n, g in expected.items()}, model)
    scales: list[float] = []
    with torch.autocast(device.type, dtype=torch.float16):
        with_loss_scale(lambda scale: scales.append(scale) or scale, lambda out: out < INITIAL_LOSS_SCALE / 100)
    assert scales == [INITIAL_LOSS_SCALE, INITIAL_LOSS_SCALE / 16, INITIAL_LOSS_SCALE / 256]
    assert with_loss_scale(lambda scale: scale, lambda out: False) == 1.0  # no autocast: never scaled
