"""Models built with torch features that change what a layer's weight or output is.

* ``torch.nn.utils.weight_norm`` / ``spectral_norm`` (the legacy forms) make ``weight`` a tensor
  computed from ``weight_g``/``weight_v`` (``weight_orig``) before each call: a Linear grad sampler
  gave that tensor's gradient, which no parameter receives (hooks returned zeros for weight_g and
  weight_v; ghost raised a KeyError).
* A user's forward hook that replaces a layer's output: psg took the replaced output's gradient for
  the layer's.
* A TorchScript submodule: no hook can follow it (raw errors, hooks left on the model).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psg_core import DPConfig, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled

N, D = 4, 5

# torch.nn.utils.weight_norm is deprecated for the parametrizations form, but still used.
pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*torch.nn.utils.spectral_norm.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*torch.jit.script.*:DeprecationWarning")]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int) -> dict[str, torch.Tensor]:
    """Each sample's gradient, the model run on its K rows alone (on the model itself: the legacy
    weight_norm's computed weight cannot be deep-copied)."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    per_sample: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for n in range(N):
        rows = slice(n * K, (n + 1) * K)
        grads = torch.autograd.grad(_loss(model(x[rows]), y[rows]).mean(), list(params.values()))
        for name, g in zip(params, grads):
            per_sample[name].append(g)
    return {name: torch.stack(g) for name, g in per_sample.items()}


def _weight_norm() -> nn.Module:
    return nn.Sequential(nn.utils.weight_norm(nn.Linear(D, 6)), nn.Tanh(), nn.Linear(6, 3))


def _spectral_norm() -> nn.Module:
    # eval(): the stored singular vectors, no power iteration updating them in place per call
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(D, 6)), nn.Tanh(), nn.Linear(6, 3)).eval()


def _conv_weight_norm() -> nn.Module:
    class Pool(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.mean(-1)
    return nn.Sequential(nn.Unflatten(1, (1, D)), nn.utils.weight_norm(nn.Conv1d(1, 3, 2)), nn.Tanh(), Pool())


def _parametrized(kind: str) -> Callable[[], nn.Module]:
    """``torch.nn.utils.parametrizations`` (wav2vec2, HuBERT, WavLM and SEW's positional
    convolution): ``weight`` is computed from ``parametrizations.weight.original*`` at every access.
    Refused before (a tensor computed from parameters meeting the batch in linear/conv1d)."""
    from torch.nn.utils import parametrizations

    def build() -> nn.Module:
        if kind == "conv":
            conv = parametrizations.weight_norm(nn.Conv1d(1, 4, 2, groups=1), dim=2)
            return nn.Sequential(nn.Unflatten(1, (1, D)), conv, nn.Tanh(), nn.Flatten(), nn.Linear(4 * (D - 1), 3))
        wrap = {"weight_norm": parametrizations.weight_norm, "spectral_norm": parametrizations.spectral_norm,
                "orthogonal": parametrizations.orthogonal}[kind]
        return nn.Sequential(wrap(nn.Linear(D, D)), nn.Tanh(), nn.Linear(D, 3)).eval()
    return build


class _Softplus(nn.Module):
    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return F.softplus(value)


def _parametrized_bias(conv: bool) -> Callable[[], nn.Module]:
    """A bias computed by a parametrization (``parametrize.register_parametrization(layer, "bias",
    ...)``) under a plain weight, on ``(N*K, d)`` rows: ghost took the layer's own Gram norm, whose
    bias gradient was the computed tensor's (no parameter's): dropped, norms short by its share."""
    from torch.nn.utils import parametrize

    def build() -> nn.Module:
        layer: nn.Module = nn.Conv1d(1, 3, 2) if conv else nn.Linear(D, 6)
        parametrize.register_parametrization(layer, "bias", _Softplus())
        if conv:
            return nn.Sequential(nn.Unflatten(1, (1, D)), layer, nn.Tanh(), nn.Flatten(), nn.Linear(3 * (D - 1), 3))
        return nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3))
    return build


