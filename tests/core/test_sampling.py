"""PoissonBatchSampler: inclusion probabilities, independence, seeds, empty batches."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from psg_core.errors import ConfigError
from psg_core.sampling import PoissonBatchSampler


def test_batches_are_sorted_unique_in_range_and_count_is_right() -> None:
    sampler = PoissonBatchSampler(50, 0.2, generator=torch.Generator().manual_seed(0))
    assert len(sampler) == 5  # round(1 / 0.2)
    batches = list(sampler)
    assert len(batches) == 5
    for batch in batches:
        assert batch == sorted(set(batch))
        assert all(isinstance(i, int) and 0 <= i < 50 for i in batch)
    assert PoissonBatchSampler(50, 0.2, num_batches=7).num_batches == 7
    assert PoissonBatchSampler(50, 0.2).expected_batch_size == pytest.approx(10.0)


def test_inclusion_is_independent_with_probability_q() -> None:
    n, q, batches = 200, 0.1, 400
    sampler = PoissonBatchSampler(n, q, num_batches=batches, generator=torch.Generator().manual_seed(1))
    membership = torch.zeros(batches, n)
    for b, batch in enumerate(sampler):
        membership[b, batch] = 1.0
    total = batches * n
    # overall rate: binomial(total, q) within 5 standard errors.
    assert abs(membership.mean().item() - q) < 5 * math.sqrt(q * (1 - q) / total)
    # batch sizes are Binomial(n, q): mean n q, variance n q (1 - q) (a fixed size would have 0).
    sizes = membership.sum(1)
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(n * q * (1 - q) / batches)
    assert sizes.var().item() == pytest.approx(n * q * (1 - q), rel=0.25)
    # every index is drawn at about rate q (chi-square over indices, df = n - 1 ~ 199).
    counts = membership.sum(0)
    expected = batches * q
    chi2 = (((counts - expected) ** 2) / (expected * (1 - q))).sum().item()
    assert chi2 < n + 5 * math.sqrt(2 * n)
    # independence of two indices within a batch: empirical correlation near 0.
    corr = torch.corrcoef(membership.T[:2])[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(batches)


def test_seeded_generator_reproduces_batches() -> None:
    def run(seed: int) -> list[list[int]]:
        return list(PoissonBatchSampler(100, 0.05, num_batches=10, generator=torch.Generator().manual_seed(seed)))

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_secure_rng_differs_between_passes_and_leaves_global_rng_alone() -> None:
    sampler = PoissonBatchSampler(500, 0.1, num_batches=3, secure_rng=True)
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    first, second = list(sampler), list(sampler)
    assert torch.equal(torch.rand(2), expected)
    assert first != second
    assert all(20 < len(batch) < 90 for batch in first + second)


def test_empty_batches_are_legal() -> None:
    sampler = PoissonBatchSampler(5, 0.01, num_batches=50, generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert len(batches) == 50
    assert sum(1 for b in batches if not b) > 40  # P(empty) = 0.99^5 ~ 0.95
    assert all(batch == [] for batch in PoissonBatchSampler(0, 0.5, num_batches=3))


def test_sample_rate_one_takes_everything() -> None:
    assert list(PoissonBatchSampler(6, 1.0)) == [[0, 1, 2, 3, 4, 5]]


def test_works_as_a_dataloader_batch_sampler_with_empty_batches() -> None:
    data = TensorDataset(torch.arange(8, dtype=torch.float32)[:, None], torch.arange(8))

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not items:
            return torch.zeros(0, 1), torch.zeros(0, dtype=torch.long)
        xs, ys = zip(*items)
        return torch.stack(xs), torch.stack(ys)

    sampler = PoissonBatchSampler(len(data), 0.1, num_batches=20, generator=torch.Generator().manual_seed(2))
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate)
    sizes = []
    for x, y in loader:
        assert x.shape == (len(y), 1)
        assert torch.equal(x[:, 0].long(), y)
        sizes.append(len(y))
    assert len(sizes) == 20 and 0 in sizes


def test_validation_errors() -> None:
    for bad in (0.0, -0.1, 1.5, math.nan, True):
        with pytest.raises(ConfigError, match="PoissonBatchSampler: sample_rate"):
            PoissonBatchSampler(10, bad)
    for bad_n in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="PoissonBatchSampler: num_samples"):
            PoissonBatchSampler(bad_n, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_batches must be an int >= 1, got 0"):
        PoissonBatchSampler(10, 0.5, num_batches=0)
    with pytest.raises(ConfigError, match="either a generator or secure_rng"):
        PoissonBatchSampler(10, 0.5, generator=torch.Generator(), secure_rng=True)
    with pytest.raises(ConfigError, match="must be a torch.Generator"):
        PoissonBatchSampler(10, 0.5, generator=0)  # type: ignore[arg-type]
