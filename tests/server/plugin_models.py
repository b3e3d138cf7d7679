"""A model plugin as an operator would write one (loaded with --model-plugin tests.server.plugin_models)."""

from __future__ import annotations

from torch import nn

from psg_server.models import ModelRegistry


def tiny_regressor(*, in_features: int = 3, out_features: int = 2) -> nn.Module:
    """Linear regression without a declared signature (only the row layout is checked)."""
    return nn.Linear(in_features, out_features)


def register_models(registry: ModelRegistry) -> None:
    registry.register("tiny_regressor", tiny_regressor)
