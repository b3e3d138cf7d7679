"""Activation checkpointing (``torch.utils.checkpoint``) and layers psg can only run per sample.

* Non-reentrant checkpointing recomputes a block's forward in the backward pass: hooks and ghost
  give the oracle's answer through it; torch's ExpandedWeights would count the recomputed call, so
  ``ew`` refuses it rather than return wrong gradients.
* Reentrant checkpointing cannot run under ``torch.autograd.grad``: hooks and ghost say so (and
  what to pass instead) instead of letting torch's RuntimeError through.
* A parameter-owning module without a grad sampler runs per sample under ``torch.func``, from the
  input it was called with: when that fails the error names the module and the remedy, as a
  PsgError; a module that changes its input in place is refused (its input no longer exists);
  the batch axis of its outputs is where the forward pass put it, not assumed to be the input's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from psg_core import DPConfig, UnsupportedModuleError, dp_gradient
from tests.oracle import assert_close_scaled, microbatch_oracle


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp, self.block, self.out = nn.Linear(6, 8), Block(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_non_reentrant_checkpointing_gives_the_oracle(mode: str, K: int) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant=False)
    x, y = torch.randn(4 * K, 6), torch.randint(0, 3, (4 * K,))
    out = dp_gradient(model, x, y, loss_fn=_loss,
                      config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e6))
    samples = [((x[K * n: K * n + K],), y[K * n: K * n + K]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda o, t: _loss(o, t).mean())
    for name, value in expected.items():
        assert_close_scaled(out.grads[name], value.sum(0), name=name)


class Scale(nn.Module):
    """A layer without a grad sampler whose own weight meets the batch pointwise (an RMSNorm's)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


class Table(nn.Module):
    """Batch-free rows computed from its parameters (a position table's)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows, self.fill = nn.Parameter(0.1 * torch.randn(5, 8)), nn.Parameter(torch.tensor(0.3))
        self.mix = nn.Parameter(0.3 * torch.randn(8, 8))


class MeetingBlock(nn.Module):
    """Parameters meeting the batch inside a checkpointed region: a layer's own weight, another
    module's rows added, a fill value (``masked_fill``, computed by ``where``), a weight computed from
    another module's parameter in ``F.linear``; ``in_place``: the rows added in place."""

    def __init__(self, table: Table, in_place: str = "") -> None:
        super().__init__()
        self.scale, self.lin, self.table, self.in_place = Scale(), nn.Linear(8, 8), [table], in_place

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, 5, 8)
        table = self.table[0]
        h = self.scale(h)
        if self.in_place == "add_":
            h = h * 1.0
            h.add_(table.rows)
        else:
            h = h + table.rows
        if self.in_place == "masked_fill_":
            h = h * 1.0
            h.masked_fill_(h < -0.5, table.fill)
            h = torch.tanh(h)
        else:
            h = torch.tanh(h).masked_fill(h < -0.5, table.fill)
        return self.lin(h) + F.linear(h, torch.tanh(table.mix))


class CheckpointedMeetings(nn.Module):
    def __init__(self, in_place: str = "") -> None:
        super().__init__()
        self.table = Table()
        self.inp, self.block, self.out = nn.Linear(6, 8), MeetingBlock(self.table, in_place), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 5, 6)
        return self.out(checkpoint(self.block, self.inp(x), use_reentrant=False).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_parameters_meeting_the_batch_inside_a_checkpointed_region(mode: str, K: int) -> None:
    """A meeting rewrites its op (an operand expanded to the batch's shape): the recomputation,
    without psg, saved other shapes than the first forward, and torch's checkpoint raised
    CheckpointError (a Llama's RMSNorm weights, fully fine-tuned with gradient checkpointing).
    Inside a checkpoint the rewritten op keeps what it saves, and the op as written is recorded
    for the recomputation: the oracle's gradients."""
    torch.manual_seed(0)
    model = CheckpointedMeetings()
    x, y = torch.randn(4 * K, 5, 6), torch.randint(0, 3, (4 * K,))
    out = dp_gradient(model, x, y, loss_fn=_loss,
                      config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e6))
    samples = [((x[K * n: K * n + K],), y[K * n: K * n + K]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda o, t: _loss(o, t).mean())
    assert set(out.grads) == set(expected)
    for name, value in expected.items():
        assert_close_scaled(out.grads[name], value.sum(0), name=name)


@pytest.mark.parametrize("op", ["add_", "masked_fill_"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_an_in_place_meeting_inside_a_checkpointed_region_is_refused(mode: str, op: str) -> None:
    """(``masked_fill_`` with a parameter's value is computed by the meeting itself: run again as
    written for the checkpoint's record, it would have written the tensor a second time, the
    parameter's gradient flowing through that op instead of the meeting.)"""
    x, y = torch.randn(4, 5, 6), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModuleError, match="activation checkpoint"):
        dp_gradient(CheckpointedMeetings(in_place=op), x, y, loss_fn=_loss, config=DPConfig(mode=mode))


def test_ew_refuses_checkpointed_blocks() -> None:
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModuleError, match="saved-tensor hooks"):
        dp_gradient(Checkpointed(reentrant=False), x, y, loss_fn=_loss, config=DPConfig(mode="ew"))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_reentrant_checkpointing_is_refused_with_the_remedy(mode: str) -> None:
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModuleError, match="use_reentrant=False"):
        dp_gradient(Checkpointed(reentrant=True), x, y, loss_fn=_loss, config=DPConfig(mode=mode))


