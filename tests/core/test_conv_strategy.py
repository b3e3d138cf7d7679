"""Every way of computing a convolution's per-sample gradients and ghost norms, against the oracle,
and the switch that chooses among them (psg_core.grad_sample.conv_strategy)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import psg_core
import psg_core.grad_sample.conv as conv_module
import psg_core.grad_sample.conv_strategy as strategy_module
from psg_core.clipping import clip_and_sum
from psg_core.config import DPConfig
from psg_core.dp import dp_gradient
from psg_core.errors import ConfigError
from psg_core.grad_sample.conv import conv_per_sample_strategy, conv_weight_per_sample
from psg_core.grad_sample.conv_strategy import (ConvStrategy, clear_conv_strategy_cache, conv_strategy,
                                                conv_strategy_cache, current_conv_strategy, get_conv_strategy,
                                                set_conv_strategy)
from tests.core.test_conv import CONV_CASES, KS, REDUCTIONS, SAME_EVEN_KERNEL, TRANSPOSE_CASES
from tests.devices import requires_cuda
from tests.oracle import assert_close_scaled, check_against_oracle, microbatch_oracle, mse_loss, split_samples

ALL_CASES = CONV_CASES + TRANSPOSE_CASES
CASE_IDS = [case[0] for case in ALL_CASES]
PER_SAMPLE = ["grouped_conv", "unfold", "correlate", "auto"]
GHOST = ["gram", "grouped_conv", "unfold", "correlate", "auto", "rule"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_strategy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from the default (no setting, no environment variable, an empty cache)."""
    monkeypatch.delenv(strategy_module.ENVIRONMENT_VARIABLE, raising=False)
    set_conv_strategy(None)
    clear_conv_strategy_cache()
    yield
    set_conv_strategy(None)
    clear_conv_strategy_cache()


@pytest.fixture
def used(monkeypatch: pytest.MonkeyPatch) -> list[ConvStrategy]:
    """Records every per-sample kernel that runs (measurement included)."""
    seen: list[ConvStrategy] = []
    for strategy, fn in list(conv_module._PER_SAMPLE.items()):
        def spy(*args: Any, _fn: Callable[..., torch.Tensor] = fn, _s: ConvStrategy = strategy) -> torch.Tensor:
            seen.append(_s)
            return _fn(*args)
        monkeypatch.setitem(conv_module._PER_SAMPLE, strategy, spy)
    return seen


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[ConvStrategy, ...]]:
    """Records the candidates of every measurement (which still runs)."""
    seen: list[tuple[ConvStrategy, ...]] = []
    original = strategy_module.time_candidates

    def spy(candidates: Any, device: torch.device) -> dict[ConvStrategy, float]:
        seen.append(tuple(candidates))
        return original(candidates, device)

    monkeypatch.setattr(strategy_module, "time_candidates", spy)
    return seen


def _batch(make: Callable[[], nn.Module], row_shape: tuple[int, ...], K: int, *, n_samples: int = 3,
           seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = make()
    x = torch.randn(n_samples * K, *row_shape)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    return model, x, y


# ------------------------------------------------------------------------------ hooks, per strategy
@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("strategy", PER_SAMPLE)
@pytest.mark.parametrize(("name", "make", "row_shape"), ALL_CASES, ids=CASE_IDS)
@SAME_EVEN_KERNEL
def test_hooks_strategy_matches_oracle(name: str, make: Callable[[], nn.Module], row_shape: tuple[int, ...],
                                       strategy: str, K: int, loss_reduction: str, used: list[ConvStrategy]) -> None:
    model, x, y = _batch(make, row_shape, K)
    with conv_strategy(strategy):
        check_against_oracle(model, x, y, K=K, loss_reduction=loss_reduction)
    if strategy == "correlate" and not conv_module.is_depthwise(model):  # forced where it applies only
        assert used and ConvStrategy.CORRELATE not in used
    elif strategy != "auto":
        assert used and set(used) == {ConvStrategy(strategy)}
    else:  # measured once: every admissible candidate ran, one choice cached
        assert len(conv_strategy_cache()) == 1


@pytest.mark.parametrize(("name", "make", "row_shape"), ALL_CASES, ids=CASE_IDS)
@SAME_EVEN_KERNEL
def test_strategies_agree_directly(name: str, make: Callable[[], nn.Module], row_shape: tuple[int, ...]) -> None:
    """conv_weight_per_sample gives the same tensor every way, with K folded in (correlate on the
    depthwise layers, and a clear error on the others)."""
    model, x, _ = _batch(make, row_shape, 2)
    g = torch.randn_like(model(x))
    grouped = conv_weight_per_sample(model, x, g, 2, strategy="grouped_conv")
    unfolded = conv_weight_per_sample(model, x, g, 2, strategy=ConvStrategy.UNFOLD)
    torch.testing.assert_close(grouped, unfolded, rtol=1e-4, atol=1e-5)
    if conv_module.is_depthwise(model):
        correlated = conv_weight_per_sample(model, x, g, 2, strategy="correlate")
        torch.testing.assert_close(correlated, unfolded, rtol=1e-4, atol=1e-5)
    else:
        with pytest.raises(ConfigError, match="depthwise convolutions only"):
            conv_weight_per_sample(model, x, g, 2, strategy="correlate")


# ------------------------------------------------------------------------------ ghost, per strategy
def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int, reduction: str
               ) -> tuple[dict[str, torch.Tensor], float]:
    """The oracle's per-sample gradients and a bound that clips all samples but the smallest."""
    expected = microbatch_oracle(model, split_samples(x, y, K), mse_loss(reduction))
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1).sort().values  # (N,)
    return expected, float(norms[0] + norms[1]) / 2


