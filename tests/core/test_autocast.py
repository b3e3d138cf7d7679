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

import math
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


def test_loss_scale_keeps_each_sample_at_the_highest_scale_it_fits() -> None:
    """with_loss_scale's protocol: the scale drops by 16 for the samples still overflowing, down to
    1; each sample keeps its result from the highest scale at which it was finite; one never finite
    keeps the first (non-finite) result, for clipping to drop."""
    highest = torch.tensor([INITIAL_LOSS_SCALE, 2.0 ** 8, 0.5])  # sample i is finite at scale <= highest[i]
    asked: list[tuple[float, list[bool] | None]] = []

    def run(scale: float, pending: torch.Tensor | None) -> torch.Tensor:
        asked.append((scale, None if pending is None else pending.tolist()))
        return torch.where(scale <= highest, scale, math.inf)

    def finite(out: torch.Tensor) -> torch.Tensor:
        return out < math.inf

    def merge(kept: torch.Tensor, new: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
        return torch.where(take, new, kept)

    with torch.autocast("cpu", dtype=torch.float16):
        out = with_loss_scale(run, finite, merge)
    s = INITIAL_LOSS_SCALE
    assert asked == [(s, None), (s / 16, [False, True, True]), (s / 256, [False, True, True]),
                     (s / 4096, [False, False, True]), (1.0, [False, False, True])]
    assert out.tolist() == [s, s / 256, math.inf]
    asked.clear()
    assert with_loss_scale(run, finite, merge).tolist() == [1.0, 1.0, math.inf]  # no autocast: never scaled
    assert asked == [(1.0, None)]  # nor run again (sample 2 is left for clipping to drop)
    assert INITIAL_LOSS_SCALE == 2.0 ** 15  # float16 holds it (65536 is infinite in float16)


# ------------------------------------------------------------------ half-precision parameters
def _identical_samples(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """4 copies of one sample with a large gradient (norm ~6e3): the clipped sum is exactly 4 * C."""
    torch.manual_seed(0)
    model = nn.Linear(64, 8).to(dtype)
    return model, (5 * torch.randn(1, 64)).to(dtype).repeat(4, 1), torch.randn(1, 8).repeat(4, 1)


def _sum_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


@pytest.mark.parametrize("C", [1e-3, 3e-4, 1e-4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
def test_half_precision_parameters_keep_the_clipping_bound(mode: str, dtype: torch.dtype, C: float,
                                                           device: torch.device) -> None:
    """The clip factor (~C / 6e3) was cast to the parameters' dtype before multiplying: in float16
    below ~6e-5 it is subnormal or 0, and the sum was 1.11 x, 1.23 x, then 0 x N*C with every
    sample counted as clipped, none dropped (bf16: 1.0035 x). Multiplied and summed in float32,
    cast once: N*C to the half-precision rounding of the result."""
    model, x, y = _identical_samples(dtype)
    model, x, y = model.to(device), x.to(device), y.to(device)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 10 * F.mse_loss(out.float(), target, reduction="none").sum(-1)

    out = dp_gradient(model, x, y, loss_fn=loss, config=DPConfig(mode=mode, max_grad_norm=C))
    assert out.num_clipped == 4 and out.num_dropped == 0
    assert all(g.dtype == dtype for g in out.grads.values())
    assert _sum_norm(out.grads) / (4 * C) == pytest.approx(1.0, abs=2e-3)


@pytest.mark.parametrize("C", [1e-3, 3e-4, 1e-4])
def test_ghost_scales_half_precision_rows_in_float32(C: float, device: torch.device) -> None:
    """Ghost clipping scales a layer's kept output-gradient rows (~1e-3 here, beside activations
    ~100) by the factors (~2e-5): in float16 the product underflows, and the clipped sum was
    1.02 x to 1.13 x N*C where hooks is exact. Rows scaled and summed in float32 (a Linear's
    weight from its Gram factors, an Embedding's table), the sum cast once: hooks' sum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 8, bias=False))
    with torch.no_grad():
        model[0].weight.mul_(100)  # large activations
    model = model.half().to(device)
    ids = torch.randint(0, 10, (1, 3), device=device)
    target = model(ids).detach().float() + 1e-3 * torch.randn(1, 3, 8, device=device)
    x, y = ids.repeat(4, 1), target.repeat(4, 1, 1)  # 4 identical samples; output gradients ~1e-3

    def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), t, reduction="none").sum((1, 2))

    out = dp_gradient(model, x, y, loss_fn=loss, config=DPConfig(mode="ghost", max_grad_norm=C))
    hooks = dp_gradient(model, x, y, loss_fn=loss, config=DPConfig(mode="hooks", max_grad_norm=C))
    assert out.num_clipped == 4 and out.num_dropped == 0
    assert _sum_norm(out.grads) / (4 * C) == pytest.approx(1.0, abs=2e-3)
    assert _sum_norm(hooks.grads) / (4 * C) == pytest.approx(1.0, abs=2e-3)
    scale = max(float(g.float().abs().max()) for g in hooks.grads.values())
    for name, grad in hooks.grads.items():
        assert out.grads[name].dtype == torch.float16
        torch.testing.assert_close(out.grads[name].float(), grad.float(), rtol=0, atol=2e-3 * scale, msg=name)


# ------------------------------------------------------------------ the loss under fp16 autocast
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
def test_fp16_loss_sum_is_finite_and_the_first_pass_counts(mode: str, device: torch.device) -> None:
    """A loss computed in float16 (the target cast to the output's dtype: values ~20, gradients
    +-1) times the loss scale overflowed: hooks reported loss_sum=inf, and 65536 times a float16
    loss's gradient is infinite, so every first pass was wasted. The loss is scaled in float32,
    by 2**15: one pass, the fp32 step's loss."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    x, y = torch.randn(6, 8).to(device), (5 * torch.randn(6, 4)).to(device)
    calls: list[torch.dtype] = []

    def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        value = (out - t.to(out.dtype)).abs().sum(-1)
        calls.append(value.dtype)
        return value

    config = DPConfig(mode=mode, max_grad_norm=1e9)
    expected = dp_gradient(model, x, y, loss_fn=loss, config=config)
    calls.clear()
    with torch.autocast(device.type, dtype=torch.float16):
        actual = dp_gradient(model, x, y, loss_fn=loss, config=config)
    assert len(calls) == 1, calls  # one pass: nothing overflowed
    assert math.isfinite(actual.loss_sum) and actual.loss_sum == pytest.approx(expected.loss_sum, rel=2e-3)
    assert actual.num_dropped == 0
    _assert_close(actual.grads, expected.grads, model)


# ------------------------------------------------------------------ one sample that overflows
def _weighted_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y[:, 5]`` is each row's loss weight."""
    return y[:, 5] * F.mse_loss(out.float(), y[:, :5], reduction="none").sum(-1)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
def test_an_overflowing_sample_does_not_zero_the_others(mode: str, device: torch.device) -> None:
    """Sample 0's gradient (loss weight 3e4) overflows float16 at every scale; the others' (weight
    1e-8) underflow float16 unless scaled. The whole batch used to be retried down to scale 1,
    where samples 3-5 came out exactly 0 (norms 0.96, 0.93, 0, 0, 0 of their fp32 values),
    unreported. Each sample now keeps its result from the highest scale it fits in: the honest
    ones their fp32 norms, sample 0 dropped and counted where it overflows (hooks and ghost run in
    float16; functorch computes in float32, where it is finite), the sum within N*C."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5)).to(device)
    x, t = torch.randn(6, 10), torch.randn(6, 5)
    weights = torch.full((6, 1), 1e-8)
    weights[0] = 3e4
    y = torch.cat([t, weights], 1).to(device)
    x = x.to(device)
    reference = dp_gradient(model, x, y, loss_fn=_weighted_mse, config=DPConfig(max_grad_norm=1e9))
    C = float(reference.per_sample_norms[1:].median())  # some honest samples clipped, some not
    with torch.autocast(device.type, dtype=torch.float16):
        out = dp_gradient(model, x, y, loss_fn=_weighted_mse, config=DPConfig(mode=mode, max_grad_norm=C))
    overflows = not bool(torch.isfinite(out.per_sample_norms[0]))
    assert overflows or mode not in ("hooks", "ghost")  # (ew's per-sample kernels follow autocast too)
    assert out.num_dropped == int(overflows)
    torch.testing.assert_close(out.per_sample_norms[1:], reference.per_sample_norms[1:], rtol=1e-2, atol=0)
    assert _sum_norm(out.grads) <= 6 * C * (1 + 1e-3)
    # the honest samples' clipped sum, as an fp32 step without sample 0 gives it (plus sample 0's
    # clipped contribution where it is kept)
    honest = dp_gradient(model, x[1:], y[1:], loss_fn=_weighted_mse, config=DPConfig(max_grad_norm=C))
    first = dp_gradient(model, x[:1], y[:1], loss_fn=_weighted_mse, config=DPConfig(max_grad_norm=C))
    expected = {n: g + (0 if overflows else first.grads[n]) for n, g in honest.grads.items()}
    _assert_close(out.grads, expected, model)
    assert out.loss_sum == pytest.approx(honest.loss_sum + (0 if overflows else first.loss_sum), rel=1e-2)
