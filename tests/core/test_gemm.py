"""psg_core.gemm: the products psg computes itself, on torch's kernel or oneDNN's, and the switch
that chooses (rule, auto, forced, environment variable)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import psg_core.gemm as gemm
import psg_core.native as native
from psg_core.clipping import clip_and_sum
from psg_core.config import DPConfig
from psg_core.dp import dp_gradient
from psg_core.errors import ConfigError
from psg_core.gemm import GemmKernel, Projection, gemm_kernel, linear, linear_uses_onednn, mm_tn
from psg_core.layers import DPGRU, DPLSTM, DPRNN
from psg_core import per_sample_gradients
from tests.oracle import assert_close_scaled

needs_onednn = pytest.mark.skipif(not gemm.onednn_available(), reason="torch has no oneDNN linear kernel here")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from the default: no setting, no environment variable, no measurement."""
    monkeypatch.delenv(gemm.ENVIRONMENT_VARIABLE, raising=False)
    gemm.set_gemm_kernel(None)
    gemm.clear_gemm_cache()
    yield
    gemm.set_gemm_kernel(None)
    gemm.clear_gemm_cache()


@pytest.fixture
def onednn_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Counts the products that went to oneDNN (the shape of each call's first operand)."""
    calls: list[tuple[int, ...]] = []
    real_linear, real_add_linear = gemm._onednn_linear, gemm._onednn_add_linear

    def counted_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real_linear(x, weight, bias)

    def counted_add_linear(other: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real_add_linear(other, x, weight)

    monkeypatch.setattr(gemm, "_onednn_linear", counted_linear)
    monkeypatch.setattr(gemm, "_onednn_add_linear", counted_add_linear)
    return calls


# ------------------------------------------------------------------------------ the products
@pytest.mark.parametrize("kernel", ["aten", pytest.param("onednn", marks=needs_onednn), "rule", "auto"])
def test_products_equal_float64(kernel: str) -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(5, 7, 6), torch.randn(4, 6), torch.randn(4)
    a, b = torch.randn(9, 3), torch.randn(9, 8)
    h, other, hidden = torch.randn(5, 6), torch.randn(5, 4), torch.randn(4, 6)
    with gemm_kernel(kernel):
        got_linear = linear(x, weight, bias)
        got_tn = mm_tn(a, b)
        got_tn_view = mm_tn(b.t().contiguous().t(), a)  # a transposed view as the first operand
        with torch.no_grad():
            step = Projection(hidden, h, other)
            got_step, got_plain = step(other, h), step(None, h)
            got_bias = Projection(hidden, h, None, bias)(None, h)
    d = torch.float64

    def close(got: torch.Tensor, exact: torch.Tensor) -> None:  # float32 results, float64 references
        torch.testing.assert_close(got, exact.float())

    close(got_linear, x.to(d) @ weight.to(d).t() + bias.to(d))
    close(got_tn, a.to(d).t() @ b.to(d))
    close(got_tn_view, b.to(d).t() @ a.to(d))
    close(got_step, other.to(d) + h.to(d) @ hidden.to(d).t())
    close(got_plain, h.to(d) @ hidden.to(d).t())
    close(got_bias, h.to(d) @ hidden.to(d).t() + bias.to(d))


@needs_onednn
def test_onednn_takes_only_plain_float32_cpu_products_outside_autograd(onednn_calls: list[tuple[int, ...]]) -> None:
    x, weight = torch.randn(3, 4), torch.randn(5, 4)
    with gemm_kernel("onednn"):
        assert linear_uses_onednn(x, weight)
        linear(x, weight)
        assert len(onednn_calls) == 1
        # a tensor autograd records, while grad mode is on: torch's kernel (oneDNN's has no backward)
        trained = weight.clone().requires_grad_()
        assert not linear_uses_onednn(x, trained)
        out = linear(x, trained)
        out.sum().backward()
        torch.testing.assert_close(trained.grad, x.sum(0).expand(5, 4))
        with torch.no_grad():
            assert linear_uses_onednn(x, trained)
        # other dtypes, autocast, torch.func transforms, subclasses, empty tensors: torch's kernel
        assert not linear_uses_onednn(x.double(), weight.double())
        assert not linear_uses_onednn(x.bfloat16(), weight.bfloat16())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not linear_uses_onednn(x, weight)
        assert not linear_uses_onednn(torch.empty(0, 4), weight)

        def wrapped_check(row: torch.Tensor) -> torch.Tensor:
            assert not linear_uses_onednn(row, weight)
            return linear(row, weight)

        torch.testing.assert_close(torch.func.vmap(wrapped_check)(x), x @ weight.t())
        assert len(onednn_calls) == 1


def test_aten_never_calls_onednn(onednn_calls: list[tuple[int, ...]]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), DPLSTM(4, 6, batch_first=True))
    with gemm_kernel("aten"):
        out, _ = model(torch.randint(0, 10, (2, 5)))
        out.sum().backward()
    assert onednn_calls == []


@needs_onednn
@pytest.mark.parametrize("layer", [DPLSTM, DPGRU, DPRNN])
def test_recurrent_layers_run_on_onednn_when_chosen(layer: type[nn.Module], onednn_calls: list[tuple[int, ...]]
                                                    ) -> None:
    """The time loops, both directions' steps and the input projection take oneDNN's kernel (so
    the oracle tests run under ``onednn`` exercise it), and equal torch's kernel. (The LSTM's loop
    taken step by step: psg's native loop, psg_core.native, computes its products itself.)"""
    torch.manual_seed(0)
    rnn = layer(4, 6, batch_first=True)
    x = torch.randn(3, 5, 4, requires_grad=True)
    results = {}
    for kernel in ("aten", "onednn"):
        with gemm_kernel(kernel), native.native_kernels("off"):
            rnn.zero_grad()
            x.grad = None
            out, _ = rnn(x)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            results[kernel] = (out.detach(), x.grad.clone(), *(p.grad.clone() for p in rnn.parameters()))
    steps = [shape for shape in onednn_calls if shape == (3, 6) or shape == (3, layer_gates(layer) * 6)]
    assert len(steps) >= 2 * 5 - 1, onednn_calls  # every forward step and all but the last backward one
    assert (3, 5, 4) in onednn_calls  # the input projection
    for a, b in zip(results["aten"], results["onednn"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def layer_gates(layer: type[nn.Module]) -> int:
    return {DPLSTM: 4, DPGRU: 3, DPRNN: 1}[layer]


class _TextModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = DPLSTM(8, 12, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(tokens))
        return self.mlp(out[:, -1])


@needs_onednn
@pytest.mark.parametrize("K", [1, 2])
def test_ghost_sums_equal_under_both_kernels_and_the_hooks_clipped_sum(K: int) -> None:
    """Ghost clipping's clipped weight sums (psg_core.gemm.mm_tn) and the recurrent layers on
    oneDNN equal torch's kernel and the hooks backend's materialised clipping."""
    torch.manual_seed(1)
    model = _TextModel()
    tokens, targets = torch.randint(0, 20, (4 * K, 6)), torch.randint(0, 3, (4 * K,))
    loss = nn.CrossEntropyLoss(reduction="none")
    config = DPConfig(mode="ghost", max_grad_norm=0.05, augmentation_multiplicity=K)
    results = {}
    for kernel in ("aten", "onednn"):
        with gemm_kernel(kernel):
            results[kernel] = dp_gradient(model, tokens, targets, loss_fn=loss, config=config)
    with gemm_kernel("aten"):
        per_sample = per_sample_gradients(model, tokens, targets, loss_fn=loss, mode="hooks",
                                          augmentation_multiplicity=K)
        reference = clip_and_sum(per_sample, max_grad_norm=0.05)
    for kernel, result in results.items():
        assert result.num_clipped == reference.num_clipped == 4
        torch.testing.assert_close(result.per_sample_norms, reference.per_sample_norms, rtol=1e-4, atol=1e-6)
        for name, grad in reference.grads.items():
            assert_close_scaled(result.grads[name], grad, name=f"{kernel} {name}")


# ------------------------------------------------------------------------------ the switch
def test_switch_setting_context_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gemm.get_gemm_kernel() is None
    assert gemm.current_gemm_kernel() is GemmKernel.RULE
    monkeypatch.setenv(gemm.ENVIRONMENT_VARIABLE, "aten")
    assert gemm.current_gemm_kernel() is GemmKernel.ATEN
    with gemm_kernel("auto"):
        assert gemm.current_gemm_kernel() is GemmKernel.AUTO
        with gemm_kernel(None):
            assert gemm.current_gemm_kernel() is GemmKernel.ATEN
    assert gemm.get_gemm_kernel() is None
    monkeypatch.setenv(gemm.ENVIRONMENT_VARIABLE, "fastest")
    with pytest.raises(ConfigError, match="PSG_GEMM.*unknown matrix-product kernel 'fastest'"):
        gemm.current_gemm_kernel()
    with pytest.raises(ConfigError, match="set_gemm_kernel: unknown matrix-product kernel 'mkl'"):
        gemm.set_gemm_kernel("mkl")


def test_rule_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN under the rule only on a CPU that is not Intel's, with AVX-512, where torch has it."""
    cases = [("GenuineIntel", "AVX512", True, False), ("AuthenticAMD", "AVX512", True, True),
             ("AuthenticAMD", "AVX2", True, False), ("AuthenticAMD", "AVX512", False, False),
             ("", "AVX512", True, False)]
    for vendor, capability, available, expected in cases:
        gemm._rule_prefers_onednn.cache_clear()
        monkeypatch.setattr(gemm, "_cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        monkeypatch.setattr(gemm, "onednn_available", lambda available=available: available)
        assert gemm._rule_prefers_onednn() is expected, (vendor, capability, available)
    gemm._rule_prefers_onednn.cache_clear()


@needs_onednn
def test_rule_leaves_small_products_to_torch(monkeypatch: pytest.MonkeyPatch,
                                            onednn_calls: list[tuple[int, ...]]) -> None:
    """Under the rule, products below RULE_MIN_MULTIPLY_ADDS take torch's kernel, larger ones oneDNN."""
    monkeypatch.setattr(gemm, "_rule_prefers_onednn", lambda: True)
    small_x, small_w = torch.randn(32, 64), torch.randn(64, 64)  # 131k multiply-adds
    large_x, large_w = torch.randn(64, 128), torch.randn(256, 128)  # 2.1M
    assert 32 * 64 * 64 < gemm.RULE_MIN_MULTIPLY_ADDS <= 64 * 128 * 256
    torch.testing.assert_close(gemm.linear(small_x, small_w), small_x @ small_w.t())
    torch.testing.assert_close(gemm.mm_tn(small_x, small_x), small_x.t() @ small_x)
    assert onednn_calls == []
    torch.testing.assert_close(gemm.linear(large_x, large_w), large_x @ large_w.t(), rtol=1e-4, atol=1e-4)
    a, b = torch.randn(256, 64), torch.randn(256, 128)  # mm_tn: 2.1M
    torch.testing.assert_close(gemm.mm_tn(a, b), a.t() @ b, rtol=1e-4, atol=1e-4)
    assert len(onednn_calls) == 2


@needs_onednn
def test_auto_measures_once_per_signature_and_keeps_the_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[list[str]] = []

    def fake_timing(candidates: dict[str, object], device: torch.device) -> dict[str, float]:
        timed.append(sorted(candidates))
        return {"aten": 1.0, "onednn": 0.95}  # oneDNN not 10% faster: torch's kernel is kept

    monkeypatch.setattr("psg_core.gemm.time_candidates", fake_timing)
    x, weight = torch.randn(3, 4), torch.randn(5, 4)
    with gemm_kernel("auto"):
        assert not linear_uses_onednn(x, weight)
        assert not linear_uses_onednn(torch.randn(3, 4), torch.randn(5, 4))  # same signature: cached
        assert timed == [["aten", "onednn"]]
        assert list(gemm.gemm_cache().values()) == ["aten"]
        monkeypatch.setattr("psg_core.gemm.time_candidates",
                            lambda candidates, device: {"aten": 1.0, "onednn": 0.5})
        assert linear_uses_onednn(torch.randn(6, 4), weight)  # a new signature: measured, oneDNN
        assert sorted(gemm.gemm_cache().values()) == ["aten", "onednn"]
    gemm.clear_gemm_cache()
    assert gemm.gemm_cache() == {}


@needs_onednn
def test_auto_really_times_both_kernels() -> None:
    x, weight = torch.randn(64, 32), torch.randn(48, 32)
    with gemm_kernel("auto"):
        linear(x, weight)
    (key, choice), = gemm.gemm_cache().items()
    assert key[0] == "linear" and choice in ("aten", "onednn")


@pytest.mark.parametrize("kernel", ["aten", pytest.param("onednn", marks=needs_onednn)])
def test_a_pass_to_the_layer_outputs_computes_no_weight_gradient(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks backend takes the layers' output gradients with torch.autograd.grad: the input and
    hidden projections' backward computes no weight gradient there (as F.linear's does not); an
    ordinary backward computes both."""
    import psg_core.layers._recurrence as recurrence

    weight_sums: list[tuple[int, ...]] = []
    real = recurrence.mm_tn

    def counted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        weight_sums.append(tuple(a.shape))
        return real(a, b)

    monkeypatch.setattr(recurrence, "mm_tn", counted)
    torch.manual_seed(0)
    model = _TextModel()
    tokens, targets = torch.randint(0, 20, (4, 6)), torch.randint(0, 3, (4,))
    with gemm_kernel(kernel):
        per_sample_gradients(model, tokens, targets, loss_fn=nn.CrossEntropyLoss(reduction="none"), mode="hooks")
        assert weight_sums == []
        nn.functional.cross_entropy(model(tokens), targets).backward()
    assert len(weight_sums) == (2 if kernel == "onednn" else 1)  # hh always through _KnownOutput; ih on oneDNN