@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("strategy", GHOST)
@pytest.mark.parametrize(("name", "make", "row_shape"), ALL_CASES, ids=CASE_IDS)
@SAME_EVEN_KERNEL
def test_ghost_strategy_matches_oracle(name: str, make: Callable[[], nn.Module], row_shape: tuple[int, ...],
                                       strategy: str, K: int, loss_reduction: str, used: list[ConvStrategy]) -> None:
    model, x, y = _batch(make, row_shape, K)
    expected, bound = _reference(model, x, y, K, loss_reduction)
    reference = clip_and_sum(expected, max_grad_norm=bound)
    config = DPConfig(mode="ghost", augmentation_multiplicity=K, loss_reduction=loss_reduction, max_grad_norm=bound)
    with conv_strategy(strategy):
        result = dp_gradient(model, x, y, loss_fn=mse_loss("none"), config=config)
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
    assert result.num_clipped == reference.num_clipped
    for param_name, grad in reference.grads.items():
        assert_close_scaled(result.grads[param_name], grad, name=param_name)
    if strategy == "gram":
        assert not used  # norms from Gram matrices, the sum from the kept activations
    elif strategy in ("grouped_conv", "unfold"):
        assert used and set(used) == {ConvStrategy(strategy)}


def test_ghost_auto_measures_once_and_seeds_the_per_sample_choice(used: list[ConvStrategy]) -> None:
    model, x, y = _batch(lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 6, 6), 2)
    config = DPConfig(mode="ghost", augmentation_multiplicity=2, max_grad_norm=1.0)
    with conv_strategy("auto"):
        first = dp_gradient(model, x, y, loss_fn=mse_loss("none"), config=config)
        cached = conv_strategy_cache()
        assert [key[0] for key in cached] in (["ghost"], ["ghost", "per_sample"])
        measured = len(used)
        second = dp_gradient(model, x, y, loss_fn=mse_loss("none"), config=config)
    assert conv_strategy_cache() == cached
    ghost_choice = next(v for k, v in cached.items() if k[0] == "ghost")
    # The second step measures nothing: at most the chosen kernel runs once.
    assert len(used) - measured == (0 if ghost_choice is ConvStrategy.GRAM else 1)
    torch.testing.assert_close(first.per_sample_norms, second.per_sample_norms)


# ------------------------------------------------------------------------------ the switch
def test_default_is_rule_on_cpu_and_auto_on_cuda() -> None:
    assert get_conv_strategy() is None
    assert current_conv_strategy(CPU) is ConvStrategy.RULE
    assert current_conv_strategy(torch.device("cuda")) is ConvStrategy.AUTO  # no device needed to ask


