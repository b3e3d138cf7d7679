"""A batch-free tensor computed from parameters, multiplied with the batch in a matrix product.

DeBERTa's disentangled attention projects a batch-free relative-position table with the layer's own
query and key projections, tiles the result once per batch row (``repeat``) and multiplies it with
the batch's queries and keys in ``bmm``; DeBERTa (v1) broadcasts its projection over the batch in
a 4-D ``matmul``. Each batch row then multiplies its own copy, whose gradient is that row's: every
mode gives the oracle's per-sample gradients (ghost: its norms and clipped sum). A product that
contracts the batch's rows themselves (``x @ W`` on ``(N, d)`` rows) stays refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled, microbatch_oracle

HEADS, STEPS, DIM, SPAN = 2, 3, 4, 5


class RelativeScores(nn.Module):
    """Content-to-position scores as DeBERTa-v2/v3 computes them.

    ``how`` picks the batch-free operand: "tiled" (``repeat`` of the per-head keys once per batch
    row, then a transpose: DeBERTa-v2), "shared_heads" (one head's keys tiled over every head of
    every row: the tile is smaller than a batch row's block), "broadcast" (a 4-D matmul with a
    ``(1, H, d, S)`` operand: DeBERTa v1), "broadcast_3d" (a ``(H, d, S)`` operand, batch
    dimension missing), "sliced_tiles" (the tiled keys sliced to N*K rows by a step: a
    batch-sized operand whose tiling the tracker no longer knows, split row by row) and "tiled_then_scaled" (a pointwise op after ``repeat``: the tiling is no longer
    known, the product still right).
    """

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.positions = nn.Embedding(SPAN, DIM)  # read whole, as DeBERTa's rel_embeddings
        self.norm = nn.LayerNorm(DIM)
        self.query = nn.Linear(DIM, HEADS * DIM)
        self.key = nn.Linear(DIM, HEADS * DIM)
        self.head = nn.Linear(STEPS * SPAN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*K, T, d)
        rows = x.shape[0]
        q = self.query(x).view(rows, STEPS, HEADS, DIM).transpose(1, 2)  # (N*K, H, T, d)
        keys = self.key(self.norm(self.positions.weight)).view(SPAN, HEADS, DIM).transpose(0, 1)  # (H, S, d): no batch
        if self.how == "broadcast":
            scores = q @ keys.unsqueeze(0).transpose(-1, -2)  # (N*K, H, T, S)
        elif self.how == "broadcast_3d":
            scores = torch.matmul(q, keys.transpose(-1, -2))
        elif self.how == "sliced_tiles":
            tiled = keys.repeat(rows, 1, 1)[::HEADS]  # (N*K, S, d): head 0's keys, the tiling lost
            scores = torch.bmm(q[:, 0], tiled.transpose(-1, -2)).unsqueeze(1)  # (N*K, 1, T, S)
        else:
            flat = q.reshape(rows * HEADS, STEPS, DIM)  # (N*K*H, T, d): H entries per batch row
            if self.how == "shared_heads":
                tiled = keys[:1].repeat(rows * HEADS, 1, 1)  # every head reads head 0's keys
            else:
                tiled = keys.repeat(rows, 1, 1)  # (N*K*H, S, d)
            if self.how == "tiled_then_scaled":
                tiled = tiled * 0.5
            scores = torch.bmm(flat, tiled.transpose(-1, -2)).view(rows, HEADS, STEPS, SPAN)
        return self.head(torch.tanh(scores).mean(1).flatten(1))  # (N*K, 2)


HOWS = ["tiled", "shared_heads", "broadcast", "broadcast_3d", "sliced_tiles", "tiled_then_scaled"]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _case(how: str, K: int, reduction: str, N: int = 3) -> tuple[nn.Module, torch.Tensor, torch.Tensor,
                                                                   dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = RelativeScores(how)
    x, y = torch.randn(N * K, STEPS, DIM), torch.randint(0, 2, (N * K,))
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]

    def reduce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        per_row = _loss(out, t)
        return per_row.mean() if reduction == "mean" else per_row.sum()

    return model, x, y, microbatch_oracle(model, samples, reduce)


def _assert_grads(actual: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, ref in expected.items():
        assert_close_scaled(actual[name], ref.to(actual[name].dtype), name=name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("how", HOWS)
def test_per_sample_gradients_match_the_oracle(how: str, mode: str, K: int, reduction: str) -> None:
    model, x, y, expected = _case(how, K, reduction)
    grads = per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode, augmentation_multiplicity=K,
                                 loss_reduction=reduction)
    _assert_grads(grads, expected)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("how", HOWS)
def test_ghost_norms_and_clipped_sum_match_the_oracle(how: str, K: int) -> None:
    model, x, y, expected = _case(how, K, "mean")
    bound = 0.05  # every sample clipped
    reference = psg_core.clip_and_sum(expected, max_grad_norm=bound)
    result = dp_gradient(model, x, y, loss_fn=_loss,
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=bound))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms.float(), name="norms")
    _assert_grads(result.grads, reference.grads)


@pytest.mark.parametrize("how", ["tiled", "broadcast"])
def test_grad_sample_module_matches_the_oracle(how: str) -> None:
    model, x, y, expected = _case(how, 2, "mean")
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=2)
    try:
        _loss(wrapped(x), y).mean().backward()
        _assert_grads({n: p.grad_sample for n, p in model.named_parameters()}, expected)
    finally:
        wrapped.remove_hooks()


def test_a_tile_costs_one_tile_per_sample() -> None:
    """The tiled operand's meeting point is one tile broadcast over the batch rows, not the whole
    ``(N*K*H, S, d)`` operand per sample (which would hold N copies of it)."""
    from psg_core.provenance import BatchTracker

    model = RelativeScores("tiled")
    x = torch.randn(6, STEPS, DIM)
    with BatchTracker(model, num_samples=6, augmentation_multiplicity=1, on_meeting=lambda *_: None) as tracker:
        tracker.mark(x, 0)
        model(x)
        (point,) = tracker.meetings
        assert point.broadcast and point.source.shape == (1, HEADS, DIM, SPAN) and point.shape[0] == 6
        tracker.release()


class RowProduct(nn.Module):
    """A weight computed from parameters (a lookup), applied to the batch's rows by a product."""

    def __init__(self, batched_bmm: bool) -> None:
        super().__init__()
        self.batched_bmm = batched_bmm
        self.table = nn.Embedding(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 4)
        weight = self.table(torch.arange(4))  # (4, 4): no batch
        if self.batched_bmm:  # the rows as one matrix of a batch of one
            return torch.bmm(x.unsqueeze(0), weight[None]).squeeze(0)
        return x @ weight


