"""The per-layer torch.func fallback (a module without a grad sampler) splits the inputs the batch
tracker followed, not the ones whose size happens to match the batch.

Before, a batch-free tensor passed to such a module with N*K entries on the batch dimension (a
buffer of the model, say) was split into samples as if it were a batch tensor: hooks and ghost
returned wrong per-sample gradients, with no error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled, microbatch_oracle

N, D = 4, 5


class Gate(nn.Module):
    """No grad sampler: its per-sample gradients come from the torch.func fallback."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, D) * 0.3)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * table).t()  # table: (outputs, D)


class Net(nn.Module):
    def __init__(self, outputs: int, source: str) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.gate = Gate(outputs)
        self.head = nn.Linear(outputs, 3)
        self.register_buffer("table", torch.randn(outputs, D))
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.source == "buffer":
            return self.head(self.gate(h, self.table))
        return self.head(self.gate(h, self.table + h.mean(0)))  # "mixed"


class Shift(nn.Module):
    """No grad sampler; its second input is the batch flattened with the sequence, (N*K*T, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        return x * self.scale + flat.view_as(x)


class SeqNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.shift = Shift()
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        h = torch.tanh(self.inp(x))
        return self.head(self.shift(h, h.reshape(-1, D).square()).mean(1))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _check(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int, mode: str) -> None:
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: _loss(out, t).mean())
    if mode == "ghost":
        got = dp_gradient(model, x, y, loss_fn=_loss,
                          config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9)).grads
        expected = {name: g.sum(0) for name, g in expected.items()}
    else:
        got = per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode, augmentation_multiplicity=K)
    for name, value in expected.items():
        assert_close_scaled(got[name], value.to(got[name].dtype), name=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_batch_free_input_sized_like_the_batch_is_not_split(mode: str, K: int) -> None:
    torch.manual_seed(0)
    model = Net(outputs=N * K, source="buffer")  # the buffer has N*K rows, by coincidence
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    _check(model, x, y, K, mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_an_input_that_merges_the_batch_with_the_sequence_is_split_per_sample(mode: str, K: int) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(N * K, 3, D), torch.randint(0, 3, (N * K,))
    _check(SeqNet(), x, y, K, mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_second_input_that_mixes_samples_is_refused_at_the_module(mode: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(N, D), torch.randint(0, 3, (N,))
    with pytest.raises(UnsupportedModuleError, match=r"'gate' \(Gate\) receives values that mix samples"):
        dp_gradient(Net(outputs=6, source="mixed"), x, y, loss_fn=_loss,
                    config=DPConfig(mode=mode, max_grad_norm=1.0))


class TwoOutputs(nn.Module):
    """No grad sampler; ``v`` feeds only the second output, which the caller drops."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.5)
        self.v = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.w, x * self.v


class TwiceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = TwoOutputs()
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.f(x)
        b, _ = self.f(torch.tanh(a))
        return self.head(b)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
def test_a_module_called_twice_with_a_parameter_whose_gradient_is_zero(mode: str) -> None:
    """torch.func returns an expanded zero for ``v``; the second call's sum must not add into it."""
    torch.manual_seed(0)
    x, y = torch.randn(N, D), torch.randint(0, 3, (N,))
    _check(TwiceNet(), x, y, 1, mode)
