"""Units (psg_core.unit_module): a module whose forward reads its submodules' parameters itself
(a functional op on ``self.proj.weight``) is taken whole, its subtree's parameters differentiated
per sample by torch.func on its call; Hugging Face's Mamba mixer and WavLM attention, full
fine-tuning. Also: a layer returning a tensor computed from its parameters without the batch beside
its batched output (WavLM's position bias)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core
from psg_core import DPConfig, dp_gradient, per_sample_gradients
from psg_core.errors import UnsupportedModuleError
from psg_core.support import hooked_modules, is_unit, own_parameters
from tests.oracle import assert_close_scaled, check_against_oracle, check_mode, microbatch_oracle

N, C, L = 3, 2, 6


class _Functional(nn.Module):
    """Reads ``conv``'s weight in a functional convolution (doubled: not the layer's own call),
    calls ``gate`` as a module, and owns ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(C, C, 3, padding=1)
        self.gate = nn.Linear(C, C)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, L)
        h = F.conv1d(x, self.conv.weight * 2.0, self.conv.bias, padding=1)
        gate = torch.sigmoid(self.gate(x.transpose(1, 2))).transpose(1, 2)
        return h * gate * self.scale[:, None]


@psg_core.unit_module
class _Unit(_Functional):
    pass


def _model(block: type[nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Conv1d(C, C, 1), block(), nn.Tanh(), nn.Flatten(), nn.Linear(C * L, 3))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


class _Transposed(_Functional):
    """Reads ``conv``'s weight in a functional transposed convolution: no meeting splits it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, L)
        h = F.conv_transpose1d(x, self.conv.weight * 2.0, self.conv.bias, padding=1)
        return h * self.scale[:, None]


def test_a_module_reading_its_submodules_weights_is_refused_with_the_remedy() -> None:
    torch.manual_seed(0)
    model = _model(_Transposed)
    x, y = torch.randn(N, C, L), torch.randint(0, 3, (N,))
    for mode in ("hooks", "ghost"):
        with pytest.raises(UnsupportedModuleError, match=r"psg_core\.unit_module\(cls\)"):
            if mode == "ghost":
                dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode="ghost", max_grad_norm=1.0))
            else:
                per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_functional_convolution_on_a_childs_weight_needs_no_unit(mode: str) -> None:
    """The child's kernel meets the batch in ``conv1d`` (one copy per row): the oracle's gradients
    without declaring the class a unit (tests/core/test_conv_meetings.py)."""
    torch.manual_seed(0)
    check_mode(_model(_Functional), torch.randn(N * 2, C, L), torch.randint(0, 3, (N * 2,)), K=2, mode=mode,
               loss=_loss)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_unit_equals_the_oracle(mode: str, K: int) -> None:
    torch.manual_seed(0)
    model = _model(_Unit)
    x, y = torch.randn(N * K, C, L), torch.randint(0, 3, (N * K,))
    check_mode(model, x, y, K=K, mode=mode, loss=_loss)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_unit_in_a_wrapped_model(K: int, loss_reduction: str) -> None:
    """GradSampleModule: the unit's subtree gets grad samples from the unit, none twice."""
    torch.manual_seed(0)
    model = _model(_Unit)
    x, y = torch.randn(N * K, C, L), torch.randn(N * K, 3)
    check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction)


class _BiasBeside(nn.Module):
    """No grad sampler (the torch.func fallback); returns its batched output and a bias computed
    from its parameter alone, which the next layer adds to the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(-1.0, 1.0, L))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.p, self.p * 2.0


class _WithBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(C, C, 1)
        self.mixed = _BiasBeside()
        self.head = nn.Linear(C * L, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.mixed(self.a(x))
        return self.head(torch.tanh(h + bias).flatten(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_parameter_made_output_beside_the_batched_one(mode: str, K: int) -> None:
    """Its gradient is the tracker's to attribute where it meets the batch; hooking it as an output
    too counted it twice (a raw 'second backward pass' error under hooks, a vmap error under ghost)."""
    torch.manual_seed(0)
    x, y = torch.randn(N * K, C, L), torch.randint(0, 3, (N * K,))
    check_mode(_WithBias(), x, y, K=K, mode=mode, loss=_loss)


class _BiasTwice(_WithBias):
    """The parameter-made output feeds two later layers, and the loss too (a regulariser)."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Conv1d(C, C, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h, bias = self.mixed(self.a(x))
        return self.head(torch.tanh(self.b(h * bias) + bias).flatten(1)), bias.pow(2).sum()


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_parameter_made_output_used_twice_and_in_the_loss(mode: str, K: int) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(N * K, C, L), torch.randint(0, 3, (N * K,))

    def loss(out: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out[0], t, reduction="none") + out[1]

    check_mode(_BiasTwice(), x, y, K=K, mode=mode, loss=loss)


