"""Where the batch is: the functional entry points follow it from what the caller passed.

Layers whose inputs do not carry the batch (a position table on broadcast ids, a ``(T, T)``
matrix), even when one of their sizes equals N*K; an EmbeddingBag's bags given by offsets; a
PackedSequence's sequences; a time-major network whose head reads the last step; a view that
merges the batch with the sequence axis. Each mode gives the oracle's per-sample gradients or a
PsgError naming the layer, never a silent sum.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import psg_core
from psg_core import (BatchLayoutError, DPConfig, PsgError, UnsupportedModuleError, dp_gradient,
                      per_sample_gradients)
from psg_core.layers import DPGRU, DPLSTM
from tests.oracle import assert_close_scaled, microbatch_oracle

MODES = ["hooks", "functorch", "ew"]
REDUCTIONS = ["mean", "sum"]


def _oracle(model: nn.Module, samples: list[tuple[tuple[Any, ...], torch.Tensor]], loss: Any,
            reduction: str) -> dict[str, torch.Tensor]:
    return microbatch_oracle(model, samples, lambda out, y: _reduce(loss(out, y), reduction))


def _reduce(per_element: torch.Tensor, reduction: str) -> torch.Tensor:
    return per_element.mean() if reduction == "mean" else per_element.sum()


def _assert_grads(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, ref in expected.items():
        assert_close_scaled(actual[name], ref, name=name)


def _assert_ghost(model: nn.Module, inputs: Any, targets: torch.Tensor, loss: Any, expected: dict[str, torch.Tensor],
                  *, K: int, reduction: str, batch_first: bool = True) -> None:
    bound = 0.05
    reference = psg_core.clip_and_sum({n: g.to(torch.float32) for n, g in expected.items()}, max_grad_norm=bound)
    result = dp_gradient(model, inputs, targets, loss_fn=loss,
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, loss_reduction=reduction,
                                         batch_first=batch_first, max_grad_norm=bound))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    _assert_grads(result.grads, reference.grads)


def _check_mode(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Any, mode: str, K: int, *,
                samples: int) -> None:
    """``mode`` on ``samples`` samples of K rows equals the oracle (mean reduction; ghost: its
    norms and clipped sum)."""
    expected = _oracle(model, [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(samples)], loss, "mean")
    if mode == "ghost":
        _assert_ghost(model, x, y, loss, expected, K=K, reduction="mean")
    else:
        _assert_grads(per_sample_gradients(model, x, y, loss_fn=loss, mode=mode, augmentation_multiplicity=K),
                      expected)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y, reduction="none")


# ----------------------------------------------------------------------------- batch-free layers
class PositionTable(nn.Module):
    """Token embedding plus a learned position table looked up with broadcast ``(1, T)`` ids, added
    by broadcasting or (``expand_as=True``, XLM's and Flaubert's way) expanded to the embeddings'
    shape first."""

    def __init__(self, steps: int, expand_as: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(11, 4)
        self.positions = nn.Embedding(steps, 4)
        self.head = nn.Linear(4, 2)
        self.expand_as = expand_as

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])[None]  # (1, T): no batch
        tokens, table = self.tokens(ids), self.positions(positions)
        if self.expand_as:
            table = table.expand_as(tokens)  # (N*K, T, 4), every row the same (1, T, 4) table
        return self.head(torch.tanh(tokens + table))  # (N*K, T, 2)


class PairBias(nn.Module):
    """A bias over (T, T) pairs from a bucket matrix, added to batched scores (T5-like)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.bias = nn.Embedding(2 * steps, 1)
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N*K, T, 3)
        steps = x.shape[1]
        buckets = torch.arange(steps)[:, None] - torch.arange(steps)[None, :] + steps  # (T, T)
        h = self.proj(x)
        scores = h @ h.transpose(1, 2) + self.bias(buckets).squeeze(-1)  # (N*K, T, T)
        return scores.softmax(-1) @ x  # (N*K, T, 3)


