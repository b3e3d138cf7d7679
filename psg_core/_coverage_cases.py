"""The examples behind the coverage table (:mod:`psg_core.coverage`): one tiny model per layer, and
every refusal the table states, with the condition under which it happens and a model that shows it.

Rows are ``K * samples`` on the batch dimension; each example builds its model and inputs afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from psg_core.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention, SequenceBias
from psg_core.modes import GradSampleMode

__all__ = ["K", "SAMPLES", "ROWS", "Example", "Refusal", "EXAMPLES", "REFUSALS"]

K = 2
SAMPLES = 2
ROWS = K * SAMPLES


@dataclass(frozen=True)
class Example:
    """A model and its positional inputs (``ROWS`` rows on dimension 0, or 1 when not ``batch_first``)."""

    model: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    batch_first: bool = True
    #: run under ``torch.autocast("cpu", dtype=...)`` and compare with the fp32 reference within
    #: the documented mixed-precision tolerance (psg_core.precision).
    autocast: torch.dtype | None = None


@dataclass(frozen=True)
class Refusal:
    """``mode`` refuses ``layer`` (a row of the table) ``condition``, with a ``PsgError`` naming it.

    ``example`` shows the refusal; ``None`` means the layer is refused in every configuration
    (its row's own example shows it) and ``condition`` says why.
    """

    mode: GradSampleMode
    layer: str
    condition: str
    example: Example | None = None

    @property
    def always(self) -> bool:
        return self.example is None


class _FirstOutput(nn.Module):
    """Keeps the first output of layers returning tuples (recurrent layers, attention)."""

    def __init__(self, layer: nn.Module, self_attention: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.self_attention = self_attention

    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        out = self.layer(x, x, x, *rest) if self.self_attention else self.layer(x, *rest)
        return out[0]


class _BareParameter(nn.Module):
    """A custom module whose parameter no grad sampler knows: ``x * scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Padded(nn.Module):
    """A recurrent layer on a PackedSequence, its output padded back to ``steps``."""

    def __init__(self, rnn: nn.Module, steps: int) -> None:
        super().__init__()
        self.rnn = rnn
        self.steps = steps

    def forward(self, packed: PackedSequence) -> torch.Tensor:
        out, _ = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=self.steps)[0]  # (B, T, H)


class _Masked(nn.Module):
    """Self-attention with a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = DPMultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, key_padding_mask=mask)[0]


class _MaskedTimeMajor(nn.Module):
    """Time-major self-attention with a key padding mask (the mask is batch-first whatever the
    layout: functorch splits it along the layout's batch dimension, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = DPMultiheadAttention(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, key_padding_mask=mask)[0]


class _Bag(nn.Module):
    """An EmbeddingBag called with offsets."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, **options)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(ids, offsets)


class _AutocastCNN(nn.Module):
    """A small CNN for the mixed-precision rows: convolution, GroupNorm, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1)).float()


def _floats(*shape: int) -> Callable[[], tuple[Any, ...]]:
    return lambda: (torch.randn(ROWS, *shape),)


def _time_major(steps: int, *shape: int) -> Callable[[], tuple[Any, ...]]:
    return lambda: (torch.randn(steps, ROWS, *shape),)


def _tokens(vocab: int, *shape: int) -> Callable[[], tuple[Any, ...]]:
    return lambda: (torch.randint(0, vocab, (ROWS, *shape)),)


def _time_major_tokens(vocab: int, steps: int) -> Callable[[], tuple[Any, ...]]:
    return lambda: (torch.randint(0, vocab, (steps, ROWS)),)


def _packed() -> tuple[Any, ...]:
    lengths = torch.tensor([4, 2, 3, 1])  # ROWS sequences
    return (pack_padded_sequence(torch.randn(ROWS, 4, 3), lengths, batch_first=True, enforce_sorted=False),)


def _with_state(lstm: bool) -> Callable[[], tuple[Any, ...]]:
    def inputs() -> tuple[Any, ...]:
        state = torch.randn(1, ROWS, 4)  # (layers * directions, B, H): the batch on axis 1
        return torch.randn(ROWS, 5, 3), ((state, torch.randn(1, ROWS, 4)) if lstm else state)
    return inputs


