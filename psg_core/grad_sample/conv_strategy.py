"""How convolutions get their per-sample weight gradients (and ghost norms): the kernel choice.

The same per-sample gradient can be computed several ways, and which one is fastest depends on
the layer's shape, the dtype and the device (on one H100 cuDNN's grouped weight-gradient kernel is
3x slower than unfold + bmm at a CIFAR CNN's shape; on a CPU the grouped kernel wins there and
loses on wide layers with few positions):

* ``grouped_conv``: stack the samples along channels and take the weight gradient of one grouped
  convolution (``groups = N * G``) whose batch is the K copies: no unfolded patches;
* ``unfold``: copy out the im2col patches and contract them with the output gradients (one
  batched matmul per sample and group), as Opacus does;
* ``correlate`` (depthwise convolutions only: ``groups == in_channels``): each sample's input
  correlated with its own output gradient, all samples as one *forward* convolution with
  ``groups = N * C`` whose weights are the output gradients;
* ``gram`` (ghost clipping only): the per-sample *norm* from two ``(T, T)`` Gram matrices, never
  the gradient; its clipped sum comes from one weight-gradient kernel over the batch.

The choice is made per call signature (layer hyper-parameters, per-row shapes, the batch size
rounded up to a power of two, K, dtype, device) in one of three ways:

* ``auto``: the candidates are timed once on the call's own tensors and the fastest is cached
  for the process, as ``torch.backends.cudnn.benchmark`` does (so the first step with a new
  shape synchronises with the device while it measures; later steps do not). Candidates that
  would need orders of magnitude more memory than the leanest one are not tried (see
  :func:`admissible`).
* ``rule``: a fixed rule of the shapes, no measurement (see :func:`rule_per_sample`).
* a forced strategy: ``grouped_conv``, ``unfold``, ``correlate`` or ``gram`` wherever it
  applies, the rule elsewhere (``gram`` forces ghost's Gram norms; per-sample gradients then
  follow the rule).

The default is ``auto`` on CUDA and ``rule`` on CPU. On CPU the kernels' relative costs follow
the shapes closely enough for a rule, while a measurement of a few milliseconds is at the mercy
of whatever else runs on the cores (on a shared 2-core host one kernel's best-of-15 time moved by up to 8x
between runs), so an ``auto`` choice would be noisy and not reproducible from run to run; and it
would cost several steps' worth of time per new shape. The environment variable
``PSG_CONV_STRATEGY`` changes the default; :func:`set_conv_strategy` and the
:func:`conv_strategy` context manager override both.

>>> with conv_strategy("unfold"):
...     current_conv_strategy(torch.device("cpu"))
<ConvStrategy.UNFOLD: 'unfold'>
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from psg_core._settings import ProcessSetting, time_candidates
from psg_core.gemm import onednn_outpaces_mkl

__all__ = ["ConvStrategy", "PER_SAMPLE_STRATEGIES", "ENVIRONMENT_VARIABLE", "set_conv_strategy",
           "get_conv_strategy", "conv_strategy", "current_conv_strategy", "clear_conv_strategy_cache",
           "conv_strategy_cache", "choose_measured", "admissible", "rule_per_sample"]

logger = logging.getLogger(__name__)

#: The environment variable that sets the default strategy (``auto``, ``rule``, ``grouped_conv``,
#: ``unfold``, ``correlate`` or ``gram``).
ENVIRONMENT_VARIABLE = "PSG_CONV_STRATEGY"


class ConvStrategy(str, enum.Enum):
    """How a convolution's per-sample weight gradient (or ghost norm) is computed."""

    #: measure the candidates once per call signature, keep the fastest for the process.
    AUTO = "auto"
    #: a fixed rule of the shapes (see :func:`rule_per_sample`), no measurement.
    RULE = "rule"
    #: the weight gradient of one grouped convolution over the samples.
    GROUPED_CONV = "grouped_conv"
    #: im2col patches contracted with the output gradients.
    UNFOLD = "unfold"
    #: depthwise convolutions: inputs correlated with their output gradients (one forward convolution).
    CORRELATE = "correlate"
    #: ghost clipping only: per-sample norms from Gram matrices.
    GRAM = "gram"