def test_a_weight_made_of_parameters_on_the_rows() -> None:
    """``x @ W`` on ``(N, d)`` rows is a linear layer with weight ``W.T`` (refused before); the
    same rows as one matrix of a batch of one (``bmm`` with the batch on a matrix axis) are refused,
    naming the remedy."""
    torch.manual_seed(7)
    model = RowProduct(False)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    samples = [((x[n:n + 1],), y[n:n + 1]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda out, t: (out - t).square().mean())
    _assert_grads(per_sample_gradients(model, x, y, loss_fn=lambda out, t: (out - t).square()), expected)
    with pytest.raises(UnsupportedModuleError, match=r"'<root>'.*matrix axis.*nn\.Linear"):
        per_sample_gradients(RowProduct(True), x, y, loss_fn=lambda out, t: (out - t).square())


@pytest.mark.parametrize("how", HOWS)
def test_ew_is_right_or_refuses(how: str) -> None:
    """ExpandedWeights cannot take the batch-free LayerNorm on the table: a PsgError naming it."""
    model, x, y, expected = _case(how, 2, "mean")
    try:
        grads = per_sample_gradients(model, x, y, loss_fn=_loss, mode="ew", augmentation_multiplicity=2)
    except psg_core.PsgError as err:
        assert "module 'norm' (LayerNorm)" in str(err)
        return
    _assert_grads(grads, expected)


# ----------------------------------------------------------------------------- found by the battery
class Keyed(nn.Module):
    """A batch-free position table projected to keys, queries from the batch, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(SPAN, DIM)
        self.key = nn.Linear(DIM, HEADS * DIM)
        self.query = nn.Linear(DIM, HEADS * DIM)
        self.head = nn.Linear(STEPS * SPAN, 2)


class TiledInPlace(Keyed):
    """The tiled keys (or their tile) changed in place between ``repeat`` and the product: the
    operand is no longer copies of the tile, and is taken as it is (raw errors or wrong before)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q = self.query(x).view(rows, STEPS, HEADS, DIM).transpose(1, 2).reshape(rows * HEADS, STEPS, DIM)
        keys = self.key(self.positions.weight).view(SPAN, HEADS, DIM).transpose(0, 1).clone()  # (H, S, d)
        tiled = keys.repeat(rows, 1, 1)  # (N*K*H, S, d)
        if self.how == "scaled":
            tiled.mul_(0.5)
        elif self.how == "row_zeroed":
            tiled[:, 0] = 0.0
        elif self.how == "tile_scaled":
            keys.mul_(3.0)  # the tile changes after the repeat: the copies do not
        elif self.how == "transposed_in_place":
            tiled.transpose_(1, 2)
            return self.head(torch.tanh(torch.bmm(q, tiled)).view(rows, HEADS, STEPS * SPAN).mean(1))
        return self.head(torch.tanh(torch.bmm(q, tiled.transpose(-1, -2))).view(rows, HEADS, STEPS * SPAN).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("how", ["scaled", "row_zeroed", "tile_scaled", "transposed_in_place"])
def test_a_tiled_operand_changed_in_place(how: str, mode: str) -> None:
    _check_model(TiledInPlace(how), mode)


class Child(nn.Module):
    def __init__(self, pointwise: bool) -> None:
        super().__init__()
        self.pointwise = pointwise
        self.query = nn.Linear(DIM, HEADS * DIM)

    def forward(self, x: torch.Tensor, relative: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q = self.query(x).view(rows, STEPS, HEADS, DIM).transpose(1, 2)  # (N*K, H, T, d)
        if self.pointwise:
            return (q.unsqueeze(-2) * relative[:, None]).sum(-1)
        return q @ relative.transpose(-1, -2)  # (N*K, H, T, S)


class Owner(nn.Module):
    """Owns a bare Parameter (no grad sampler: its torch.func fallback differentiates its whole
    forward) and hands it to a child that multiplies it with the batch: 2x before."""

    def __init__(self, pointwise: bool) -> None:
        super().__init__()
        self.relative = nn.Parameter(torch.randn(HEADS, SPAN, DIM) * 0.5)
        self.child = Child(pointwise)
        self.head = nn.Linear(STEPS * SPAN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.child(x, self.relative)).mean(1).flatten(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("pointwise", [False, True])
def test_an_enclosing_modules_parameter_meeting_the_batch_in_a_child(pointwise: bool, mode: str) -> None:
    _check_model(Owner(pointwise), mode)


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return 2 * a * g


class Opaque(Keyed):
    """The batch-free keys come out of a custom autograd.Function, whose forward runs without
    grad: their parameters got no per-sample gradient before (zeros)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q = self.query(x).view(rows, STEPS, HEADS, DIM).transpose(1, 2)
        keys = Square.apply(self.key(self.positions.weight)).view(SPAN, HEADS, DIM).transpose(0, 1)
        return self.head(torch.tanh(q @ keys.transpose(-1, -2)).mean(1).flatten(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_batch_free_keys_from_a_custom_autograd_function(mode: str) -> None:
    _check_model(Opaque(), mode)


def _check_model(model: nn.Module, mode: str, K: int = 2, x: torch.Tensor | None = None,
                 y: torch.Tensor | None = None) -> None:
    """``mode``'s result on three samples of K rows equals the oracle's (ghost: norms and clipped
    sum; "gsm": GradSampleModule's grad samples)."""
    torch.manual_seed(3)
    if x is None or y is None:
        x, y = torch.randn(3 * K, STEPS, DIM), torch.randint(0, 2, (3 * K,))
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(3)]
    expected = microbatch_oracle(model, samples, lambda out, t: _loss(out, t).mean())
    if mode == "ghost":
        reference = psg_core.clip_and_sum(expected, max_grad_norm=0.05)
        result = dp_gradient(model, x, y, loss_fn=_loss,
                             config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=0.05))
        assert_close_scaled(result.per_sample_norms, reference.per_sample_norms.float(), name="norms")
        _assert_grads(result.grads, reference.grads)
    elif mode == "gsm":
        wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=K)
        try:
            _loss(wrapped(x), y).mean().backward()
            _assert_grads({n: p.grad_sample for n, p in model.named_parameters()}, expected)
        finally:
            wrapped.remove_hooks()
    else:
        _assert_grads(per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode, augmentation_multiplicity=K),
                      expected)


def test_the_batch_written_in_place_into_a_batch_free_tensor_is_refused() -> None:
    class Writer(TiledInPlace):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            q = self.query(x).view(rows, STEPS, HEADS, DIM).transpose(1, 2).reshape(rows * HEADS, STEPS, DIM)
            tiled = self.key(self.positions.weight).view(SPAN, HEADS, DIM).transpose(0, 1).repeat(rows, 1, 1)
            tiled.add_(q[:, :1].expand(rows * HEADS, SPAN, DIM))  # batch values into the tiled keys
            return self.head(torch.bmm(q, tiled.transpose(-1, -2)).view(rows, HEADS, STEPS * SPAN).mean(1))

    x, y = torch.randn(4, STEPS, DIM), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError, match=r"add_.*writes the batch's values in place.*out of place"):
        per_sample_gradients(Writer("scaled"), x, y, loss_fn=_loss)


