"""A call that hooks and ghost differentiate again (the per-layer fallback, a unit) and that draws
random numbers: dropout in training mode.

A sample's run alone draws other masks than the batch's forward did, so its per-sample gradients
were of another function than the one the forward computed: wrong, silently (WavLM's attention
and Longformer's in training mode). The call is now replayed on the whole batch with the
generators as the call found them (the same masks), and each sample's gradient is the
vector-Jacobian product with its own rows' output gradients.

The reference: the gradient of one sample's loss alone through the batch's forward, run with the
same seed (the same masks); rows do not mix, so that is the sample's gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from psg_core import DPConfig, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled, cross_entropy_rows

WIDTH, STEPS, SEED = 6, 3, 11


class Gate(nn.Module):
    """No grad sampler (its weight meets the batch in a product): dropout on its output."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(x @ self.weight), p=0.5, training=self.training)


@psg_core.unit_module
class Block(nn.Module):
    """A unit: a Linear child, an ``nn.Dropout`` child and attention weights dropped as attention's are."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        h = self.drop(self.proj(x)) * self.scale
        weights = F.dropout(torch.softmax(h @ x.transpose(1, 2), -1), p=0.25, training=self.training)
        return weights @ h


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.inner = Gate() if how == "layer" else Block()
        self.head = nn.Linear(WIDTH, 3)
        self.drop = nn.Dropout(0.2)  # outside the re-run call: drops the Linear's input

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        return self.head(self.drop(self.inner(torch.tanh(self.inp(x)))).mean(1))


def _batch(K: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(K)
    return torch.randn(4 * K, STEPS, WIDTH, generator=generator), torch.randint(0, 3, (4 * K,), generator=generator)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int) -> dict[str, torch.Tensor]:
    """Each sample's gradient of its rows' mean loss, through the batch's forward with SEED's masks."""
    params = dict(model.named_parameters())
    per_sample: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for n in range(x.shape[0] // K):
        torch.manual_seed(SEED)
        losses = cross_entropy_rows(model(x), y)
        grads = torch.autograd.grad(losses[n * K:(n + 1) * K].mean(), list(params.values()))
        for name, g in zip(params, grads):
            per_sample[name].append(g)
    return {name: torch.stack(gs) for name, gs in per_sample.items()}


@pytest.mark.parametrize("how", ["layer", "unit"])
@pytest.mark.parametrize("K", [1, 2])
def test_hooks_replay_the_call_s_dropout_masks(how: str, K: int) -> None:
    torch.manual_seed(0)
    model = Net(how).train()
    x, y = _batch(K)
    expected = _reference(model, x, y, K)
    torch.manual_seed(SEED)
    got = per_sample_gradients(model, x, y, loss_fn=cross_entropy_rows, augmentation_multiplicity=K)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)


@pytest.mark.parametrize("how", ["layer", "unit"])
@pytest.mark.parametrize("K", [1, 2])
def test_ghost_replays_the_call_s_dropout_masks(how: str, K: int) -> None:
    torch.manual_seed(1)
    model = Net(how).train()
    x, y = _batch(K)
    expected = _reference(model, x, y, K)
    reference = psg_core.clip_and_sum(expected, max_grad_norm=0.05)
    torch.manual_seed(SEED)
    result = dp_gradient(model, x, y, loss_fn=cross_entropy_rows,
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=0.05))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    for name, value in reference.grads.items():
        assert_close_scaled(result.grads[name], value, name=name)


def test_grad_sample_module_replays_the_call_s_dropout_masks() -> None:
    torch.manual_seed(2)
    model = Net("unit").train()
    x, y = _batch(2)
    expected = _reference(model, x, y, 2)
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=2, strict=False)
    torch.manual_seed(SEED)
    cross_entropy_rows(wrapped(x), y).mean().backward()
    for name, p in model.named_parameters():
        assert_close_scaled(p.grad_sample, expected[name], name=name)  # type: ignore[attr-defined]


def test_the_generators_are_left_as_the_forward_left_them() -> None:
    """The replay resets the generators to the call's start and puts them back: the next draw is
    the one that follows the step's forward, as without psg."""
    model = Net("layer").train()
    x, y = _batch(1)
    torch.manual_seed(SEED)
    loss = cross_entropy_rows(model(x), y).mean()
    loss.backward()
    after_plain = torch.rand(3)
    torch.manual_seed(SEED)
    per_sample_gradients(model, x, y, loss_fn=cross_entropy_rows)
    assert torch.equal(torch.rand(3), after_plain)


def test_in_eval_mode_each_sample_runs_alone_as_before() -> None:
    """No random number drawn: no replay (the per-sample runs, vmapped), the oracle's gradients."""
    from tests.oracle import check_mode

    torch.manual_seed(3)
    x, y = _batch(2)
    check_mode(Net("unit").eval(), x, y, K=2, mode="hooks", loss=cross_entropy_rows)


