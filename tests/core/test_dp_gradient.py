"""dp_gradient against the clipped microbatch oracle, across backends; DPStep end to end."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from psg_core.accounting import PrivacyAccountant
from psg_core.clipping import AUTOMATIC_STABILITY, FLAT_EPSILON
from psg_core.config import DPConfig, DPGradient
from psg_core.dp import dp_gradient, l2_sensitivity
from psg_core.dp_step import DPStep
from psg_core.errors import (BatchLayoutError, BudgetExhaustedError, ConfigError, NonFiniteInputError,
                             UnsupportedModuleError)
from psg_core.noise import add_noise
from psg_core.sampling import PoissonBatchSampler
from tests.oracle import assert_close_scaled, microbatch_oracle, mse_loss, split_samples

CLIPPINGS = ["flat", "per_layer", "automatic"]
OTHER_MODES = ["functorch", "ew", "ghost"]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def clipped_oracle(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, K: int,
                   loss_reduction: str, C: float, clipping: str, batch_dim: int = 0
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int, float]:
    """float64 reference: oracle per-sample grads, clipped by the rules psg_core/clipping.py states, summed."""
    samples = split_samples(inputs, targets, K, batch_dim=batch_dim)
    per_sample = microbatch_oracle(model, samples, mse_loss(loss_reduction))
    n = len(samples)
    layer_norms = torch.stack([g.reshape(n, -1).norm(dim=1) for g in per_sample.values()], 1)  # (N, P)
    norms = layer_norms.norm(dim=1)  # (N,)
    if clipping == "flat":
        factors = (C / (norms + FLAT_EPSILON)).clamp(max=1.0)[:, None].expand_as(layer_norms)
        clipped = int((norms > C).sum())
    elif clipping == "automatic":
        factors = (C / (norms + AUTOMATIC_STABILITY))[:, None].expand_as(layer_norms)
        clipped = int((factors[:, 0] < 1).sum())
    else:
        bound = C / math.sqrt(len(per_sample))
        factors = (bound / (layer_norms + FLAT_EPSILON)).clamp(max=1.0)
        clipped = int((layer_norms > bound).any(1).sum())
    sums = {name: torch.einsum("n,n...->...", factors[:, i], g) for i, (name, g) in enumerate(per_sample.items())}
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        loss_sum = sum(mse_loss(loss_reduction)(ref(*(a.double() for a in args)), t.double()).item()
                       for args, t in samples)
    return sums, norms, clipped, loss_sum


def assert_same(actual: DPGradient, expected: DPGradient, *, rtol: float = 1e-4) -> None:
    assert actual.grads.keys() == expected.grads.keys()
    for name in expected.grads:
        assert_close_scaled(actual.grads[name], expected.grads[name], name=name, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(actual.per_sample_norms, expected.per_sample_norms, rtol=rtol, atol=1e-6)
    assert actual.num_samples == expected.num_samples
    assert actual.num_clipped == expected.num_clipped
    assert actual.loss_sum == pytest.approx(expected.loss_sum, rel=1e-5)


@pytest.mark.parametrize("clipping", CLIPPINGS)
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_matches_clipped_oracle(clipping: str, K: int, loss_reduction: str, device: torch.device) -> None:
    model = mlp().to(device)
    x, y = torch.randn(5 * K, 4).to(device), torch.randn(5 * K, 3).to(device)
    # C between the per-sample norms, so that some samples are clipped and some are not.
    _, norms, _, _ = clipped_oracle(model, x, y, K=K, loss_reduction=loss_reduction, C=1.0, clipping="flat")
    C = float(norms.sort().values[2:4].mean())
    config = DPConfig(max_grad_norm=C, clipping=clipping, augmentation_multiplicity=K,
                      loss_reduction=loss_reduction)
    result = dp_gradient(model, x, y, loss_fn=nn.MSELoss(reduction="none"), config=config)
    sums, norms, clipped, loss_sum = clipped_oracle(model, x, y, K=K, loss_reduction=loss_reduction, C=C,
                                                    clipping=clipping)
    for name, value in sums.items():
        assert_close_scaled(result.grads[name], value, name=name)
    assert result.per_sample_norms.dtype == torch.float32
    torch.testing.assert_close(result.per_sample_norms.double(), norms, rtol=1e-4, atol=1e-6)
    assert result.num_clipped == clipped
    assert 0 < clipped < 5  # C is chosen so that some samples are clipped and some are not
    assert result.num_samples == 5
    assert result.loss_sum == pytest.approx(loss_sum, rel=1e-5)


@pytest.mark.parametrize("mode", OTHER_MODES)
@pytest.mark.parametrize("clipping", CLIPPINGS)
def test_backends_agree_with_hooks(mode: str, clipping: str, device: torch.device) -> None:
    model = mlp(1).to(device)
    x, y = torch.randn(8, 4).to(device), torch.randn(8, 3).to(device)
    kwargs = dict(max_grad_norm=0.3, clipping=clipping, augmentation_multiplicity=2)
    expected = dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=DPConfig(mode="hooks", **kwargs))
    actual = dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=DPConfig(mode=mode, **kwargs))
    assert_same(actual, expected)


class TinyTagger(nn.Module):
    """Embedding -> Linear -> Linear per token; every layer sees the batch on the model's batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.mix = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))  # (B, T, 3) or (T, B, 3)


