"""Model plugin for the pool tests (loaded by the frontend registry and by every Ray worker).

``slow_mlp`` sleeps in its forward pass, so a test can kill a worker while its shard is running;
with ``started_file`` it first appends a line to that file, so the test knows when that is.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from psg_server.models import ModelRegistry


class _SlowMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_classes: int, delay_ms: int, started_file: str) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, num_classes)
        self.delay_s = delay_ms / 1000
        self.started_file = Path(started_file) if started_file else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.started_file is not None:
            with self.started_file.open("a") as signal:  # one short line per forward: appends stay whole
                signal.write(f"{x.shape[0]}\n")
        time.sleep(self.delay_s)
        return self.out(torch.tanh(self.hidden(x)))  # (B, C)


def slow_mlp(*, in_features: int = 6, hidden: int = 8, num_classes: int = 3, delay_ms: int = 0,
             started_file: str = "") -> nn.Module:
    """An MLP whose forward pass sleeps ``delay_ms`` milliseconds, after appending a line to
    ``started_file`` (when given)."""
    return _SlowMLP(in_features, hidden, num_classes, delay_ms, started_file)


def register_models(registry: ModelRegistry) -> None:
    registry.register("slow_mlp", slow_mlp)
