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


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_layer_whose_output_outgrows_one_sample_s_rows_is_refused(mode: str) -> None:
    x, y = torch.randn(N, D), torch.randint(0, 3, (N,))
    with pytest.raises(UnsupportedModuleError, match="per sample"):
        dp_gradient(Broadcast(copies=True), x, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


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
