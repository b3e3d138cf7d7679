"""The four benchmark models, each in three variants, and their synthetic batches.

Every model exists as

* ``"psg"``: built from layers psg has grad samplers for (psg's own DP rewrites of fused layers);
* ``"opacus"``: the same architecture as Opacus users build it (Opacus' DP rewrites; layers Opacus
  accepts as they are stay identical, so both libraries do the same arithmetic);
* ``"torch"``: what one trains without privacy (torch's fused ``nn.MultiheadAttention`` and
  ``nn.LSTM``), the non-private baseline.

Variants of one model hold the same number of parameters. Batches are synthetic (seeded random
inputs and labels): step time and memory do not depend on the data, and no download is needed.
Rows are sample-major: a batch of N samples with K augmented copies has ``N*K`` rows, rows
``n*K .. n*K+K-1`` belonging to sample n (README.md, "Batch layout").

>>> spec = MODELS["cnn"]
>>> model = spec.build("psg", "tiny")
>>> inputs, targets = spec.make_batch(rows=4, size="tiny", generator=torch.Generator().manual_seed(0))
>>> model(*inputs).shape, targets.shape
(torch.Size([4, 10]), torch.Size([4]))
"""

from __future__ import annotations

import enum
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = ["Variant", "ModelSpec", "MODELS", "opacus_available", "model_names"]


class Variant(str, enum.Enum):
    """Which library's layers a model is built from."""

    PSG = "psg"
    OPACUS = "opacus"
    TORCH = "torch"


def opacus_available() -> bool:
    """Whether ``opacus`` can be imported (it is only needed for the Opacus rows)."""
    return importlib.util.find_spec("opacus") is not None


def _attention_class(variant: Variant) -> type[nn.Module]:
    if variant is Variant.TORCH:
        return nn.MultiheadAttention
    # psg's DPMultiheadAttention is built from plain nn.Linear layers, which Opacus handles with
    # its own Linear sampler: both libraries then run the very same forward pass.
    from psg_core.layers import DPMultiheadAttention
    return DPMultiheadAttention


def _lstm_class(variant: Variant) -> type[nn.Module]:
    if variant is Variant.TORCH:
        return nn.LSTM
    if variant is Variant.OPACUS:
        from opacus.layers import DPLSTM as OpacusDPLSTM
        return OpacusDPLSTM  # type: ignore[no-any-return]
    from psg_core.layers import DPLSTM
    return DPLSTM


# ------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class _Size:
    """Batch and architecture sizes of one model at one benchmark scale."""

    #: N, samples per batch (the batch has N*K rows).
    samples: int
    #: width (channels, model dim, hidden size, embedding dim).
    width: int
    #: sequence length / tokens per bag; unused by the CNN.
    length: int = 1
    #: vocabulary size; unused by the CNN.
    vocab: int = 1
    #: depth (conv stages, encoder blocks, LSTM layers).
    depth: int = 1
    #: the LSTM's hidden size when it differs from its input (embedding) width; 0: the width.
    hidden: int = 0


# "full" is the reported CPU benchmark; "quick" fits a 2-core CPU in a few minutes; "tiny" keeps the
# rot-guard test fast. "gpu" is the reported GPU benchmark (the shapes of the GPU-speed issue: a
# 4-conv GroupNorm CNN at batch 256, a d-512 4-block transformer at T 128 and batch 64, a 20k x 64
# bag model at batch 512, an LSTM 128 -> 256 at T 64 and batch 128); "gpu16" is the same models at
# 1/16 of those batches, the form its CPU targets are stated at.
_SIZES: dict[str, dict[str, _Size]] = {
    "cnn": {"full": _Size(samples=64, width=32, depth=3),
            "quick": _Size(samples=16, width=16, depth=3),
            "tiny": _Size(samples=2, width=8, depth=2),
            "gpu": _Size(samples=256, width=96, depth=2),
            "gpu16": _Size(samples=16, width=96, depth=2)},
    "transformer": {"full": _Size(samples=32, width=128, length=64, vocab=2000, depth=2),
                    "quick": _Size(samples=8, width=64, length=32, vocab=1000, depth=2),
                    "tiny": _Size(samples=2, width=8, length=5, vocab=20, depth=1),
                    "gpu": _Size(samples=64, width=512, length=128, vocab=8000, depth=4),
                    "gpu16": _Size(samples=4, width=512, length=128, vocab=8000, depth=4)},
    "lstm": {"full": _Size(samples=32, width=128, length=32, vocab=2000, depth=1),
             "quick": _Size(samples=8, width=64, length=16, vocab=1000, depth=1),
             "tiny": _Size(samples=2, width=8, length=4, vocab=20, depth=1),
             "gpu": _Size(samples=128, width=128, hidden=256, length=64, vocab=8000, depth=1),
             "gpu16": _Size(samples=8, width=128, hidden=256, length=64, vocab=8000, depth=1)},
    "embedding_bag": {"full": _Size(samples=64, width=64, length=16, vocab=10000),
                      "quick": _Size(samples=16, width=32, length=16, vocab=4000),
                      "tiny": _Size(samples=2, width=8, length=3, vocab=20),
                      "gpu": _Size(samples=512, width=64, length=16, vocab=20000),
                      "gpu16": _Size(samples=32, width=64, length=16, vocab=20000)},
}
_CLASSES = 10


