from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import psg_core
from psg_core import native
from psg_core.errors import BatchLayoutError, UnsupportedModuleError
from tests.oracle import Batch, check_against_oracle, hooks_grad_samples, mse_loss

REDUCTIONS = ["mean", "sum"]
KS = [1, 3]


# ----------------------------------------------------------------------------------- Embedding
@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding_sequence(loss_reduction: str, K: int, batch_first: bool,
                            padding_idx: int | None, device: torch.device) -> None:
    torch.manual_seed(0)
    vocab = 7  # small, so tokens repeat within and across samples
    model = nn.Sequential(nn.Embedding(vocab, 4, padding_idx=padding_idx), nn.Tanh(), nn.Linear(4, 3))
    shape = (3 * K, 5) if batch_first else (5, 3 * K)
    tokens = torch.randint(0, vocab, shape)
    tokens.view(-1)[::4] = 2 if padding_idx is None else padding_idx % vocab
    targets = torch.randn(*shape, 3)
    grads = check_against_oracle(model, tokens, targets, K=K, loss_reduction=loss_reduction,
                                 batch_first=batch_first, device=device)
    if padding_idx is not None:
        assert grads["0.weight"][:, padding_idx].abs().max() == 0


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
def test_embedding_one_token_per_row_and_extra_dims(loss_reduction: str, K: int, device: torch.device) -> None:
    torch.manual_seed(1)
    model = nn.Embedding(6, 3, max_norm=1.0)
    flat = torch.randint(0, 6, (4 * K,))
    check_against_oracle(model, flat, torch.randn(4 * K, 3), K=K, loss_reduction=loss_reduction, device=device)
    grid = torch.randint(0, 6, (2 * K, 3, 2))
    check_against_oracle(model, grid, torch.randn(2 * K, 3, 2, 3), K=K, loss_reduction=loss_reduction,
                         device=device)