def token_cross_entropy(reduction: str):
    """Cross-entropy per token; logits (..., 3) and labels of the same leading shape."""
    return lambda logits, labels: F.cross_entropy(logits.movedim(-1, 1), labels, reduction=reduction)


@pytest.mark.parametrize("mode", ["hooks", *OTHER_MODES])
@pytest.mark.parametrize("batch_first", [True, False])
def test_sequence_model_with_integer_targets_agrees_with_oracle(mode: str, batch_first: bool,
                                                                device: torch.device) -> None:
    torch.manual_seed(2)
    model = TinyTagger().to(device)
    K, n, T, C = 2, 3, 4, 0.5
    shape = (n * K, T) if batch_first else (T, n * K)
    tokens, labels = torch.randint(0, 11, shape).to(device), torch.randint(0, 3, shape).to(device)
    config = DPConfig(mode=mode, max_grad_norm=C, augmentation_multiplicity=K, batch_first=batch_first)
    if mode == "ew" and not batch_first:
        # torch's ExpandedWeights embedding only knows batch-first inputs: a clear error.
        with pytest.raises(UnsupportedModuleError, match="Embedding"):
            dp_gradient(model, tokens, labels, loss_fn=token_cross_entropy("none"), config=config)
        return
    result = dp_gradient(model, tokens, labels, loss_fn=token_cross_entropy("none"), config=config)
    samples = split_samples(tokens, labels, K, batch_dim=0 if batch_first else 1)
    per_sample = microbatch_oracle(model, samples, token_cross_entropy("mean"))
    norms = torch.cat([g.reshape(n, -1) for g in per_sample.values()], 1).norm(dim=1)  # (N,)
    factors = (C / (norms + FLAT_EPSILON)).clamp(max=1.0)
    assert 0 < int((norms > C).sum()) == result.num_clipped < n
    for name, g in per_sample.items():
        assert_close_scaled(result.grads[name], torch.einsum("n,n...->...", factors, g), name=name)
    torch.testing.assert_close(result.per_sample_norms.double(), norms, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["hooks", *OTHER_MODES])
@pytest.mark.parametrize("clipping", CLIPPINGS)
def test_empty_batch_gives_zeros(mode: str, clipping: str, device: torch.device) -> None:
    model = mlp().to(device)
    config = DPConfig(mode=mode, clipping=clipping, augmentation_multiplicity=3)
    result = dp_gradient(model, torch.zeros(0, 4, device=device), torch.zeros(0, 3, device=device),
                         loss_fn=nn.MSELoss(), config=config)
    assert result.num_samples == 0 and result.num_clipped == 0 and result.loss_sum == 0.0
    assert result.per_sample_norms.shape == (0,) and result.per_sample_norms.dtype == torch.float32
    for name, p in model.named_parameters():
        assert result.grads[name].shape == p.shape
        assert torch.equal(result.grads[name], torch.zeros_like(p))


@pytest.mark.parametrize("mode", ["hooks", *OTHER_MODES])
def test_non_finite_inputs_and_targets_are_refused(mode: str) -> None:
    model = mlp()
    config = DPConfig(mode=mode)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    bad_x = x.clone()
    bad_x[1, 2] = math.nan
    with pytest.raises(NonFiniteInputError, match="dp_gradient: inputs contain NaN or infinity"):
        dp_gradient(model, bad_x, y, loss_fn=nn.MSELoss(), config=config)
    bad_y = y.clone()
    bad_y[0, 0] = -math.inf
    with pytest.raises(NonFiniteInputError, match=r"targets .* \(1 of 12 values"):
        dp_gradient(model, x, bad_y, loss_fn=nn.MSELoss(), config=config)


