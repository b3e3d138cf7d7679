from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import psg_core
from psg_core.errors import ConfigError, UnsupportedModuleError
from psg_core.layers import DPMultiheadAttention, SequenceBias
from tests.oracle import check_against_oracle

REDUCTIONS = ["mean", "sum"]
KS = [1, 3]
EMBED, HEADS, TGT, SRC = 6, 2, 3, 4
MASKS = ["none", "padding_bool", "padding_float", "attn2d_bool", "attn2d_float", "attn3d_bool",
         "attn3d_float", "both_bool", "both_float"]


def make_pair(**kwargs: Any) -> tuple[nn.MultiheadAttention, DPMultiheadAttention]:
    """torch's attention and the DP rewrite with the same weights, both in eval mode."""
    reference = nn.MultiheadAttention(EMBED, HEADS, **kwargs).eval()
    rewrite = DPMultiheadAttention(EMBED, HEADS, **kwargs).eval()
    rewrite.load_state_dict(reference.state_dict())
    return reference, rewrite


def sequence(batch: int, steps: int, features: int, batch_first: bool) -> torch.Tensor:
    return torch.randn((batch, steps, features) if batch_first else (steps, batch, features))


def make_masks(kind: str, batch: int, tgt: int, src: int) -> tuple[torch.Tensor | None,
                                                                   torch.Tensor | None]:
    """(key_padding_mask, attn_mask); every query keeps at least one key, so no row is all -inf."""
    padding = torch.zeros(batch, src, dtype=torch.bool)
    padding[0, -1] = True  # sample 0 has one padded key
    causal = torch.ones(tgt, src, dtype=torch.bool).triu(1)  # (L, S), key 0 always visible
    per_head = causal.expand(batch * HEADS, tgt, src).clone()  # (B*H, L, S)
    per_head[-1, -1, 0] = True  # make it differ between rows
    as_float = kind.endswith("float")
    def float_of(m: torch.Tensor) -> torch.Tensor:
        if not as_float:
            return m
        return torch.zeros(m.shape).masked_fill(m, float("-inf")) + 0.1 * torch.randn(m.shape)

    key_padding = float_of(padding) if kind.startswith(("padding", "both")) else None
    attn: torch.Tensor | None = None
    if kind.startswith(("attn2d", "both")):
        attn = float_of(causal)
    elif kind.startswith("attn3d"):
        attn = float_of(per_head)
    return key_padding, attn


# ------------------------------------------------------------------------ equality with torch
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("average_attn_weights", [True, False])
def test_matches_torch_masks(batch_first: bool, mask: str, need_weights: bool,
                             average_attn_weights: bool) -> None:
    torch.manual_seed(0)
    reference, rewrite = make_pair(batch_first=batch_first)
    q = sequence(2, TGT, EMBED, batch_first)
    kv = sequence(2, SRC, EMBED, batch_first)
    key_padding_mask, attn_mask = make_masks(mask, 2, TGT, SRC)
    kwargs = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=need_weights,
                  average_attn_weights=average_attn_weights)
    expected, expected_weights = reference(q, kv, kv, **kwargs)
    actual, actual_weights = rewrite(q, kv, kv, **kwargs)
    torch.testing.assert_close(actual, expected)
    if need_weights:
        torch.testing.assert_close(actual_weights, expected_weights)
    else:
        assert actual_weights is None and expected_weights is None


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("add_bias_kv", [True, False])
@pytest.mark.parametrize("add_zero_attn", [True, False])
@pytest.mark.parametrize("kvdim", [None, 5])
def test_matches_torch_options(batch_first: bool, bias: bool, add_bias_kv: bool,
                               add_zero_attn: bool, kvdim: int | None) -> None:
    torch.manual_seed(1)
    reference, rewrite = make_pair(batch_first=batch_first, bias=bias, add_bias_kv=add_bias_kv,
                                   add_zero_attn=add_zero_attn, kdim=kvdim, vdim=kvdim)
    q = sequence(2, TGT, EMBED, batch_first)
    k = sequence(2, SRC, kvdim or EMBED, batch_first)
    v = sequence(2, SRC, kvdim or EMBED, batch_first)
    key_padding_mask, attn_mask = make_masks("both_bool", 2, TGT, SRC)
    for kwargs in ({}, {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask,
                        "average_attn_weights": False}):
        expected = reference(q, k, v, **kwargs)
        actual = rewrite(q, k, v, **kwargs)
        torch.testing.assert_close(actual[0], expected[0])
        torch.testing.assert_close(actual[1], expected[1])


