"""Which layer works with which backend: the coverage table, measured rather than written down.

Every layer type in the grad-sampler registry, psg's DP rewrites and a few notable torch layers
get a tiny example; each backend computes per-sample gradients (ghost: per-sample norms and the
clipped sum) for it with ``K=2`` and is compared with a sample-by-sample reference. A registered
type without an example shows up as "no example" until one is added to :data:`EXAMPLES`.

    python -m psg_core.coverage            # prints the Markdown table for the README

>>> rows = coverage_rows([nn.Linear])
>>> rows[0].cells["ghost"]
'✅ ghost norm'
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from psg_core.api import per_sample_gradients
from psg_core.backends.ghost import ghost_dp_gradient, ghost_norm_layers
from psg_core.config import DPConfig
from psg_core.errors import PsgError
from psg_core.grad_sample import GRAD_SAMPLERS
from psg_core.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention, SequenceBias
from psg_core.modes import GradSampleMode

__all__ = ["EXAMPLES", "CoverageRow", "coverage_rows", "render_markdown", "main"]

logger = logging.getLogger(__name__)

_K = 2
_SAMPLES = 2
_ROWS = _K * _SAMPLES
MODES = [m.value for m in GradSampleMode]


class _FirstOutput(nn.Module):
    """Keeps the first output of layers returning tuples (recurrent layers, attention)."""

    def __init__(self, layer: nn.Module, self_attention: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.self_attention = self_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x, x, x) if self.self_attention else self.layer(x)
        return out[0]


class _BareParameter(nn.Module):
    """A custom module whose parameter no grad sampler knows: ``x * scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _floats(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(_ROWS, *shape)


def _tokens(vocab: int, length: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, vocab, (_ROWS, length))


#: label -> (model factory, input factory); rows = K * samples on dim 0.
EXAMPLES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "Linear": (lambda: nn.Linear(4, 3), _floats(3, 4)),
    "Conv1d": (lambda: nn.Conv1d(2, 4, 3, padding=1), _floats(2, 6)),
    "Conv2d": (lambda: nn.Conv2d(2, 4, 3, stride=2, groups=2), _floats(2, 5, 5)),
    "Conv3d": (lambda: nn.Conv3d(2, 2, 2), _floats(2, 3, 3, 3)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), _floats(2, 4)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(2, 2, 2), _floats(2, 3, 3)),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 2, 2), _floats(2, 2, 2, 2)),
    "Embedding": (lambda: nn.Embedding(10, 4, padding_idx=0), _tokens(10, 5)),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(10, 4, mode="mean"), _tokens(10, 5)),
    "LayerNorm": (lambda: nn.LayerNorm(4), _floats(3, 4)),
    "RMSNorm": (lambda: nn.RMSNorm(4), _floats(3, 4)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), _floats(4, 5)),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), _floats(3, 5)),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(3, affine=True), _floats(3, 4, 4)),
    "InstanceNorm3d": (lambda: nn.InstanceNorm3d(2, affine=True), _floats(2, 3, 3, 3)),
    "SequenceBias": (lambda: SequenceBias(4, batch_first=True), _floats(3, 4)),
    "DPMultiheadAttention": (lambda: _FirstOutput(DPMultiheadAttention(4, 2, batch_first=True), True),
                             _floats(3, 4)),
    "DPRNN": (lambda: _FirstOutput(DPRNN(3, 4, batch_first=True)), _floats(4, 3)),
    "DPGRU": (lambda: _FirstOutput(DPGRU(3, 4, batch_first=True)), _floats(4, 3)),
    "DPLSTM": (lambda: _FirstOutput(DPLSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)),
               _floats(4, 3)),
    "nn.MultiheadAttention (fused)": (lambda: _FirstOutput(nn.MultiheadAttention(4, 2, batch_first=True), True),
                                      _floats(3, 4)),
    "nn.RNN (fused)": (lambda: _FirstOutput(nn.RNN(3, 4, batch_first=True)), _floats(4, 3)),
    "nn.GRU (fused)": (lambda: _FirstOutput(nn.GRU(3, 4, batch_first=True)), _floats(4, 3)),
    "nn.LSTM (fused)": (lambda: _FirstOutput(nn.LSTM(3, 4, batch_first=True)), _floats(4, 3)),
    "BatchNorm1d (training)": (lambda: nn.BatchNorm1d(3), _floats(3)),
    "custom module, bare nn.Parameter": (lambda: _BareParameter(), _floats(3, 4)),
}