def test_non_finite_second_positional_input_is_refused() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.linear(a * b)

    b = torch.ones(3, 2)
    b[2, 1] = math.inf
    with pytest.raises(NonFiniteInputError, match="inputs"):
        dp_gradient(TwoInputs(), (torch.ones(3, 2), b), torch.zeros(3, 1), loss_fn=nn.MSELoss(), config=DPConfig())


def test_float64_model_gives_float64_sums_and_float32_norms() -> None:
    model = mlp().double()
    result = dp_gradient(model, torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64),
                         loss_fn=nn.MSELoss(), config=DPConfig(max_grad_norm=0.1))
    assert all(g.dtype == torch.float64 for g in result.grads.values())
    assert result.per_sample_norms.dtype == torch.float32


def test_model_and_its_grads_are_left_untouched() -> None:
    model = mlp()
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    dp_gradient(model, torch.randn(4, 4), torch.randn(4, 3), loss_fn=nn.MSELoss(), config=DPConfig())
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    assert model[2].weight.grad is None
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
        assert getattr(p, "grad_sample", None) is None


def test_frozen_parameters_are_left_out() -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    result = dp_gradient(model, torch.randn(4, 4), torch.randn(4, 3), loss_fn=nn.MSELoss(),
                         config=DPConfig(clipping="per_layer"))
    assert list(result.grads) == ["0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_shard_results_merge_to_the_whole_batch(mode: str, device: torch.device) -> None:
    model = mlp(3).to(device)
    K = 2
    x, y = torch.randn(7 * K, 4).to(device), torch.randn(7 * K, 3).to(device)
    config = DPConfig(mode=mode, max_grad_norm=0.25, augmentation_multiplicity=K)
    whole = dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=config)
    cuts = [0, 3 * K, 3 * K, 7 * K]  # includes an empty shard
    parts = [dp_gradient(model, x[a:b], y[a:b], loss_fn=nn.MSELoss(), config=config)
             for a, b in zip(cuts[:-1], cuts[1:])]
    assert_same(DPGradient.merge(parts), whole, rtol=1e-5)


def test_argument_errors() -> None:
    model = mlp()
    with pytest.raises(BatchLayoutError, match="7 rows.*K=2"):
        dp_gradient(model, torch.randn(7, 4), torch.randn(7, 3), loss_fn=nn.MSELoss(),
                    config=DPConfig(augmentation_multiplicity=2))
    with pytest.raises(ConfigError, match="config must be a DPConfig, got dict"):
        dp_gradient(model, torch.randn(2, 4), torch.randn(2, 3), loss_fn=nn.MSELoss(),
                    config={"mode": "hooks"})  # type: ignore[arg-type]
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        dp_gradient(frozen, torch.randn(2, 4), torch.randn(2, 3), loss_fn=nn.MSELoss(), config=DPConfig())
    with pytest.raises(ConfigError, match="2 bounds for 4 trainable parameters"):
        dp_gradient(model, torch.randn(2, 4), torch.randn(2, 3), loss_fn=nn.MSELoss(),
                    config=DPConfig(clipping="per_layer", per_layer_max_grad_norms=(1.0, 1.0)))


def test_l2_sensitivity() -> None:
    assert l2_sensitivity(DPConfig(max_grad_norm=2.5)) == 2.5
    assert l2_sensitivity(DPConfig(max_grad_norm=2.5, clipping="automatic")) == 2.5
    assert l2_sensitivity(DPConfig(max_grad_norm=2.5, clipping="per_layer")) == 2.5
    assert l2_sensitivity(DPConfig(clipping="per_layer", per_layer_max_grad_norms=(1.0, 2.0, 2.0))) == 3.0


# The device fixture holds no state between examples (a device, and TF32 off on CUDA).
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 4), K=st.integers(1, 3), C=st.floats(0.01, 3.0),
       clipping=st.sampled_from(CLIPPINGS), seed=st.integers(0, 1000))