@pytest.mark.parametrize("need_weights", [True, False])
def test_self_attention_matches_torch_fast_path(need_weights: bool) -> None:
    # query is key is value, eval, batch_first: torch takes its fused inference kernel.
    torch.manual_seed(2)
    reference, rewrite = make_pair(batch_first=True)
    x = torch.randn(2, SRC, EMBED)
    key_padding_mask, _ = make_masks("padding_bool", 2, SRC, SRC)
    with torch.no_grad():
        for mask in (None, key_padding_mask):
            expected = reference(x, x, x, key_padding_mask=mask, need_weights=need_weights)
            actual = rewrite(x, x, x, key_padding_mask=mask, need_weights=need_weights)
            torch.testing.assert_close(actual[0], expected[0])
            if need_weights:
                torch.testing.assert_close(actual[1], expected[1])


def test_unbatched_and_causal_match_torch() -> None:
    torch.manual_seed(3)
    reference, rewrite = make_pair(add_bias_kv=True)
    q, kv = torch.randn(TGT, EMBED), torch.randn(SRC, EMBED)
    padding = torch.tensor([False, False, False, True])
    torch.testing.assert_close(rewrite(q, kv, kv, key_padding_mask=padding),
                               reference(q, kv, kv, key_padding_mask=padding))
    x = torch.randn(SRC, 2, EMBED)
    causal = nn.Transformer.generate_square_subsequent_mask(SRC)
    # With add_bias_kv, torch applies attn_mask only when it returns weights (without them it
    # switches to a causal kernel over the extended keys); the rewrite always applies attn_mask.
    expected = reference(x, x, x, attn_mask=causal, is_causal=True)
    torch.testing.assert_close(rewrite(x, x, x, attn_mask=causal, is_causal=True), expected)
    reference, rewrite = make_pair()
    for need_weights in (True, False):
        expected = reference(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
        actual = rewrite(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(actual[0], expected[0])


def test_dropout_matches_torch_in_training() -> None:
    torch.manual_seed(4)
    reference = nn.MultiheadAttention(EMBED, HEADS, dropout=0.5, batch_first=True)
    rewrite = DPMultiheadAttention(EMBED, HEADS, dropout=0.5, batch_first=True)
    rewrite.load_state_dict(reference.state_dict())
    q, kv = torch.randn(2, TGT, EMBED), torch.randn(2, SRC, EMBED)
    # Same draws in the same order: one dropout over the (B*H, L, S) weights.
    torch.manual_seed(5)
    expected = reference(q, kv, kv)
    torch.manual_seed(5)
    actual = rewrite(q, kv, kv)
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1])
    assert not torch.equal(rewrite(q, kv, kv)[0], rewrite(q, kv, kv)[0])
    rewrite.eval()
    assert torch.equal(rewrite(q, kv, kv)[0], rewrite(q, kv, kv)[0])


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), head_dim=st.integers(1, 3),
       tgt=st.integers(1, 4), src=st.integers(1, 4), batch_first=st.booleans(),
       add_bias_kv=st.booleans(), add_zero_attn=st.booleans(), bias=st.booleans())