class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, DIM)
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embedding(ids)))  # (N*K, T, d)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "ew"])
def test_a_loss_that_reads_the_models_parameters(mode: str) -> None:
    """A tied output head computed in the loss (``hidden @ model.embedding.weight.T``): hooks and
    ghost follow the loss too; functorch keeps the sample's parameters swapped in while the loss
    runs (the head's gradient was lost before); ew refuses (it ignored it before)."""
    torch.manual_seed(4)
    model, K = Hidden(), 2
    ids, y = torch.randint(0, 11, (3 * K, STEPS)), torch.randint(0, 11, (3 * K, STEPS))

    def loss(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = h @ model.embedding.weight.t()  # (N*K, T, 11)
        return F.cross_entropy(logits.transpose(1, 2), t, reduction="none").mean(1)

    if mode == "ew":
        with pytest.raises(UnsupportedModuleError, match="ExpandedWeights computes per-sample gradients inside"):
            per_sample_gradients(model, ids, y, loss_fn=loss, mode=mode, augmentation_multiplicity=K)
        return
    reference_model = copy.deepcopy(model).double()
    expected: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for n in range(3):
        rows = slice(n * K, (n + 1) * K)
        h = reference_model(ids[rows])
        logits = h @ reference_model.embedding.weight.t()
        value = F.cross_entropy(logits.transpose(1, 2), y[rows], reduction="none").mean(1).mean()
        for (name, _), g in zip(reference_model.named_parameters(),
                                torch.autograd.grad(value, list(reference_model.parameters()))):
            expected[name].append(g)
    oracle = {n: torch.stack(gs) for n, gs in expected.items()}
    if mode == "ghost":
        reference = psg_core.clip_and_sum(oracle, max_grad_norm=0.05)
        result = dp_gradient(model, ids, y, loss_fn=loss,
                             config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=0.05))
        _assert_grads(result.grads, reference.grads)
        return
    _assert_grads(per_sample_gradients(model, ids, y, loss_fn=loss, mode=mode, augmentation_multiplicity=K), oracle)