def test_random_shapes_match_oracle(n: int, K: int, C: float, clipping: str, seed: int,
                                    device: torch.device) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2)).to(device)
    x, y = torch.randn(n * K, 3).to(device), torch.randn(n * K, 2).to(device)
    result = dp_gradient(model, x, y, loss_fn=nn.MSELoss(),
                         config=DPConfig(max_grad_norm=C, clipping=clipping, augmentation_multiplicity=K))
    sums, norms, clipped, _ = clipped_oracle(model, x, y, K=K, loss_reduction="mean", C=C, clipping=clipping)
    for name, value in sums.items():
        assert_close_scaled(result.grads[name], value, name=name)
    torch.testing.assert_close(result.per_sample_norms.double(), norms, rtol=1e-4, atol=1e-6)
    assert result.num_clipped == clipped


# -- DPStep --------------------------------------------------------------------------------------

def test_dp_step_fills_grad_with_normalised_noisy_sum() -> None:
    model = mlp()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    config = DPConfig(max_grad_norm=0.5, noise_multiplier=1.3)
    step = DPStep(model, loss_fn=nn.MSELoss(), config=config, sample_rate=0.01, expected_batch_size=8.0,
                  accountant=PrivacyAccountant("rdp"), generator=torch.Generator().manual_seed(9))
    stats = step(x, y)
    clean = dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=config)
    noised = add_noise(clean.grads, noise_multiplier=1.3, sensitivity=0.5,
                       generator=torch.Generator().manual_seed(9))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, noised[name] / 8.0)
    assert stats.num_samples == 6 and step.accountant.steps == 1
    assert step.accountant.history == [(1.3, 0.01, 1)]
    assert step.epsilon(1e-5) > 0


@pytest.mark.parametrize(("loss_reduction", "normaliser"), [("mean", 4.0), ("sum", 1.0)])
def test_dp_step_without_noise_is_the_normalised_clipped_sum_and_overwrites_grad(
        loss_reduction: str, normaliser: float) -> None:
    model = mlp()
    for p in model.parameters():
        p.grad = torch.full_like(p, 100.0)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    config = DPConfig(max_grad_norm=0.2, clipping="automatic", loss_reduction=loss_reduction)
    step = DPStep(model, loss_fn=nn.MSELoss(), config=config, sample_rate=0.5, expected_batch_size=4)
    step(x, y)
    assert step.normaliser == normaliser
    clean = dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=config)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, clean.grads[name] / normaliser)


def test_dp_step_noise_uses_the_per_layer_sensitivity() -> None:
    model = nn.Linear(2, 1)
    config = DPConfig(clipping="per_layer", per_layer_max_grad_norms=(3.0, 4.0), noise_multiplier=1.0)
    step = DPStep(model, loss_fn=nn.MSELoss(), config=config, sample_rate=0.1, expected_batch_size=1.0,
                  generator=torch.Generator().manual_seed(4), accountant=PrivacyAccountant("rdp"))
    step(torch.zeros(0, 2), torch.zeros(0, 1))  # empty batch: pure noise of std 5
    expected = add_noise({n: torch.zeros_like(p) for n, p in model.named_parameters()}, noise_multiplier=1.0,
                         sensitivity=5.0, generator=torch.Generator().manual_seed(4))
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, expected[name])


def test_dp_step_refuses_past_the_budget_before_computing() -> None:
    model = mlp()
    accountant = PrivacyAccountant("rdp", target_epsilon=1.0, target_delta=1e-5)
    step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.5), sample_rate=0.05,
                  expected_batch_size=2.0, accountant=accountant, generator=torch.Generator().manual_seed(0))
    allowed = accountant.steps_within_budget(noise_multiplier=1.5, sample_rate=0.05)
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    accountant.step(1.5, 0.05, num_steps=allowed - 1)
    step(x, y)
    last = {name: p.grad.clone() for name, p in model.named_parameters()}
    with pytest.raises(BudgetExhaustedError):
        step(x, y)
    assert accountant.steps == allowed
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, last[name])