@psg_core.unit_module
class _TiledBias(nn.Module):
    """A unit that builds a bias from its table once per batch row (``repeat(B, ...)``, then the
    batch and head axes merged) or takes the previous unit's, and gates it with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(L, 2)
        self.gate = nn.Linear(C, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows, steps, _ = x.shape  # (B, L, C)
        if bias is None:
            bias = self.table(torch.arange(steps)).t().unsqueeze(0).repeat(rows, 1, 1).view(rows * 2, steps)
        gated = torch.sigmoid(self.gate(x)).permute(0, 2, 1).reshape(rows * 2, steps) * bias  # (B*2, L)
        return x * gated.view(rows, 2, steps).sum(1).unsqueeze(-1), bias


class _TiledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _TiledBias(), _TiledBias()
        self.head = nn.Linear(C * L, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, L)
        h, bias = self.first(x.transpose(1, 2))
        h, _ = self.second(h, bias=bias)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_tiled_bias_handed_from_unit_to_unit(mode: str, K: int) -> None:
    """The second unit's per-sample run takes the bias one block per row (as the sample's own
    forward builds it); the first unit's table gets its per-sample gradient where the bias meets
    the batch in the second."""
    torch.manual_seed(2)
    x, y = torch.randn(N * K, C, L), torch.randint(0, 3, (N * K,))
    check_mode(_TiledModel(), x, y, K=K, mode=mode, loss=_loss)


def test_a_unit_owns_its_subtree_and_its_submodules_are_not_hooked() -> None:
    model = _model(_Unit)
    unit = model[1]
    assert is_unit(unit) and not is_unit(unit.conv)
    assert {id(p) for p in own_parameters(unit)} == {id(p) for p in unit.parameters()}
    assert [path for path, _ in hooked_modules(model)] == ["", "0", "1", "2", "3", "4"]
    assert [path for path, _ in hooked_modules(unit)] == [""]
    assert not is_unit(_Functional())  # declaring a subclass leaves its base alone


# ------------------------------------------------------------------------------ Mamba
transformers = pytest.importorskip("transformers")


def _mamba(use_cache: bool) -> nn.Module:
    config = transformers.MambaConfig(vocab_size=40, hidden_size=8, state_size=4, num_hidden_layers=2, expand=2,
                                      conv_kernel=3, time_step_rank=2, use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.MambaForSequenceClassification(config).eval() \
        if hasattr(transformers, "MambaForSequenceClassification") else transformers.MambaForCausalLM(config).eval()


def _mamba_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    if logits.dim() == 3:  # causal LM: next-token loss per sample
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="none").view(
            y.shape[0], -1).mean(1)
    return F.cross_entropy(logits, y, reduction="none")


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_mamba_full_fine_tuning(mode: str, K: int, use_cache: bool) -> None:
    """Every parameter of Hugging Face's Mamba trains (the mixer's in/x/dt/out projections, its
    convolution, A_log and D): equal to the oracle in float64. With the cache on (the default), the
    forward makes an empty cache that each mixer fills with the batch's states: each sample's run
    of a mixer computes the same without it."""
    model = _mamba(use_cache=use_cache).double()
    assert is_unit(model.backbone.layers[0].mixer)
    tokens = torch.randint(0, 40, (N * K, 6))
    targets = tokens if model.__class__.__name__.endswith("CausalLM") else torch.randint(0, 2, (N * K,))
    samples = [((tokens[n * K:(n + 1) * K],), targets[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: _mamba_loss(out, t).mean())
    if mode == "ghost":
        out = dp_gradient(model, tokens, targets, loss_fn=_mamba_loss,
                          config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9))
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in expected.values()))
        assert_close_scaled(out.per_sample_norms.double(), norms, name="norms")
        for name, value in expected.items():
            assert_close_scaled(out.grads[name], value.sum(0), name=name)
        return
    got = per_sample_gradients(model, tokens, targets, loss_fn=_mamba_loss, mode=mode, augmentation_multiplicity=K)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)


# ------------------------------------------------------------------------------ WavLM
def _wavlm() -> nn.Module:
    config = transformers.WavLMConfig(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, conv_dim=(4, 4),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_buckets=8, max_bucket_distance=20, num_labels=2, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0)
    torch.manual_seed(0)
    return transformers.WavLMForSequenceClassification(config).eval()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_wavlm_full_fine_tuning(mode: str, K: int) -> None:
    """WavLM's attention runs F.multi_head_attention_forward on its projections' weights (a unit),
    and hands the next layer a relative-position bias tiled from its parameters per batch row,
    which the next unit's per-sample run takes one block per row of: equal to the oracle."""
    model = _wavlm().double()
    assert is_unit(model.wavlm.encoder.layers[0].attention)
    audio = torch.randn(N * K, 200, dtype=torch.float64)
    labels = torch.arange(N * K) % 2

    def loss(out: object, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits, t, reduction="none")  # type: ignore[attr-defined]

    samples = [((audio[n * K:(n + 1) * K],), labels[n * K:(n + 1) * K]) for n in range(N)]
    expected = microbatch_oracle(model, samples, lambda out, t: loss(out, t).mean())
    if mode == "ghost":
        out = dp_gradient(model, audio, labels, loss_fn=loss,
                          config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9))
        got, expected = out.grads, {name: value.sum(0) for name, value in expected.items()}
    else:
        got = per_sample_gradients(model, audio, labels, loss_fn=loss, mode=mode, augmentation_multiplicity=K)
    # One scale for the model: the key projection's bias has a zero gradient (softmax ignores a
    # shift of every score), which float64 rounding leaves at 1e-17 in both.
    scale = max(value.abs().max() for value in expected.values())
    for name, value in expected.items():
        torch.testing.assert_close(got[name] / scale, value / scale, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")


class _Scale(nn.Module):
    """No grad sampler; its parameter meets the batch in a pointwise op only (an RMSNorm's weight):
    outside a unit, such a call's per-sample gradients come from meeting points."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, L)
        return x * self.weight[:, None]


@psg_core.unit_module
class _UnitOverScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(C, C, 3, padding=1)
        self.norm = _Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.conv1d(x, self.conv.weight * 2.0, self.conv.bias, padding=1))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_child_of_a_unit_meeting_the_batch_pointwise_is_counted_once(mode: str, K: int) -> None:
    """The unit's whole call gives its child's per-sample gradients: the child's pointwise meeting
    is not a meeting point as well (which counted its parameter twice: 2x the oracle, silently)."""
    torch.manual_seed(3)
    model = _model(_UnitOverScale)
    x, y = torch.randn(N * K, C, L), torch.randint(0, 3, (N * K,))
    check_mode(model, x, y, K=K, mode=mode, loss=_loss)
