"""Small DP-friendly architectures in plain torch: the gradient service's built-in models.

No BatchNorm (it mixes samples): convolutional models use GroupNorm; attention and recurrence use
psg's DP rewrites (:class:`psg_core.layers.DPMultiheadAttention`, :class:`psg_core.layers.DPLSTM`)
so that every parameter sits in a layer with a grad sampler. All take the batch on dimension 0.

They live here, not in the server, because both ends of the service build them: the server's
registry (``psg_server.architectures``) serves them by name, and a trainer builds the same module
locally to own its parameters (``psg_client.demo`` does), without importing the server.

>>> model = cnn_groupnorm(in_channels=1, image_size=8, channels=(4,), groups=2, num_classes=3)
>>> model(torch.zeros(2, 1, 8, 8)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

import torch
from torch import nn

from psg_core.errors import ConfigError
from psg_core.layers import DPLSTM, DPMultiheadAttention

__all__ = ["cnn_groupnorm", "embedding_bag_classifier", "lstm_classifier", "mlp", "resnet_groupnorm",
           "transformer_classifier"]

_MAX_WIDTH = 1 << 20
_MAX_DEPTH = 64


def _check(model: str, **values: int | tuple[int, ...]) -> None:
    """Every value (or element) must be in 1..limit; depth-like names allow 0 only via tuples."""
    for name, value in values.items():
        items = value if isinstance(value, tuple) else (value,)
        limit = _MAX_DEPTH if name in ("num_layers", "stages") else _MAX_WIDTH
        if not items or any(not 1 <= v <= limit for v in items):
            raise ConfigError(f"{model}: {name} must be in 1..{limit}, got {value!r}")


# ----------------------------------------------------------------------------------------- mlp
def mlp(*, in_features: int = 784, hidden: tuple[int, ...] = (128,), num_classes: int = 10) -> nn.Module:
    """Multi-layer perceptron: Linear + ReLU per hidden width, then a Linear head."""
    _check("mlp", in_features=in_features, num_classes=num_classes)
    if hidden:
        _check("mlp", hidden=hidden)
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------------- conv nets
def _group_norm(model: str, groups: int, channels: int) -> nn.GroupNorm:
    if channels % groups:
        raise ConfigError(f"{model}: groups={groups} must divide every channel count, got {channels}")
    return nn.GroupNorm(groups, channels)


def cnn_groupnorm(*, in_channels: int = 1, image_size: int = 28, channels: tuple[int, ...] = (16, 32),
                  groups: int = 4, num_classes: int = 10) -> nn.Module:
    """Conv3x3 + GroupNorm + ReLU + MaxPool per stage, global average pool, Linear head."""
    _check("cnn_groupnorm", in_channels=in_channels, image_size=image_size, channels=channels,
           groups=groups, num_classes=num_classes)
    if image_size < 2 ** len(channels):
        raise ConfigError(f"cnn_groupnorm: image_size={image_size} is too small for "
                          f"{len(channels)} pooling stages")
    layers: list[nn.Module] = []
    width = in_channels
    for size in channels:
        layers += [nn.Conv2d(width, size, 3, padding=1), _group_norm("cnn_groupnorm", groups, size),
                   nn.ReLU(), nn.MaxPool2d(2)]
        width = size
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
    return nn.Sequential(*layers)


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a residual connection (1x1 conv when reshaped)."""

    def __init__(self, width_in: int, width_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width_in, width_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _group_norm("resnet_groupnorm", groups, width_out)
        self.conv2 = nn.Conv2d(width_out, width_out, 3, padding=1, bias=False)
        self.norm2 = _group_norm("resnet_groupnorm", groups, width_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or width_in != width_out:
            self.shortcut = nn.Sequential(nn.Conv2d(width_in, width_out, 1, stride=stride, bias=False),
                                          _group_norm("resnet_groupnorm", groups, width_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))  # (N, C_out, H', W')
        h = self.norm2(self.conv2(h))  # (N, C_out, H', W')
        return torch.relu(h + self.shortcut(x))


def resnet_groupnorm(*, in_channels: int = 3, image_size: int = 32, width: int = 16,
                     stages: tuple[int, ...] = (1, 1, 1), groups: int = 4,
                     num_classes: int = 10) -> nn.Module:
    """Small ResNet: a stem, then stages of basic blocks (width doubling, stride 2), GroupNorm."""
    _check("resnet_groupnorm", in_channels=in_channels, image_size=image_size, width=width,
           stages=stages, groups=groups, num_classes=num_classes)
    layers: list[nn.Module] = [nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                               _group_norm("resnet_groupnorm", groups, width), nn.ReLU()]
    current = width
    for index, blocks in enumerate(stages):
        out = width * 2 ** index
        for block in range(blocks):
            stride = 2 if index > 0 and block == 0 else 1
            layers.append(_BasicBlock(current, out, stride, groups))
            current = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(current, num_classes)]
    return nn.Sequential(*layers)


# -------------------------------------------------------------------------------- sequence nets


class _EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block on :class:`~psg_core.layers.DPMultiheadAttention`."""

    def __init__(self, d_model: int, num_heads: int, dim_feedforward: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = DPMultiheadAttention(d_model, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.feedforward = nn.Sequential(nn.Linear(d_model, dim_feedforward), nn.ReLU(),
                                         nn.Linear(dim_feedforward, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)  # (N, T, d)
        x = x + self.attention(h, h, h, need_weights=False)[0]  # (N, T, d)
        return x + self.feedforward(self.norm2(x))  # (N, T, d)


class _TransformerClassifier(nn.Module):
    def __init__(self, vocab_size: int, max_len: int, d_model: int, num_heads: int, num_layers: int,
                 dim_feedforward: int, num_classes: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        self.blocks = nn.Sequential(*(_EncoderBlock(d_model, num_heads, dim_feedforward)
                                      for _ in range(num_layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n, length = tokens.shape
        # Positions per row (not one shared (T,) index), so the embedding sees a batch dimension.
        positions = torch.arange(length, device=tokens.device).expand(n, length)  # (N, T)
        x = self.tokens(tokens) + self.positions(positions)  # (N, T, d)
        x = self.norm(self.blocks(x))  # (N, T, d)
        return self.head(x.mean(dim=1))  # (N, classes)


def transformer_classifier(*, vocab_size: int = 1000, max_len: int = 128, d_model: int = 64,
                           num_heads: int = 4, num_layers: int = 2, dim_feedforward: int = 128,
                           num_classes: int = 2) -> nn.Module:
    """Token classifier: embeddings + learned positions, pre-norm DP attention blocks, mean pool."""
    _check("transformer_classifier", vocab_size=vocab_size, max_len=max_len, d_model=d_model,
           num_heads=num_heads, num_layers=num_layers, dim_feedforward=dim_feedforward,
           num_classes=num_classes)
    return _TransformerClassifier(vocab_size, max_len, d_model, num_heads, num_layers, dim_feedforward,
                                  num_classes)


class _LSTMClassifier(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, hidden_size: int, num_layers: int,
                 bidirectional: bool, num_classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = DPLSTM(embed_dim, hidden_size, num_layers=num_layers, batch_first=True,
                           bidirectional=bidirectional)
        self.head = nn.Linear(hidden_size * (2 if bidirectional else 1), num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embedding(tokens))  # (N, T, dirs * hidden)
        return self.head(output.mean(dim=1))  # (N, classes)


def lstm_classifier(*, vocab_size: int = 1000, max_len: int = 256, embed_dim: int = 32,
                    hidden_size: int = 64, num_layers: int = 1, bidirectional: bool = False,
                    num_classes: int = 2) -> nn.Module:
    """Token classifier: embedding, DP LSTM, mean over time, Linear head."""
    _check("lstm_classifier", vocab_size=vocab_size, max_len=max_len, embed_dim=embed_dim,
           hidden_size=hidden_size, num_layers=num_layers, num_classes=num_classes)
    return _LSTMClassifier(vocab_size, embed_dim, hidden_size, num_layers, bidirectional, num_classes)


class _BagClassifier(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, mode: str, num_classes: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab_size, embed_dim, mode=mode)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens))  # (N, T) -> (N, d) -> (N, classes)


def embedding_bag_classifier(*, vocab_size: int = 1000, max_len: int = 256, embed_dim: int = 32,
                             mode: str = "mean", num_classes: int = 2) -> nn.Module:
    """Bag-of-tokens classifier: EmbeddingBag (one bag per row), Linear head."""
    _check("embedding_bag_classifier", vocab_size=vocab_size, max_len=max_len, embed_dim=embed_dim,
           num_classes=num_classes)
    if mode not in ("mean", "sum"):
        raise ConfigError(f"embedding_bag_classifier: mode must be 'mean' or 'sum', got {mode!r}")
    return _BagClassifier(vocab_size, embed_dim, mode, num_classes)

