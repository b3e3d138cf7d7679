"""TensorMemo: the ghost pass's reuse of results computed from one tensor (psg_core.grad_sample.ghost_norm).

A DP LSTM's ih and hh receive the very same output gradient: its Gram matrix and its rows scaled
by the clipping factors are computed once. Reuse must never hand back a result for different
numbers: a tensor changed in place, or another tensor in the same memory, is computed afresh.
"""

from __future__ import annotations

import torch
from torch import nn

from psg_core.grad_sample.ghost_norm import GhostFactors, TensorMemo


class _Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return rows * 2


def test_the_same_numbers_are_computed_once() -> None:
    memo, compute, x = TensorMemo(), _Counting(), torch.randn(4, 3)
    first = memo.get(x, compute)
    assert memo.get(x.view(4, 3), compute) is first and memo.get(x[:], compute) is first
    assert compute.calls == 1


def test_other_numbers_are_computed_afresh() -> None:
    memo, compute, x = TensorMemo(), _Counting(), torch.randn(4, 3)
    memo.get(x, compute)
    memo.get(x.t(), compute)  # other strides
    memo.get(x[1:], compute)  # another offset
    memo.get(x.clone(), compute)  # other memory
    memo.get(x, compute, "other key")  # another extra key part
    assert compute.calls == 5
    x.add_(1.0)  # changed in place: its version moved on
    assert torch.equal(memo.get(x, compute), x * 2)
    assert compute.calls == 6


def test_only_the_latest_results_are_kept() -> None:
    memo, compute = TensorMemo(capacity=2), _Counting()
    tensors = [torch.randn(2, 2) for _ in range(3)]
    for tensor in tensors:
        memo.get(tensor, compute)
    assert len(memo) == 2
    memo.get(tensors[0], compute)  # evicted: computed again
    assert compute.calls == 4
    memo.clear()
    assert len(memo) == 0


def test_a_tensor_that_requires_grad_is_not_memoised() -> None:
    memo, compute = TensorMemo(), _Counting()
    x = torch.randn(3, requires_grad=True)
    memo.get(x, compute)
    memo.get(x, compute)
    assert compute.calls == 2 and len(memo) == 0


def test_shared_output_gradient_norms_equal_the_plain_ones() -> None:
    g = torch.randn(3, 1, 7, 16)
    a1, a2 = torch.randn(3, 1, 7, 5), torch.randn(3, 1, 7, 9)
    memo = TensorMemo()
    shared = [GhostFactors.dot(a, g).sq_norms(torch.float32, memo) for a in (a1, a2)]
    plain = [GhostFactors.dot(a, g).sq_norms(torch.float32) for a in (a1, a2)]
    for got, want, a in zip(shared, plain, (a1, a2)):
        torch.testing.assert_close(got, want)
        explicit = (g.transpose(-1, -2) @ a).square().sum((1, 2, 3))
        torch.testing.assert_close(got, explicit, rtol=1e-4, atol=1e-4)
    assert len(memo) == 1  # g's Gram, computed once


def test_dplstm_ghost_computes_the_gate_gradient_gram_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import psg_core.grad_sample.ghost_norm as ghost_norm
    from psg_core.config import DPConfig
    from psg_core.dp import dp_gradient
    from psg_core.layers import DPLSTM

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = DPLSTM(12, 16, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(x)[0][:, -1]

    shapes: list[tuple[int, ...]] = []
    real = ghost_norm._cast_gram  # (a Gram in float64: psg's native kernel or torch's)

    def counting(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        shapes.append(tuple(rows.shape))
        return real(rows, dtype)

    monkeypatch.setattr(ghost_norm, "_cast_gram", counting)
    torch.manual_seed(0)
    model, x, y = Model(), torch.randn(3, 8, 12), torch.randn(3, 16)
    out = dp_gradient(model, x, y, loss_fn=nn.MSELoss(reduction="none"),
                      config=DPConfig(mode="ghost", max_grad_norm=1e3))
    # ih's input (12), hh's input (16) and the gates' gradient (64) shared by both: three Grams.
    assert sorted(s[-1] for s in shapes) == [12, 16, 64]
    reference = dp_gradient(model, x, y, loss_fn=nn.MSELoss(reduction="none"),
                            config=DPConfig(mode="hooks", max_grad_norm=1e3))
    torch.testing.assert_close(out.per_sample_norms, reference.per_sample_norms, rtol=1e-4, atol=1e-5)
    for name in reference.grads:
        torch.testing.assert_close(out.grads[name], reference.grads[name], rtol=1e-4, atol=1e-5)


def test_projections_of_one_input_compute_its_gram_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An attention block's query, key and value projections read one input: ghost takes its Gram
    once (and each projection's own output-gradient Gram), with the hooks backend's norms and sums."""
    import psg_core.grad_sample.ghost_norm as ghost_norm
    from psg_core.config import DPConfig
    from psg_core.dp import dp_gradient

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(40, 48), nn.Linear(40, 40), nn.Linear(40, 56)
            self.out = nn.Linear(56, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, 40)
            scores = (self.q(x)[..., :40] @ self.k(x).transpose(1, 2)).softmax(-1)
            return self.out(scores @ self.v(x)).mean(1)

    shapes: list[int] = []
    real = ghost_norm._cast_gram  # (a Gram in float64: psg's native kernel or torch's)

    def counting(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        shapes.append(rows.shape[-1])
        return real(rows, dtype)

    monkeypatch.setattr(ghost_norm, "_cast_gram", counting)
    torch.manual_seed(0)
    model, x, y = Attention(), torch.randn(6, 9, 40), torch.randn(6, 2)
    for K in (1, 2):
        shapes.clear()
        config = DPConfig(mode="ghost", max_grad_norm=0.1, augmentation_multiplicity=K)
        out = dp_gradient(model, x, y, loss_fn=nn.MSELoss(reduction="none"), config=config)
        # x's Gram once (40), q, k, v's output gradients (48, 40, 56); out's weight (2 x 56, fewer
        # numbers than two (T, T) Grams) is materialised
        assert sorted(shapes) == [40, 40, 48, 56], K
        reference = dp_gradient(model, x, y, loss_fn=nn.MSELoss(reduction="none"),
                                config=DPConfig(mode="hooks", max_grad_norm=0.1, augmentation_multiplicity=K))
        torch.testing.assert_close(out.per_sample_norms, reference.per_sample_norms, rtol=1e-4, atol=1e-6)
        for name in reference.grads:
            torch.testing.assert_close(out.grads[name], reference.grads[name], rtol=1e-4, atol=1e-6)