def test_environment_variable_and_setters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSG_CONV_STRATEGY", "unfold")
    assert current_conv_strategy(CPU) is ConvStrategy.UNFOLD
    with conv_strategy("grouped_conv"):  # the setting overrides the environment
        assert current_conv_strategy(CPU) is ConvStrategy.GROUPED_CONV
        with psg_core.conv_strategy(ConvStrategy.GRAM):
            assert current_conv_strategy(CPU) is ConvStrategy.GRAM
        assert current_conv_strategy(CPU) is ConvStrategy.GROUPED_CONV
    assert current_conv_strategy(CPU) is ConvStrategy.UNFOLD
    psg_core.set_conv_strategy("auto")
    assert current_conv_strategy(CPU) is ConvStrategy.AUTO
    monkeypatch.setenv("PSG_CONV_STRATEGY", "fastest")
    psg_core.set_conv_strategy(None)
    with pytest.raises(ConfigError, match="PSG_CONV_STRATEGY: unknown convolution strategy 'fastest'"):
        current_conv_strategy(CPU)
    with pytest.raises(ConfigError, match="set_conv_strategy: unknown convolution strategy 'im2col'"):
        set_conv_strategy("im2col")


def test_per_sample_refuses_gram_and_forced_gram_follows_the_rule() -> None:
    conv = nn.Conv2d(2, 3, 3)
    x, g = torch.randn(2, 2, 5, 5), torch.randn(2, 3, 3, 3)
    with pytest.raises(ConfigError, match="conv_weight_per_sample: strategy must be one of"):
        conv_weight_per_sample(conv, x, g, strategy="gram")
    with conv_strategy("gram"):
        assert conv_per_sample_strategy(conv, x, g, 1) is conv_per_sample_strategy(conv, x, g, 1)
        assert conv_per_sample_strategy(conv, x, g, 1) in strategy_module.PER_SAMPLE_STRATEGIES
    assert not conv_strategy_cache()  # neither the rule nor a forced strategy measures


@pytest.mark.parametrize("onednn_ahead", [False, True])
def test_rule_on_cpu(onednn_ahead: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU rule: unfold for wide layers with few positions (from O*I >= 1024 T, or
    1024 T max(1, T/128) where oneDNN runs AVX-512 and MKL AVX2) and, unless oneDNN is ahead, for
    few input channels; the grouped kernel elsewhere and for grouped convolutions; correlate for
    depthwise ones of stride 1 (any channel multiplier) with 25 taps or more or at most 16 output
    positions, unfold for a 1x1 map."""
    monkeypatch.setattr(strategy_module, "onednn_outpaces_mkl", lambda: onednn_ahead)
    first = ConvStrategy.GROUPED_CONV if onednn_ahead else ConvStrategy.UNFOLD
    between = ConvStrategy.GROUPED_CONV if onednn_ahead else ConvStrategy.UNFOLD  # O*I = 1296 T
    cases = [(nn.Conv2d(128, 128, 3, padding=1), 8, ConvStrategy.UNFOLD),
             (nn.Conv2d(3, 16, 3, padding=1), 32, first),
             (nn.Conv2d(192, 192, 3, padding=1), 16, between),
             (nn.Conv2d(64, 128, 3, padding=1), 8, ConvStrategy.UNFOLD),  # O*I = 1152 T at T 64
             (nn.Conv2d(32, 32, 3, padding=1), 32, ConvStrategy.GROUPED_CONV),
             (nn.Conv2d(64, 64, 3, padding=1, groups=64), 4, ConvStrategy.CORRELATE),
             (nn.Conv2d(64, 64, 3, padding=1, groups=64), 14, ConvStrategy.GROUPED_CONV),
             (nn.Conv2d(64, 64, 3, padding=1, groups=64), 1, ConvStrategy.UNFOLD),
             (nn.Conv2d(32, 64, 7, padding=3, groups=32), 8, ConvStrategy.CORRELATE),
             (nn.Conv2d(32, 32, 7, padding=3, groups=32), 1, ConvStrategy.UNFOLD),
             (nn.Conv2d(64, 64, 3, stride=2, padding=1, groups=64), 8, ConvStrategy.GROUPED_CONV),
             (nn.Conv2d(64, 64, 3, padding=1, groups=16), 4, ConvStrategy.GROUPED_CONV)]
    for conv, side, expected in cases:
        x = torch.randn(2, conv.in_channels, side, side)
        g = torch.randn(2, conv.out_channels, side, side)
        assert conv_per_sample_strategy(conv, x, g, 1) is expected, conv


def test_auto_caches_per_signature_with_batch_buckets(timed: list[tuple[ConvStrategy, ...]]) -> None:
    conv = nn.Conv2d(2, 3, 3, padding=1)
    with conv_strategy("auto"):
        for n_samples in (5, 6, 8, 9):  # 5..8 share the bucket 8, 9 is in 16
            x, g = torch.randn(n_samples, 2, 6, 6), torch.randn(n_samples, 3, 6, 6)
            conv_weight_per_sample(conv, x, g)
        conv_weight_per_sample(conv, torch.randn(4, 2, 7, 7), torch.randn(4, 3, 7, 7))  # a new shape
        conv_weight_per_sample(conv, torch.randn(4, 2, 6, 6).double(), torch.randn(4, 3, 6, 6).double())
    assert len(timed) == 4 and all(set(t) == {ConvStrategy.GROUPED_CONV, ConvStrategy.UNFOLD} for t in timed)
    assert sorted(key[4] for key in conv_strategy_cache()) == [4, 4, 8, 16]


def test_auto_leaves_out_candidates_that_need_far_more_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gram matrices over 1024 positions per sample are not even tried for a small weight."""
    timed: list[tuple[ConvStrategy, ...]] = []
    monkeypatch.setattr(strategy_module, "time_candidates",
                        lambda candidates, device: timed.append(tuple(candidates)) or dict.fromkeys(candidates, 1.0))
    model, x, y = _batch(lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 32, 32), 1)
    with conv_strategy("auto"):
        dp_gradient(model, x, y, loss_fn=mse_loss("none"), config=DPConfig(mode="ghost", max_grad_norm=1.0))
    assert timed and ConvStrategy.GRAM not in timed[0]