def _size(model: str, size: str) -> _Size:
    try:
        return _SIZES[model][size]
    except KeyError:
        raise ValueError(f"benchmarks.models: unknown size {size!r} for model {model!r}; expected "
                         f"one of {sorted(_SIZES.get(model, {}))}") from None


# ------------------------------------------------------------------------------ CNN
class GroupNormCNN(nn.Module):
    """A CIFAR-size (3x32x32) CNN: ``depth`` stages of conv-GroupNorm-ReLU-maxpool, then an MLP.

    GroupNorm (not BatchNorm) because per-sample gradients need layers that do not mix samples.

    >>> GroupNormCNN(width=8, depth=2)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """

    def __init__(self, *, width: int, depth: int, classes: int = _CLASSES) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels_in, channels = 3, width
        for _ in range(depth):
            layers += [nn.Conv2d(channels_in, channels, 3, padding=1),
                       nn.GroupNorm(min(8, channels // 2), channels), nn.ReLU(),
                       nn.Conv2d(channels, channels, 3, padding=1),
                       nn.GroupNorm(min(8, channels // 2), channels), nn.ReLU(),
                       nn.MaxPool2d(2)]
            channels_in, channels = channels, channels * 2
        self.features = nn.Sequential(*layers)
        side = 32 // 2 ** depth
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels_in * side * side, 128), nn.ReLU(),
                                  nn.Linear(128, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))  # (B, classes)


def _build_cnn(variant: Variant, size: _Size) -> nn.Module:
    return GroupNormCNN(width=size.width, depth=size.depth)


def _cnn_batch(rows: int, size: _Size, generator: torch.Generator) -> tuple[tuple[Any, ...], torch.Tensor]:
    images = torch.randn(rows, 3, 32, 32, generator=generator)  # (B, 3, 32, 32)
    return (images,), torch.randint(0, _CLASSES, (rows,), generator=generator)


# ------------------------------------------------------------------------------ transformer
def _sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """``(length, dim)`` fixed sinusoidal position codes (Vaswani et al., 2017)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]  # (T, 1)
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    codes = torch.zeros(length, dim)  # (T, d)
    codes[:, 0::2] = torch.sin(position * frequency)
    codes[:, 1::2] = torch.cos(position * frequency[: dim // 2])
    return codes


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    ``attention`` is the multi-head attention class (torch's or a DP rewrite with the same
    constructor), always used batch-first.
    """

    def __init__(self, dim: int, heads: int, attention: type[nn.Module]) -> None:
        super().__init__()
        self.norm_attention = nn.LayerNorm(dim)
        self.attention = attention(dim, heads, batch_first=True)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_attention(x)  # (B, T, d)
        x = x + self.attention(h, h, h, need_weights=False)[0]  # (B, T, d)
        return x + self.mlp(self.norm_mlp(x))  # (B, T, d)


class TransformerClassifier(nn.Module):
    """Token embedding + fixed positions, ``depth`` encoder blocks, mean pooling, a linear head.

    >>> from torch import nn
    >>> model = TransformerClassifier(vocab=20, dim=8, heads=2, depth=1, length=5,
    ...                               attention=nn.MultiheadAttention)
    >>> model(torch.zeros(3, 5, dtype=torch.long)).shape
    torch.Size([3, 10])
    """

    def __init__(self, *, vocab: int, dim: int, heads: int, depth: int, length: int,
                 attention: type[nn.Module], classes: int = _CLASSES) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.register_buffer("positions", _sinusoidal_positions(length, dim), persistent=False)
        self.blocks = nn.Sequential(*[EncoderBlock(dim, heads, attention) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = cast(torch.Tensor, self.positions)  # a buffer
        x = self.embedding(tokens) + positions[: tokens.shape[1]]  # (B, T, d)
        x = self.blocks(x)  # (B, T, d)
        return self.head(self.norm(x.mean(1)))  # (B, classes)


def _build_transformer(variant: Variant, size: _Size) -> nn.Module:
    return TransformerClassifier(vocab=size.vocab, dim=size.width, heads=max(1, size.width // 32) * 2,
                                 depth=size.depth, length=size.length,
                                 attention=_attention_class(variant))


def _token_batch(rows: int, size: _Size, generator: torch.Generator) -> tuple[tuple[Any, ...], torch.Tensor]:
    tokens = torch.randint(0, size.vocab, (rows, size.length), generator=generator)  # (B, T)
    return (tokens,), torch.randint(0, _CLASSES, (rows,), generator=generator)


# ------------------------------------------------------------------------------ LSTM
class LSTMClassifier(nn.Module):
    """Token embedding, a batch-first LSTM, and a linear head on the last hidden state.

    >>> model = LSTMClassifier(vocab=20, dim=8, layers=1, lstm=nn.LSTM)
    >>> model(torch.zeros(3, 4, dtype=torch.long)).shape
    torch.Size([3, 10])
    """

    def __init__(self, *, vocab: int, dim: int, layers: int, lstm: type[nn.Module],
                 classes: int = _CLASSES, hidden: int = 0) -> None:
        super().__init__()
        hidden = hidden or dim
        self.embedding = nn.Embedding(vocab, dim)
        self.lstm = lstm(dim, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embedding(tokens))  # (B, T, d)
        return self.head(output[:, -1])  # (B, classes)


def _build_lstm(variant: Variant, size: _Size) -> nn.Module:
    return LSTMClassifier(vocab=size.vocab, dim=size.width, layers=size.depth, lstm=_lstm_class(variant),
                          hidden=size.hidden)


# ------------------------------------------------------------------------------ EmbeddingBag
class EmbeddingBagClassifier(nn.Module):
    """Bag-of-tokens text classifier: ``EmbeddingBag(mode="mean")`` then a two-layer MLP.

    Takes ``(B, L)`` token ids (fixed-length bags) and calls the EmbeddingBag in its flat
    ``input, offsets`` form, the form real variable-length text uses (and the only one Opacus'
    EmbeddingBag sampler accepts).

    >>> EmbeddingBagClassifier(vocab=20, dim=8)(torch.zeros(3, 4, dtype=torch.long)).shape
    torch.Size([3, 10])
    """

    def __init__(self, *, vocab: int, dim: int, classes: int = _CLASSES) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, classes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        bags, length = tokens.shape
        offsets = torch.arange(0, bags * length, length, device=tokens.device)  # (B,)
        return self.mlp(self.bag(tokens.reshape(-1), offsets))  # (B, classes)


def _build_embedding_bag(variant: Variant, size: _Size) -> nn.Module:
    return EmbeddingBagClassifier(vocab=size.vocab, dim=size.width)


# ------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to build each variant and how to make a batch."""

    name: str
    description: str
    _build: Callable[[Variant, _Size], nn.Module]
    _batch: Callable[[int, _Size, torch.Generator], tuple[tuple[Any, ...], torch.Tensor]]

    def samples(self, size: str) -> int:
        """N, the number of samples per batch at this scale."""
        return _size(self.name, size).samples

    def build(self, variant: Variant | str, size: str, *, seed: int = 0) -> nn.Module:
        """The model in ``variant`` at scale ``size`` ("full", "quick" or "tiny").

        Initialised from ``seed`` so that variants built with one seed start from the same
        weights wherever their layers coincide.
        """
        torch.manual_seed(seed)
        return self._build(Variant(variant), _size(self.name, size))

    def make_batch(self, *, rows: int, size: str, generator: torch.Generator
                   ) -> tuple[tuple[Any, ...], torch.Tensor]:
        """``(inputs, targets)``: positional model inputs and class labels, ``rows`` rows each."""
        return self._batch(rows, _size(self.name, size), generator)

    def num_parameters(self, size: str) -> int:
        """Trainable parameters of the psg variant at this scale."""
        return sum(p.numel() for p in self.build(Variant.PSG, size).parameters() if p.requires_grad)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec("cnn", "CNN with GroupNorm on 3x32x32 images (CIFAR size)", _build_cnn, _cnn_batch),
        ModelSpec("transformer", "transformer encoder classifier (DP multi-head attention, LayerNorm)",
                  _build_transformer, _token_batch),
        ModelSpec("lstm", "LSTM classifier (embedding, one LSTM layer, linear head)", _build_lstm,
                  _token_batch),
        ModelSpec("embedding_bag", "EmbeddingBag (mean) text classifier with an MLP head",
                  _build_embedding_bag, _token_batch),
    )
}


def model_names() -> list[str]:
    """Names of the benchmark models, in table order."""
    return list(MODELS)