class SeqFirstBias(nn.Module):
    """A bare parameter used by the root module itself, on a sequence-first batch whose length
    differs from the batch: the per-sample torch.func run cannot split its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.randn(3, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, B, 4)
        return self.lin(x + self.pos).mean(0)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_failing_per_sample_fallback_is_a_psg_error_naming_the_module(mode: str) -> None:
    torch.manual_seed(0)
    model = SeqFirstBias()
    x, y = torch.randn(3, 4, 4), torch.randn(4, 4)
    loss = nn.MSELoss(reduction="none")
    try:
        out = dp_gradient(model, x, y, loss_fn=loss, config=DPConfig(mode=mode, batch_first=False, max_grad_norm=1e6))
    except UnsupportedModuleError as err:
        assert "SeqFirstBias" in str(err) and "torch.func" in str(err)
        return
    # A fallback that handles it must give the oracle's answer.
    samples = [((x[:, n: n + 1],), y[n: n + 1]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda o, t: loss(o, t).mean())
    for name, value in expected.items():
        assert_close_scaled(out.grads[name], value.sum(0), name=name)


def test_the_batch_on_a_linear_layer_s_features_is_refused() -> None:
    """``h.reshape(-1).reshape(d, B).t()`` puts the samples on the features the next Linear sums."""

    class Scrambled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.l1(x))
            return self.l2(h.reshape(-1).reshape(h.shape[1], h.shape[0]).t())

    for mode, K in (("hooks", 2), ("ghost", 2), ("ew", 1), ("ew", 2)):
        x, y = torch.randn(4 * K, 6), torch.randint(0, 3, (4 * K,))
        with pytest.raises(UnsupportedModuleError, match="mix samples"):
            dp_gradient(Scrambled(), x, y, loss_fn=_loss,
                        config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1.0))


class Affine(nn.Module):
    """No grad sampler (run per sample under torch.func): shifts and scales its input in place, or
    a copy of it."""

    def __init__(self, clone: bool) -> None:
        super().__init__()
        self.clone = clone
        self.bias = nn.Parameter(torch.randn(8) * 0.3)
        self.scale = nn.Parameter(torch.randn(8) * 0.3 + 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.clone:
            h = h.clone()
        h.add_(self.bias)
        h.mul_(self.scale)
        return h


class ProductAffine(Affine):
    """Its scale in a matrix product: the torch.func fallback runs its whole call per sample."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.clone:
            h = h.clone()
        h.add_(self.bias)
        return h @ torch.diag(self.scale)


class InPlace(nn.Module):
    def __init__(self, clone: bool, product: bool = False) -> None:
        super().__init__()
        self.l1, self.aff, self.l3 = nn.Linear(6, 8), (ProductAffine if product else Affine)(clone), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.aff(self.l1(x))))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_module_that_modifies_its_input_in_place_is_refused(mode: str) -> None:
    """Refused where the fallback would re-run the call on its input, which is gone; where the
    parameters meet the batch in pointwise ops only (meeting points, no re-run), the oracle's."""
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModuleError, match="modifies its input in place"):
        dp_gradient(InPlace(clone=False, product=True), x, y, loss_fn=_loss,
                    config=DPConfig(mode=mode, max_grad_norm=1.0))
    torch.manual_seed(0)
    model = InPlace(clone=False)
    out = dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1e6))
    expected = microbatch_oracle(model, [((x[n: n + 1],), y[n: n + 1]) for n in range(4)],
                                 lambda o, t: _loss(o, t).mean())
    for name, value in expected.items():
        assert_close_scaled(out.grads[name], value.sum(0), name=name)


@pytest.mark.parametrize("product", [False, True])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
def test_the_same_module_on_a_clone_gives_the_oracle(mode: str, product: bool) -> None:
    torch.manual_seed(0)
    model = InPlace(clone=True, product=product)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    out = dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1e6))
    expected = microbatch_oracle(model, [((x[n: n + 1],), y[n: n + 1]) for n in range(4)],
                                 lambda o, t: _loss(o, t).mean())
    for name, value in expected.items():
        assert_close_scaled(out.grads[name], value.sum(0), name=name)

