"""A layer without a grad sampler whose own parameters meet the batch in pointwise ops only.

A layer scale (``gamma * branch(x)``, BEiT, ConvNeXt, CaiT), an RMSNorm's ``weight * x_hat``, a bias
added to a child's output: the layer owns those parameters, has no grad sampler, and the per-layer
torch.func fallback would run its whole call again per sample (the attention and MLP under it)
just for them. Instead the batch tracker makes those ops meeting points, whose per-sample
gradients come from the gradient at the expanded parameter: the call is never re-run. Where one
of the layer's own parameters meets the batch in anything else (a product, a child's op), the
layer's pending meetings are dropped and the fallback differentiates the whole call as before.
Either way the result is the oracle's, in hooks, ghost and GradSampleModule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from psg_core import DPConfig, dp_gradient, per_sample_gradients
from psg_core.grad_sample import functorch_fallback
from tests.oracle import assert_close_scaled, microbatch_oracle

N = 3


class LayerScale(nn.Module):
    """``x + gamma * mlp(x)`` and an RMSNorm-style ``weight * x / rms(x)``: own parameters in
    pointwise ops only, the Linear children hooked as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.weight = nn.Parameter(torch.rand(4) + 0.5)
        self.shift = nn.Parameter(torch.randn(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.gamma * self.mlp(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (1.0 + self.weight) * h + self.shift  # (Gemma's norm: the weight through an op first)


class Opaque(LayerScale):
    """The same, and ``gamma`` also in a product: the whole call is differentiated per sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ torch.diag(self.gamma)


class PassedDown(LayerScale):
    """``gamma`` handed to a child op's module: the child's op is not the layer's own, so the
    layer's call is differentiated whole."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(super().forward(x), self.gamma)


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        return x * gamma


class Viewed(nn.Module):
    """Own parameters through views in pointwise ops (ConvNeXt's channels-first norm:
    ``weight[:, None, None] * x``): ``gamma[:, None]`` holds gamma's elements in their order (its
    gradient is gamma's, no VJP), ``table.t()`` does not (one batched VJP)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.table = nn.Parameter(torch.randn(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 4)
        h = self.mlp(x).transpose(1, 2)  # (N*K, 4, T)
        return (self.gamma[:, None] * h + self.table.t()).transpose(1, 2)


class Model(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.block = block
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 3)
        return self.out(self.block(torch.tanh(self.inp(x))).mean(1))


def _fallback_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The class names of the layers the per-layer fallback runs, appended as it runs them."""
    calls: list[str] = []
    original = functorch_fallback.functorch_layer_grad_sample

    def counting(layer: nn.Module, *args: object, **kwargs: object) -> object:
        calls.append(type(layer).__name__)
        return original(layer, *args, **kwargs)

    monkeypatch.setattr("psg_core.backends.capture.functorch_layer_grad_sample", counting)
    return calls


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "gsm"])
@pytest.mark.parametrize("block, fallback", [(LayerScale, False), (Opaque, True), (PassedDown, True), (Viewed, False)])
def test_own_parameters_in_pointwise_ops_need_no_fallback(block: type[nn.Module], fallback: bool, mode: str, K: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fallback_calls(monkeypatch)
    torch.manual_seed(0)
    model = Model(block())
    x, y = torch.randn(N * K, 5, 3), torch.randint(0, 2, (N * K,))
    samples = [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: _loss(out, t).mean())
    if mode == "ghost":
        reference = psg_core.clip_and_sum({n: g.float() for n, g in expected.items()}, max_grad_norm=0.01)
        result = dp_gradient(model, x, y, loss_fn=_loss,
                             config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=0.01))
        assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
        got, expected = result.grads, reference.grads
    elif mode == "gsm":
        wrapped = psg_core.GradSampleModule(model, strict=False, augmentation_multiplicity=K)
        try:
            _loss(wrapped(x), y).mean().backward()
            got = {name: p.grad_sample for name, p in model.named_parameters()}
            batch = {name: p.grad for name, p in model.named_parameters()}
        finally:
            wrapped.remove_hooks()
            for p in model.parameters():
                p.grad, p.grad_sample = None, None
        for name, value in expected.items():  # the ordinary gradient is untouched by the meetings
            assert_close_scaled(batch[name], value.mean(0), name=f"{name}.grad")
    else:
        got = per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode, augmentation_multiplicity=K)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)
    assert calls == ([block.__name__] if fallback else []), calls


