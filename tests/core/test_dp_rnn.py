"""The DP recurrent layers against torch's and against the oracle, under each of psg's
matrix-product kernels (:mod:`psg_core.gemm`: torch's and oneDNN's, which the time loops, the
projections and their backward take), with and without psg's native pointwise step kernels
(:mod:`psg_core.native`)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import psg_core
from psg_core import gemm, native
from psg_core.backends.hooks import ALWAYS_BATCH_FIRST
from psg_core.errors import ConfigError, UnsupportedModuleError
from psg_core.layers import DPGRU, DPLSTM, DPRNN, DPGRUCell, DPLSTMCell, DPRNNCell, RNNLinear
from tests.oracle import check_against_oracle

@pytest.fixture(autouse=True, params=[("aten", "auto"), ("onednn", "auto"), ("aten", "off")],
                ids=["aten", "onednn", "aten-torch-ops"])
def gemm_kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test of this file runs under each matrix-product kernel (oneDNN where torch has it),
    with psg's native pointwise kernels (:mod:`psg_core.native`, where they build) and without
    (the torch ops they replace)."""
    kernel, pointwise = request.param
    if kernel == "onednn" and not gemm.onednn_available():
        pytest.skip("torch has no oneDNN linear kernel here")
    with gemm.gemm_kernel(kernel), native.native_kernels(pointwise):
        yield kernel


REDUCTIONS = ["mean", "sum"]
KS = [1, 3]
KINDS = ["tanh", "relu", "gru", "lstm"]
INPUT, HIDDEN, STEPS = 3, 4, 4


def make_pair(kind: str, *args: Any, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """A torch recurrent layer and its DP rewrite holding the same weights."""
    if kind in ("tanh", "relu"):
        reference: nn.Module = nn.RNN(*args, nonlinearity=kind, **kwargs)
        rewrite: nn.Module = DPRNN(*args, nonlinearity=kind, **kwargs)
    elif kind == "gru":
        reference, rewrite = nn.GRU(*args, **kwargs), DPGRU(*args, **kwargs)
    else:
        reference, rewrite = nn.LSTM(*args, **kwargs), DPLSTM(*args, **kwargs)
    rewrite.load_state_dict(reference.state_dict())
    return reference, rewrite


def make_dp(kind: str, *args: Any, **kwargs: Any) -> nn.Module:
    return make_pair(kind, *args, **kwargs)[1]


def random_state(kind: str, layers: int, batch: int) -> Any:
    h = torch.randn(layers, batch, HIDDEN)
    return (h, torch.randn(layers, batch, HIDDEN)) if kind == "lstm" else h


def assert_same_state(actual: Any, expected: Any) -> None:
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e)
    else:
        torch.testing.assert_close(actual, expected)


# ------------------------------------------------------------------------ equality with torch
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("inputs", ["padded", "packed_sorted", "packed_unsorted"])
@pytest.mark.parametrize("with_hx", [False, True])
def test_matches_torch(kind: str, batch_first: bool, bidirectional: bool, num_layers: int,
                       inputs: str, with_hx: bool) -> None:
    torch.manual_seed(0)
    reference, rewrite = make_pair(kind, INPUT, HIDDEN, num_layers, batch_first=batch_first,
                                   bidirectional=bidirectional)
    batch = 3
    x: Any = torch.randn((batch, 5, INPUT) if batch_first else (5, batch, INPUT))
    if inputs == "packed_sorted":
        x = pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=batch_first)
    elif inputs == "packed_unsorted":
        x = pack_padded_sequence(x, torch.tensor([2, 5, 3]), batch_first=batch_first,
                                 enforce_sorted=False)
    directions = 2 if bidirectional else 1
    hx = random_state(kind, num_layers * directions, batch) if with_hx else None
    expected_out, expected_state = reference(x, hx)
    actual_out, actual_state = rewrite(x, hx)
    if isinstance(expected_out, PackedSequence):
        assert isinstance(actual_out, PackedSequence)
        torch.testing.assert_close(actual_out.data, expected_out.data)
        assert torch.equal(actual_out.batch_sizes, expected_out.batch_sizes)
        for name in ("sorted_indices", "unsorted_indices"):
            want, got = getattr(expected_out, name), getattr(actual_out, name)
            assert (want is None and got is None) or torch.equal(want, got)
    else:
        torch.testing.assert_close(actual_out, expected_out)
    assert_same_state(actual_state, expected_state)