@pytest.mark.parametrize("expand_as", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_position_table_with_sequence_length_equal_to_rows(mode: str, K: int, reduction: str, expand_as: bool) -> None:
    """T == N*K: the table's (1, T) lookup has T on no batch axis, whatever the sizes say; expanded
    as the batch's embeddings (``expand_as``), it meets the batch there, each row its sample's."""
    torch.manual_seed(0)
    N = 3
    steps = N * K
    model = PositionTable(steps, expand_as=expand_as)
    ids, y = torch.randint(0, 11, (N * K, steps)), torch.randn(N * K, steps, 2)
    samples = [((ids[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = _oracle(model, samples, _mse, reduction)
    grads = per_sample_gradients(model, ids, y, loss_fn=_mse, mode=mode, augmentation_multiplicity=K,
                                 loss_reduction=reduction)
    _assert_grads(grads, expected)
    _assert_ghost(model, ids, y, _mse, expected, K=K, reduction=reduction)
    with pytest.raises(UnsupportedModuleError, match=r"'positions' \(Embedding\)"):
        per_sample_gradients(model, ids, y, loss_fn=_mse, mode="ew", augmentation_multiplicity=K)


class TimeMajorPositions(nn.Module):
    """``(T, B)`` ids; the ``(T, 1, d)`` position rows expanded as the ``(T, B, d)`` embeddings."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(11, 4), nn.Embedding(steps, 4), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T, B)
        tokens = self.tokens(ids)
        table = self.positions(torch.arange(ids.shape[0])[:, None]).expand_as(tokens)  # (T, B, 4)
        return self.head(torch.tanh(tokens + table))  # (T, B, 2)


@pytest.mark.parametrize("K", [1, 2])
def test_expand_as_meets_a_time_major_batch_and_the_wrapper(K: int) -> None:
    """The batch on axis 1 (batch_first=False): ``expand_as`` meets it there, in the functional
    API, ghost and the GradSampleModule wrapper (which tracks each forward pass itself)."""
    torch.manual_seed(3)
    N, steps = 3, 4
    model = TimeMajorPositions(steps)
    ids, y = torch.randint(0, 11, (steps, N * K)), torch.randn(steps, N * K, 2)
    samples = [((ids[:, n * K:(n + 1) * K],), y[:, n * K:(n + 1) * K]) for n in range(N)]
    expected = _oracle(model, samples, _mse, "mean")
    _assert_grads(per_sample_gradients(model, ids, y, loss_fn=_mse, augmentation_multiplicity=K, batch_first=False),
                  expected)
    _assert_ghost(model, ids, y, _mse, expected, K=K, reduction="mean", batch_first=False)
    wrapped = psg_core.GradSampleModule(model, batch_first=False, augmentation_multiplicity=K)
    try:
        _mse(wrapped(ids), y).mean().backward()
        _assert_grads({n: p.grad_sample for n, p in model.named_parameters()}, expected)
    finally:
        wrapped.remove_hooks()


@pytest.mark.parametrize("K", [1, 2])
def test_pair_bias_from_a_square_bucket_matrix(K: int) -> None:
    """A (T, T) bucket matrix with T == N*K is not a batch of T rows."""
    torch.manual_seed(1)
    N = 2
    model = PairBias(N * K)
    x, y = torch.randn(N * K, N * K, 3), torch.randn(N * K, N * K, 3)
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = _oracle(model, samples, _mse, "mean")
    for mode in ("hooks", "functorch"):
        _assert_grads(per_sample_gradients(model, x, y, loss_fn=_mse, mode=mode, augmentation_multiplicity=K), expected)
    _assert_ghost(model, x, y, _mse, expected, K=K, reduction="mean")
    # ExpandedWeights would read the bucket matrix's first axis as the batch: refused, not summed.
    with pytest.raises(UnsupportedModuleError, match=r"'bias' \(Embedding\).*does not carry the batch"):
        per_sample_gradients(model, x, y, loss_fn=_mse, mode="ew", augmentation_multiplicity=K)
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=K)
    try:
        _reduce(_mse(wrapped(x), y), "mean").backward()
        _assert_grads({n: p.grad_sample for n, p in model.named_parameters()}, expected)
    finally:
        wrapped.remove_hooks()


class LookupKernel(nn.Module):
    """A convolution kernel made of a lookup: met per batch row in ``conv1d`` (tests/core/
    test_conv_meetings.py), refused in ``conv_transpose1d`` (psg does not split that one)."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 3)
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.table(torch.arange(1)).view(1, 1, 3)
        if self.transposed:
            return F.conv_transpose1d(x.unsqueeze(1), kernel)[..., :4].squeeze(1)
        return F.conv1d(x.unsqueeze(1), kernel, padding="same").squeeze(1)


def test_unsupported_meeting_names_the_module() -> None:
    """A batch-free tensor from parameters that meets the batch in an op psg cannot split."""
    with pytest.raises(UnsupportedModuleError, match=r"'<root>'.*conv_transpose1d"):
        per_sample_gradients(LookupKernel(transposed=True), torch.randn(4, 4), torch.randn(4, 4), loss_fn=_mse)


def test_a_kernel_made_of_a_lookup_meets_the_batch_in_conv1d() -> None:
    torch.manual_seed(3)
    model, x, y = LookupKernel(transposed=False), torch.randn(4, 4), torch.randn(4, 4)
    expected = _oracle(model, [((x[n:n + 1],), y[n:n + 1]) for n in range(4)], _mse, "mean")
    _assert_grads(per_sample_gradients(model, x, y, loss_fn=_mse), expected)


# ----------------------------------------------------------------------------- EmbeddingBag offsets
class BagHead(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode=mode)
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens, offsets))


def _bags(K: int, N: int = 3, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [int(v) for v in torch.randint(1, 5, (N * K,), generator=generator)]
    tokens = torch.randint(0, 20, (sum(lengths),), generator=generator)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    return tokens, offsets, lengths, torch.randn(N * K, 2, generator=generator)


@pytest.mark.parametrize("bag_mode", ["sum", "mean"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("K", [1, 2])
def test_embedding_bag_offsets_through_the_functional_api(bag_mode: str, reduction: str, K: int) -> None:
    """Rows are bags (the targets' rows), not tokens; the token count need not divide anything."""
    torch.manual_seed(3)
    N = 3
    model = BagHead(bag_mode)
    tokens, offsets, lengths, y = _bags(K, N)
    samples = []
    starts = offsets.tolist() + [tokens.shape[0]]
    for n in range(N):
        first, last = starts[n * K], starts[(n + 1) * K]
        sample_offsets = offsets[n * K:(n + 1) * K] - first
        samples.append(((tokens[first:last], sample_offsets), y[n * K:(n + 1) * K]))
    expected = _oracle(model, samples, _mse, reduction)
    grads = per_sample_gradients(model, (tokens, offsets), y, loss_fn=_mse, augmentation_multiplicity=K,
                                 loss_reduction=reduction)
    _assert_grads(grads, expected)
    _assert_ghost(model, (tokens, offsets), y, _mse, expected, K=K, reduction=reduction)
    for mode in ("functorch", "ew"):  # they cannot split offsets per sample: refused, naming the layer
        with pytest.raises(UnsupportedModuleError, match=r"'bag' \(EmbeddingBag\)"):
            per_sample_gradients(model, (tokens, offsets), y, loss_fn=_mse, mode=mode, augmentation_multiplicity=K)


# ----------------------------------------------------------------------------- packed sequences
class PackedClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = DPLSTM(3, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, 2)

    def forward(self, packed: Any) -> torch.Tensor:
        _, (h, _) = self.rnn(packed)  # h: (2, B, 4)
        return self.head(torch.cat([h[0], h[1]], dim=1))  # (B, 2)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("K", [1, 3])
def test_packed_sequence_through_the_functional_api(K: int, reduction: str) -> None:
    torch.manual_seed(4)
    N = 2
    model = PackedClassifier()
    padded = torch.randn(N * K, 5, 3)
    lengths = torch.tensor([5, 2, 4, 3, 1, 5][:N * K])
    packed = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    y = torch.randn(N * K, 2)
    samples = [((pack_padded_sequence(padded[n * K:(n + 1) * K].double(), lengths[n * K:(n + 1) * K],
                                      batch_first=True, enforce_sorted=False),), y[n * K:(n + 1) * K])
               for n in range(N)]
    expected = _oracle(model, samples, _mse, reduction)
    grads = per_sample_gradients(model, packed, y, loss_fn=_mse, augmentation_multiplicity=K, loss_reduction=reduction)
    _assert_grads(grads, expected)
    _assert_ghost(model, packed, y, _mse, expected, K=K, reduction=reduction)
    with pytest.raises(UnsupportedModuleError, match="PackedSequence"):
        per_sample_gradients(model, packed, y, loss_fn=_mse, mode="functorch", augmentation_multiplicity=K)


# ----------------------------------------------------------------------------- time-major networks
class TimeMajorGRU(nn.Module):
    """A 2-layer bidirectional GRU run time-major whose head reads the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = DPGRU(3, 4, num_layers=2, bidirectional=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, N*K, 3)
        out, _ = self.rnn(x)  # (T, N*K, 8)
        return self.head(out[-1])  # (N*K, 5)


@pytest.mark.parametrize("K", [1, 3])
def test_time_major_head_on_the_last_step(K: int) -> None:
    torch.manual_seed(5)
    N, steps = 2, 4
    model = TimeMajorGRU()
    x = torch.randn(steps, N * K, 3)
    y = torch.randint(0, 5, (N * K,))  # (N*K,): their batch dimension is their own first one

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target, reduction="none")

    samples = [((x[:, n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = _oracle(model, samples, loss, "mean")
    for mode in ("hooks", "functorch"):
        grads = per_sample_gradients(model, x, y, loss_fn=loss, mode=mode, augmentation_multiplicity=K, batch_first=False)
        _assert_grads(grads, expected)
    _assert_ghost(model, x, y, loss, expected, K=K, reduction="mean", batch_first=False)


# ----------------------------------------------------------------------------- merged batch axes
class FlatMLP(nn.Module):
    """Runs its MLP on ``(N*T, d)`` rows, as OPT's decoder does."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 4)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N*K*T, 4)
        return (x.reshape(-1, shape[-1]) + self.fc(self.norm(flat))).view(shape)


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_views_that_merge_the_batch_with_the_sequence(mode: str, K: int) -> None:
    torch.manual_seed(6)
    N, steps = 3, 5
    model = FlatMLP()
    x, y = torch.randn(N * K, steps, 4), torch.randn(N * K, steps, 4)
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = _oracle(model, samples, _mse, "mean")
    _assert_grads(per_sample_gradients(model, x, y, loss_fn=_mse, mode=mode, augmentation_multiplicity=K), expected)
    _assert_ghost(model, x, y, _mse, expected, K=K, reduction="mean")


class Frames(nn.Module):
    """A layer run on every frame of every sample: ``(N*K, T, C, H, W)`` viewed as ``(N*K*T, C, H,
    W)`` rows (a video model's per-frame CNN, a multi-crop encoder, LeViT's BatchNorm on tokens).
    A convolution or a batch/group/instance norm fixes its axes: the frames cannot be split off as
    an extra axis, they are more rows of the same sample."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, frames = x.shape[:2]
        h = self.layer(x.reshape(rows * frames, *x.shape[2:]))  # (N*K*T, 4, 3, 3)
        return self.head(torch.tanh(h).reshape(rows, frames, -1).mean(1))


def _frame_layer(kind: str) -> tuple[nn.Module, int]:
    if kind == "conv":
        return nn.Conv2d(3, 4, 3, padding=1), 3
    if kind == "conv_transpose":
        return nn.ConvTranspose2d(3, 4, 3, padding=1), 3
    if kind == "group_norm":
        return nn.GroupNorm(2, 4), 4
    if kind == "instance_norm":
        return nn.InstanceNorm2d(4, affine=True), 4
    if kind == "batch_norm_eval":
        layer = nn.BatchNorm2d(4).eval()
        with torch.no_grad():
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
        return layer, 4
    return nn.LayerNorm([4, 3, 3]), 4


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("kind", ["conv", "conv_transpose", "group_norm", "instance_norm", "batch_norm_eval",
                                  "layer_norm"])
def test_frames_merged_into_the_rows_of_a_layer_that_fixes_its_axes(kind: str, mode: str, K: int) -> None:
    """Raw errors (channels read from the frame axis) or refusals before."""
    torch.manual_seed(8)
    N = 3
    layer, channels = _frame_layer(kind)
    model = Frames(layer)
    x, y = torch.randn(N * K, 2, channels, 3, 3), torch.randint(0, 2, (N * K,))
    _check_mode(model, x, y, nn.CrossEntropyLoss(reduction="none"), mode, K, samples=N)


# ----------------------------------------------------------------------------- keyword inputs, errors
def test_keyword_inputs_and_layout_errors() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            return self.a(left) * self.b(right)

    torch.manual_seed(7)
    model = Pair()
    left, right, y = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 2)
    positional = per_sample_gradients(model, (left, right), y, loss_fn=_mse, augmentation_multiplicity=2)
    for mode in MODES:
        named = per_sample_gradients(model, {"right": right, "left": left}, y, loss_fn=_mse, mode=mode,
                                     augmentation_multiplicity=2)
        _assert_grads(named, positional)
    with pytest.raises(BatchLayoutError, match="no input tensor has 6 rows"):
        per_sample_gradients(model, (left, right), torch.randn(6, 2), loss_fn=_mse)
    with pytest.raises(BatchLayoutError, match="not divisible"):
        per_sample_gradients(model, (left, right), y, loss_fn=_mse, augmentation_multiplicity=3)
    with pytest.raises(PsgError):
        per_sample_gradients(model, {1: left}, y, loss_fn=_mse)


class FlatBags(nn.Module):
    """Takes (N*K, L) tokens, flattens them and pools fixed-length bags through offsets (as the
    benchmark's bag classifier does): the bag's input is merged with L, its output is not."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="mean")
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows, length = tokens.shape
        offsets = torch.arange(0, rows * length, length)
        return self.head(self.bag(tokens.reshape(-1), offsets))


@pytest.mark.parametrize("K", [1, 2])
def test_bags_from_flattened_tokens(K: int) -> None:
    torch.manual_seed(8)
    N = 3
    model = FlatBags()
    tokens, y = torch.randint(0, 20, (N * K, 5)), torch.randn(N * K, 2)
    samples = [((tokens[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = _oracle(model, samples, _mse, "mean")
    _assert_grads(per_sample_gradients(model, tokens, y, loss_fn=_mse, augmentation_multiplicity=K), expected)
    _assert_ghost(model, tokens, y, _mse, expected, K=K, reduction="mean")


# ----------------------------------------------------------------------------- windows
class Patches(nn.Module):
    """A series cut into patches (``Tensor.unfold``, as PatchTST does), then put patch-major: the
    Linear's dim 0 has P entries, which here equals N*K. The batch was lost at ``unfold`` and dim 0
    taken for it: silently wrong before."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, 12, 2)
        if self.how == "im2col":  # F.unfold on (N*K, 2, 12, 1) images
            patches = F.unfold(x.transpose(1, 2).unsqueeze(-1), kernel_size=(4, 1), stride=(4, 1))  # (N*K, 8, 3)
            patches = patches.view(x.shape[0], 2, 4, 3).permute(3, 0, 1, 2)  # (P, N*K, C, 4)
        else:
            patches = x.unfold(dimension=1, size=4, step=4).transpose(0, 1)  # (P, N*K, C, 4)
        h = torch.tanh(self.embed(patches))
        return self.head(h.mean((0, 2)))


@pytest.mark.parametrize("how", ["unfold", "im2col"])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
def test_patches_put_before_the_batch(how: str, mode: str) -> None:
    torch.manual_seed(9)
    K = 1
    model = Patches(how)
    x, y = torch.randn(3, 12, 2), torch.randint(0, 3, (3,))
    samples = [((x[n:n + 1],), y[n:n + 1]) for n in range(3)]
    loss = nn.CrossEntropyLoss(reduction="none")
    expected = microbatch_oracle(model, samples, lambda out, t: F.cross_entropy(out, t))
    if mode == "ghost":
        _assert_ghost(model, x, y, loss, expected, K=K, reduction="mean")
    else:
        _assert_grads(per_sample_gradients(model, x, y, loss_fn=loss, mode=mode), expected)


def test_windows_across_the_batch_mix_samples() -> None:
    class Across(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 4)
            return self.fc(x.unfold(0, 2, 1).transpose(1, 2)).mean(1)  # windows of consecutive samples

    with pytest.raises(UnsupportedModuleError, match="unfold"):
        per_sample_gradients(Across(), torch.randn(5, 4), torch.randn(5, 2),
                             loss_fn=lambda out, t: (out - t).square().sum(1))


def test_the_wrapper_refuses_layers_that_disagree_on_the_rows() -> None:
    """GradSampleModule knows no N: a layer that sees channels folded into the batch by an op the
    tracker cannot follow, beside one that sees the batch, is refused (grad samples of N*C rows,
    and a mean scaled by N*C, before)."""

    class Folded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C=3, 4)
            rows = x.movedim(1, 0).reshape(-1, 4)  # (C*N, 4), channel-major: the batch axis is lost
            h = self.a(rows).view(3, x.shape[0], 4).mean(0)  # (N, 4)
            return self.b(h)

    wrapped = psg_core.GradSampleModule(Folded())
    try:
        with pytest.raises(BatchLayoutError, match=r"Linear was called with 2 rows.*Linear saw 6 in the same forward"):
            wrapped(torch.randn(2, 3, 4)).sum().backward()
    finally:
        wrapped.remove_hooks()
    with pytest.raises(BatchLayoutError, match="called with 6 rows"):
        per_sample_gradients(Folded(), torch.randn(2, 3, 4), torch.randn(2, 2),
                             loss_fn=lambda out, t: (out - t).square().sum(1))


# ----------------------------------------------------------------------- constants of the batch's shape
class TypedAttention(nn.Module):
    """Attention that reads token types (no grad sampler: its calls run per sample under torch.func,
    so every batched input must be known to hold the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.types = nn.Parameter(torch.randn(2, 4))
        self.proj = nn.Parameter(torch.randn(4, 4) / 2)

    def forward(self, h: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:  # (B, T, 4), (B, T)
        same = (token_types[:, :, None] == token_types[:, None, :]).to(h.dtype)  # (B, T, T)
        scores = (h @ self.proj) @ h.transpose(1, 2) * same + F.embedding(token_types, self.types) @ h.transpose(1, 2)
        return scores.softmax(-1) @ h


class DefaultTokenTypes(nn.Module):
    """Token types defaulted as Hugging Face models do: zeros of the ids' own ``size()``
    (``numbers=True``: of a shape written out in numbers, ``zeros(B, T)``)."""

    def __init__(self, numbers: bool = False) -> None:
        super().__init__()
        self.tokens, self.attn, self.head = nn.Embedding(11, 4), TypedAttention(), nn.Linear(4, 2)
        self.numbers = numbers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        types = (torch.zeros(ids.shape[0], ids.shape[1], dtype=torch.long) if self.numbers
                 else torch.zeros(ids.size(), dtype=torch.long))
        return self.head(self.attn(self.tokens(ids), types))


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_a_constant_of_the_batch_tensors_own_size_holds_the_batch(mode: str, K: int) -> None:
    """``torch.zeros(ids.size())`` is the batch's rows (each row the value a sample's own call
    makes), so a layer run per sample under torch.func takes it row by row; zeros of a shape
    written in numbers say nothing about where the batch is: refused where it matters, naming the
    layer (never split by its sizes)."""
    torch.manual_seed(0)
    N = 3
    ids, y = torch.randint(0, 11, (N * K, 5)), torch.randn(N * K, 5, 2)
    samples = [((ids[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    model = DefaultTokenTypes()
    expected = _oracle(model, samples, _mse, "mean")
    if mode == "ghost":
        _assert_ghost(model, ids, y, _mse, expected, K=K, reduction="mean")
    else:
        _assert_grads(per_sample_gradients(model, ids, y, loss_fn=_mse, mode=mode, augmentation_multiplicity=K),
                      expected)
    numbers = DefaultTokenTypes(numbers=True)
    numbers.load_state_dict(model.state_dict())
    if mode == "functorch":  # the whole model per sample: zeros(B, T) is one sample's there
        _assert_grads(per_sample_gradients(numbers, ids, y, loss_fn=_mse, mode=mode, augmentation_multiplicity=K),
                      expected)
        return
    with pytest.raises(UnsupportedModuleError, match=r"TypedAttention"):
        if mode == "ghost":
            dp_gradient(numbers, ids, y, loss_fn=_mse, config=DPConfig(mode="ghost", augmentation_multiplicity=K))
        else:
            per_sample_gradients(numbers, ids, y, loss_fn=_mse, mode=mode, augmentation_multiplicity=K)


def test_which_factories_follow_a_size() -> None:
    """The tracker marks a factory's result batched only for the very ``torch.Size`` object of a
    batched tensor (its ``size()`` or ``shape``), with that tensor's axis and merged rows."""
    from psg_core.provenance import BatchTracker

    layer = nn.Linear(3, 3)
    x, time_major, merged = torch.randn(4, 5, 3), torch.randn(5, 4, 3), torch.randn(8, 3)
    with BatchTracker(layer, num_samples=4, augmentation_multiplicity=1, on_meeting=lambda *_: None) as tracker:
        tracker.mark(x, 0)
        tracker.mark(time_major, 1)
        rows = x.reshape(-1, 3)  # (N*T, 3): 5 rows per sample
        size = x.size()
        followed = {
            "zeros(size())": torch.zeros(size), "zeros(shape, dtype)": torch.zeros(x.shape, dtype=torch.long),
            "ones(shape)": torch.ones(x.shape), "full(shape, v)": torch.full(x.shape, 2.0),
            "empty(size=shape)": torch.empty(size=x.shape),
            "parameter.new_zeros(shape)": layer.weight.new_zeros(x.shape),
            "time-major": torch.zeros(time_major.shape), "merged": torch.zeros(rows.shape),
        }
        not_followed = {
            "numbers": torch.zeros(4, 5, 3), "numbers from the shape": torch.zeros(x.shape[0], 5, 3),
            "a tuple of it": torch.zeros(tuple(x.shape)), "a slice of it": torch.zeros(x.shape[:-1]),
            "a batch-free tensor's size": torch.zeros(layer.weight.shape),
        }
        axes = {name: (tracker.batch_dim(t), tracker.merged(t)) for name, t in followed.items()}
        free = {name: tracker.batch_dim(t) for name, t in not_followed.items()}
    assert axes == {**{name: (0, 1) for name in followed}, "time-major": (1, 1), "merged": (0, 5)}
    assert free == {name: None for name in not_followed}


def test_an_index_arange_made_is_the_identity_without_a_read() -> None:
    """``x[torch.arange(B), positions]`` (a classifier's pooled token) keeps the batch axis with no
    read of the index where the forward made it with ``arange`` (so a step can be recorded); an
    index changed since, or another one, is read and a permutation refused."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from psg_core.provenance import MIXED, BatchTracker

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.count += func._schema.name == "aten::equal"
            return func(*args, **(kwargs or {}))

    layer = nn.Linear(3, 3)
    x, positions = torch.randn(4, 5, 3), torch.tensor([4, 0, 2, 1])
    with BatchTracker(layer, num_samples=4, augmentation_multiplicity=1, on_meeting=lambda *_: None) as tracker:
        tracker.mark(x, 0)
        tracker.mark(positions, 0)
        with Reads() as reads:
            pooled = x[torch.arange(4), positions]  # (4, 3)
            rows = torch.arange(4)[:, None]  # an unsqueezed view of it
            picked = x[rows, torch.tensor([[0, 1]])]  # (4, 2, 3)
            kept = x.index_select(0, torch.arange(x.shape[0]))
        assert reads.count == 0
        assert (tracker.batch_dim(pooled), tracker.batch_dim(picked), tracker.batch_dim(kept)) == (0, 0, 0)
        changed = torch.arange(4)
        changed[0] = 3  # (3, 1, 2, 3): not the identity any more
        with Reads() as reads:
            assert tracker.batch_dim(x[changed, positions]) == MIXED
            assert tracker.batch_dim(x[torch.arange(4).flip(0), positions]) == MIXED
            assert tracker.batch_dim(x[torch.tensor([0, 1, 2, 3]), positions]) == 0  # the identity, read
        assert reads.count == 3


class CastScale(nn.Module):
    """A per-feature scale made of parameters without the batch, cast to the batch's dtype with
    ``type_as(x)`` (Gemma 3n's per-layer inputs), then multiplied with the batch; ``x.type_as(w)``
    the other way round."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Embedding(1, 3)
        self.proj = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 3)
        scale = self.scale(torch.zeros(1, dtype=torch.long)).type_as(x)  # (1, 3): no batch
        return self.proj(torch.tanh(x.type_as(self.proj.weight) * scale)).mean(1)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_type_as_reads_only_the_other_tensors_dtype(mode: str, K: int) -> None:
    """It was taken for a meeting of the batch-free scale with the batch, refused ('type_as')."""
    torch.manual_seed(4)
    model = CastScale()
    x, y = torch.randn(3 * K, 4, 3), torch.randn(3 * K, 2)
    _check_mode(model, x, y, _mse, mode, K, samples=3)


class HashRouted(nn.Module):
    """DeepSeek V4's hash routing in small: which experts a token uses is a lookup of its id in a
    fixed table (a buffer, ``tid2eid[ids]``); the learned gate's scores at those experts weight
    each expert's output. ``how``: the lookup by ``__getitem__`` or ``index_select``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(7, 4)
        self.gate = nn.Linear(4, 3, bias=False)
        self.experts = nn.Linear(4, 3 * 4)
        self.register_buffer("tid2eid", torch.randint(0, 3, (7, 2)))
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N*K, T)
        h = self.embed(ids)  # (N*K, T, 4)
        flat_ids = ids.reshape(-1)
        index = self.tid2eid[flat_ids] if self.how == "getitem" else self.tid2eid.index_select(0, flat_ids)
        weights = torch.softmax(self.gate(h), -1).reshape(-1, 3).gather(1, index)  # (N*K*T, 2)
        outs = self.experts(h).reshape(-1, 3, 4)  # (N*K*T, E, 4)
        picked = outs.gather(1, index[:, :, None].expand(-1, -1, 4))  # (N*K*T, 2, 4)
        routed = (picked * weights[:, :, None]).sum(1).view(h.shape)
        return self.head(torch.tanh(routed).mean(1))


@pytest.mark.parametrize("how", ["getitem", "index_select"])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_batch_free_table_looked_up_by_the_batch_s_ids(how: str, mode: str, K: int) -> None:
    """``table[ids]`` (or ``index_select``) of a buffer holds the batch where the ids do; it was an
    axis psg lost, which the experts' gather then could not follow."""
    torch.manual_seed(5)
    model = HashRouted(how)
    x, y = torch.randint(0, 7, (3 * K, 4)), torch.randn(3 * K, 2)
    _check_mode(model, x, y, _mse, mode, K, samples=3)


def test_which_lookups_of_a_batch_free_table_hold_the_batch() -> None:
    from psg_core.provenance import BatchTracker

    layer = nn.Linear(2, 2)
    table = torch.arange(14).view(7, 2)
    ids = torch.randint(0, 7, (4, 3))
    mask = torch.rand(4, 3) > 0.5
    with BatchTracker(layer, num_samples=4, augmentation_multiplicity=1, on_meeting=lambda *_: None) as tracker:
        tracker.mark(ids, 0)
        tracker.mark(mask, 0)
        flat = ids.reshape(-1)
        assert tracker.state(table[ids]) == (0, 1)  # (4, 3, 2): the ids' axes lead
        assert tracker.state(table[flat]) == (0, 3)  # three entries per row, as the ids
        assert tracker.state(table.index_select(0, flat)) == (0, 3)
        assert tracker.state(table.t().index_select(1, flat)) == (1, 3)
        # a mask picks entries of the table, not rows of the batch
        assert tracker.batch_dim(torch.zeros(4, 3)[mask]) != 0