def test_llama_fully_fine_tuned_runs_no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's RMSNorm weights meet the batch in ``weight * hidden``: no layer of a fully trained
    Llama needs the torch.func fallback any more."""
    transformers = pytest.importorskip("transformers")

    def refuse(layer: nn.Module, *args: object, **kwargs: object) -> object:
        raise AssertionError(f"fallback run for {type(layer).__name__}")

    monkeypatch.setattr("psg_core.backends.capture.functorch_layer_grad_sample", refuse)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32, max_position_embeddings=16,
                                   num_labels=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(cfg).eval()
    ids = torch.randint(2, 40, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, -2:] = 0
    inputs, labels = {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 2, (4,))
    grads = per_sample_gradients(model, inputs, labels,
                                 loss_fn=lambda o, t: F.cross_entropy(o.logits, t, reduction="none"))
    functorch = per_sample_gradients(model, inputs, labels, mode="functorch",
                                     loss_fn=lambda o, t: F.cross_entropy(o.logits, t, reduction="none"))
    for name, value in functorch.items():
        assert_close_scaled(grads[name], value, name=name)
    assert any(name.endswith("input_layernorm.weight") for name in grads)


class Twice(nn.Module):
    """One layer-scaled block called twice in a forward pass, on rows merged with time between."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(3, 4), LayerScale(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N*K, T, 3)
        h = self.block(torch.tanh(self.inp(x)))
        h = self.block(h.reshape(-1, 4)).reshape(x.shape[0], x.shape[1], 4)  # (N*K*T, 4) rows
        return self.out(h.mean(1))


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_layer_called_twice_adds_both_calls(mode: str, K: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(layer: nn.Module, *args: object, **kwargs: object) -> object:
        raise AssertionError(f"fallback run for {type(layer).__name__}")

    monkeypatch.setattr("psg_core.backends.capture.functorch_layer_grad_sample", refuse)
    torch.manual_seed(0)
    model = Twice()
    _matches_the_oracle(model, torch.randn(N * K, 5, 3), torch.randint(0, 2, (N * K,)), mode, K)


def _matches_the_oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, K: int) -> None:
    """hooks' per-sample gradients, or ghost's unclipped sum, are the oracle's."""
    expected = microbatch_oracle(model, [((x[n * K:(n + 1) * K],), y[n * K:(n + 1) * K]) for n in range(N)],
                                 lambda out, t: _loss(out, t).mean())
    if mode == "hooks":
        got = per_sample_gradients(model, x, y, loss_fn=_loss, augmentation_multiplicity=K)
    else:
        got = dp_gradient(model, x, y, loss_fn=_loss,
                          config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9)).grads
        expected = {name: g.sum(0) for name, g in expected.items()}
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_parameter_or_its_reshape_meets_the_batch_without_a_vjp(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the op received the parameter itself or a view holding its elements in their order,
    the per-sample gradient is the cotangent (reshaped): no batched VJP; a transposed view takes one."""
    batched: list[int] = []
    original = torch.autograd.grad

    def counting(*args: object, **kwargs: object) -> object:
        if kwargs.get("is_grads_batched"):
            batched.append(len(kwargs.get("grad_outputs") or args[2]))  # type: ignore[arg-type]
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.autograd, "grad", counting)
    torch.manual_seed(0)
    model = Model(Viewed())
    x, y = torch.randn(N, 5, 3), torch.randint(0, 2, (N,))
    if mode == "ghost":
        dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode="ghost", max_grad_norm=1.0))
    else:
        per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode)
    assert batched == [1]  # table.t() only: gamma[:, None] needs none


class Filled(nn.Module):
    """Masks a hidden layer's negative inputs to a learned fill value: ``masked_fill`` with a 0-d
    parameter (``form``: the method, ``torch.masked_fill``, the in-place method, a computed value
    by keyword), the layer's own or, with ``borrowed``, another module's."""

    def __init__(self, form: str, borrowed: bool) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(5, 5), nn.Linear(5, 2)
        if borrowed:
            self.holder = nn.Module()
            self.holder.fill = nn.Parameter(torch.tensor(0.5))
        else:
            self.fill = nn.Parameter(torch.tensor(0.5))
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mask = self.inp(x), x < 0
        fill = self.holder.fill if hasattr(self, "holder") else self.fill
        if self.form == "method":
            h = h.masked_fill(mask, fill)
        elif self.form == "function":
            h = torch.masked_fill(h, mask, fill)
        elif self.form == "in place":
            h = h * 2.0  # (a product's backward needs none of its output, which is overwritten)
            h.masked_fill_(mask, fill)
        else:
            h = h.masked_fill(mask=mask, value=fill * 2.0)
        return self.head(h)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("borrowed", [False, True])
@pytest.mark.parametrize("form", ["method", "function", "in place", "keyword"])
def test_a_parameter_as_masked_fill_s_value(form: str, borrowed: bool, mode: str, K: int) -> None:
    """The fill value's meeting view has the output's shape, which ``masked_fill`` refuses (it takes
    a 0-d value): the hooks and ghost modes raised torch's RuntimeError. The fill is now computed as
    ``where(mask, value, input)``, with the oracle's gradients."""
    torch.manual_seed(0)
    model = Filled(form, borrowed)
    _matches_the_oracle(model, torch.randn(N * K, 5), torch.randint(0, 2, (N * K,)), mode, K)


class SpecMasked(nn.Module):
    """wav2vec2's and WavLM's SpecAugment in small: masked time steps of the hidden states set to
    a learned vector, ``h[mask] = self.embed``. ``mask``: computed from the batch (``batched``), or
    drawn outside torch as the models do with numpy (``constant``: here from each row's values, so
    a sample's own forward draws its rows' mask), the model's own parameter or a child's
    (``borrowed``)."""

    def __init__(self, mask: str, borrowed: bool) -> None:
        super().__init__()
        self.mask, self.borrowed = mask, borrowed
        self.inp, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        if borrowed:
            self.holder = nn.Module()
            self.holder.embed = nn.Parameter(torch.randn(4))
        else:
            self.embed = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 3)
        h = self.inp(x)
        mask = x[..., 0] > 0
        if self.mask == "constant":
            mask = torch.tensor(mask.numpy())  # batch-free for psg, as numpy's draws are
        h[mask] = self.holder.embed if self.borrowed else self.embed
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("borrowed", [False, True])
@pytest.mark.parametrize("mask", ["batched", "constant"])
def test_a_parameter_written_into_masked_rows(mask: str, borrowed: bool, mode: str, K: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``h[mask] = parameter`` was no meeting: the model's own parameter sent its whole call to the
    per-layer fallback (in wav2vec2 and WavLM in training mode, the whole backbone per sample, with
    SpecAugment's numpy masks drawn again: wrong, silently), another module's was refused. It is
    now computed as ``h.copy_(where(mask, value, h))`` with the value met per row."""
    calls = _fallback_calls(monkeypatch)
    torch.manual_seed(0)
    _matches_the_oracle(SpecMasked(mask, borrowed), torch.randn(N * K, 5, 3), torch.randint(0, 2, (N * K,)), mode, K)
    assert calls == [], calls


class SlotWrite(nn.Module):
    """Its own parameter written into one slot of every row (``h[:, 0] = cls``): no mask, so no
    meeting; the whole call runs per sample, as before masked writes became meetings."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(4))
        self.inp, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 3)
        h = self.inp(x).clone()
        h[:, 0] = self.cls
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_parameter_written_into_a_slot_runs_the_call_per_sample(mode: str) -> None:
    torch.manual_seed(0)
    _matches_the_oracle(SlotWrite(), torch.randn(N * 2, 5, 3), torch.randint(0, 2, (N * 2,)), mode, 2)


class CheckpointedSpec(nn.Module):
    """SpecMasked's own-parameter write inside a non-reentrant activation checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SpecMasked("batched", borrowed=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_masked_write_inside_an_activation_checkpoint_runs_the_call_per_sample(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's recomputation would write the value a second time over the met one (the
    parameter's per-sample gradients came out wrong, silently): there the write is no meeting, and
    the layer's call runs per sample, as before masked writes became meetings."""
    calls = _fallback_calls(monkeypatch)
    torch.manual_seed(0)
    _matches_the_oracle(CheckpointedSpec(), torch.randn(N * 2, 5, 3), torch.randint(0, 2, (N * 2,)), mode, 2)
    assert calls == ["SpecMasked"], calls