def test_dp_step_argument_errors() -> None:
    model = mlp()
    common = dict(loss_fn=nn.MSELoss(), config=DPConfig())
    with pytest.raises(ConfigError, match="DPStep: sample_rate"):
        DPStep(model, sample_rate=0.0, expected_batch_size=1.0, **common)
    with pytest.raises(ConfigError, match="DPStep: expected_batch_size"):
        DPStep(model, sample_rate=0.1, expected_batch_size=0, **common)
    with pytest.raises(ConfigError, match="either a generator or secure_rng"):
        DPStep(model, sample_rate=0.1, expected_batch_size=1.0, generator=torch.Generator(), secure_rng=True,
               **common)
    with pytest.raises(ConfigError, match="config must be a DPConfig"):
        DPStep(model, loss_fn=nn.MSELoss(), config=None, sample_rate=0.1,  # type: ignore[arg-type]
               expected_batch_size=1.0)


def test_dp_sgd_with_poisson_batches_learns() -> None:
    # A tiny linear regression trained with DP-SGD (low noise): the loss must drop clearly.
    torch.manual_seed(0)
    n = 256
    features = torch.randn(n, 3)
    labels = features @ torch.tensor([[1.5], [-2.0], [0.5]])
    model = nn.Linear(3, 1)
    q = 32 / n
    step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(max_grad_norm=1.0, noise_multiplier=0.3),
                  sample_rate=q, expected_batch_size=q * n, accountant=PrivacyAccountant("rdp"),
                  generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    sampler = PoissonBatchSampler(n, q, num_batches=120, generator=torch.Generator().manual_seed(2))
    before = F.mse_loss(model(features), labels).item()
    for batch in sampler:
        optimizer.zero_grad()
        step(features[batch], labels[batch])
        optimizer.step()
    after = F.mse_loss(model(features), labels).item()
    assert after < 0.1 * before
    assert step.accountant.steps == 120
    assert 0 < step.epsilon(1e-5) < math.inf


def _drops_one_sample(model: nn.Module, inputs: torch.Tensor, y: torch.Tensor, keep: torch.Tensor,
                      config: DPConfig) -> DPGradient:
    """``dp_gradient`` on a batch with one sample whose gradient is not finite: it is dropped and
    counted, and every clipped sum is finite and equal to the step without that sample's rows
    (``keep`` False). Returns the step's result."""
    result = dp_gradient(model, inputs, y, loss_fn=nn.MSELoss(), config=config)
    expected = dp_gradient(model, inputs[keep], y[keep], loss_fn=nn.MSELoss(), config=config)
    assert result.num_dropped == 1
    for name, grad in result.grads.items():
        assert bool(torch.isfinite(grad).all()), name
        torch.testing.assert_close(grad, expected.grads[name], rtol=1e-5, atol=1e-7)
    return result


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
def test_a_sample_with_a_non_finite_gradient_is_dropped(mode: str, clipping: str, device: torch.device) -> None:
    """One record with finite but overflowing inputs must not poison the step: its gradient is
    not finite, so it is left out of the sum (and counted), never summed as NaN."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(device)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    x[2:4] = 3e38  # sample 1 of 4 (K = 2): its outputs and squared error overflow
    x, y = x.to(device), y.to(device)
    config = DPConfig(mode=mode, augmentation_multiplicity=2, max_grad_norm=0.5, clipping=clipping)
    keep = torch.tensor([True, True, False, False, True, True, True, True], device=device)
    result = _drops_one_sample(model, x, y, keep, config)
    assert result.num_samples == 4
    assert not bool(torch.isfinite(result.per_sample_norms[1]))
    assert math.isfinite(result.loss_sum)


class _TableModel(nn.Module):
    """A lookup table (Embedding or EmbeddingBag, mean over each row's tokens) and a linear head."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.table: nn.Module = nn.EmbeddingBag(20, 4, mode="mean") if bag else nn.Embedding(20, 4)
        self.bag = bag
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.table(tokens) if self.bag else self.table(tokens).mean(1)
        return self.head(rows)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
def test_a_table_sample_with_a_non_finite_gradient_is_dropped(mode: str, bag: bool, device: torch.device) -> None:
    """A lookup table's clipped sum (ghost: from its entries and their gradient rows) leaves a
    dropped sample's non-finite rows out, and keeps the others' exactly."""
    torch.manual_seed(4)
    model = _TableModel(bag).to(device)
    tokens, y = torch.randint(0, 20, (8, 3)), torch.randn(8, 2)
    tokens[2, 0] = tokens[0, 0]  # the dropped sample shares a table row with a kept one
    y[2:4] = 3e38  # sample 1 of 4 (K = 2): its output gradient overflows
    tokens, y = tokens.to(device), y.to(device)
    config = DPConfig(mode=mode, augmentation_multiplicity=2, max_grad_norm=0.5)
    keep = torch.tensor([True, True, False, False, True, True, True, True], device=device)
    _drops_one_sample(model, tokens, y, keep, config)


class _TwiceModel(nn.Module):
    """One Linear called twice on a sequence, so ghost stacks its two calls' rows for the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(32, 32)  # wide enough for its Gram matrices to be the cheaper norm
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, 32) -> (rows, 2)
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_dropped_sample_of_a_layer_called_twice_leaves_the_other_rows_exact(mode: str, device: torch.device) -> None:
    """Ghost scales the stacked rows of a layer's calls (calls x N x K rows) by their sample's
    factor: a dropped sample's rows are zeroed in every call, the other samples' sums are kept."""
    torch.manual_seed(5)
    model = _TwiceModel().to(device)
    x, y = torch.randn(12, 32), torch.randn(12, 2)
    y[3:6] = 3e38  # sample 1 of 4 (K = 3): its output gradient overflows
    x, y = x.to(device), y.to(device)
    config = DPConfig(mode=mode, augmentation_multiplicity=3, max_grad_norm=0.5)
    keep = torch.ones(12, dtype=torch.bool, device=device)
    keep[3:6] = False
    assert _drops_one_sample(model, x, y, keep, config).num_samples == 4


class _PartRows(nn.Module):
    """Its head sees only two of the batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 3))
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h[:2]).sum() + h.sum(1, keepdim=True)


