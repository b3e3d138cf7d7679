"""Every backend against the microbatch oracle on a zoo of small models.

Grid: reduction x K {1, 2, 4} x batch_first (where the model has a layout choice); the full grid
for the smallest models and a diagonal for the bigger ones. Modes that cannot run a model must
raise a clear UnsupportedModuleError naming the layer. Ghost (which has no per-sample gradients)
is compared through the clipped sum and the per-sample norms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psg_core.backends.ghost as ghost_module
from psg_core.api import per_sample_gradients
from psg_core.backends.ghost import ghost_dp_gradient
from psg_core.clipping import clip_and_sum
from psg_core.config import DPConfig
from psg_core.errors import UnsupportedModuleError
from psg_core.layers import DPGRU, DPLSTM, DPMultiheadAttention
from tests.devices import to_device
from tests.oracle import assert_close_scaled, microbatch_oracle, split_samples

N_SAMPLES = 3
LossFactory = Callable[[str], Callable[[Any, torch.Tensor], torch.Tensor]]


# ------------------------------------------------------------------------------------ models
class ScaleShift(nn.Module):
    """A custom layer with bare parameters and no grad sampler."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))  # (B, C, H, W)
        return torch.relu(x + self.norm2(self.conv2(h)))


class TinyTransformer(nn.Module):
    """Token + position embeddings, one pre-norm encoder block with DP attention, a token head."""

    def __init__(self, batch_first: bool, vocab: int = 13, d: int = 8, max_len: int = 6) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.tokens = nn.Embedding(vocab, d, padding_idx=0)
        self.positions = nn.Embedding(max_len, d)
        self.norm1 = nn.LayerNorm(d)
        self.attention = DPMultiheadAttention(d, 2, batch_first=batch_first)
        self.norm2 = nn.LayerNorm(d)
        self.feed_forward = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.head = nn.Linear(d, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_dim = 1 if self.batch_first else 0
        steps = torch.arange(tokens.shape[seq_dim], device=tokens.device)  # (T,)
        positions = steps.view(1, -1) if self.batch_first else steps.view(-1, 1)
        h = self.tokens(tokens) + self.positions(positions.expand_as(tokens))  # (B, T, d) / (T, B, d)
        a = self.norm1(h)
        h = h + self.attention(a, a, a, need_weights=False)[0]
        h = h + self.feed_forward(self.norm2(h))
        return self.head(h)  # (B, T, 2) / (T, B, 2)


class RecurrentTagger(nn.Module):
    """DPLSTM over the sequence, a per-step regression head."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.rnn = DPLSTM(4, 5, batch_first=batch_first)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])  # (B, T, 2) / (T, B, 2)


class RecurrentClassifier(nn.Module):
    """Bidirectional two-layer DPGRU; classifies from the last step. With the batch on dim 1 the
    logits keep a leading length-1 axis so that the loss has the batch on dim 1 too."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = DPGRU(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x)[0]  # (B, T, 8) / (T, B, 8)
        last = out[:, -1] if self.batch_first else out[-1:]  # (B, 8) / (1, B, 8)
        return self.head(last)


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode="mean")
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bag(tokens)))  # (B, 3)


# ------------------------------------------------------------------------------------ losses
def mse(reduction: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    return lambda out, target: F.mse_loss(out, target, reduction=reduction)


def cross_entropy(reduction: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    # Class scores on the last axis; any leading axes (the batch among them) stay.
    return lambda out, target: F.cross_entropy(out.movedim(-1, 1), target, reduction=reduction)


# ------------------------------------------------------------------------------------ the zoo
Batch = tuple[torch.Tensor, torch.Tensor]


def _classes(rows: int, classes: int, batch_first: bool = True) -> torch.Tensor:
    return torch.randint(0, classes, (rows,) if batch_first else (1, rows))


@dataclass(frozen=True)
class Entry:
    name: str
    build: Callable[[bool], nn.Module]
    batch: Callable[[int, bool], Batch]
    loss: LossFactory
    layouts: tuple[bool, ...] = (True,)
    full_grid: bool = False
    #: mode -> a regex the UnsupportedModuleError must match, per batch_first; absent: it works.
    fails: dict[tuple[str, bool], str] = field(default_factory=dict)


ZOO = [
    Entry("mlp", lambda bf: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)),
          lambda rows, bf: (torch.randn(rows, 6), _classes(rows, 3)), cross_entropy, full_grid=True),
    Entry("cnn_groupnorm",
          lambda bf: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                                   nn.Conv2d(4, 4, 3, stride=2), nn.Flatten(), nn.Linear(16, 3)),
          lambda rows, bf: (torch.randn(rows, 2, 6, 6), _classes(rows, 3)), cross_entropy),
    Entry("resnet_block",
          lambda bf: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), ResBlock(4), nn.AdaptiveAvgPool2d(1),
                                   nn.Flatten(), nn.Linear(4, 3)),
          lambda rows, bf: (torch.randn(rows, 2, 5, 5), _classes(rows, 3)), cross_entropy),
    Entry("transformer", TinyTransformer,
          lambda rows, bf: (torch.randint(0, 13, (rows, 5) if bf else (5, rows)),
                            torch.randn((rows, 5, 2) if bf else (5, rows, 2))),
          mse, layouts=(True, False),
          fails={("ew", False): r"'tokens' \(Embedding\).*batch_first=False"}),
    Entry("lstm_tagger", RecurrentTagger,
          lambda rows, bf: (torch.randn((rows, 4, 4) if bf else (4, rows, 4)),
                            torch.randn((rows, 4, 2) if bf else (4, rows, 2))),
          mse, layouts=(True, False)),
    Entry("gru_classifier", RecurrentClassifier,
          lambda rows, bf: (torch.randn((rows, 3, 3) if bf else (3, rows, 3)), _classes(rows, 3, bf)),
          cross_entropy, layouts=(True, False)),
    Entry("embedding_bag", lambda bf: BagClassifier(),
          lambda rows, bf: (torch.randint(0, 20, (rows, 4)), _classes(rows, 3)), cross_entropy,
          full_grid=True, fails={("ew", True): r"'bag' \(EmbeddingBag\).*ExpandedWeights"}),
    Entry("bare_parameter",
          lambda bf: nn.Sequential(nn.Linear(5, 4), ScaleShift(4), nn.Tanh(), nn.Linear(4, 2)),
          lambda rows, bf: (torch.randn(rows, 5), torch.randn(rows, 2)), mse, full_grid=True,
          fails={("ew", True): r"'1' \(ScaleShift\).*ExpandedWeights"}),
]
ENTRIES = {entry.name: entry for entry in ZOO}
MODES = ["hooks", "functorch", "ew"]
DIAGONAL = [(1, "mean"), (2, "sum"), (4, "mean")]


