"""Helpers shared by the service tests: servers on port 0, tiny models, local reference results."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from psg_client import GradientClient, RetryPolicy
from psg_core.config import DPConfig, DPGradient
from psg_core.dp import dp_gradient
from psg_server.background import BackgroundServer
from psg_server.config import ServerConfig
from psg_server.losses import get_loss
from psg_server.models import default_registry

#: A small MLP: 6 features, 3 classes.
MLP_KWARGS: dict[str, Any] = {"in_features": 6, "hidden": [8], "num_classes": 3}
TOKEN_ALICE = "alice-token-0123456789abcdef"
TOKEN_BOB = "bob-token-0123456789abcdefgh"
#: Clients in tests give up fast on UNAVAILABLE unless a test asks otherwise.
FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)


@contextlib.contextmanager
def serve(**overrides: Any) -> Iterator[BackgroundServer]:
    """A server on an ephemeral loopback port with ``ServerConfig(**overrides)``."""
    create_kwargs = {k: overrides.pop(k) for k in ("executor", "registry") if k in overrides}
    # The tests compare with references computed on the CPU; the CUDA cases ask for device="cuda".
    overrides.setdefault("device", "cpu")
    config = ServerConfig(port=overrides.pop("port", 0), **overrides)
    with BackgroundServer(config, **create_kwargs) as server:
        yield server


def client_for(server: BackgroundServer, token: str | None = None, **kwargs: Any) -> GradientClient:
    """A plaintext client of ``server``."""
    kwargs.setdefault("retry", FAST_RETRY)
    kwargs.setdefault("timeout_s", 60.0)
    return GradientClient(server.target, token=token, **kwargs)


def build(name: str = "mlp", kwargs: dict[str, Any] | None = None, *, seed: int = 0) -> nn.Module:
    """The registry's model, with parameters drawn from ``seed``."""
    registry = default_registry()
    torch.manual_seed(seed)
    given = kwargs if kwargs is not None else MLP_KWARGS
    return registry.build(name, registry.parse_kwargs(name, json.dumps(given)))


def mlp_batch(rows: int, *, seed: int = 0, num_classes: int = 3,
              features: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs (rows, features) and class targets (rows,)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, features, generator=generator),
            torch.randint(0, num_classes, (rows,), generator=generator))


def local_dp(model: nn.Module, inputs: Any, targets: torch.Tensor, config: DPConfig,
             loss: str = "cross_entropy") -> DPGradient:
    """psg_core's dp_gradient on the whole batch: what the service must reproduce."""
    return dp_gradient(model, inputs, targets, loss_fn=get_loss(loss).build(), config=config)
