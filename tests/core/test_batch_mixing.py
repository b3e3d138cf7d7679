"""Ops that combine samples are refused, never answered silently; row-wise ops stay exact.

A per-sample gradient is the gradient of one sample's rows run alone (DESIGN.md, the oracle). An op
that reduces, reorders, selects or pairs the rows of the batch (``x - x.mean(0)``, ``cumsum(x, 0)``,
``x.flip(0)``, ``x[mask]``, ``h @ h.T``, batch-norm statistics, a loss divided by a batch-wide count)
makes each sample's result depend on the others: the hooks, ghost and ew backends then raise an
``UnsupportedModuleError`` that names the op and the module, since their row-by-row answer would
differ from the oracle (and the clipping bound would no longer bound what one sample contributes).
functorch runs each sample alone by construction, so it gives the oracle's answer.

The other half: ops that work along other axes, or that keep the rows aligned (a softmax over
features, a sort along the sequence, ``x[arange(B), lengths]``, a full-range slice, ``torch.max(a,
b)``, ``einsum`` over shared batch letters, a batch-wide ``mask.all()`` read as a Python bool), are
not refused and match the oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled, microbatch_oracle

Op = Callable[[torch.Tensor], torch.Tensor]
MIXING: dict[str, Op] = {
    "sub mean over batch": lambda h: h - h.mean(0, keepdim=True),
    "cumsum over batch": lambda h: torch.cumsum(h, 0),
    "flip batch": lambda h: h.flip(0),
    "fixed permutation": lambda h: h[torch.tensor([3, 1, 2, 0, 5, 4, 7, 6])[: h.shape[0]]],
    "add batch sum": lambda h: h + h.sum(0),
    "roll batch": lambda h: torch.roll(h, 1, 0),
    "roll flattened": lambda h: torch.roll(h, 3),
    "softmax over batch": lambda h: torch.softmax(h, 0),
    "log_softmax over batch (keyword)": lambda h: F.log_softmax(h, dim=0),
    "pairwise product": lambda h: (h @ h.t()) @ h,
    "sort over batch": lambda h: h.sort(0).values,
    "batch_norm statistics": lambda h: F.batch_norm(h, None, None, training=True),
    "every other row": lambda h: torch.cat([h[1::2], h[::2]]),
    "rows rotated by cat": lambda h: torch.cat([h[1:], h[:1]]),
    "one row broadcast": lambda h: h + h[0],
    "index_select over batch": lambda h: h.index_select(0, torch.arange(h.shape[0]).flip(0)),
    "einsum contracting the batch": lambda h: torch.einsum("bd,be->de", h, h).sum(0) + h,
    "outer pairs through broadcasting": lambda h: (h[:, None, :] * h[None, :, :]).sum(1),
    "repeat_interleave then slice": lambda h: h.repeat_interleave(2, dim=0)[: h.shape[0]],
    "repeat tiling the batch": lambda h: h.repeat(2, 1)[: h.shape[0]],
    "cdist between rows": lambda h: torch.cdist(h, h) @ h,
    "max over batch": lambda h: h + h.max(0).values,
    "std over batch": lambda h: h / h.std(0),
    "logsumexp over batch": lambda h: h - torch.logsumexp(h, 0),
    "in-place add of the batch mean": lambda h: h.clone().add_(h.mean(0)),
    "setitem from another row": lambda h: _assign_first_row(h),
    # numpy's axis= keyword, which torch takes for dim= (IBert, Funnel)
    "mean over batch (axis=)": lambda h: h - h.mean(axis=0, keepdim=True),
    "cat along the batch (axis=)": lambda h: torch.cat([h[1:], h[:1]], axis=0),
    "sum over every axis but kept (axis=)": lambda h: h + torch.sum(h, axis=(0, 1)),
    "stack then unbind the batch (axis=)": lambda h: torch.stack(torch.unbind(h, axis=0)[::-1], axis=0),
}


def _assign_first_row(h: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out[0] = h[1]
    return out


ROWWISE: dict[str, Op] = {
    "softmax over features": lambda h: torch.softmax(h, -1),
    "cumsum over features": lambda h: torch.cumsum(h, 1),
    "flip features": lambda h: h.flip(-1),
    "sort features": lambda h: h.sort(-1).values,
    "topk features": lambda h: torch.cat([h, h.topk(2, dim=1).values], 1)[:, : h.shape[1]],
    "feature index": lambda h: h[:, torch.tensor([2, 0, 1, 3, 4, 5, 6, 7])],
    "full-range slice": lambda h: h[0: h.shape[0]] * 2,
    "binary maximum": lambda h: torch.max(h, torch.tanh(h)),
    "layer_norm": lambda h: F.layer_norm(h, (h.shape[-1],)),
    "einsum keeping the batch": lambda h: torch.einsum("bd,bd->b", h, h)[:, None] * h,
    "pick each row": lambda h: h[torch.arange(h.shape[0]), :],
    "cat features": lambda h: torch.cat([h, h], 1)[:, : h.shape[1]] + h,
    "stack and sum": lambda h: torch.stack([h, 2 * h], 0).sum(0),
    "batch-wide predicate read on the host": lambda h: h * 2 if bool((h > -100).all()) else h,
    "normalize rows": lambda h: F.normalize(h, dim=1),
    "sum over features kept": lambda h: h - h.mean(1, keepdim=True),
    "repeat_interleave viewed back per row": lambda h: h.repeat_interleave(3, 0).view(h.shape[0], 3, -1).sum(1),
    "repeat along features": lambda h: h.repeat(1, 2)[:, : h.shape[1]] * 2,
    "mean over features (axis=)": lambda h: h - h.mean(axis=1, keepdim=True),
    "cat features (axis=)": lambda h: torch.cat([h, h], axis=1)[:, : h.shape[1]] + h,
    "stack and sum (axis=)": lambda h: torch.stack([h, 2 * h], axis=2).sum(axis=-1),
    "split features (axis=)": lambda h: torch.cat(torch.split(h, 4, dim=1)[::-1], axis=-1),
}


class Mixer(nn.Module):
    """Linear -> op -> Linear: the op sits between two layers with parameters."""

    def __init__(self, op: Op) -> None:
        super().__init__()
        self.op = op
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.op(torch.tanh(self.l1(x))))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _batch(K: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4 * K, 6, generator=g), torch.randint(0, 3, (4 * K,), generator=g)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("name", list(MIXING))
def test_ops_that_mix_samples_are_refused(name: str, K: int, mode: str) -> None:
    torch.manual_seed(0)
    x, y = _batch(K)
    with pytest.raises(UnsupportedModuleError, match="mix samples"):
        dp_gradient(Mixer(MIXING[name]), x, y, loss_fn=_loss,
                    config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1.0))


@pytest.mark.parametrize("name", ["sub mean over batch", "pairwise product", "softmax over batch"])
def test_functorch_runs_each_sample_alone_so_mixing_ops_match_the_oracle(name: str) -> None:
    torch.manual_seed(0)
    x, y = _batch(2)
    model = Mixer(MIXING[name])
    got = per_sample_gradients(model, x, y, loss_fn=_loss, mode="functorch", augmentation_multiplicity=2)
    samples = [((x[2 * n: 2 * n + 2],), y[2 * n: 2 * n + 2]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda out, t: _loss(out, t).mean())
    for key, value in expected.items():
        assert_close_scaled(got[key], value, name=key)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew", "functorch"])
@pytest.mark.parametrize("name", list(ROWWISE))
def test_rowwise_ops_are_not_refused_and_match_the_oracle(name: str, mode: str) -> None:
    torch.manual_seed(0)
    K = 2
    x, y = _batch(K)
    model = Mixer(ROWWISE[name])
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e6)
    try:
        out = dp_gradient(model, x, y, loss_fn=_loss, config=config)
    except UnsupportedModuleError as err:
        if mode == "ew" and "ExpandedWeights" in str(err):
            pytest.skip(f"torch's ExpandedWeights: {err}")
        raise
    samples = [((x[K * n: K * n + K],), y[K * n: K * n + K]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda o, t: _loss(o, t).mean())
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in expected.values()], 1).sum(1).sqrt()
    assert_close_scaled(out.per_sample_norms, norms, name="norms")
    for key, value in expected.items():
        assert_close_scaled(out.grads[key], value.sum(0), name=key)


class MaskedRows(nn.Module):
    """A head applied to the rows a per-sample mask selects, flattened across samples."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        mask = torch.arange(x.shape[1])[None, :] < lengths[:, None]  # (B, T)
        rows = self.head(h[mask])  # (M, 3): rows of every sample, in one axis
        out = torch.zeros(x.shape[0], x.shape[1], 3, dtype=rows.dtype).masked_scatter(mask[..., None], rows)
        return out.sum(1) / lengths.clamp_min(1)[:, None]


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
def test_rows_selected_by_a_mask_are_refused_even_when_their_count_equals_the_batch(mode: str) -> None:
    # 4 selected rows for 4 samples: a size check alone would take row i for sample i.
    x, y = torch.randn(4, 5, 6), torch.randint(0, 3, (4,))
    lengths = torch.tensor([2, 0, 2, 0])
    with pytest.raises(UnsupportedModuleError, match="a boolean mask picked from every sample"):
        dp_gradient(MaskedRows(), (x, lengths), y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
def test_a_loss_normalised_by_a_batch_wide_count_is_refused(mode: str) -> None:
    x, y = torch.randn(4, 5, 6), torch.randint(0, 3, (4, 5))
    y[1, 2:], y[3, 1:] = -100, -100  # padding

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mask = target != -100
        per_token = F.cross_entropy(out.transpose(1, 2), target, reduction="none")  # 0 on padding
        return per_token / mask.sum()  # every sample's loss scaled by the batch's token count

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(UnsupportedModuleError, match="the loss receives values that mix samples"):
        dp_gradient(model, (x,), y, loss_fn=loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


def test_the_message_names_the_op_and_the_module() -> None:
    x, y = _batch(1)
    with pytest.raises(UnsupportedModuleError) as info:
        dp_gradient(Mixer(MIXING["cumsum over batch"]), x, y, loss_fn=_loss,
                    config=DPConfig(mode="hooks", max_grad_norm=1.0))
    message = str(info.value)
    assert "'cumsum'" in message and "'l2' (Linear)" in message


def test_flattened_logits_and_targets_in_the_loss_keep_each_sample_s_rows() -> None:
    """The HF-style loss ``cross_entropy(logits.view(-1, V), labels.view(-1))`` stays per sample."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, 6), torch.randint(0, 3, (4, 5))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, 3), target.reshape(-1), reduction="none")

    for mode in ("hooks", "ghost"):  # (ew wants the loss's rows to be the batch's)
        out = dp_gradient(model, (x,), y, loss_fn=loss, config=DPConfig(mode=mode, max_grad_norm=1e6))
        expected = microbatch_oracle(model, [((x[n: n + 1],), y[n: n + 1]) for n in range(4)],
                                     lambda o, t: loss(o, t).mean())
        for key, value in expected.items():
            assert_close_scaled(out.grads[key], value.sum(0), name=f"{mode} {key}")


def test_mixing_that_never_reaches_a_value_is_harmless() -> None:
    x, y = _batch(1)

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> Any:
            h = self.l1(x)
            if bool(h.isfinite().all()):  # a batch-wide check, read on the host
                h = torch.relu(h)
            return self.l2(h)

    for mode in ("hooks", "ghost", "ew"):
        dp_gradient(Branchy(), x, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


# ------------------------------------------------------------------ reorderings that put rows back
class PackInside(nn.Module):
    """Packs its padded batch itself (sorting by length), runs a DP GRU, unpacks and pools."""

    def __init__(self) -> None:
        super().__init__()
        from psg_core.layers import DPGRU
        self.rnn = DPGRU(6, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, h_n = self.rnn(packed)
        padded, unpacked_lengths = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        pooled = padded.sum(1) / unpacked_lengths[:, None].to(padded.dtype)
        return self.head(torch.tanh(h_n[-1]) + pooled)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
@pytest.mark.parametrize("K", [1, 2])
def test_packing_inside_the_model_is_followed_back_to_the_batch_order(mode: str, K: int) -> None:
    """pack_padded_sequence(enforce_sorted=False) sorts the batch by length; the DP layer and
    pad_packed_sequence put it back: the result is the oracle's, not a refusal."""
    torch.manual_seed(0)
    N, T = 4, 5
    x, y = torch.randn(N * K, T, 6), torch.randint(0, 3, (N * K,))
    lengths = torch.tensor([2, 5, 1, 4, 3, 5, 2, 1][: N * K])
    model = PackInside()
    out = dp_gradient(model, (x, lengths), y, loss_fn=_loss,
                      config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e6))
    samples = [((x[K * n: K * n + K], lengths[K * n: K * n + K]), y[K * n: K * n + K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda o, t: _loss(o, t).mean())
    for key, value in expected.items():
        assert_close_scaled(out.grads[key], value.sum(0), name=key)


class PackInsideTimeMajor(nn.Module):
    """PackInside on a time-major batch (T, B, d): the sort selects rows on axis 1."""

    def __init__(self) -> None:
        super().__init__()
        from psg_core.layers import DPLSTM
        self.rnn = DPLSTM(6, 5, batch_first=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
        packed = pack_padded_sequence(x, lengths, batch_first=False, enforce_sorted=False)
        out, _ = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=False, total_length=x.shape[0])  # (T, B, 5)
        return self.head(padded.sum(0) / lengths[:, None].to(padded.dtype))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_packing_a_time_major_batch_inside_the_model(mode: str, K: int) -> None:
    torch.manual_seed(0)
    N, T = 4, 5
    x, y = torch.randn(T, N * K, 6), torch.randint(0, 3, (N * K,))
    lengths = torch.tensor([2, 5, 1, 4, 3, 5, 2, 1][: N * K])
    model = PackInsideTimeMajor()
    out = dp_gradient(model, (x, lengths), y, loss_fn=_loss,
                      config=DPConfig(mode=mode, augmentation_multiplicity=K, batch_first=False, max_grad_norm=1e6))
    samples = [((x[:, K * n: K * n + K], lengths[K * n: K * n + K]), y[K * n: K * n + K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda o, t: _loss(o, t).mean())
    for key, value in expected.items():
        assert_close_scaled(out.grads[key], value.sum(0), name=key)


class EosPooling(nn.Module):
    """BART's classification head: the hidden state at each sample's last end token, picked with a
    boolean mask and viewed back to one row per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))  # (B, T, 8)
        picked = h[eos, :].view(h.shape[0], -1, h.shape[-1])[:, -1, :]  # (B, 8)
        return self.head(picked)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
def test_rows_a_mask_picks_viewed_back_per_sample_keep_the_batch(mode: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, 6), torch.randint(0, 3, (4,))
    eos = torch.zeros(4, 5, dtype=torch.bool)
    eos[torch.arange(4), torch.tensor([4, 2, 3, 1])] = True  # one end token per sample
    model = EosPooling()
    out = dp_gradient(model, (x, eos), y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1e6))
    samples = [((x[n: n + 1], eos[n: n + 1]), y[n: n + 1]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda o, t: _loss(o, t).mean())
    for key, value in expected.items():
        assert_close_scaled(out.grads[key], value.sum(0), name=key)


def test_an_identity_index_select_keeps_the_batch() -> None:
    model = Mixer(lambda h: h.index_select(0, torch.arange(h.shape[0])))
    x, y = _batch(1)
    dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode="hooks", max_grad_norm=1.0))


def test_an_input_taken_for_a_batch_tensor_by_its_size_is_refused_with_a_hint() -> None:
    """Position ids passed as an input whose length equals N*K look like a batch tensor; where they
    meet the real batch the axes disagree, and the message says what may have happened."""

    class PositionsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos, self.head = nn.Linear(6, 8), nn.Embedding(8, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.head((self.tok(x) + self.pos(positions)).mean(1))  # (B, T, 8) + (T, 8)

    x, y = torch.randn(4, 4, 6), torch.randint(0, 3, (4,))
    with pytest.raises(UnsupportedModuleError, match="by coincidence"):
        dp_gradient(PositionsInput(), (x, torch.arange(4)), y, loss_fn=_loss,
                    config=DPConfig(mode="hooks", max_grad_norm=1.0))


class HeadMasks(nn.Module):
    """nn.MultiheadAttention's 3-D mask, one (T, T) per sample and head: ``(B*H, T, T)``."""

    def __init__(self, tiled: bool) -> None:
        super().__init__()
        from psg_core.layers import DPMultiheadAttention
        self.att = DPMultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)
        self.tiled = tiled

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        B, T = pad.shape
        per_sample = pad[:, None, :].expand(B, T, T)
        # Sample-major (each sample's mask repeated per head), or tiled head-major: a user's bug
        # that hands sample b the mask of sample b mod B... in the wrong rows.
        mask = per_sample.repeat(2, 1, 1) if self.tiled else per_sample.repeat_interleave(2, dim=0)
        out, _ = self.att(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(out.mean(1))


def _padded(K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    pad = torch.zeros(4 * K, 5, dtype=torch.bool)
    pad[1, 3:] = True
    pad[2, 4:] = True
    return (torch.randn(4 * K, 5, 4, generator=g, dtype=torch.float64), pad,
            torch.randint(0, 3, (4 * K,), generator=g))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
@pytest.mark.parametrize("K", [1, 2])
def test_per_head_masks_built_by_repeat_interleave_keep_each_sample_s_rows(mode: str, K: int) -> None:
    torch.manual_seed(0)
    model = HeadMasks(tiled=False).double()
    model.att.k_proj.bias.requires_grad_(False)  # its gradient is zero: a shift every softmax ignores
    x, pad, y = _padded(K)
    out = dp_gradient(model, (x, pad), y, loss_fn=_loss,
                      config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e6))
    samples = [((x[K * n: K * n + K], pad[K * n: K * n + K]), y[K * n: K * n + K]) for n in range(4)]
    expected = microbatch_oracle(model, samples, lambda o, t: _loss(o, t).mean())
    for key, value in expected.items():
        assert_close_scaled(out.grads[key], value.sum(0), name=key)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
def test_per_head_masks_tiled_by_repeat_are_refused(mode: str) -> None:
    x, pad, y = _padded(1)
    with pytest.raises(UnsupportedModuleError, match="'repeat'"):
        dp_gradient(HeadMasks(tiled=True).double(), (x, pad), y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


class MaxNormTied(nn.Module):
    """An Embedding with max_norm (renormalises the looked-up rows in place), optionally tied to
    the output head."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6, max_norm=0.5)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 9, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids)))).mean(1)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
def test_a_max_norm_table_tied_to_the_head_is_refused(mode: str) -> None:
    """The batch's lookups scale every sample's rows before the head reads the whole table."""
    ids, y = torch.randint(1, 9, (4, 5)), torch.randint(0, 9, (4,))
    with pytest.raises(UnsupportedModuleError, match="max_norm"):
        dp_gradient(MaxNormTied(tied=True), ids, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "ew"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_max_norm_table_read_only_by_its_lookups_keeps_each_sample_s_rows(mode: str, K: int) -> None:
    import copy
    torch.manual_seed(0)
    model = MaxNormTied(tied=False).double()
    ids, y = torch.randint(1, 9, (4 * K, 5)), torch.randint(0, 9, (4 * K,))
    samples = [((ids[K * n: K * n + K],), y[K * n: K * n + K]) for n in range(4)]
    # max_norm rescales the table in place: each run starts from the same table.
    expected = microbatch_oracle(copy.deepcopy(model), samples, lambda o, t: _loss(o, t).mean())
    out = dp_gradient(copy.deepcopy(model), ids, y, loss_fn=_loss,
                      config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e6))
    for key, value in expected.items():
        assert_close_scaled(out.grads[key], value.sum(0), name=key)


@pytest.mark.parametrize("mode", ["hooks", "ew"])
def test_a_wrapped_model_whose_output_mixes_samples_is_refused_at_its_forward(mode: str) -> None:
    """The wrappers' loss is the caller's, out of the tracker's sight: a model output whose rows
    already mix samples is refused when the forward returns; a loss the model reduced itself
    (0-dim) is not."""
    import psg_core

    class Centred(nn.Module):  # the op after the last layer with parameters
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = self.head(x)
            return logits - logits.mean(0, keepdim=True)

    wrapped = psg_core.wrap_model(Centred(), mode=mode)
    with pytest.raises(UnsupportedModuleError, match="the model's output receives values that mix samples"):
        wrapped(torch.randn(4, 6))

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.body(x)
            return {"loss": F.cross_entropy(logits, y), "logits": logits}

    model = WithLoss()
    out = psg_core.wrap_model(model, mode=mode)(torch.randn(4, 6), torch.randint(0, 3, (4,)))
    out["loss"].backward()
    assert model.body.weight.grad_sample.shape == (4, 3, 6)
