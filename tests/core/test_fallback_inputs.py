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

from psg_core import DPConfig, UnsupportedModuleError, dp_gradient
from tests.oracle import check_mode

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
    check_mode(model, x, y, K=K, mode=mode, loss=_loss)


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


# ------------------------------------------------------------------ tensors shared across samples
class Mix(nn.Module):
    """No grad sampler; ``pos`` is the same for every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x + pos) @ self.w)


class Broadcast(nn.Module):
    def __init__(self, copies: bool) -> None:
        super().__init__()
        self.register_buffer("pe", torch.randn(D))
        self.mix = Mix()
        self.head = nn.Linear(D, 3)
        self.copies = copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # XLNet's relative positions: a batch-free tensor broadcast to the batch's rows (a view),
        # or materialised row by row (a copy, which the fallback cannot tell from a table).
        pos = self.pe.repeat(x.shape[0], 1) if self.copies else self.pe.expand(x.shape[0], -1)
        return self.head(self.mix(x, pos))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_batch_free_tensor_broadcast_to_the_batch_is_each_sample_s_copy(mode: str, K: int) -> None:
    """Whole, it was broadcast against one sample's rows inside the layer: gradients N times too large."""
    torch.manual_seed(0)
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    _check(Broadcast(copies=False), x, y, K, mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_batch_free_tensor_tiled_once_per_row_is_each_sample_s_copy(mode: str, K: int) -> None:
    """Materialised row by row (``pe.repeat(B, 1)``): once passed whole to each sample's run, whose
    output then outgrew the sample's rows (refused); now split like the broadcast view, one tile
    per row, as the sample's own forward builds it."""
    torch.manual_seed(0)
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    _check(Broadcast(copies=True), x, y, K, mode)


class Rows(nn.Module):
    """No grad sampler: adds a table of N*K rows (by coincidence) to its input's rows; one sample's
    run, which gets the whole table, returns more rows than the sample has."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) + table  # (rows, D) + (N*K, D)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_layer_whose_output_outgrows_one_sample_s_rows_is_refused(mode: str) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = Rows()
            self.register_buffer("table", torch.randn(N, D))
            self.head = nn.Linear(D, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rows(x, self.table))

    x, y = torch.randn(N, D), torch.randint(0, 3, (N,))
    with pytest.raises(UnsupportedModuleError, match="returns shape .* per sample"):
        dp_gradient(Net(), x, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


class TiedBiasHead(nn.Module):
    """Hugging Face's MLM head: it owns ``bias`` and its decoder Linear holds the same Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.transform = nn.Linear(D, D)
        self.decoder = nn.Linear(D, 3, bias=False)
        self.bias = nn.Parameter(torch.randn(3) * 0.1)
        self.decoder.bias = self.bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.transform(h)))


class TiedBiasNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, D)
        self.head = TiedBiasHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_head_bias_tied_to_its_decoder_is_counted_once(mode: str, K: int) -> None:
    """The head (no grad sampler) ran under torch.func with its tied decoder bias swapped too, and
    the decoder's Linear sampler added the same gradient again: 2x."""
    torch.manual_seed(0)
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    _check(TiedBiasNet(), x, y, K, mode)


class Counted(nn.Module):
    """No grad sampler: reads its input's values with ``.tolist()`` (JetMoE's router takes its
    experts' token counts so), which vmap cannot run on a batched tensor: here which features are
    finite in every row (all are), as a guard."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(x).all(0).tolist()
        return (x @ self.weight) * torch.tensor(finite, dtype=x.dtype)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_layer_that_reads_its_rows_values_runs_one_sample_at_a_time(mode: str, K: int) -> None:
    """vmap raises 'Cannot access data pointer' at the ``.tolist()``: the fallback (and the functorch
    backend) run each sample alone instead of refusing the layer."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(D, D), Counted(), nn.Linear(D, 3))
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    _check(model, x, y, K, mode)


class PositionBias(nn.Module):
    """No grad sampler: CPM-Ant's position embedding in small. It takes positions tiled once per
    batch row from the batch's size (``arange(T).repeat(B, 1)``) beside per-row segments, and views
    both with the batch size it reads from the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * 3 + 4, 2) * 0.5)

    def forward(self, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        batch, length = positions.shape
        relative = (positions.view(batch, length, 1) - positions.view(batch, 1, length)).clamp(-2, 1) + 2
        bucket = torch.where(segments.view(batch, length, 1) == segments.view(batch, 1, length), relative,
                             4 + segments.view(batch, length, 1) * 3 + segments.view(batch, 1, length))
        return F.embedding(bucket, self.table)  # (B, T, T, 2)


class Positioned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.bias = PositionBias()
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        batch, length = x.shape[0], x.shape[1]
        positions = torch.arange(length).repeat(batch, 1)  # a constant, one tile per batch row
        segments = (x[..., 0] > 0).long()  # per row
        h = torch.tanh(self.inp(x))
        scores = self.bias(positions, segments).sum(-1)  # (B, T, T)
        return self.head(torch.softmax(scores, -1) @ h).mean(1)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_constant_tiled_once_per_batch_row_is_split_per_sample(mode: str, K: int) -> None:
    """The positions were passed whole to each sample's run, whose view with their batch size then
    failed (refused); one tile per row of the sample's own is what its forward alone builds."""
    torch.manual_seed(7)
    x, y = torch.randn(N * K, 3, D), torch.randint(0, 3, (N * K,))
    _check(Positioned(), x, y, K, mode)


class TopK(nn.Module):
    """No grad sampler: a router returning ``(indices, weights)``, the integer indices first, both
    ``(rows, 2)`` (Inkling's router returns its top-k indices between its weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, D) * 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = torch.softmax(x @ self.weight.t(), -1).topk(2, dim=-1)
        return indices, weights


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.router = TopK()
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        indices, weights = self.router(torch.tanh(self.inp(x)))
        return self.head(weights * (1 + indices.to(weights.dtype)))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_an_output_without_gradient_before_the_hooked_one_is_skipped(mode: str, K: int) -> None:
    """The per-sample run paired the outputs with their gradients by position among its tensors:
    the weights' gradient went to the indices, of the same shape, and the router's per-sample
    gradients came out zero, silently. It now takes the outputs the backend hooked."""
    torch.manual_seed(8)
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    _check(Routed(), x, y, K, mode)