def _loss_of(out: Any, state: Any, weights: list[torch.Tensor]) -> torch.Tensor:
    """A loss reading every output and final state with fixed random weights (so that no
    gradient is trivially symmetric)."""
    data = out.data if isinstance(out, PackedSequence) else out
    parts = [data] + (list(state) if isinstance(state, tuple) else [state])
    return sum((p * w).sum() for p, w in zip(parts, weights))  # type: ignore[return-value]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("inputs", ["padded", "packed_unsorted"])
@pytest.mark.parametrize("with_hx", [False, True])
def test_gradients_match_torch(kind: str, bidirectional: bool, num_layers: int, inputs: str,
                               with_hx: bool) -> None:
    """The hand-written backward recurrence (psg_core.layers._recurrence) against autograd through
    torch's own layer: every parameter, the input and the initial state, in float64."""
    torch.manual_seed(3)
    batch_first = bidirectional
    reference, rewrite = make_pair(kind, INPUT, HIDDEN, num_layers, batch_first=batch_first,
                                   bidirectional=bidirectional)
    reference.double(), rewrite.double()
    batch, directions = 3, 2 if bidirectional else 1
    x = torch.randn((batch, 5, INPUT) if batch_first else (5, batch, INPUT), dtype=torch.float64)
    hx = random_state(kind, num_layers * directions, batch) if with_hx else None
    grads = []
    for module in (reference, rewrite):
        x_in = x.clone().requires_grad_()
        state_in = None
        if hx is not None:
            state_in = (tuple(h.double().requires_grad_() for h in hx) if isinstance(hx, tuple)
                        else hx.double().requires_grad_())
        arg: Any = x_in
        if inputs == "packed_unsorted":
            arg = pack_padded_sequence(x_in, torch.tensor([2, 5, 3]), batch_first=batch_first,
                                       enforce_sorted=False)
        out, state = module(arg, state_in)
        torch.manual_seed(4)
        data = out.data if isinstance(out, PackedSequence) else out
        weights = [torch.randn(t.shape, dtype=t.dtype) for t in [data] + (list(state) if isinstance(state, tuple) else [state])]
        leaves = [x_in] + ([] if state_in is None else list(state_in) if isinstance(state_in, tuple)
                           else [state_in])
        named = dict(module.named_parameters())
        keys = sorted(reference.state_dict()) if module is reference else None
        loss = _loss_of(out, state, weights)
        values = torch.autograd.grad(loss, leaves + list(named.values()))
        by_name = dict(zip(named, values[len(leaves):]))
        grads.append((values[:len(leaves)], by_name, keys))
    (ref_leaves, ref_params, keys), (dp_leaves, dp_params, _) = grads
    for want, got in zip(ref_leaves, dp_leaves):
        torch.testing.assert_close(got, want)
    renamed = {}
    for key in keys:  # torch's weight_ih_l0_reverse -> l0_reverse.ih.weight
        kind_, linear, cell = key.split("_", 2)[0], key.split("_")[1], key.split("_", 2)[2]
        renamed[key] = f"{cell}.{linear}.{kind_}"
    for key, name in renamed.items():
        torch.testing.assert_close(dp_params[name], ref_params[key], msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_second_derivatives_are_refused_not_wrong(kind: str) -> None:
    rnn = make_dp(kind, INPUT, HIDDEN, 1, batch_first=True)
    head = nn.Linear(HIDDEN, 1)
    loss = head(rnn(torch.randn(2, STEPS, INPUT))[0]).square().sum()
    params = list(rnn.parameters()) + list(head.parameters())
    with pytest.raises(UnsupportedModuleError, match="differentiable once"):
        torch.autograd.grad(loss, params, create_graph=True)
    # First derivatives, with or without a retained graph, are unaffected.
    assert all(g is not None for g in torch.autograd.grad(loss, params, retain_graph=True))


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_matches_torch(kind: str) -> None:
    torch.manual_seed(1)
    reference, rewrite = make_pair(kind, INPUT, HIDDEN, 2, bidirectional=True)
    x = torch.randn(STEPS, INPUT)
    h = torch.randn(4, HIDDEN)
    hx = (h, torch.randn(4, HIDDEN)) if kind == "lstm" else h
    expected_out, expected_state = reference(x, hx)
    actual_out, actual_state = rewrite(x, hx)
    torch.testing.assert_close(actual_out, expected_out)
    assert_same_state(actual_state, expected_state)


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_between_layers(kind: str) -> None:
    torch.manual_seed(2)
    # p=1 zeroes the second layer's input in both, deterministically: the same function.
    reference, rewrite = make_pair(kind, INPUT, HIDDEN, 2, dropout=1.0, bidirectional=True)
    x = torch.randn(STEPS, 2, INPUT)
    reference.train(), rewrite.train()
    torch.testing.assert_close(rewrite(x)[0], reference(x)[0])
    reference.eval(), rewrite.eval()
    torch.testing.assert_close(rewrite(x)[0], reference(x)[0])
    # Random dropout changes outputs in training, never in eval.
    noisy = make_dp(kind, INPUT, HIDDEN, 2, dropout=0.5)
    noisy.train()
    assert not torch.equal(noisy(x)[0], noisy(x)[0])
    noisy.eval()
    assert torch.equal(noisy(x)[0], noisy(x)[0])


@pytest.mark.parametrize("cell_type,torch_type", [(DPRNNCell, nn.RNNCell), (DPGRUCell, nn.GRUCell),
                                                  (DPLSTMCell, nn.LSTMCell)])
@pytest.mark.parametrize("batched", [True, False])
def test_cells_match_torch(cell_type: type[nn.Module], torch_type: type[nn.Module],
                           batched: bool) -> None:
    torch.manual_seed(3)
    reference = torch_type(INPUT, HIDDEN)
    cell = cell_type(INPUT, HIDDEN)
    cell.load_state_dict(reference.state_dict())
    x = torch.randn(2, INPUT) if batched else torch.randn(INPUT)
    h = torch.randn(2, HIDDEN) if batched else torch.randn(HIDDEN)
    hx: Any = (h, torch.randn_like(h)) if cell_type is DPLSTMCell else h
    assert_same_state(cell(x, hx), reference(x, hx))
    assert_same_state(cell(x), reference(x))


def test_state_dict_names_follow_torch() -> None:
    lstm = DPLSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True)
    names = set(lstm.state_dict())
    assert "l0.ih.weight" in names and "l1_reverse.hh.bias" in names
    assert len(names) == len(nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True).state_dict())
    # Its own state dict loads back strictly.
    DPLSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True).load_state_dict(lstm.state_dict())
    # Every parameter sits in a cell Linear, which the hooks backend treats as batch-first.
    assert not list(lstm.parameters(recurse=False))
    assert all(isinstance(m, RNNLinear) for m in lstm.modules() if list(m.parameters(recurse=False)))
    assert getattr(RNNLinear, ALWAYS_BATCH_FIRST) is True