def _bags(**options: Any) -> Example:
    last = bool(options.get("include_last_offset"))
    return Example(lambda: _Bag(**options),
                   lambda: (torch.randint(0, 10, (9,)), torch.tensor([0, 2, 4, 7] + ([9] if last else []))))


def _eval_batch_norm(layer: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A BatchNorm in eval mode with running statistics and affine parameters away from their
    initial values (as a pretrained network has them): a per-channel affine map of each row."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor, low, high in ((layer.running_mean, -0.5, 0.5), (layer.running_var, 0.5, 2.0),
                                  (layer.weight, 0.5, 1.5), (layer.bias, -0.5, 0.5)):
            assert tensor is not None  # affine, with running statistics
            tensor.copy_(torch.rand(tensor.shape, generator=generator) * (high - low) + low)
    return layer.eval()


#: label -> the row's example; rows with a registered grad sampler first, then the rest.
EXAMPLES: dict[str, Example] = {
    "Linear": Example(lambda: nn.Linear(4, 3), _floats(3, 4)),
    "Conv1d": Example(lambda: nn.Conv1d(2, 4, 3, padding=1), _floats(2, 6)),
    "Conv2d": Example(lambda: nn.Conv2d(2, 4, 3, stride=2, groups=2), _floats(2, 5, 5)),
    "Conv3d": Example(lambda: nn.Conv3d(2, 2, 2), _floats(2, 3, 3, 3)),
    "ConvTranspose1d": Example(lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), _floats(2, 4)),
    "ConvTranspose2d": Example(lambda: nn.ConvTranspose2d(2, 2, 2), _floats(2, 3, 3)),
    "ConvTranspose3d": Example(lambda: nn.ConvTranspose3d(2, 2, 2), _floats(2, 2, 2, 2)),
    "Embedding": Example(lambda: nn.Embedding(10, 4, padding_idx=0), _tokens(10, 5)),
    "EmbeddingBag": Example(lambda: nn.EmbeddingBag(10, 4, mode="mean"), _tokens(10, 5)),
    "LayerNorm": Example(lambda: nn.LayerNorm(4), _floats(3, 4)),
    "RMSNorm": Example(lambda: nn.RMSNorm(4), _floats(3, 4)),
    "GroupNorm": Example(lambda: nn.GroupNorm(2, 4), _floats(4, 5)),
    "InstanceNorm1d": Example(lambda: nn.InstanceNorm1d(3, affine=True), _floats(3, 5)),
    "InstanceNorm2d": Example(lambda: nn.InstanceNorm2d(3, affine=True), _floats(3, 4, 4)),
    "InstanceNorm3d": Example(lambda: nn.InstanceNorm3d(2, affine=True), _floats(2, 3, 3, 3)),
    "BatchNorm1d": Example(lambda: _eval_batch_norm(nn.BatchNorm1d(3)), _floats(3)),
    "BatchNorm2d": Example(lambda: _eval_batch_norm(nn.BatchNorm2d(3)), _floats(3, 4, 4)),
    "BatchNorm3d": Example(lambda: _eval_batch_norm(nn.BatchNorm3d(2)), _floats(2, 3, 3, 3)),
    "SequenceBias": Example(lambda: SequenceBias(4, batch_first=True), _floats(3, 4)),
    "DPMultiheadAttention": Example(lambda: _FirstOutput(DPMultiheadAttention(4, 2, batch_first=True), True),
                                    _floats(3, 4)),
    "DPRNN": Example(lambda: _FirstOutput(DPRNN(3, 4, batch_first=True)), _floats(4, 3)),
    "DPGRU": Example(lambda: _FirstOutput(DPGRU(3, 4, batch_first=True)), _floats(4, 3)),
    "DPLSTM": Example(lambda: _FirstOutput(DPLSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)),
                      _floats(4, 3)),
    "nn.MultiheadAttention (fused)": Example(
        lambda: _FirstOutput(nn.MultiheadAttention(4, 2, batch_first=True), True), _floats(3, 4)),
    "nn.RNN (fused)": Example(lambda: _FirstOutput(nn.RNN(3, 4, batch_first=True)), _floats(4, 3)),
    "nn.GRU (fused)": Example(lambda: _FirstOutput(nn.GRU(3, 4, batch_first=True)), _floats(4, 3)),
    "nn.LSTM (fused)": Example(lambda: _FirstOutput(nn.LSTM(3, 4, batch_first=True)), _floats(4, 3)),
    "BatchNorm1d (training)": Example(lambda: nn.BatchNorm1d(3), _floats(3)),
    "custom module, bare nn.Parameter": Example(_BareParameter, _floats(3, 4)),
    "autocast bf16: Conv2d + GroupNorm + Linear": Example(_AutocastCNN, _floats(2, 6, 6), autocast=torch.bfloat16),
    "autocast fp16: Conv2d + GroupNorm + Linear": Example(_AutocastCNN, _floats(2, 6, 6), autocast=torch.float16),
    "autocast bf16: DPMultiheadAttention + LayerNorm": Example(
        lambda: nn.Sequential(_FirstOutput(DPMultiheadAttention(4, 2, batch_first=True), True), nn.LayerNorm(4)),
        _floats(3, 4), autocast=torch.bfloat16),
    "autocast bf16: DPLSTM": Example(lambda: _FirstOutput(DPLSTM(3, 4, batch_first=True)), _floats(4, 3),
                                     autocast=torch.bfloat16),
}