def test_embedding_sparse_matches_dense(device: torch.device) -> None:
    torch.manual_seed(2)
    dense = nn.Embedding(8, 3)
    sparse = nn.Embedding(8, 3, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    dense, sparse = dense.to(device), sparse.to(device)
    tokens = torch.randint(0, 8, (6, 4)).to(device)
    targets = torch.randn(6, 4, 3).to(device)
    results = [hooks_grad_samples(m, tokens, targets, mse_loss("sum"), K=2, loss_reduction="sum",
                                  batch_first=True)[0]["weight"] for m in (dense, sparse)]
    torch.testing.assert_close(results[1], results[0])


def test_embedding_scale_grad_by_freq_is_rejected() -> None:
    # Refused when wrapped, naming the layer (its gradient scales by counts over the whole batch).
    with pytest.raises(UnsupportedModuleError, match=r"'<root>' \(Embedding\).*scale_grad_by_freq"):
        psg_core.GradSampleModule(nn.Embedding(5, 2, scale_grad_by_freq=True))


# -------------------------------------------------------------------------------- EmbeddingBag
class _BagHead(nn.Module):
    """EmbeddingBag then a Linear head; passes offsets / per_sample_weights by keyword when told."""

    def __init__(self, bag: nn.EmbeddingBag, *, by_keyword: bool = False) -> None:
        super().__init__()
        self.bag = bag
        self.head = nn.Linear(bag.embedding_dim, 2)
        self.by_keyword = by_keyword

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.by_keyword:
            pooled = self.bag(tokens, offsets=offsets, per_sample_weights=per_sample_weights)
        elif per_sample_weights is not None:
            pooled = self.bag(tokens, offsets, per_sample_weights)
        elif offsets is not None:
            pooled = self.bag(tokens, offsets)
        else:
            pooled = self.bag(tokens)
        return self.head(torch.tanh(pooled))  # (B, 2)


def _random_bags(bags: int, vocab: int, *, max_len: int = 4, seed: int = 0
                 ) -> tuple[torch.Tensor, list[int]]:
    """Flat tokens and bag lengths (some bags empty)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (bags,), generator=gen).tolist()
    lengths[0] = max(lengths[0], 1)
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    return tokens, lengths


def _offsets(lengths: list[int], include_last_offset: bool) -> torch.Tensor:
    ends = torch.tensor(lengths).cumsum(0)
    starts = ends - torch.tensor(lengths)
    return torch.cat([starts, ends[-1:]]) if include_last_offset else starts


def _bag_samples(tokens: torch.Tensor, lengths: list[int], weights: torch.Tensor | None,
                 targets: torch.Tensor, K: int, include_last_offset: bool) -> list[Batch]:
    """Per-sample microbatches: sample n's K bags, with its own offsets starting at 0."""
    ends = torch.tensor(lengths).cumsum(0).tolist()
    starts = [e - n for e, n in zip(ends, lengths)]
    samples: list[Batch] = []
    for n in range(len(lengths) // K):
        first, last = n * K, n * K + K - 1
        lo, hi = starts[first], ends[last]
        args: tuple[Any, ...] = (tokens[lo:hi], _offsets(lengths[first:last + 1], include_last_offset))
        if weights is not None:
            args = args + (weights[lo:hi],)
        samples.append((args, targets[first:last + 1]))
    return samples


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 1])
def test_embedding_bag_2d(loss_reduction: str, K: int, mode: str, padding_idx: int | None,
                          device: torch.device) -> None:
    torch.manual_seed(3)
    model = _BagHead(nn.EmbeddingBag(6, 4, mode=mode, padding_idx=padding_idx))
    tokens = torch.randint(0, 6, (3 * K, 4))
    tokens[0] = 1  # a bag of padding only when padding_idx=1
    check_against_oracle(model, tokens, torch.randn(3 * K, 2), K=K, loss_reduction=loss_reduction, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("by_keyword", [False, True])
def test_embedding_bag_offsets(loss_reduction: str, K: int, mode: str, include_last_offset: bool,
                               by_keyword: bool, device: torch.device) -> None:
    torch.manual_seed(4)
    bag = nn.EmbeddingBag(7, 3, mode=mode, include_last_offset=include_last_offset, padding_idx=0)
    model = _BagHead(bag, by_keyword=by_keyword)
    tokens, lengths = _random_bags(3 * K, 7, seed=K)
    offsets = _offsets(lengths, include_last_offset)
    targets = torch.randn(3 * K, 2)
    samples = _bag_samples(tokens, lengths, None, targets, K, include_last_offset)
    check_against_oracle(model, (tokens, offsets), targets, K=K, loss_reduction=loss_reduction,
                         samples=samples, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("by_keyword", [False, True])
def test_embedding_bag_per_sample_weights(loss_reduction: str, K: int, by_keyword: bool,
                                          device: torch.device) -> None:
    torch.manual_seed(5)
    model = _BagHead(nn.EmbeddingBag(6, 3, mode="sum", padding_idx=2), by_keyword=by_keyword)
    tokens, lengths = _random_bags(2 * K, 6, seed=10 + K)
    weights = torch.rand(tokens.shape[0]) + 0.5
    targets = torch.randn(2 * K, 2)
    samples = _bag_samples(tokens, lengths, weights, targets, K, False)
    check_against_oracle(model, (tokens, _offsets(lengths, False), weights), targets, K=K,
                         loss_reduction=loss_reduction, samples=samples, device=device)
    # 2-D input: the weights have the input's shape.
    grid = torch.randint(0, 6, (2 * K, 3))
    grid_weights = torch.rand(2 * K, 3)
    check_against_oracle(model, (grid, None, grid_weights), targets, K=K,
                         loss_reduction=loss_reduction,
                         samples=[((grid[n * K:n * K + K], None, grid_weights[n * K:n * K + K]),
                                   targets[n * K:n * K + K]) for n in range(2)], device=device)


@pytest.mark.parametrize("K", [1, 2, 3, 5])
@pytest.mark.parametrize("config", [dict(mode="sum"), dict(mode="mean"), dict(mode="sum", padding_idx=0),
                                    dict(mode="mean", include_last_offset=True), dict(mode="sum", weights=True)])
@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_embedding_bag_ghost_norms_and_clipped_sums(K: int, config: dict[str, Any], flat: bool, kernels: str) -> None:
    """The ghost norm from the tokens' weights and their bags' gradients (never the (M, d) rows):
    per-sample norms and clipped sums equal the hooks backend's, tokens repeating within and
    across bags, empty bags included (K up to 3: the (M, K) weights and (N, K, K) Grams; K=5: the (M, d) runs);
    through psg's native kernels (where they build) and through torch ops."""
    torch.manual_seed(8 + K)
    config = dict(config)
    weighted = config.pop("weights", False)
    model = _BagHead(nn.EmbeddingBag(5, 10, **config))  # K*K <= 10 up to K=3; K=5 the (M, d) runs
    if flat:
        tokens, lengths = _random_bags(4 * K, 5, max_len=6, seed=30 + K)
        offsets = _offsets(lengths, config.get("include_last_offset", False))
        inputs: tuple[Any, ...] = (tokens, offsets)
        count = tokens.shape[0]
    else:
        if config.get("include_last_offset"):
            pytest.skip("include_last_offset takes a 1-D input")
        tokens = torch.randint(0, 5, (4 * K, 6))
        inputs, count = (tokens, None), tokens.numel()
    if weighted:
        weight = torch.rand(count) + 0.5
        inputs = inputs + (weight if flat else weight.view(tokens.shape),)
    targets = torch.randn(4 * K, 2)
    loss = nn.MSELoss(reduction="none")
    with native.native_kernels(kernels):
        results = {mode: psg_core.dp_gradient(model, inputs, targets, loss_fn=loss, config=psg_core.DPConfig(
            mode=mode, augmentation_multiplicity=K, max_grad_norm=0.05)) for mode in ("hooks", "ghost")}
    torch.testing.assert_close(results["ghost"].per_sample_norms, results["hooks"].per_sample_norms,
                               rtol=1e-5, atol=1e-6)
    assert results["ghost"].num_clipped == results["hooks"].num_clipped > 0
    for name, grad in results["hooks"].grads.items():
        torch.testing.assert_close(results["ghost"].grads[name], grad, rtol=1e-5, atol=1e-6)


class _TimeMajorWithBag(nn.Module):
    """A time-major model: an EmbeddingBag (always batch-first) added to a Linear on (T, B, d)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode="mean")
        self.proj = nn.Linear(2, 3)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.bag(tokens, offsets)[None]  # (T, B, 3)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
def test_embedding_bag_in_time_major_model(loss_reduction: str, K: int, device: torch.device) -> None:
    torch.manual_seed(6)
    tokens, lengths = _random_bags(3 * K, 6, seed=20 + K)
    offsets = _offsets(lengths, False)
    x = torch.randn(4, 3 * K, 2)  # (T, B, 2)
    targets = torch.randn(4, 3 * K, 3)
    samples = [((args[0], args[1], x[:, n * K:n * K + K]), targets[:, n * K:n * K + K])
               for n, (args, _) in enumerate(_bag_samples(tokens, lengths, None, targets[0], K,
                                                          False))]
    check_against_oracle(_TimeMajorWithBag(), (tokens, offsets, x), targets, K=K,
                         loss_reduction=loss_reduction, batch_first=False, samples=samples, device=device)


def test_embedding_bag_rows_are_bags() -> None:
    model = psg_core.GradSampleModule(nn.EmbeddingBag(5, 2), augmentation_multiplicity=2)
    # 4 tokens but 3 bags: the bag count is what K must divide.
    with pytest.raises(BatchLayoutError, match="3 rows"):
        model(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3]))
    model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1, 2])).sum().backward()
    assert model.weight.grad_sample.shape == (2, 5, 2)


def test_embedding_bag_offsets_rejected_by_functorch_fallback() -> None:
    model = psg_core.GradSampleModule(nn.EmbeddingBag(5, 2), force_functorch=True)
    with pytest.raises(UnsupportedModuleError, match="offsets"):
        model(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3])).sum().backward()


class _BagOfTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 3, mode="mean")

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(tokens, offsets)


class _BagsBuiltPerSample(nn.Module):
    """2-D bags flattened inside the model, with offsets built from a sample's own shape."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 3, mode="mean")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows, length = tokens.shape
        return self.bag(tokens.reshape(-1), torch.arange(0, rows * length, length, device=tokens.device))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap loops over embedding_bag
@pytest.mark.parametrize("K", [1, 2])
def test_functorch_refuses_batch_offsets_itself(K: int, device: torch.device, caplog: pytest.LogCaptureFixture
                                                ) -> None:
    """Undeclared 1-D tokens and offsets: the offsets (one per row) are split per sample but stay
    positions in the whole batch's token list. psg refuses before the kernel runs: torch's CPU
    kernel rejects a sample's offsets (not starting at 0), its CUDA kernel read them and returned
    wrong gradients (seen on an H200). Offsets the model builds from a sample's tokens are fine."""
    torch.manual_seed(0)
    rows = 3 * K
    tokens, offsets = torch.randint(0, 10, (2 * rows,), device=device), torch.arange(0, 2 * rows, 2, device=device)
    targets = torch.randn(rows, 3, device=device)
    with pytest.raises(UnsupportedModuleError, match=r"'bag' \(EmbeddingBag\) takes 1-D tokens with offsets"):
        psg_core.per_sample_gradients(_BagOfTokens().to(device), (tokens, offsets), targets, loss_fn=mse_loss("none"),
                                      mode="functorch", augmentation_multiplicity=K)
    # refused at once, not taken for a limit of vmap's (no one-sample-at-a-time retry)
    assert "one sample at a time" not in caplog.text
    model = _BagsBuiltPerSample().to(device)
    square = tokens.reshape(rows, 2)
    grads = psg_core.per_sample_gradients(model, square, targets, loss_fn=mse_loss("none"), mode="functorch",
                                          augmentation_multiplicity=K)
    expected = psg_core.per_sample_gradients(model, square, targets, loss_fn=mse_loss("none"), mode="hooks",
                                             augmentation_multiplicity=K)
    torch.testing.assert_close(grads["bag.weight"], expected["bag.weight"])


def test_embedding_bag_scale_grad_by_freq_is_rejected() -> None:
    # Refused when wrapped, naming the layer (its gradient scales by counts over the whole batch).
    with pytest.raises(UnsupportedModuleError, match=r"'<root>' \(EmbeddingBag\).*scale_grad_by_freq"):
        psg_core.GradSampleModule(nn.EmbeddingBag(5, 2, scale_grad_by_freq=True))


# ---------------------------------------------------------------------------------- shapes
# The device fixture holds no state between examples (a device, and TF32 off on CUDA).
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), K=st.integers(1, 3), vocab=st.integers(2, 6), dim=st.integers(1, 4),
       mode=st.sampled_from(["sum", "mean", "max"]), padding=st.booleans(),
       include_last_offset=st.booleans(), seed=st.integers(0, 1000),
       reduction=st.sampled_from(REDUCTIONS))