def test_configuration_errors(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(UnsupportedModuleError, match="proj_size=2"):
        DPLSTM(INPUT, HIDDEN, proj_size=2)
    with pytest.raises(ConfigError, match="dropout"):
        DPGRU(INPUT, HIDDEN, dropout=1.5)
    with pytest.raises(ConfigError, match="nonlinearity"):
        DPRNN(INPUT, HIDDEN, nonlinearity="sigmoid")
    with pytest.raises(ConfigError, match="num_layers"):
        DPRNN(INPUT, HIDDEN, num_layers=0)
    lstm = DPLSTM(INPUT, HIDDEN)
    with pytest.raises(ConfigError, match="features"):
        lstm(torch.randn(STEPS, 2, INPUT + 1))
    with pytest.raises(ConfigError, match=r"\(1, 2, 4\)"):
        lstm(torch.randn(STEPS, 2, INPUT), (torch.zeros(1, 3, HIDDEN), torch.zeros(1, 3, HIDDEN)))
    with pytest.raises(ConfigError, match="pair"):
        lstm(torch.randn(STEPS, 2, INPUT), torch.zeros(1, 2, HIDDEN))
    with caplog.at_level(logging.WARNING, logger="psg_core.layers.recurrent"):
        DPGRU(INPUT, HIDDEN, dropout=0.3)
    assert "no effect" in caplog.text


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(KINDS), batch=st.integers(1, 3), steps=st.integers(1, 4),
       input_size=st.integers(1, 4), hidden=st.integers(1, 4), layers=st.integers(1, 2),
       bidirectional=st.booleans(), bias=st.booleans(), data=st.data())
