"""Inputs declared with ``psg_core.batch_free`` are never taken for batch tensors.

Without the declaration an input with N*K entries on the batch dimension is a batch tensor: a
``(T, T)`` bias matrix whose T equals N*K is seen as pairing rows of different samples, and every
mode refuses it with a hint naming ``batch_free`` (functorch, which would split it into samples,
follows its batch inputs through one forward pass first when there are several).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psg_core import (ConfigError, DPConfig, DPStep, PrivacyAccountant, UnsupportedModuleError, batch_free,
                      dp_gradient, per_sample_gradients, split_batch, wrap_model)
from tests.oracle import assert_close_scaled, microbatch_oracle

N, D = 2, 3


class RelativeMix(nn.Module):
    """Mixes a sequence's positions with a batch-free ``(T, T)`` matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:  # x (B, T, D), rel (T, T)
        h = torch.tanh(self.inp(x))
        return self.head(torch.einsum("ts,bsd->btd", rel, h).mean(1))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _batch(K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    T = N * K  # the matrix's size equals the batch's rows
    return (torch.randn(N * K, T, D, generator=g), torch.randn(T, T, generator=g),
            torch.randint(0, 3, (N * K,), generator=g))


def _expected(model: nn.Module, x: torch.Tensor, rel: torch.Tensor, y: torch.Tensor, K: int
              ) -> dict[str, torch.Tensor]:
    samples = [((x[n * K:(n + 1) * K], rel), y[n * K:(n + 1) * K]) for n in range(N)]
    return microbatch_oracle(model, samples, lambda out, t: _loss(out, t).mean())


@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_declared_batch_free_input_is_whole_in_every_sample(mode: str, K: int) -> None:
    torch.manual_seed(0)
    model = RelativeMix()
    x, rel, y = _batch(K)
    got = per_sample_gradients(model, (x, batch_free(rel)), y, loss_fn=_loss, mode=mode, augmentation_multiplicity=K)
    for name, value in _expected(model, x, rel, y, K).items():
        assert_close_scaled(got[name], value.to(got[name].dtype), name=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew", "functorch"])
def test_dp_gradient_with_a_batch_free_keyword_input(mode: str) -> None:
    torch.manual_seed(0)
    model = RelativeMix()
    x, rel, y = _batch(2)
    config = DPConfig(mode=mode, augmentation_multiplicity=2, max_grad_norm=1e9)
    got = dp_gradient(model, {"x": x, "rel": batch_free(rel)}, y, loss_fn=_loss, config=config)
    for name, value in _expected(model, x, rel, y, 2).items():
        assert_close_scaled(got.grads[name], value.sum(0).to(torch.float32), name=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_undeclared_it_is_refused_with_a_hint_to_declare_it(mode: str, K: int) -> None:
    model = RelativeMix()
    x, rel, y = _batch(K)
    with pytest.raises(UnsupportedModuleError, match=r"psg_core\.batch_free"):
        dp_gradient(model, (x, rel), y, loss_fn=_loss,
                    config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1.0))


class Positions(nn.Module):
    """Adds a position table's rows, looked up from a ``(T,)`` position vector passed in."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(10, D), nn.Embedding(8, D), nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # ids (B, T)
        return self.head((self.tokens(ids) + self.positions(positions)).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
def test_a_position_vector_as_long_as_the_batch_is_refused_undeclared(mode: str) -> None:
    """functorch split the undeclared positions into one per sample and returned wrong gradients
    (nothing inside vmap shows it); declared, every mode gets the oracle's."""
    torch.manual_seed(0)
    model = Positions()
    rows = 4
    ids, positions, y = torch.randint(0, 10, (rows, rows)), torch.arange(rows), torch.randint(0, 3, (rows,))
    config = DPConfig(mode=mode, max_grad_norm=1e9)
    with pytest.raises(UnsupportedModuleError, match=r"psg_core\.batch_free"):
        dp_gradient(model, (ids, positions), y, loss_fn=_loss, config=config)
    got = dp_gradient(model, (ids, batch_free(positions)), y, loss_fn=_loss, config=config)
    expected = microbatch_oracle(model, [((ids[n:n + 1], positions), y[n:n + 1]) for n in range(rows)],
                                 lambda out, t: _loss(out, t).mean())
    for name, value in expected.items():
        assert_close_scaled(got.grads[name], value.sum(0).to(torch.float32), name=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_position_vector_one_longer_than_the_batch_is_no_bag_offsets(mode: str, K: int) -> None:
    """``arange(N*K + 1)`` positions beside ``(N*K, N*K + 1)`` tokens have the shape and values of an
    EmbeddingBag's offsets with the last one included (one per row, plus the end), and were taken
    for them: refused as a layer called with the wrong number of rows. Offsets end at the size of
    the indices they cut (none here): these are batch-free, and every mode gets the oracle's."""
    torch.manual_seed(0)
    model = Positions()
    rows = N * K
    ids, positions, y = torch.randint(0, 10, (rows, rows + 1)), torch.arange(rows + 1), torch.randint(0, 3, (rows,))
    got = dp_gradient(model, (ids, positions), y, loss_fn=_loss,
                      config=DPConfig(mode=mode, max_grad_norm=1e9, augmentation_multiplicity=K))
    expected = microbatch_oracle(model, [((ids[n * K:(n + 1) * K], positions), y[n * K:(n + 1) * K]) for n in range(N)],
                                 lambda out, t: _loss(out, t).mean())
    for name, value in expected.items():
        assert_close_scaled(got.grads[name], value.sum(0).to(torch.float32), name=name)


@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_a_wrapped_model_s_forward_takes_the_declaration(mode: str) -> None:
    torch.manual_seed(0)
    model = RelativeMix()
    x, rel, y = _batch(2)
    wrapped = wrap_model(model, mode=mode, augmentation_multiplicity=2)
    _loss(wrapped(x, batch_free(rel)), y).mean().backward()
    for name, value in _expected(model, x, rel, y, 2).items():
        got = dict(model.named_parameters())[name].grad_sample
        assert_close_scaled(got, value.to(got.dtype), name=name)


def test_physical_batches_keep_it_whole_and_a_dp_step_equals_one_call() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 8, D)
    rel = torch.randn(8, 8)  # T = 8 = the logical batch's rows, not a physical batch's
    y = torch.randint(0, 3, (8,))
    parts = list(split_batch((x, batch_free(rel)), y, max_samples=3))
    assert [tuple(p[0][0].shape) for p in parts] == [(3, 8, D), (3, 8, D), (2, 8, D)]
    assert all(p[0][1].tensor is rel for p in parts)

    model = RelativeMix()
    config = DPConfig(mode="ghost", max_grad_norm=0.5)
    whole = dp_gradient(model, (x, batch_free(rel)), y, loss_fn=_loss, config=config)
    step = DPStep(model, loss_fn=_loss, config=config, sample_rate=0.5, expected_batch_size=8.0,
                  accountant=PrivacyAccountant("rdp"))
    stats = step((x, batch_free(rel)), y, max_physical_batch_size=3)
    for name, value in whole.grads.items():
        assert_close_scaled(stats.grads[name], value, name=name)


def test_only_tensors_can_be_declared() -> None:
    with pytest.raises(ConfigError, match="expected a tensor"):
        batch_free([1, 2])  # type: ignore[arg-type]


def test_functorch_s_look_at_several_batch_inputs_changes_nothing() -> None:
    """The forward pass that follows several batch inputs before vmap puts back what it changed in
    place: an InstanceNorm's running statistics (functorch then refuses the layer: the refused
    call leaves the model as it was)."""

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.head = nn.InstanceNorm1d(D, track_running_stats=True), nn.Linear(D, 3)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x (B, D, L), scale (B, 1)
            return self.head(self.norm(x).mean(2) * scale)

    torch.manual_seed(0)
    model = Normed().train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    x, scale, y = torch.randn(4, D, 5) * 3 + 1, torch.rand(4, 1), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModuleError, match="'norm' \\(InstanceNorm1d\\)"):
        per_sample_gradients(model, (x, scale), y, loss_fn=_loss, mode="functorch")
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name