_HOOKS, _FUNCTORCH, _EW, _GHOST = (GradSampleMode.HOOKS, GradSampleMode.FUNCTORCH, GradSampleMode.EW,
                                   GradSampleMode.GHOST)
_NOT_IN_EW = "not in torch's ExpandedWeights"
_FUSED = "fused kernel: fix_model"
_MIXES = "mixes samples"
_RECURRENT: dict[str, Callable[..., nn.Module]] = {"DPRNN": DPRNN, "DPGRU": DPGRU, "DPLSTM": DPLSTM}


def _padded(rnn: Callable[..., nn.Module]) -> Callable[[], nn.Module]:
    return lambda: _Padded(rnn(3, 4, batch_first=True), 4)


def _first_output(rnn: Callable[..., nn.Module]) -> Callable[[], nn.Module]:
    return lambda: _FirstOutput(rnn(3, 4, batch_first=True))


def _recurrent_refusals() -> list[Refusal]:
    out = []
    for label, rnn in _RECURRENT.items():
        out.append(Refusal(_FUNCTORCH, label, "with a PackedSequence input", Example(_padded(rnn), _packed)))
        out.append(Refusal(_FUNCTORCH, label, "with an initial state and batch_first=True",
                           Example(_first_output(rnn), _with_state(label == "DPLSTM"))))
    return out


def _running_stats(norm: Callable[..., nn.Module]) -> Callable[[], nn.Module]:
    return lambda: norm(3, affine=True, track_running_stats=True)


def _instance_norm_refusals() -> list[Refusal]:
    shapes: dict[str, tuple[Callable[..., nn.Module], tuple[int, ...]]] = {
        "InstanceNorm1d": (nn.InstanceNorm1d, (3, 5)), "InstanceNorm2d": (nn.InstanceNorm2d, (3, 4, 4)),
        "InstanceNorm3d": (nn.InstanceNorm3d, (3, 3, 3, 3))}
    return [Refusal(_FUNCTORCH, label, "with track_running_stats=True", Example(_running_stats(norm), _floats(*shape)))
            for label, (norm, shape) in shapes.items()]


def _embedding(**options: Any) -> Callable[[], nn.Module]:
    return lambda: nn.Embedding(10, 4, **options)