#: The strategies that materialise per-sample gradients.
PER_SAMPLE_STRATEGIES = (ConvStrategy.GROUPED_CONV, ConvStrategy.UNFOLD, ConvStrategy.CORRELATE)

_LOCK = threading.RLock()
_SETTING = ProcessSetting(ConvStrategy, ENVIRONMENT_VARIABLE, "convolution strategy")
#: signature -> chosen strategy (``auto`` only).
_cache: dict[tuple[Any, ...], ConvStrategy] = {}


def set_conv_strategy(strategy: ConvStrategy | str | None) -> None:
    """Sets how convolutions compute per-sample gradients and ghost norms, for the process (every
    thread: the setting is process-wide, like ``torch.backends.cudnn.benchmark``).

    Args:
        strategy: ``"auto"`` (measure once per shape, cache), ``"rule"`` (fixed rule),
            ``"grouped_conv"``, ``"unfold"``, ``"correlate"`` or ``"gram"`` (forced where it
            applies, the rule elsewhere), or None to go back to the default
            (``PSG_CONV_STRATEGY``, else ``auto`` on CUDA and ``rule`` on CPU).

    >>> set_conv_strategy("grouped_conv"); get_conv_strategy()
    <ConvStrategy.GROUPED_CONV: 'grouped_conv'>
    >>> set_conv_strategy(None); get_conv_strategy() is None
    True
    """
    _SETTING.set(strategy, where="set_conv_strategy")


def get_conv_strategy() -> ConvStrategy | None:
    """The strategy set by :func:`set_conv_strategy` (None: the default applies)."""
    return _SETTING.forced


def conv_strategy(strategy: ConvStrategy | str | None) -> contextlib.AbstractContextManager[None]:
    """:func:`set_conv_strategy` for the duration of a block, then the previous setting.

    >>> with conv_strategy("rule"):
    ...     get_conv_strategy()
    <ConvStrategy.RULE: 'rule'>
    """
    return _SETTING.scoped(strategy, where="set_conv_strategy")


def current_conv_strategy(device: torch.device) -> ConvStrategy:
    """The strategy in force for tensors on ``device``: the one set, else ``PSG_CONV_STRATEGY``,
    else ``auto`` on CUDA and ``rule`` elsewhere (see the module docstring for why)."""
    return _SETTING.current(ConvStrategy.AUTO if device.type == "cuda" else ConvStrategy.RULE)


def clear_conv_strategy_cache() -> None:
    """Forgets every measured choice (the next call of each signature measures again)."""
    with _LOCK:
        _cache.clear()


def conv_strategy_cache() -> dict[tuple[Any, ...], ConvStrategy]:
    """A copy of the measured choices: ``{signature: strategy}``."""
    with _LOCK:
        return dict(_cache)


def seed_cache(key: tuple[Any, ...], strategy: ConvStrategy) -> None:
    """Records ``strategy`` for ``key`` unless a choice is cached already."""
    with _LOCK:
        _cache.setdefault(key, strategy)


# ------------------------------------------------------------------------------ measurement
def choose_measured(key: tuple[Any, ...], candidates: Mapping[ConvStrategy, Callable[[], Any]],
                    device: torch.device) -> ConvStrategy:
    """The cached choice for ``key``, or the fastest of ``candidates`` (timed now, then cached).

    ``candidates`` maps each strategy to a call that runs it on the real tensors (its result is
    dropped). One candidate is returned without timing.
    """
    with _LOCK:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        if len(candidates) == 1:
            choice = next(iter(candidates))
        else:
            with torch.no_grad():
                seconds = time_candidates(candidates, device)
            if not seconds:
                raise torch.OutOfMemoryError(f"conv strategy: every candidate of {key} ran out of memory")
            choice = min(seconds, key=lambda s: seconds[s])
            logger.debug("conv strategy for %s: %s (%s)", key, choice.value,
                         ", ".join(f"{s.value} {t * 1e3:.3f} ms" for s, t in seconds.items()))
        _cache[key] = choice
        return choice