def test_ghost_names_the_module_that_saw_part_of_the_batch() -> None:
    with pytest.raises(UnsupportedModuleError, match=r"module 'head' \(Linear\) receives values that mix samples"):
        dp_gradient(_PartRows(), torch.randn(4, 3), torch.randn(4, 1), loss_fn=nn.MSELoss(),
                    config=DPConfig(mode="ghost"))


# ------------------------------------------------------------------ which side the clipped sum scales
@pytest.mark.parametrize("K", [1, 3])
def test_ghost_scales_the_smaller_side_of_each_weight_sum(K: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family whose weight sum is linear in its input (Linear, Conv) has the clipping factors
    applied to the smaller of its input and its output gradient: a widening Linear and a conv
    from 2 to 32 channels (Gram factors) scale their inputs, a narrowing Linear its output gradient; the clipped
    sum is the microbatch oracle's either way."""
    from psg_core.backends import ghost

    torch.manual_seed(11)
    model = nn.Sequential(nn.Conv1d(2, 32, 3), nn.Flatten(), nn.Linear(32, 40), nn.Tanh(), nn.Linear(40, 3))
    x, y = torch.randn(4 * K, 2, 3), torch.randn(4 * K, 3)
    scaled: list[tuple[int, ...]] = []
    real = ghost._scale_rows

    def spy(rows: torch.Tensor, **kwargs: object) -> torch.Tensor:
        scaled.append(tuple(rows.shape[1:]))
        return real(rows, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ghost, "_scale_rows", spy)
    config = DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=0.05)
    result = dp_gradient(model, x, y, loss_fn=nn.MSELoss(), config=config)
    assert sorted(scaled) == sorted([(2, 3), (32,), (3,)])  # conv input, Linear(32, 40) input, last output grad
    sums, norms, clipped, _ = clipped_oracle(model, x, y, K=K, loss_reduction="mean", C=0.05, clipping="flat")
    assert 0 < clipped == result.num_clipped
    torch.testing.assert_close(result.per_sample_norms.double(), norms, rtol=1e-4, atol=1e-6)
    for name, grad in result.grads.items():
        assert_close_scaled(grad, sums[name], name=name)


def test_linear_in_input_needs_a_weight_sum_of_the_first_input() -> None:
    from psg_core.grad_sample.ghost_norm import GHOST_NORMS, GhostNormRegistry, WeightLayout

    for layer_type in (nn.Linear, nn.Conv2d, nn.ConvTranspose1d):
        entry = GHOST_NORMS.lookup(layer_type)
        assert entry is not None and entry.linear_in_input, layer_type
    registry = GhostNormRegistry()
    with pytest.raises(ConfigError, match="linear_in_input needs a weight_sum"):
        registry.register(nn.EmbeddingBag, positions=lambda *a: 1, layout=WeightLayout.KEYED_TABLE, whole_call=True,
                          linear_in_input=True)
