"""A model plugin as an operator would write one (loaded with --model-plugin tests.server.plugin_models)."""

from __future__ import annotations

import torch
from torch import nn

from psg_server.models import ModelRegistry


def tiny_regressor(*, in_features: int = 3, out_features: int = 2) -> nn.Module:
    """Linear regression without a declared signature (only the row layout is checked)."""
    return nn.Linear(in_features, out_features)


class _SeqFirstTagger(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, num_classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (T, B) -> (T, B, C)
        return self.head(torch.tanh(self.norm(self.embedding(tokens))))


def seq_first_tagger(*, vocab_size: int = 11, embed_dim: int = 4, num_classes: int = 3) -> nn.Module:
    """Token tagger taking (T, B) tokens, returning (T, B, classes): a batch_first=False model."""
    return _SeqFirstTagger(vocab_size, embed_dim, num_classes)


def register_models(registry: ModelRegistry) -> None:
    registry.register("tiny_regressor", tiny_regressor)
    registry.register("seq_first_tagger", seq_first_tagger, batch_first_only=False)