class TiedProjection(nn.Module):
    """An output projection tied to the token table through ``F.linear(h, embedding.weight, b)``
    (fairseq-style), in a module that does not own the table: refused before, while the same
    ``h @ embedding.weight.T`` was accepted. ``b`` is a bias computed from another layer."""

    def __init__(self, rank: int, bias: bool) -> None:
        super().__init__()
        self.rank = rank
        self.embedding = nn.Embedding(11, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.bias = nn.Linear(1, 11) if bias else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N*K, T)
        h = torch.tanh(self.mix(self.embedding(ids)))  # (N*K, T, d)
        if self.rank == 2:
            h = h.mean(1)  # (N*K, d)
        b = None if self.bias is None else self.bias(torch.ones(1, 1, dtype=h.dtype)).squeeze(0)
        logits = F.linear(h, self.embedding.weight, b)
        return logits if self.rank == 2 else logits.mean(1)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch", "gsm"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rank", [2, 3])
def test_a_tied_projection_through_functional_linear(rank: int, bias: bool, mode: str, K: int) -> None:
    torch.manual_seed(6)
    ids, y = torch.randint(0, 11, (3 * K, STEPS)), torch.randint(0, 11, (3 * K,))
    _check_model(TiedProjection(rank, bias), mode, K, ids, y)


class RelativeEinsum(Keyed):
    """Transformer-XL-style scores: ``einsum`` of the batch's queries with batch-free relative
    keys (refused before). "time_major" puts the batch on the queries' second axis; "bias" adds a
    third, batch-free operand (a slice of a layer's bias)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q = self.query(x).view(rows, STEPS, HEADS, DIM)  # (N*K, T, H, d)
        keys = self.key(self.positions.weight).view(SPAN, HEADS, DIM)  # (S, H, d): no batch
        if self.how == "time_major":
            scores = torch.einsum("tbhd,shd->bhts", q.transpose(0, 1), keys)
        elif self.how == "bias":
            scores = torch.einsum("bthd,shd,h->bhts", q, keys, self.key.bias[:HEADS])
        else:
            scores = torch.einsum("bthd,shd->bhts", q, keys)
        return self.head(torch.tanh(scores).mean(1).flatten(1))


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "gsm"])
@pytest.mark.parametrize("how", ["batch_first", "time_major", "bias"])
def test_batch_free_relative_keys_in_einsum(how: str, mode: str, K: int) -> None:
    _check_model(RelativeEinsum(how), mode, K)


def test_an_einsum_with_an_ellipsis_is_refused() -> None:
    class Ellipsis_(RelativeEinsum):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.query(x).view(x.shape[0], STEPS, HEADS, DIM)
            keys = self.key(self.positions.weight).view(SPAN, HEADS, DIM)
            return self.head(torch.einsum("...thd,shd->...hts", q, keys).mean(1).flatten(1))

    x, y = torch.randn(4, STEPS, DIM), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError, match=r"einsum.*explicit equations"):
        per_sample_gradients(Ellipsis_("batch_first"), x, y, loss_fn=_loss)