def _grid() -> list[tuple[str, int, str, bool]]:
    cases = []
    for entry in ZOO:
        pairs = [(K, r) for K in (1, 2, 4) for r in ("mean", "sum")] if entry.full_grid else DIAGONAL
        cases += [(entry.name, K, r, bf) for bf in entry.layouts for K, r in pairs]
    return cases


GRID = _grid()


def _id(case: tuple[str, int, str, bool]) -> str:
    name, K, reduction, bf = case
    return f"{name}-K{K}-{reduction}-{'bf' if bf else 'seq_first'}"


@functools.lru_cache(maxsize=None)
def _case(name: str, K: int, reduction: str, batch_first: bool, device: torch.device
          ) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Model, batch and oracle per-sample gradients on ``device`` (computed once per configuration
    and device; built on the CPU from the same seed, so every device sees the same numbers)."""
    entry = ENTRIES[name]
    torch.manual_seed(sum(map(ord, name)) + 10 * K + batch_first)
    model = entry.build(batch_first).to(device)
    inputs, targets = to_device(entry.batch(N_SAMPLES * K, batch_first), device)
    batch_dim = 0 if batch_first else 1
    expected = microbatch_oracle(model, split_samples(inputs, targets, K, batch_dim=batch_dim),
                                 entry.loss(reduction))
    return model, inputs, targets, expected


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                       name: str) -> None:
    """Every entry after dividing by the largest magnitude over the whole model: a parameter whose
    gradient is zero in exact arithmetic (the key bias of attention) is then held to the model's
    scale, not to its own rounding noise."""
    assert set(actual) == set(expected), f"{name}: {sorted(actual)} != {sorted(expected)}"
    scale = max((float(g.abs().max()) for g in expected.values() if g.numel()), default=0.0) or 1.0
    for param_name, grad in expected.items():
        assert actual[param_name].shape == grad.shape, f"{name}/{param_name}: shape"
        torch.testing.assert_close(actual[param_name].double() / scale, grad.double() / scale,
                                   rtol=1e-4, atol=1e-6, msg=lambda m, p=param_name: f"{name}/{p}: {m}")


# EmbeddingBag has no vmap batching rule; torch.func falls back to a loop and says so.
_SLOW_VMAP = "ignore:There is a performance drop:UserWarning"


@pytest.mark.filterwarnings(_SLOW_VMAP)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_zoo_per_sample_gradients(case: tuple[str, int, str, bool], mode: str, device: torch.device) -> None:
    name, K, reduction, batch_first = case
    entry = ENTRIES[name]
    model, inputs, targets, expected = _case(*case, device)

    def run() -> dict[str, torch.Tensor]:
        return per_sample_gradients(model, inputs, targets, loss_fn=entry.loss("none"), mode=mode,
                                    augmentation_multiplicity=K, loss_reduction=reduction,
                                    batch_first=batch_first)

    failure = entry.fails.get((mode, batch_first))
    if failure is not None:
        with pytest.raises(UnsupportedModuleError, match=failure):
            run()
        return
    assert_grads_close(run(), expected, name=f"{name}/{mode}")


CLIPPINGS = ["flat", "automatic", "per_layer"]
PLANS = ["auto", "ghost", "materialise"]


@pytest.mark.parametrize("case", GRID, ids=_id)
def test_zoo_ghost(case: tuple[str, int, str, bool], monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """Ghost norms and clipped sums equal the oracle's, for every clipping rule and both plans
    of the 2T^2 vs p*d rule (cycled over the grid so each model meets each)."""
    name, K, reduction, batch_first = case
    index = GRID.index(case)
    clipping, plan = CLIPPINGS[index % 3], PLANS[(index // 3 + index) % 3]
    if plan != "auto":
        monkeypatch.setattr(ghost_module, "_ghost_is_cheaper", lambda layer, positions: plan == "ghost")
    model, inputs, targets, expected = _case(*case, device)
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)  # (N,)
    smallest = norms.sort().values
    bound = float(smallest[0] + smallest[1]) / 2  # the smallest sample unclipped, the rest clipped
    reference = clip_and_sum(expected, max_grad_norm=bound, clipping=clipping)
    result = ghost_dp_gradient(model, inputs, targets, loss_fn=ENTRIES[name].loss("none"),
                               config=DPConfig(mode="ghost", augmentation_multiplicity=K,
                                               loss_reduction=reduction, batch_first=batch_first,
                                               max_grad_norm=bound, clipping=clipping))
    assert result.num_samples == N_SAMPLES
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name=f"{name} norms")
    assert result.num_clipped == reference.num_clipped
    assert_grads_close(result.grads, reference.grads, name=f"{name}/ghost")
