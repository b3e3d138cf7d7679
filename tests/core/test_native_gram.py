"""psg's native float64 Gram kernel (csrc/gram.h through psg_core.native.gram64) and the ghost norms
that use it: the Grams equal torch's float64 product over shapes, strides, dtypes and thread
counts; ghost's squared norms equal those of the torch path (the kernels off), for the Gram
factors of the layers (DOT) and for a lookup table's token rows (INDEX, now summed run by run);
tensors the kernel cannot read are refused (None: the caller computes in torch)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from psg_core import DPConfig, dp_gradient, native
from psg_core.grad_sample.ghost_norm import GhostFactors, TensorMemo


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if native.library() is None:
        pytest.skip(f"native kernels not built here: {native.build_error()}")


def _reference(rows: torch.Tensor) -> torch.Tensor:
    wide = rows.double()
    return wide @ wide.transpose(-1, -2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("positions", [1, 2, 3, 5, 8, 9, 64, 130])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 513, 1030])  # (one panel, a padded one, several)
def test_grams_equal_the_float64_product(positions: int, width: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(positions * 1000 + width)
    rows = torch.randn(3, positions, width, generator=gen, dtype=dtype) * 100
    got = native.gram64(rows)
    assert got is not None and got.dtype == torch.float64 and got.shape == (3, positions, positions)
    torch.testing.assert_close(got, _reference(rows), rtol=1e-13, atol=1e-9 * width)
    assert torch.equal(got, got.transpose(1, 2))  # one triangle computed, mirrored


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_rows_are_left_out_and_the_grams_unchanged(dtype: torch.dtype) -> None:
    """A right-padded batch's gradients: zero rows (a padded position's), whose products are 0;
    a row with one non-zero entry, NaN or inf is not one of them."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(4, 37, 600, generator=gen, dtype=dtype)
    rows[0, 20:] = 0.0  # a sequence of 20 tokens
    rows[1, ::2] = 0.0
    rows[2] = 0.0  # all padding
    rows[3, 5] = 0.0
    rows[3, 5, 599] = 1e-30  # not zero
    got = native.gram64(rows)
    assert got is not None
    torch.testing.assert_close(got, _reference(rows), rtol=1e-13, atol=1e-9)
    assert torch.equal(got[0, 20:], torch.zeros_like(got[0, 20:])) and torch.equal(got[2], torch.zeros_like(got[2]))
    assert got[3, 5, 5] > 0
    rows[3, 6] = 0.0
    rows[3, 6, 0], rows[3, 7, 0] = math.nan, math.inf
    got = native.gram64(rows)
    assert got is not None and got[3, 6, 6].isnan() and got[3, 7, 7].isinf()


def test_strided_stacks_and_thread_counts() -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 40, 2, 300, generator=gen)
    cases = [base[:, :, 1],  # rows 600 apart, matrices 24000 apart
             base.transpose(0, 1)[:7, :, 0],  # (7, 6, 300): matrices 600 apart, rows 24000 apart
             torch.randn(5, 1, 33, 70, generator=gen)[:, 0]]
    for rows in cases:
        previous = torch.get_num_threads()
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                results.append(native.gram64(rows))
            finally:
                torch.set_num_threads(previous)
        one, two = results
        assert one is not None and two is not None
        assert torch.equal(one, two)  # each matrix by one thread in one order
        torch.testing.assert_close(one, _reference(rows), rtol=1e-13, atol=1e-9)


def test_exact_where_float32_products_cancel() -> None:
    """Rows ``a`` and ``a + d`` with ``|d|`` 1e-5 of ``|a|``: ``|a|^2 - 2 a.(a+d) + |a+d|^2`` is
    ``|d|^2``, which float32 Grams lose and float64 ones keep."""
    gen = torch.Generator().manual_seed(3)
    a, d = torch.randn(256, generator=gen), torch.randn(256, generator=gen) * 1e-5
    rows = torch.stack([a, a + d])[None]  # (1, 2, 256)
    grams = native.gram64(rows)
    assert grams is not None
    combined = grams[0, 0, 0] - 2 * grams[0, 0, 1] + grams[0, 1, 1]
    exact = (rows[0, 1].double() - rows[0, 0].double()).square().sum()
    assert abs(float(combined - exact)) <= 1e-3 * float(exact)
    narrow = rows[0] @ rows[0].T  # float32: the rounding of terms of 262 (about 1e-5) swamps 2.4e-8 (gives 0 here)
    assert abs(float(narrow[0, 0] - 2 * narrow[0, 1] + narrow[1, 1]) - float(exact)) >= 0.5 * float(exact)


def test_what_the_kernel_cannot_read_is_refused() -> None:
    rows = torch.randn(2, 3, 4)
    assert native.gram64(rows.half()) is None
    assert native.gram64(rows[0]) is None  # not a stack
    assert native.gram64(torch.randn(2, 4, 3).transpose(1, 2)) is None  # rows of stride 3
    assert native.gram64(torch.zeros(0, 3, 4)) is None and native.gram64(torch.zeros(2, 3, 0)) is None
    with torch.enable_grad():
        assert native.gram64(rows.clone().requires_grad_()) is None
    with native.native_kernels("off"):
        assert native.gram64(rows) is None