def test_shapes_match_torch(kind: str, batch: int, steps: int, input_size: int, hidden: int,
                            layers: int, bidirectional: bool, bias: bool,
                            data: st.DataObject) -> None:
    torch.manual_seed(batch * 10 + steps)
    reference, rewrite = make_pair(kind, input_size, hidden, layers, bias=bias, batch_first=True,
                                   bidirectional=bidirectional)
    x: Any = torch.randn(batch, steps, input_size)
    if data.draw(st.booleans(), label="packed"):
        lengths = data.draw(st.lists(st.integers(1, steps), min_size=batch, max_size=batch),
                            label="lengths")
        x = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    expected_out, expected_state = reference(x)
    actual_out, actual_state = rewrite(x)
    if isinstance(expected_out, PackedSequence):
        torch.testing.assert_close(actual_out.data, expected_out.data)
    else:
        torch.testing.assert_close(actual_out, expected_out)
    assert_same_state(actual_state, expected_state)


# --------------------------------------------------------------------- per-sample gradients
class Classifier(nn.Module):
    """recurrent layer -> output at each sequence's last step -> Linear, in the model's layout."""

    def __init__(self, rnn: nn.Module, *, batch_first: bool, classes: int = 2) -> None:
        super().__init__()
        self.rnn = rnn
        self.batch_first = batch_first
        directions = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(rnn.hidden_size * directions, classes)

    def forward(self, x: torch.Tensor | PackedSequence, hx: Any = None) -> torch.Tensor:
        output, _ = self.rnn(x, hx)
        if isinstance(output, PackedSequence):
            padded, lengths = pad_packed_sequence(output, batch_first=True)  # (B, T, F); lengths on the CPU
            rows = torch.arange(padded.shape[0], device=padded.device)
            last = padded[rows, (lengths - 1).to(padded.device)]  # (B, F)
            last = last.unsqueeze(1 if self.batch_first else 0)
        else:
            last = output[:, -1:] if self.batch_first else output[-1:]  # (B, 1, F) / (1, B, F)
        return self.head(last).squeeze(1 if self.batch_first else 0)  # (B, classes)


def sequence_batch(rows: int, batch_first: bool) -> torch.Tensor:
    return torch.randn((rows, STEPS, INPUT) if batch_first else (STEPS, rows, INPUT))


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_lstm_grad_samples(loss_reduction: str, K: int, batch_first: bool, device: torch.device) -> None:
    torch.manual_seed(10)
    model = Classifier(DPLSTM(INPUT, HIDDEN, batch_first=batch_first), batch_first=batch_first)
    x = sequence_batch(2 * K, batch_first)
    y = torch.randn(2 * K, 2)
    check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction, batch_first=batch_first,
                         target_batch_dim=0, device=device)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", KS)