#: Every refusal the table states. Each is checked: its example must raise a PsgError (and a row
#: refused ``always`` must be refused on its own example); everything else must match the reference.
REFUSALS: tuple[Refusal, ...] = (
    # hooks (per_sample_gradients and GradSampleModule)
    Refusal(_HOOKS, "Embedding", "with scale_grad_by_freq=True",
            Example(_embedding(scale_grad_by_freq=True), _tokens(10, 5))),
    Refusal(_HOOKS, "nn.MultiheadAttention (fused)", _FUSED),
    Refusal(_HOOKS, "nn.RNN (fused)", _FUSED),
    Refusal(_HOOKS, "nn.GRU (fused)", _FUSED),
    Refusal(_HOOKS, "nn.LSTM (fused)", _FUSED),
    Refusal(_HOOKS, "BatchNorm1d (training)", _MIXES),
    # functorch
    Refusal(_FUNCTORCH, "Embedding", "with sparse=True", Example(_embedding(sparse=True), _tokens(10, 5))),
    Refusal(_FUNCTORCH, "EmbeddingBag", "with 1-D input and offsets", _bags(mode="sum")),
    *_instance_norm_refusals(),
    Refusal(_FUNCTORCH, "DPMultiheadAttention", "with key_padding_mask and batch_first=False",
            Example(_MaskedTimeMajor, lambda: (torch.randn(3, ROWS, 4), torch.tensor([[False, False, True]] * ROWS)),
                    batch_first=False)),
    *_recurrent_refusals(),
    Refusal(_FUNCTORCH, "nn.RNN (fused)", _FUSED),
    Refusal(_FUNCTORCH, "nn.GRU (fused)", _FUSED),
    Refusal(_FUNCTORCH, "nn.LSTM (fused)", _FUSED),
    Refusal(_FUNCTORCH, "BatchNorm1d (training)", _MIXES),
    # ew
    Refusal(_EW, "Conv3d", "with groups > 1 and dilation > 1",
            Example(lambda: nn.Conv3d(2, 2, 2, groups=2, dilation=2), _floats(2, 3, 3, 3))),
    *(Refusal(_EW, label, _NOT_IN_EW) for label in ("ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")),
    Refusal(_EW, "Embedding", "when batch_first=False", Example(_embedding(), _time_major_tokens(10, 5), batch_first=False)),
    Refusal(_EW, "Embedding", "with 1-D input", Example(_embedding(), _tokens(10))),
    Refusal(_EW, "Embedding", "with scale_grad_by_freq=True",
            Example(_embedding(scale_grad_by_freq=True), _tokens(10, 5))),
    Refusal(_EW, "EmbeddingBag", _NOT_IN_EW),
    Refusal(_EW, "LayerNorm", "when batch_first=False",
            Example(lambda: nn.LayerNorm(4), _time_major(3, 4), batch_first=False)),
    Refusal(_EW, "RMSNorm", _NOT_IN_EW),
    *(Refusal(_EW, label, _NOT_IN_EW) for label in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d")),
    Refusal(_EW, "SequenceBias", _NOT_IN_EW),
    Refusal(_EW, "DPMultiheadAttention", "with add_bias_kv=True",
            Example(lambda: _FirstOutput(DPMultiheadAttention(4, 2, add_bias_kv=True, batch_first=True), True),
                    _floats(3, 4))),
    Refusal(_EW, "nn.MultiheadAttention (fused)", _NOT_IN_EW),
    Refusal(_EW, "nn.LSTM (fused)", _NOT_IN_EW),
    Refusal(_EW, "BatchNorm1d (training)", _MIXES),
    Refusal(_EW, "custom module, bare nn.Parameter", _NOT_IN_EW),
    # ghost
    Refusal(_GHOST, "Embedding", "with scale_grad_by_freq=True",
            Example(_embedding(scale_grad_by_freq=True), _tokens(10, 5))),
    Refusal(_GHOST, "nn.MultiheadAttention (fused)", _FUSED),
    Refusal(_GHOST, "nn.RNN (fused)", _FUSED),
    Refusal(_GHOST, "nn.GRU (fused)", _FUSED),
    Refusal(_GHOST, "nn.LSTM (fused)", _FUSED),
    Refusal(_GHOST, "BatchNorm1d (training)", _MIXES),
)