def _sq_norms_both_ways(factors: GhostFactors, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    got = factors.sq_norms(dtype, TensorMemo(), TensorMemo())
    with native.native_kernels("off"):
        expected = factors.sq_norms(dtype, TensorMemo(), TensorMemo())
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4, 1, 6, 5, 3), (3, 2, 9, 17, 4), (2, 1, 65, 40, 300)])
def test_dot_norms_equal_the_torch_path(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    samples, groups, positions, d_in, d_out = shape
    gen = torch.Generator().manual_seed(sum(shape))
    left = torch.randn(samples, groups, positions, d_in, generator=gen, dtype=dtype)
    right = torch.randn(samples, groups, positions, d_out, generator=gen, dtype=dtype)
    got, expected = _sq_norms_both_ways(GhostFactors.dot(left, right), dtype)
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype is torch.float32 else 1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("samples,positions,vocab", [(4, 6, 3), (3, 64, 50), (2, 1, 5)])
def test_index_norms_equal_the_gram_path(samples: int, positions: int, vocab: int, dtype: torch.dtype) -> None:
    """A lookup table's rows summed per (sample, token) run (tokens repeat: ``vocab`` is small)."""
    gen = torch.Generator().manual_seed(samples * positions)
    tokens = torch.randint(0, vocab, (samples, positions), generator=gen)
    right = torch.randn(samples, positions, 8, generator=gen, dtype=dtype)
    right[0, 0] = 0.0  # a padding row: zeroed by the family
    got, expected = _sq_norms_both_ways(GhostFactors.index(tokens, right), dtype)
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype is torch.float32 else 1e-12, atol=0)
    got32 = GhostFactors.index(tokens.int(), right).sq_norms(dtype)  # int32 ids: the Gram path
    torch.testing.assert_close(got32, expected, rtol=1e-6 if dtype is torch.float32 else 1e-12, atol=0)


class _Tagger(nn.Module):
    """Embedding, a sequence-wide Linear, a head: INDEX and DOT factors of many rows per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 12, padding_idx=0)
        self.mix = nn.Linear(12, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embedding(tokens)))).mean(1)


@pytest.mark.parametrize("K", [1, 2])
def test_ghost_steps_equal_with_the_kernels_and_without(K: int) -> None:
    torch.manual_seed(0)
    model = _Tagger()
    tokens = torch.randint(0, 30, (6 * K, 20))
    targets = torch.randint(0, 5, (6 * K,))
    config = DPConfig(mode="ghost", max_grad_norm=0.05, augmentation_multiplicity=K)
    got = dp_gradient(model, tokens, targets, loss_fn=nn.CrossEntropyLoss(reduction="none"), config=config)
    with native.native_kernels("off"):
        expected = dp_gradient(model, tokens, targets, loss_fn=nn.CrossEntropyLoss(reduction="none"), config=config)
    torch.testing.assert_close(got.per_sample_norms, expected.per_sample_norms, rtol=1e-6, atol=0)
    assert got.num_clipped == expected.num_clipped > 0
    for name in expected.grads:
        torch.testing.assert_close(got.grads[name], expected.grads[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float64, torch.float32)])
def test_shared_norms_of_a_tied_table_keep_the_rows_dtypes(dtypes: tuple[torch.dtype, torch.dtype],
                                                           kernels: str) -> None:
    """A tied table and head (GPT-2's): the head's product rows are no longer copied to float64
    before their Grams, whose products are float64 whatever the rows' dtypes (mixed ones
    included); equal to the dense per-sample gradient's norm in float64."""
    from psg_core.grad_sample.ghost_norm import WeightLayout, shared_sq_norms

    left_dtype, right_dtype = dtypes
    gen = torch.Generator().manual_seed(11)
    samples, positions, vocab, width = 3, 9, 7, 5
    tokens = torch.randint(0, vocab, (samples, positions), generator=gen)
    rows = torch.randn(samples, positions, width, generator=gen)
    left = torch.randn(samples, 1, positions, width, generator=gen).to(left_dtype)
    right = torch.randn(samples, 1, positions, vocab, generator=gen).to(right_dtype)
    parts = [(WeightLayout.TABLE, GhostFactors.index(tokens, rows)),
             (WeightLayout.ROWS_RIGHT, GhostFactors.dot(left, right))]
    with native.native_kernels(kernels):
        got = shared_sq_norms(parts, (vocab, width), torch.float64)
    dense = right[:, 0].double().transpose(1, 2) @ left[:, 0].double()  # (N, V, d)
    for n in range(samples):
        dense[n].index_add_(0, tokens[n], rows[n].double())
    torch.testing.assert_close(got, dense.square().sum((1, 2)), rtol=1e-12, atol=1e-12)