def _hooked_output() -> nn.Module:
    model = nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, 3))
    model[0].register_forward_hook(lambda _m, _a, out: torch.tanh(out) * 3.0)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "weight_norm": _weight_norm, "spectral_norm": _spectral_norm, "conv weight_norm": _conv_weight_norm,
    "forward hook replacing the output": _hooked_output,
    "parametrizations.weight_norm": _parametrized("weight_norm"),
    "parametrizations.weight_norm on a conv": _parametrized("conv"),
    "parametrizations.spectral_norm": _parametrized("spectral_norm"),
    "parametrizations.orthogonal": _parametrized("orthogonal"),
    "parametrized bias": _parametrized_bias(conv=False),
    "parametrized bias on a conv": _parametrized_bias(conv=True),
}


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_equal_the_oracle(name: str, K: int, mode: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    expected = _oracle(model, x, y, K)
    if mode == "ghost":
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in expected.values()))
        out = dp_gradient(model, x, y, loss_fn=_loss,
                          config=DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e9))
        assert_close_scaled(out.per_sample_norms, norms.to(torch.float32), name="norms")
        for key, value in expected.items():
            assert_close_scaled(out.grads[key], value.sum(0).to(torch.float32), name=key)
        return
    got = per_sample_gradients(model, x, y, loss_fn=_loss, mode=mode, augmentation_multiplicity=K)
    for key, value in expected.items():
        assert_close_scaled(got[key], value.to(got[key].dtype), name=key)


def _scripted() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 6), torch.jit.script(nn.Sequential(nn.Linear(6, 6), nn.Tanh())),
                         nn.Linear(6, 3))


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch", "ew"])
def test_a_torchscript_submodule_is_refused_and_leaves_no_hook(mode: str) -> None:
    model = _scripted()
    x, y = torch.randn(N, D), torch.randint(0, 3, (N,))
    with pytest.raises(UnsupportedModuleError, match="TorchScript"):
        dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))
    assert _hook_count(model) == 0
    model[1] = nn.Sequential(nn.Linear(6, 6), nn.Tanh())  # the eager module works afterwards
    dp_gradient(model, x, y, loss_fn=_loss, config=DPConfig(mode=mode, max_grad_norm=1.0))


@pytest.mark.parametrize("K", [1, 2])
def test_a_parametrized_weight_in_a_wrapped_model(K: int) -> None:
    import psg_core

    torch.manual_seed(1)
    model = _parametrized("weight_norm")()
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    expected = _oracle(model, x, y, K)
    wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=K)
    try:
        _loss(wrapped(x), y).mean().backward()
        got = {name: p.grad_sample for name, p in model.named_parameters()}
    finally:
        wrapped.remove_hooks()
    for key, value in expected.items():
        assert_close_scaled(got[key], value, name=key)


class Scatter(nn.Module):
    """A layer without a grad sampler that writes its result into a tensor it creates: vmap cannot
    batch the in-place write of a batched value into an unbatched tensor, so the per-layer
    torch.func fallback runs it one sample at a time (refused before: UniSpeechSat, wav2vec2 with
    masking)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], D + 1)
        out[:, :D] = x * self.scale
        return out


class KeywordRoot(nn.Module):
    """A model that owns a parameter itself and takes its input by keyword (wav2vec2 with a weighted
    layer sum): its torch.func fallback finds the rows in the keyword input (refused before)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(D))
        self.head = nn.Linear(D, 3)

    def forward(self, *, values: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(values * self.mix))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_fallback_layers_vmap_cannot_batch_and_keyword_inputs(mode: str) -> None:
    torch.manual_seed(2)
    K = 2
    x, y = torch.randn(N * K, D), torch.randint(0, 3, (N * K,))
    for model, call in ((nn.Sequential(Scatter(), nn.Linear(D + 1, 3)), lambda m, v: m(v)),
                        (KeywordRoot(), lambda m, v: m(values=v))):
        params = {name: p for name, p in model.named_parameters()}
        per_sample: dict[str, list[torch.Tensor]] = {name: [] for name in params}
        for n in range(N):
            rows = slice(n * K, (n + 1) * K)
            for name, g in zip(params, torch.autograd.grad(_loss(call(model, x[rows]), y[rows]).mean(),
                                                          list(params.values()))):
                per_sample[name].append(g)
        expected = {name: torch.stack(g) for name, g in per_sample.items()}
        inputs = {"values": x} if isinstance(model, KeywordRoot) else x
        if mode == "ghost":
            out = dp_gradient(model, inputs, y, loss_fn=_loss,
                              config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=1e9))
            for key, value in expected.items():
                assert_close_scaled(out.grads[key], value.sum(0), name=key)
        else:
            got = per_sample_gradients(model, inputs, y, loss_fn=_loss, augmentation_multiplicity=K)
            for key, value in expected.items():
                assert_close_scaled(got[key], value, name=key)
