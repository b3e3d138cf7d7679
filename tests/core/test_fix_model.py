from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import psg_core
from psg_core.errors import UnsupportedModuleError
from psg_core.fix_model import fix_model
from psg_core.layers import (DPGRU, DPLSTM, DPRNN, DPGRUCell, DPLSTMCell, DPMultiheadAttention,
                             DPRNNCell)
from tests.oracle import check_against_oracle


class SequenceModel(nn.Module):
    """Embeds with Linear, runs an LSTM and a GRU, attends, and reads out; fused layers nested."""

    def __init__(self, *, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.encoder = nn.Sequential(nn.Linear(3, 6), nn.Tanh())
        self.recurrent = nn.ModuleDict({
            "lstm": nn.LSTM(6, 6, num_layers=2, bidirectional=True, batch_first=batch_first),
            "gru": nn.GRU(12, 6, batch_first=batch_first),
        })
        self.attention = nn.MultiheadAttention(6, 2, add_bias_kv=True, batch_first=batch_first)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        h, _ = self.recurrent["lstm"](h)
        h, _ = self.recurrent["gru"](h)
        h, _ = self.attention(h, h, h, need_weights=False)
        return self.head(h)


def test_recurrent_and_attention_outputs_unchanged() -> None:
    torch.manual_seed(0)
    for batch_first in (True, False):
        model = SequenceModel(batch_first=batch_first)
        fixed = fix_model(model)
        assert isinstance(fixed.recurrent["lstm"], DPLSTM)
        assert isinstance(fixed.recurrent["gru"], DPGRU)
        assert isinstance(fixed.attention, DPMultiheadAttention)
        x = torch.randn((2, 4, 3) if batch_first else (4, 2, 3))
        torch.testing.assert_close(fixed(x), model(x))
        model.eval(), fixed.eval()
        torch.testing.assert_close(fixed(x), model(x))


def test_argument_is_not_modified() -> None:
    model = SequenceModel(batch_first=True)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    fixed = fix_model(model)
    assert fixed is not model
    assert isinstance(model.recurrent["lstm"], nn.LSTM)
    assert isinstance(model.attention, nn.MultiheadAttention)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    # Nothing is shared between the two.
    fixed_params = {id(p) for p in fixed.parameters()}
    assert not fixed_params & {id(p) for p in model.parameters()}


@pytest.mark.parametrize("torch_type,dp_type,kwargs", [
    (nn.RNN, DPRNN, {"nonlinearity": "tanh"}), (nn.RNN, DPRNN, {"nonlinearity": "relu"}),
    (nn.GRU, DPGRU, {}), (nn.LSTM, DPLSTM, {})])
def test_each_recurrent_type(torch_type: type[nn.Module], dp_type: type[nn.Module],
                             kwargs: dict[str, str]) -> None:
    torch.manual_seed(1)
    rnn = torch_type(3, 4, num_layers=2, bias=False, dropout=0.0, bidirectional=True, **kwargs)
    fixed = fix_model(rnn)  # the root itself is replaced
    assert type(fixed) is dp_type
    assert fixed.bias is False and fixed.num_layers == 2 and fixed.bidirectional
    x = torch.randn(5, 2, 3)
    out, state = fixed(x)
    expected_out, expected_state = rnn(x)
    torch.testing.assert_close(out, expected_out)
    for got, want in zip(state if isinstance(state, tuple) else (state,),
                         expected_state if isinstance(expected_state, tuple) else (expected_state,)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("torch_type,dp_type", [(nn.RNNCell, DPRNNCell), (nn.GRUCell, DPGRUCell),
                                                (nn.LSTMCell, DPLSTMCell)])
def test_cells(torch_type: type[nn.Module], dp_type: type[nn.Module]) -> None:
    torch.manual_seed(2)
    cell = torch_type(3, 4)
    fixed = fix_model(nn.Sequential(cell))[0]
    assert type(fixed) is dp_type
    x = torch.randn(2, 3)
    got, want = fixed(x), cell(x)
    torch.testing.assert_close(got, want)  # a tensor, or (h, c) for the LSTM cell


def test_attention_with_separate_projections_and_frozen_weights() -> None:
    torch.manual_seed(3)
    attention = nn.MultiheadAttention(6, 3, kdim=4, vdim=5, add_zero_attn=True)
    attention.k_proj_weight.requires_grad_(False)
    attention.in_proj_bias.requires_grad_(False)
    fixed = fix_model(attention)
    assert isinstance(fixed, DPMultiheadAttention)
    assert not fixed.k_proj.weight.requires_grad and fixed.q_proj.weight.requires_grad
    assert not any(p.requires_grad for p in (fixed.q_proj.bias, fixed.k_proj.bias, fixed.v_proj.bias))
    q, k, v = torch.randn(2, 2, 6), torch.randn(3, 2, 4), torch.randn(3, 2, 5)
    torch.testing.assert_close(fixed(q, k, v), attention(q, k, v))


def test_batch_norm_becomes_group_norm() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(3, 48, 1), nn.BatchNorm2d(48, eps=1e-3),
        nn.Sequential(nn.Flatten(2), nn.BatchNorm1d(48, affine=False)),
        nn.Unflatten(2, (2, 2)), nn.Unflatten(3, (1, 2)), nn.BatchNorm3d(48),
    )
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
    model[1].bias.requires_grad_(False)
    model.eval()
    fixed = fix_model(model)
    first, second, third = fixed[1], fixed[2][1], fixed[5]
    assert all(isinstance(m, nn.GroupNorm) for m in (first, second, third))
    assert first.num_groups == 16 and first.num_channels == 48 and first.eps == 1e-3
    torch.testing.assert_close(first.weight, model[1].weight)
    torch.testing.assert_close(first.bias, model[1].bias)
    assert first.weight.requires_grad and not first.bias.requires_grad
    assert not second.affine
    assert not fixed.training and not first.training
    assert fixed(torch.randn(2, 3, 2, 2)).shape == (2, 48, 2, 1, 2)
    # GroupNorm with gcd(32, C) groups: 1 group for an odd channel count.
    assert fix_model(nn.BatchNorm1d(7)).num_groups == 1
    assert fix_model(nn.BatchNorm1d(64)).num_groups == 32
    # Each sample is now normalised on its own: hooks no longer report a sample-mixing layer.
    with pytest.raises(UnsupportedModuleError, match="mixes samples"):
        psg_core.GradSampleModule.validate(model.train(), strict=False)
    errors = psg_core.GradSampleModule.validate(fixed, strict=False)
    assert not [e for e in errors if "mixes samples" in str(e)]


def test_lazy_batch_norm_and_projected_lstm_raise() -> None:
    lazy = nn.LazyBatchNorm1d()
    with pytest.raises(UnsupportedModuleError, match="has not seen data"):
        fix_model(nn.Sequential(lazy))
    with pytest.raises(UnsupportedModuleError, match="proj_size=2"):
        fix_model(nn.Sequential(nn.LSTM(3, 4, proj_size=2)))


def test_shared_module_gets_one_replacement_and_dtype_kept() -> None:
    lstm = nn.LSTM(3, 4).double()
    model = nn.ModuleList([lstm, nn.Sequential(lstm)])
    fixed = fix_model(model)
    assert fixed[0] is fixed[1][0]
    assert all(p.dtype == torch.float64 for p in fixed.parameters())


def test_transformer_layers_keep_outputs() -> None:
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
    model = nn.ModuleDict({"layer": layer, "encoder": encoder}).eval()
    fixed = fix_model(model)
    assert isinstance(fixed["layer"].self_attn, DPMultiheadAttention)
    x = torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():  # torch takes its fused inference paths; the rewrite its regular one
        torch.testing.assert_close(fixed["layer"](x), model["layer"](x))
        got = fixed["encoder"](x, src_key_padding_mask=padding)
        with warnings.catch_warnings():
            # torch's own nested-tensor inference path announces its prototype status (once).
            warnings.filterwarnings("ignore", message=".*nested tensors is in prototype",
                                    category=UserWarning)
            want = model["encoder"](x, src_key_padding_mask=padding)
    # torch's nested-tensor path zeroes padded positions; compare the real ones.
    torch.testing.assert_close(got[~padding], want[~padding])


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("batch_first", [True, False])
def test_fixed_model_grad_samples(loss_reduction: str, K: int, batch_first: bool) -> None:
    torch.manual_seed(6)
    model = fix_model(SequenceModel(batch_first=batch_first))
    x = torch.randn((2 * K, 3, 3) if batch_first else (3, 2 * K, 3))
    y = torch.randn((2 * K, 3, 2) if batch_first else (3, 2 * K, 2))
    check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction, batch_first=batch_first)