@example(n=2, K=1, vocab=3, dim=1, mode="sum", padding=False, include_last_offset=False, seed=443,
         reduction="mean")  # a near-zero residual (see the float64 note below)
def test_embedding_bag_shapes(n: int, K: int, vocab: int, dim: int, mode: str, padding: bool,
                              include_last_offset: bool, seed: int, reduction: str, device: torch.device) -> None:
    torch.manual_seed(seed)
    bag = nn.EmbeddingBag(vocab, dim, mode=mode, include_last_offset=include_last_offset,
                          padding_idx=0 if padding else None)
    # float64: a sample whose output nearly meets its target gets a gradient 100x smaller than
    # another's, from a difference that float32 rounds at 1e-3 of its size (seed 443, n 2, dim 1
    # failed the scaled float32 tolerance so); the shapes and the bookkeeping are what is tested
    model = _BagHead(bag).double()
    tokens, lengths = _random_bags(n * K, vocab, seed=seed)
    targets = torch.randn(n * K, 2, dtype=torch.float64)
    samples = _bag_samples(tokens, lengths, None, targets, K, include_last_offset)
    grads = check_against_oracle(model, (tokens, _offsets(lengths, include_last_offset)), targets,
                                 K=K, loss_reduction=reduction, samples=samples, device=device)
    assert grads["bag.weight"].shape == (n, vocab, dim)