def test_a_captured_step_runs_a_random_call_eagerly() -> None:
    """A recorded graph cannot reset the generators: the signature is refused, every step eager."""
    from psg_core.capture import CapturedStep

    model = Net("layer").train()
    step = CapturedStep(model, loss_fn=cross_entropy_rows, config=DPConfig(mode="hooks", max_grad_norm=0.05))
    for _ in range(3):
        x, y = _batch(1)
        step(x, y)
    assert step.stats["replayed"] == 0 and step.stats["refused"] >= 1, step.stats
    assert any("random numbers" in reason for reason in step.refusals), step.refusals


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_wavlm_trains_with_its_attention_dropout(mode: str) -> None:
    """WavLM's attention (a unit: F.multi_head_attention_forward on its projections' weights) drops
    attention weights in training mode; its defaults drop 10% everywhere else. (SpecAugment's masks
    are drawn by numpy, which no seed here replays: off.)"""
    transformers = pytest.importorskip("transformers")
    config = transformers.WavLMConfig(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, conv_dim=(4, 4),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_buckets=8, max_bucket_distance=20, num_labels=2, attention_dropout=0.3, layerdrop=0.0, mask_time_prob=0.0)
    torch.manual_seed(4)
    model = transformers.WavLMForSequenceClassification(config).double().train()
    K = 2
    audio = torch.randn(3 * K, 200, dtype=torch.float64)
    labels = torch.arange(3 * K) % 2

    def loss(out: object, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits, t, reduction="none")  # type: ignore[attr-defined]

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for n in range(3):
        torch.manual_seed(SEED)
        grads = torch.autograd.grad(loss(model(audio), labels)[n * K:(n + 1) * K].mean(), list(params.values()),
                                    allow_unused=True)
        for name, g in zip(params, grads):
            rows[name].append(torch.zeros_like(params[name]) if g is None else g)
    expected = {name: torch.stack(gs) for name, gs in rows.items()}
    torch.manual_seed(SEED)
    if mode == "ghost":
        got = dp_gradient(model, audio, labels, loss_fn=loss, config=DPConfig(
            mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9)).grads
        expected = {name: value.sum(0) for name, value in expected.items()}
    else:
        got = per_sample_gradients(model, audio, labels, loss_fn=loss, augmentation_multiplicity=K)
    scale = max(float(value.abs().max()) for value in expected.values())
    for name, value in expected.items():
        torch.testing.assert_close(got[name] / scale, value / scale, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")


class Drifting(nn.Module):
    """Draws dropout at a rate that changes with a Python counter of its calls (not state psg keeps):
    run again, it draws other masks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.dropout(x @ self.weight, p=0.5 if self.calls % 2 else 0.1, training=self.training)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_call_whose_replay_returns_other_values_is_refused(mode: str) -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Drifting(), nn.Flatten(), nn.Linear(STEPS * WIDTH, 3)).train()
    x, y = _batch(1)
    with pytest.raises(psg_core.UnsupportedModuleError, match=r"Drifting draws random numbers in its call .*returned "
                                                              r"other values.*mode='functorch'"):
        dp_gradient(model, x, y, loss_fn=cross_entropy_rows, config=DPConfig(mode=mode, max_grad_norm=1.0))


class Halved(torch.autograd.Function):
    """``x**2`` whose backward is half its derivative, written without ``setup_context`` (which
    torch.func cannot transform): PhiMoE's router multiplier is such a function."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        return x.square()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * x


class NoisyRouter(nn.Linear):
    """A Linear with two outputs (so the per-layer fallback computes it): logits and weights drawn
    with Gumbel noise in training mode through such a function (PhiMoE's sparse mixer in small)."""

    def __init__(self) -> None:
        super().__init__(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        noisy = logits - torch.empty_like(logits).exponential_().log() if self.training else logits
        return logits, Halved.apply(torch.softmax(noisy, -1))


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.router, self.head = nn.Linear(WIDTH, WIDTH), NoisyRouter(), nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, weights = self.router(torch.tanh(self.inp(x)))
        return self.head((weights + 0.1 * logits).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_random_call_through_a_function_torch_func_cannot_transform(mode: str) -> None:
    """vjp refuses the function: the replay's backward runs by autograd, once per sample."""
    torch.manual_seed(5)
    model = Routed().train()
    x, y = _batch(2)
    expected = _reference(model, x, y, 2)
    torch.manual_seed(SEED)
    if mode == "hooks":
        got = per_sample_gradients(model, x, y, loss_fn=cross_entropy_rows, augmentation_multiplicity=2)
        for name, value in expected.items():
            assert_close_scaled(got[name], value, name=name)
    else:
        reference = psg_core.clip_and_sum(expected, max_grad_norm=0.05)
        result = dp_gradient(model, x, y, loss_fn=cross_entropy_rows,
                             config=DPConfig(mode="ghost", augmentation_multiplicity=2, max_grad_norm=0.05))
        for name, value in reference.grads.items():
            assert_close_scaled(result.grads[name], value, name=name)