@pytest.mark.parametrize("K", [1, 3])
def test_fixed_conv_batch_norm_grad_samples(K: int) -> None:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                          nn.Linear(6 * 2 * 2, 3))
    with pytest.raises(UnsupportedModuleError, match="mixes samples"):
        psg_core.GradSampleModule.validate(model, strict=True)
    fixed = fix_model(model)
    assert not psg_core.GradSampleModule.validate(fixed, strict=True)
    x, y = torch.randn(2 * K, 2, 4, 4), torch.randn(2 * K, 3)
    for loss_reduction in ("mean", "sum"):
        check_against_oracle(fixed, x, y, K=K, loss_reduction=loss_reduction)


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("batch_first", [True, False])
def test_fixed_transformer_layer_grad_samples(K: int, batch_first: bool) -> None:
    torch.manual_seed(8)
    layer = nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.0,
                                       batch_first=batch_first)
    fixed = fix_model(layer)
    assert not psg_core.GradSampleModule.validate(fixed, strict=True)
    # Softmax ignores a shift shared by all keys: the key bias's true gradient is zero.
    fixed.self_attn.k_proj.bias.requires_grad_(False)
    shape = (2 * K, 3, 6) if batch_first else (3, 2 * K, 6)
    x, y = torch.randn(shape), torch.randn(shape)
    check_against_oracle(fixed, x, y, K=K, loss_reduction="mean", batch_first=batch_first)