def test_measurement_survives_an_out_of_memory_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(*args: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setitem(conv_module._PER_SAMPLE, ConvStrategy.UNFOLD, out_of_memory)
    conv = nn.Conv2d(2, 3, 3)
    with conv_strategy("auto"):
        conv_weight_per_sample(conv, torch.randn(2, 2, 5, 5), torch.randn(2, 3, 3, 3))
    assert list(conv_strategy_cache().values()) == [ConvStrategy.GROUPED_CONV]


@requires_cuda
@pytest.mark.parametrize("strategy", PER_SAMPLE)
@pytest.mark.parametrize("groups", [2, 4])  # grouped; depthwise, two output channels per input
def test_cuda_strategies_match_cpu(strategy: str, groups: int) -> None:
    model, x, _ = _batch(lambda: nn.Conv2d(4, 8, 3, padding=1, groups=groups), (4, 8, 8), 2)
    g = torch.randn_like(model(x))
    expected = conv_weight_per_sample(model, x, g, 2, strategy="grouped_conv")
    with conv_strategy(strategy):
        actual = conv_weight_per_sample(model.cuda(), x.cuda(), g.cuda(), 2)
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-3, atol=1e-4)


def test_auto_times_correlate_on_cpu_only(timed: list[tuple[ConvStrategy, ...]]) -> None:
    """auto measures correlate for a depthwise layer where it was measured (CPU); on CUDA only a
    forced strategy runs it (the candidates for a CUDA device are filtered, no GPU needed)."""
    conv = nn.Conv2d(4, 8, 3, padding=1, groups=4)
    with conv_strategy("auto"):
        conv_weight_per_sample(conv, torch.randn(2, 4, 6, 6), torch.randn(2, 8, 6, 6))
    assert timed and set(timed[0]) == {ConvStrategy.GROUPED_CONV, ConvStrategy.UNFOLD, ConvStrategy.CORRELATE}
    everything = list(strategy_module.PER_SAMPLE_STRATEGIES)
    assert conv_module._measurable(everything, torch.device("cuda")) == [ConvStrategy.GROUPED_CONV,
                                                                          ConvStrategy.UNFOLD]
    assert conv_module._measurable(everything, CPU) == everything


@pytest.mark.parametrize("side", [1, 2, 3, 5])
def test_correlate_on_maps_smaller_than_the_kernel(side: int) -> None:
    """A 7x7 depthwise layer on maps smaller than its kernel (ConvNeXt's last stages; correlate
    runs channels-last there): every way gives the same per-sample gradients, K = 2, two output
    channels per input channel, dilation 1 and 2."""
    for dilation in (1, 2):
        conv = nn.Conv2d(3, 6, 7, padding=3 * dilation, dilation=dilation, groups=3)
        x = torch.randn(4, 3, side, side)
        g = torch.randn_like(conv(x))
        expected = conv_weight_per_sample(conv, x, g, 2, strategy="unfold")
        for strategy in ("correlate", "grouped_conv"):
            torch.testing.assert_close(conv_weight_per_sample(conv, x, g, 2, strategy=strategy), expected,
                                       rtol=1e-4, atol=1e-5, msg=f"{strategy}, dilation {dilation}")
