"""psg's native EmbeddingBag kernels (csrc/table.h through psg_core.native): the entries of a
call, the per-sample squared norms and the clipped sum equal the torch-op path they replace
(psg_core.grad_sample.embedding, ghost_norm, backends.ghost), over modes, offsets, padding,
per-sample weights, K, dtypes and dropped samples; numbers the kernels cannot take are refused
(None: the caller falls back), never written out of bounds."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from psg_core import native
from psg_core.backends.ghost import _table_sum
from psg_core.grad_sample.embedding import _bag_weights, embedding_bag_ghost_factors
from psg_core.grad_sample.ghost_norm import FactorKind, GhostFactors, _weighted_keyed_sq_norms


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if native.library() is None:
        pytest.skip(f"native kernels not built here: {native.build_error()}")


def _random_call(gen: torch.Generator, *, bags: int, vocab: int, flat: bool, include_last: bool,
                 weighted: bool, dtype: torch.dtype) -> tuple[tuple[Any, ...], int]:
    """An EmbeddingBag call's arguments (empty bags and repeated tokens likely) and its token count."""
    if not flat:
        tokens = torch.randint(0, vocab, (bags, 4), generator=gen)
        weights = torch.rand(bags, 4, generator=gen, dtype=dtype) if weighted else None
        return (tokens, None, weights), tokens.numel()
    lengths = torch.randint(0, 5, (bags,), generator=gen)
    count = int(lengths.sum())
    tokens = torch.randint(0, vocab, (count + (2 if include_last else 0),), generator=gen)  # 2 past the end
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    offsets = offsets if include_last else offsets[:-1]
    weights = torch.rand(tokens.shape[0], generator=gen, dtype=dtype) + 0.5 if weighted else None
    return (tokens, offsets, weights), tokens.shape[0]