@dataclass(frozen=True)
class CoverageRow:
    """One layer: a cell per backend (✅ with how, or ❌ with why)."""

    layer: str
    cells: dict[str, str]


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sample by sample, in float64: the definition every backend must match."""
    model = copy.deepcopy(model).double()
    x, y = (x.double() if x.is_floating_point() else x), y.double()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for n in range(_SAMPLES):
        rows = slice(n * _K, (n + 1) * _K)
        loss = F.mse_loss(model(x[rows]), y[rows])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (name, p), g in zip(params.items(), grads):
            out[name].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(gs) for n, gs in out.items()}


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    """fp32 results against the fp64 reference, relative to the reference's largest entry."""
    if actual.keys() != expected.keys():
        return False
    scale = max((float(g.abs().max()) for g in expected.values() if g.numel()), default=0.0) or 1.0
    return all(actual[n].shape == g.shape and
               torch.allclose(actual[n].double() / scale, g / scale, rtol=1e-4, atol=1e-5)
               for n, g in expected.items())


def _reason(err: Exception) -> str:
    text = str(err)
    for needle, short in (("mixes", "mixes samples"), ("fused", "fused kernel: fix_model"),
                          ("ExpandedWeights", "op not in torch's ExpandedWeights"),
                          ("cannot vmap", "no vmap batching rule: fix_model")):
        if needle in text:
            return short
    return type(err).__name__


def _probe(mode: str, factory: Callable[[], nn.Module], x: torch.Tensor) -> str:
    torch.manual_seed(0)
    model = factory()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = torch.randn_like(model(x))
            expected = _reference(model, x, y)
            loss_fn = nn.MSELoss(reduction="none")
            if mode == "ghost":
                result = ghost_dp_gradient(model, x, y, loss_fn=loss_fn,
                                           config=DPConfig(mode=GradSampleMode.GHOST,
                                                           augmentation_multiplicity=_K,
                                                           max_grad_norm=1e9))
                norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)  # (N,)
                ok = _close({"norms": result.per_sample_norms}, {"norms": norms}) and \
                    _close(result.grads, {n: g.sum(0) for n, g in expected.items()})
            else:
                ok = _close(per_sample_gradients(model, x, y, loss_fn=loss_fn, mode=mode,
                                                 augmentation_multiplicity=_K), expected)
    except (PsgError, RuntimeError, NotImplementedError) as err:
        logger.debug("coverage: %s failed: %s", mode, err)
        return f"❌ {_reason(err)}"
    if not ok:
        return "❌ wrong result"
    slow = any("batching rule" in str(w.message) for w in caught)
    return "✅" + _how(mode, model) + (" (slow: vmap fallback)" if slow else "")


def _how(mode: str, model: nn.Module) -> str:
    layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    if mode == "hooks" and any(GRAD_SAMPLERS.lookup(m) is None for m in layers):
        return " torch.func fallback (strict=False)"
    if mode == "ghost":
        if all(isinstance(m, ghost_norm_layers()) for m in layers):
            return " ghost norm"
        return " materialised" if all(GRAD_SAMPLERS.lookup(m) is not None for m in layers) \
            else " torch.func fallback"
    return ""


def _label_of(layer_type: type[nn.Module]) -> str:
    return layer_type.__name__


def coverage_rows(extra_types: Sequence[type[nn.Module]] | None = None) -> list[CoverageRow]:
    """Probes every example (or only ``extra_types``' examples) under every backend.

    Rows: the registered layer types (sorted), then psg's DP rewrites and the other examples.
    """
    registered = [_label_of(t) for t in (extra_types if extra_types is not None else GRAD_SAMPLERS)]
    labels = registered + ([label for label in EXAMPLES if label not in registered]
                           if extra_types is None else [])
    rows = []
    for label in labels:
        example = EXAMPLES.get(label)
        if example is None:
            cells = {mode: "no example" for mode in MODES}
            cells["hooks"] = "✅ registered sampler (no example in psg_core/coverage.py)"
        else:
            factory, make_input = example
            torch.manual_seed(0)
            x = make_input()
            cells = {mode: _probe(mode, factory, x) for mode in MODES}
        rows.append(CoverageRow(label, cells))
    return rows


def render_markdown(rows: Sequence[CoverageRow]) -> str:
    """A Markdown table: one row per layer, one column per backend."""
    lines = ["| layer | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    lines += [f"| {row.layer} | " + " | ".join(row.cells[m] for m in MODES) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m psg_core.coverage``: prints the table (measured on this torch build)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    sys.stdout.write(render_markdown(coverage_rows()))


if __name__ == "__main__":
    main()