def test_shapes_match_torch(batch: int, heads: int, head_dim: int, tgt: int, src: int,
                            batch_first: bool, add_bias_kv: bool, add_zero_attn: bool,
                            bias: bool) -> None:
    torch.manual_seed(batch * 100 + tgt * 10 + src)
    embed = heads * head_dim
    kwargs = dict(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                  batch_first=batch_first)
    reference = nn.MultiheadAttention(embed, heads, **kwargs).eval()
    rewrite = DPMultiheadAttention(embed, heads, **kwargs).eval()
    rewrite.load_state_dict(reference.state_dict())
    q, kv = sequence(batch, tgt, embed, batch_first), sequence(batch, src, embed, batch_first)
    expected = reference(q, kv, kv, average_attn_weights=False)
    actual = rewrite(q, kv, kv, average_attn_weights=False)
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1])


# --------------------------------------------------------------------------- state dicts
def test_state_dict_conversion_and_layout() -> None:
    torch.manual_seed(6)
    fused, rewrite = make_pair(add_bias_kv=True)
    e = EMBED
    torch.testing.assert_close(rewrite.k_proj.weight, fused.in_proj_weight[e:2 * e])
    torch.testing.assert_close(rewrite.v_proj.bias, fused.in_proj_bias[2 * e:])
    assert rewrite.seq_bias_k is not None
    torch.testing.assert_close(rewrite.seq_bias_k.bias, fused.bias_k.reshape(-1))
    separate, rewrite2 = make_pair(kdim=5, vdim=3)
    torch.testing.assert_close(rewrite2.v_proj.weight, separate.v_proj_weight)
    torch.testing.assert_close(rewrite2.q_proj.bias, separate.in_proj_bias[:e])
    # The rewrite's own state dict round-trips, and every parameter lives in a sampled sublayer.
    copy = DPMultiheadAttention(EMBED, HEADS, add_bias_kv=True)
    copy.load_state_dict(rewrite.state_dict())
    assert not list(rewrite.parameters(recurse=False))
    assert {type(m) for m in rewrite.modules() if list(m.parameters(recurse=False))} == {nn.Linear,
                                                                                       SequenceBias}
    assert rewrite.in_proj_weight is None and rewrite.in_proj_bias is None


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="num_heads"):
        DPMultiheadAttention(5, 2)
    mha = DPMultiheadAttention(EMBED, HEADS)
    x = torch.randn(SRC, 2, EMBED)
    with pytest.raises(ConfigError, match="is_causal"):
        mha(x, x, x, is_causal=True)
    with pytest.raises(ConfigError, match="attn_mask must have shape"):
        mha(x, x, x, attn_mask=torch.zeros(SRC, SRC + 1, dtype=torch.bool))
    with pytest.raises(ConfigError, match="key_padding_mask must have shape"):
        mha(x, x, x, key_padding_mask=torch.zeros(SRC, 2, dtype=torch.bool))
    with pytest.raises(ConfigError, match="must have 6 features"):
        mha(x[..., :4], x, x)
    with pytest.raises(ConfigError, match="bool or floating"):
        mha(x, x, x, attn_mask=torch.zeros(SRC, SRC, dtype=torch.long))
    rewrite = DPMultiheadAttention(EMBED, HEADS, add_bias_kv=True)
    assert not psg_core.GradSampleModule.validate(rewrite, strict=True)
    with pytest.raises(UnsupportedModuleError, match="fix_model"):
        psg_core.GradSampleModule.validate(nn.MultiheadAttention(EMBED, HEADS), strict=True)