CONFIGS = [dict(mode="sum"), dict(mode="mean"), dict(mode="sum", padding_idx=1), dict(mode="mean", padding_idx=0),
           dict(mode="mean", include_last_offset=True), dict(mode="sum", include_last_offset=True, padding_idx=2),
           dict(mode="sum", weighted=True), dict(mode="sum", weighted=True, padding_idx=3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("config", CONFIGS)
def test_bag_entries_equal_the_torch_ops(config: dict[str, Any], flat: bool, K: int, dtype: torch.dtype) -> None:
    config = dict(config)
    weighted = config.pop("weighted", False)
    if not flat and config.get("include_last_offset"):
        pytest.skip("include_last_offset takes a 1-D input")
    layer = nn.EmbeddingBag(6, 3, **config)
    gen = torch.Generator().manual_seed(K + 10 * flat)
    args, _ = _random_call(gen, bags=3 * K, vocab=6, flat=flat, include_last=layer.include_last_offset,
                           weighted=weighted, dtype=dtype)
    tokens, bag, weight, bags = _bag_weights(layer, args, {}, dtype)
    backprop = torch.randn(bags, 3, dtype=dtype, generator=gen)
    factors, _ = embedding_bag_ghost_factors(layer, SimpleNamespace(args=args, kwargs={}), backprop, K)
    assert factors.left.shape[1] == tokens.shape[0], "the native kernel did not run"
    assert factors.samples == bags // K
    assert factors.left[0].tolist() == (bag // K).tolist()
    assert factors.left[1].tolist() == tokens.tolist()
    assert factors.source is not None and factors.weight is not None
    assert factors.source.tolist() == bag.tolist()
    torch.testing.assert_close(factors.weight, weight, rtol=2e-7 if dtype is torch.float32 else 1e-15, atol=0)
    with native.native_kernels("off"):
        reference, _ = embedding_bag_ghost_factors(layer, SimpleNamespace(args=args, kwargs={}), backprop, K)
    torch.testing.assert_close(factors.sq_norms(dtype), reference.sq_norms(dtype))


def _random_entries(gen: torch.Generator, *, samples: int, K: int, count: int, vocab: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``left (2, M)``, ``source (M,)``, ``weight (M,)``: entries of random samples (not in sample
    order), each from one of its sample's K rows, some of weight 0 and some cancelling."""
    sample = torch.randint(0, samples, (count,), generator=gen)
    source = sample * K + torch.randint(0, K, (count,), generator=gen)
    tokens = torch.randint(0, vocab, (count,), generator=gen)
    weight = torch.randn(count, generator=gen, dtype=dtype)
    weight[torch.rand(count, generator=gen) < 0.2] = 0.0
    return torch.stack([sample, tokens]), source, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,dim", [(1, 4), (2, 4), (3, 9), (3, 5), (5, 7), (4, 1)])  # K*K <= d: Grams; else runs
@pytest.mark.parametrize("threads", [1, 2])
def test_keyed_sq_norms_equal_the_torch_ops(K: int, dim: int, dtype: torch.dtype, threads: int) -> None:
    gen = torch.Generator().manual_seed(K * 100 + dim)
    samples = 7
    left, source, weight = _random_entries(gen, samples=samples, K=K, count=60, vocab=5, dtype=dtype)
    rows = torch.randn(samples * K, dim, generator=gen, dtype=dtype)
    rows[3 * K] = math.inf  # sample 3's first row: infinite where an entry of weight != 0 reads it
    weight[source == 3 * K + 1 if K > 1 else source == 5] = 0.0  # rows no entry reads with weight != 0
    rows[5 * K] = math.inf if K == 1 else rows[5 * K]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.keyed_sq_norms(left, source, weight, rows, samples)
    finally:
        torch.set_num_threads(previous)
    expected = _weighted_keyed_sq_norms(left, source, weight, rows, samples)
    assert got is not None
    torch.testing.assert_close(got, expected, equal_nan=True)
    if K == 1:
        assert got[5].item() == 0.0  # its infinite row has only weight-0 entries: no term, not 0 * inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K", [1, 3])
def test_keyed_table_sum_equals_the_torch_ops(K: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(K)
    samples, vocab, dim = 6, 9, 5
    left, source, weight = _random_entries(gen, samples=samples, K=K, count=40, vocab=vocab, dtype=dtype)
    rows = torch.randn(samples * K, dim, generator=gen, dtype=dtype)
    rows[2 * K] = math.inf  # sample 2 is dropped: factor 0, its rows never read
    factors = torch.rand(samples, generator=gen, dtype=dtype)
    factors[2] = 0.0
    dropped = torch.zeros(samples, dtype=torch.bool)
    dropped[2] = True
    table = nn.Parameter(torch.zeros(vocab, dim, dtype=dtype))
    keyed = GhostFactors(FactorKind.KEYED, left, rows, samples, source, weight, vocab)
    got = native.keyed_table_sum(left, source, weight, rows, factors, vocab)
    assert got is not None and torch.isfinite(got).all()
    with native.native_kernels("off"):
        expected = _table_sum(keyed, factors, dropped, table)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(_table_sum(keyed, factors, dropped, table), expected)  # the native path inside


def test_numbers_the_kernels_cannot_take_are_refused() -> None:
    """Offsets that do not start at 0 or do not rise, a token outside the table, an entry outside its
    sample's rows, or tensors the kernels cannot read: None (the caller's torch ops run instead)."""
    tokens = torch.tensor([1, 2, 3, 4])
    common: dict[str, Any] = dict(include_last_offset=False, mean=False, padding_idx=None, per_sample_weights=None,
                                  K=1, table_rows=5, dtype=torch.float32)
    assert native.bag_entries(tokens, torch.tensor([0, 2]), bags=2, **common) is not None
    assert native.bag_entries(tokens, torch.tensor([1, 2]), bags=2, **common) is None  # not from 0
    assert native.bag_entries(tokens, torch.tensor([0, 3, 2]), bags=3, **common) is None  # falling
    assert native.bag_entries(tokens, torch.tensor([0, 5]), bags=2, **common) is None  # past the input
    assert native.bag_entries(torch.tensor([1, 5]), torch.tensor([0]), bags=1, **common) is None  # token 5 of 5
    assert native.bag_entries(torch.tensor([1, -1]), torch.tensor([0]), bags=1, **common) is None
    assert native.bag_entries(tokens.int(), torch.tensor([0]), bags=1, **common) is None  # int32 ids
    assert native.bag_entries(tokens, torch.tensor([0]), bags=1, **{**common, "dtype": torch.float16}) is None
    rows = torch.randn(4, 3)
    left, weight = torch.tensor([[0, 1], [2, 2]]), torch.ones(2)
    assert native.keyed_sq_norms(left, torch.tensor([0, 3]), weight, rows, 2) is not None  # K = 2
    assert native.keyed_sq_norms(left, torch.tensor([0, 1]), weight, rows, 2) is None  # row 1 is sample 0's
    assert native.keyed_sq_norms(left, torch.tensor([0, 3]), weight.double(), rows, 2) is None  # mixed dtypes
    assert native.keyed_sq_norms(left, torch.tensor([0, 3]), weight, rows.t().contiguous().t(), 2) is None
    factors = torch.ones(2)
    assert native.keyed_table_sum(left, torch.tensor([0, 3]), weight, rows, factors, 2) is None  # token 2 of 2
    assert native.keyed_table_sum(left, torch.tensor([0, 4]), weight, rows, factors, 3) is None  # no row 4
    with torch.enable_grad():
        assert native.keyed_sq_norms(left, torch.tensor([0, 3]), weight, rows.requires_grad_(), 2) is None


def test_off_means_torch_ops() -> None:
    with native.native_kernels("off"):
        assert native.keyed_sq_norms(torch.tensor([[0], [0]]), torch.tensor([0]), torch.ones(1),
                                     torch.ones(1, 2), 1) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8), K=st.sampled_from([1, 2, 3]),
       mode=st.sampled_from(["sum", "mean"]), padding=st.sampled_from([None, 0, 3]),
       include_last=st.booleans(), weighted=st.booleans(), dim=st.sampled_from([1, 3, 8]),
       seed=st.integers(0, 10_000))
def test_the_kernels_equal_the_torch_ops_on_random_bags(lengths: list[int], K: int, mode: str, padding: int | None,
                                                       include_last: bool, weighted: bool, dim: int,
                                                       seed: int) -> None:
    """Random bag layouts (empty bags, repeated tokens, padding, a tail past include_last's last
    offset): entries, norms and clipped sums through the kernels equal the torch ops'."""
    lengths = lengths + [1] * (-len(lengths) % K)  # K bags per sample
    gen = torch.Generator().manual_seed(seed)
    layer = nn.EmbeddingBag(5, dim, mode=mode, padding_idx=padding, include_last_offset=include_last)
    count = sum(lengths)
    tokens = torch.randint(0, 5, (count + (1 if include_last else 0),), generator=gen)
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    offsets = offsets if include_last else offsets[:-1]
    weights = torch.rand(tokens.shape[0], generator=gen) if weighted and mode == "sum" else None
    call = SimpleNamespace(args=(tokens, offsets, weights), kwargs={})
    backprop = torch.randn(len(lengths), dim, generator=gen, dtype=torch.float64)
    factors, _ = embedding_bag_ghost_factors(layer, call, backprop, K)
    with native.native_kernels("off"):
        reference, _ = embedding_bag_ghost_factors(layer, call, backprop, K)
    assert factors.left.tolist() == reference.left.tolist()
    assert factors.source is not None and reference.source is not None
    assert factors.source.tolist() == reference.source.tolist()
    torch.testing.assert_close(factors.weight, reference.weight)
    torch.testing.assert_close(factors.sq_norms(torch.float64), reference.sq_norms(torch.float64))
    clip = torch.rand(len(lengths) // K, generator=gen, dtype=torch.float64)
    table = nn.Parameter(torch.zeros(5, dim, dtype=torch.float64))
    with native.native_kernels("off"):
        expected = _table_sum(reference, clip, None, table)
    torch.testing.assert_close(_table_sum(factors, clip, None, table), expected)