def test_bidirectional_two_layer_grad_samples(kind: str, K: int, device: torch.device) -> None:
    torch.manual_seed(11)
    batch_first = K == 1  # both layouts across the parametrisation
    rnn = make_dp(kind, INPUT, HIDDEN, 2, batch_first=batch_first, bidirectional=True)
    model = Classifier(rnn, batch_first=batch_first)
    x = sequence_batch(2 * K, batch_first)
    y = torch.randn(2 * K, 2)
    for loss_reduction in REDUCTIONS:
        check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction,
                             batch_first=batch_first, target_batch_dim=0, device=device)


def packed_samples(padded: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor, K: int,
                   hx: Any = None) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """Oracle microbatches: each sample's K rows packed on their own (batch-first padded input),
    in float64 like the oracle's model copy (it converts plain tensor arguments only)."""
    samples = []
    for n in range(padded.shape[0] // K):
        rows = slice(n * K, (n + 1) * K)
        packed = pack_padded_sequence(padded[rows].double(), lengths[rows], batch_first=True,
                                      enforce_sorted=False)
        args: tuple[Any, ...] = (packed,)
        if hx is not None:
            args += (tuple(h[:, rows].double() for h in hx) if isinstance(hx, tuple)
                     else hx[:, rows].double(),)
        samples.append((args, targets[rows]))
    return samples


@pytest.mark.parametrize("kind", ["gru", "lstm"])
@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_grad_samples(kind: str, loss_reduction: str, K: int, bidirectional: bool,
                             device: torch.device) -> None:
    torch.manual_seed(12)
    batch_first = bidirectional  # both layouts across the parametrisation
    rnn = make_dp(kind, INPUT, HIDDEN, 1 + int(bidirectional), batch_first=batch_first,
                  bidirectional=bidirectional)
    model = Classifier(rnn, batch_first=batch_first)
    rows = 2 * K
    padded = torch.randn(rows, STEPS, INPUT)  # (B, T, F)
    lengths = torch.tensor(list(itertools.islice(itertools.cycle([2, STEPS, 3, 1]), rows)))
    packed = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    y = torch.randn(rows, 2)
    # A PackedSequence is a tuple, so it goes in a 1-tuple of arguments.
    check_against_oracle(model, (packed,), y, K=K, loss_reduction=loss_reduction,
                         batch_first=batch_first, samples=packed_samples(padded, lengths, y, K), device=device)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", KS)
def test_given_state_grad_samples(kind: str, K: int, device: torch.device) -> None:
    torch.manual_seed(13)
    rnn = make_dp(kind, INPUT, HIDDEN, 1, batch_first=True, bidirectional=True)
    model = Classifier(rnn, batch_first=True)
    rows = 2 * K
    padded = torch.randn(rows, STEPS, INPUT)
    lengths = torch.tensor(list(itertools.islice(itertools.cycle([STEPS, 2]), rows)))
    packed = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    hx = random_state(kind, 2, rows)
    y = torch.randn(rows, 2)
    check_against_oracle(model, (packed, hx), y, K=K, loss_reduction="mean",
                         samples=packed_samples(padded, lengths, y, K, hx), device=device)


def test_hooks_accept_rewrites_and_reject_torch_layers() -> None:
    assert not psg_core.GradSampleModule.validate(DPLSTM(INPUT, HIDDEN, 2, bidirectional=True),
                                                  strict=True)
    with pytest.raises(UnsupportedModuleError, match="fix_model"):
        psg_core.GradSampleModule.validate(nn.LSTM(INPUT, HIDDEN), strict=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_an_empty_sequence_is_refused_clearly(kind: str, batch_first: bool) -> None:
    layer = make_dp(kind, INPUT, HIDDEN, batch_first=batch_first)
    with pytest.raises(ConfigError, match="sequence is empty"):
        layer(torch.randn((2, 0, INPUT) if batch_first else (0, 2, INPUT)))