# --------------------------------------------------------------------- per-sample gradients
class AttentionOutput(nn.Module):
    """Attention output only (the weights are not part of the loss)."""

    def __init__(self, attention: DPMultiheadAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attention(query, key, value, key_padding_mask=key_padding_mask,
                              attn_mask=attn_mask, need_weights=False)[0]


def attention_samples(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                      targets: torch.Tensor, K: int, batch_first: bool
                      ) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """Oracle microbatches: sample n's K rows of q/k/v/targets, padding mask and per-row mask."""
    batch_dim = 0 if batch_first else 1
    samples = []
    for n in range(q.shape[batch_dim] // K):
        def rows(t: torch.Tensor, dim: int = batch_dim, per_row: int = 1) -> torch.Tensor:
            return t.narrow(dim, n * K * per_row, K * per_row)
        padding = rows(key_padding_mask, 0) if key_padding_mask is not None else None
        mask = attn_mask
        if attn_mask is not None and attn_mask.dim() == 3:
            mask = rows(attn_mask, 0, HEADS)  # rows n*K*H .. (n+1)*K*H - 1
        samples.append(((rows(q), rows(k), rows(v), padding, mask), rows(targets)))
    return samples


def run_attention_check(rewrite: DPMultiheadAttention, *, K: int, loss_reduction: str,
                        batch_first: bool, device: torch.device, mask: str = "none",
                        self_attention: bool = False) -> None:
    if rewrite.k_proj.bias is not None and rewrite.seq_bias_k is None and not rewrite.add_zero_attn:
        # Softmax ignores a shift shared by all keys, so the key bias's true gradient is zero and
        # a relative comparison would only compare rounding noise.
        rewrite.k_proj.bias.requires_grad_(False)
    rows = 2 * K
    q = sequence(rows, TGT if not self_attention else SRC, EMBED, batch_first)
    k = sequence(rows, SRC, rewrite.kdim, batch_first) if not self_attention else q
    v = sequence(rows, SRC, rewrite.vdim, batch_first) if not self_attention else q
    key_padding_mask, attn_mask = make_masks(mask, rows, q.shape[1 if batch_first else 0], SRC)
    targets = torch.randn(q.shape)
    samples = attention_samples(q, k, v, key_padding_mask, attn_mask, targets, K, batch_first)
    check_against_oracle(AttentionOutput(rewrite), (q, k, v, key_padding_mask, attn_mask), targets,
                         K=K, loss_reduction=loss_reduction, batch_first=batch_first,
                         samples=samples, device=device)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_grad_samples(loss_reduction: str, K: int, batch_first: bool, device: torch.device) -> None:
    torch.manual_seed(20)
    rewrite = DPMultiheadAttention(EMBED, HEADS, batch_first=batch_first)
    run_attention_check(rewrite, K=K, loss_reduction=loss_reduction, batch_first=batch_first, device=device,
                        self_attention=True)


@pytest.mark.parametrize("mask", ["padding_bool", "attn3d_float", "both_bool"])
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_grad_samples_masks(mask: str, K: int, batch_first: bool, device: torch.device) -> None:
    torch.manual_seed(21)
    rewrite = DPMultiheadAttention(EMBED, HEADS, batch_first=batch_first)
    run_attention_check(rewrite, K=K, loss_reduction="mean", batch_first=batch_first, device=device, mask=mask)


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_grad_samples_bias_kv_and_kvdim(loss_reduction: str, K: int, batch_first: bool,
                                        device: torch.device) -> None:
    torch.manual_seed(22)
    rewrite = DPMultiheadAttention(EMBED, HEADS, add_bias_kv=True, add_zero_attn=True, kdim=5,
                                   vdim=3, batch_first=batch_first)
    run_attention_check(rewrite, K=K, loss_reduction=loss_reduction, batch_first=batch_first, device=device,
                        mask="both_float")


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_sequence_bias_grad_samples(K: int, batch_first: bool, device: torch.device) -> None:
    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(EMBED, EMBED), SequenceBias(EMBED, batch_first=batch_first),
                          nn.Tanh())
    x = sequence(2 * K, TGT, EMBED, batch_first)
    y = sequence(2 * K, TGT + 1, EMBED, batch_first)
    for loss_reduction in REDUCTIONS:
        check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction,
                             batch_first=batch_first, device=device)