def admissible(footprints: Mapping[ConvStrategy, int], baseline: int) -> list[ConvStrategy]:
    """The strategies whose extra memory (elements) is at most twice the leanest one's plus eight
    times ``baseline`` (the layer's own input and output gradient, alive anyway).

    A faster way may use memory of the order of the layer's activations (unfolding a 3x3
    convolution copies its input 9 times, about 4.5 times input and output gradient together,
    as Opacus does), never orders of magnitude more: not ``(T, T)`` Gram matrices over a
    thousand positions, nor a wide weight materialised for every sample of a layer with few
    positions.

    >>> admissible({ConvStrategy.GROUPED_CONV: 10, ConvStrategy.UNFOLD: 900}, baseline=100)
    [<ConvStrategy.GROUPED_CONV: 'grouped_conv'>]
    """
    leanest = min(footprints.values())
    return [s for s, size in footprints.items() if size <= 2 * leanest + 8 * baseline]


# ------------------------------------------------------------------------------ rules
def rule_per_sample(*, device: torch.device, groups: int, out_per_group: int, patch: int,
                    positions: int, fits: bool, onednn_ahead: bool | None = None,
                    depthwise: bool = False, row_positions: int = 0) -> ConvStrategy:
    """The fixed rule between ``grouped_conv``, ``unfold`` and ``correlate`` for materialised
    gradients.

    Args:
        device: where the tensors are.
        groups: G.
        out_per_group: O, output channels of the weight per group (``C_out / G``; ``C_in / G``
            for a transposed convolution).
        patch: I, the unfolded patch length per group (``C_in / G * prod(kernel)``).
        positions: T, positions per sample (``K * L``).
        fits: whether unfolding stays within :func:`admissible`'s memory bound.
        onednn_ahead: whether the host's oneDNN (the grouped kernel's) runs AVX-512 while MKL
            (unfold's ``bmm``) runs AVX2 (:func:`psg_core.gemm.onednn_outpaces_mkl`, asked when None).
        depthwise: the layer is a (non-transposed) depthwise convolution (``groups ==
            in_channels``), which ``correlate`` applies to, of stride 1.
        row_positions: L, the output positions of one row (``positions / K``).

    CPU (171 shapes of 3x3 Conv2d timed with one thread on a 2-core Xeon, torch 2.13, N 16 and
    64, K 1 and 4): the grouped kernel wins by 1.2-4x wherever its per-group weight ``O * I``
    is modest next to the positions it sums over; unfold + bmm wins by up to 8x on wide layers
    with few positions (``O * I >= 1024 * T``: 128 channels at 8x8, 256 at 4x4; around
    ``512 * T`` the two are even) and by up to 1.7x on a first layer with few input channels
    (``I <= 32``), where the grouped kernel's tiny channel groups are slow. The rule picks the
    faster one on 157 of the 171 shapes, loses at most 1.55x on the others and 1.3% on average
    (geometric mean). On a CPU where oneDNN runs AVX-512 and MKL AVX2 (an AMD EPYC, Zen 5) the
    grouped kernel has twice the vector width: measured there (one thread, N 16 and 64, K 1, 2
    and 4, 3x3 kernels, median of 12 cold calls) it wins on first layers too (3 -> 96 channels at
    32x32: 1.7 vs 2.8 ms), and its edge grows with the positions it sums over: unfold wins from
    ``O * I`` about ``1024 * T`` up to T 128 (64 -> 128 at 8x8, N 64: 9.1 vs 21.5 ms; 128 at
    8x8, K 2: 10.8 vs 13.3 ms) but only from about ``2048 * T`` at T 256 (192 at 16x16: grouped
    29 vs 31 ms at N 16, 154 vs 185 at N 64; 256 at 8x8, K 4: even). There the rule is
    ``O * I >= 1024 * T * max(1, T / 128)`` alone. Depthwise convolutions of stride 1 on a CPU
    (one thread, 2-core AMD EPYC, Zen 4, N 16, 64-256 channels): kernels of 25 taps and more
    (5x5, ConvNeXt's 7x7) take ``correlate``, whose forward kernel is 5-50x faster than the
    weight-gradient kernel over ``N * C`` one-channel groups (7x7: 0.08-0.2 against 0.9-3.9 ms at
    2x2 to 4x4, 1.9 against 27 ms at 14x14, 3.1 against 47 ms at 28x28; 5x5 at 28x28: 1.2 against
    17); 3x3 kernels take it up to 16 output positions (0.09-0.14 against 0.12-0.9 ms) and keep
    the grouped kernel beyond, where the two are within 30% either way; one output position (a
    1x1 map) takes ``unfold`` (0.1 ms; the grouped kernel 0.3-1.8, correlate 2.5-11). A strided
    one keeps the grouped kernel (the forward kernel's dilation is slower: 2.5 against 1.8 ms at
    64 channels, 56x56, stride 2), and so do other grouped convolutions. On CUDA ``auto`` does
    not time ``correlate`` (not measured on a GPU yet; forcing it runs it). CUDA (used only
    when measuring is off): unfold + bmm whenever it fits and G = 1, since cuDNN's grouped weight
    gradient with ``N * G`` groups falls back to a slow generic kernel (issue 23's H100 profile
    of the CIFAR CNN).

    >>> rule_per_sample(device=torch.device("cpu"), groups=1, out_per_group=128, patch=1152,
    ...                 positions=64, fits=True)
    <ConvStrategy.UNFOLD: 'unfold'>
    >>> rule_per_sample(device=torch.device("cpu"), groups=1, out_per_group=32, patch=288,
    ...                 positions=1024, fits=True)
    <ConvStrategy.GROUPED_CONV: 'grouped_conv'>
    >>> [rule_per_sample(device=torch.device("cpu"), groups=1, out_per_group=96, patch=27, positions=1024,
    ...                  fits=True, onednn_ahead=ahead).value for ahead in (False, True)]  # a first layer
    ['unfold', 'grouped_conv']
    >>> [rule_per_sample(device=torch.device("cpu"), groups=96, out_per_group=1, patch=patch, positions=side ** 2,
    ...                  fits=True, depthwise=True, row_positions=side ** 2).value
    ...  for patch, side in ((49, 56), (9, 4), (9, 14), (49, 1))]  # depthwise 7x7, 3x3 small and large, a 1x1 map
    ['correlate', 'correlate', 'grouped_conv', 'unfold']
    """
    if depthwise and device.type != "cuda":
        if row_positions == 1 and fits:
            return ConvStrategy.UNFOLD
        if patch >= 25 or row_positions <= 16:
            return ConvStrategy.CORRELATE
        return ConvStrategy.GROUPED_CONV
    if groups != 1 or not fits:
        return ConvStrategy.GROUPED_CONV
    if device.type == "cuda":
        return ConvStrategy.UNFOLD
    if onednn_ahead is None:
        onednn_ahead = onednn_outpaces_mkl()
    if onednn_ahead:
        wide = out_per_group * patch >= 1024 * positions * max(1.0, positions / 128)
        return ConvStrategy.UNFOLD if wide else ConvStrategy.GROUPED_CONV
    if patch <= 32 or out_per_group * patch >= 1024 * positions:
        return ConvStrategy.UNFOLD
    return ConvStrategy.GROUPED_CONV
