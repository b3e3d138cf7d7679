"""Which layer works with which backend: the coverage table, measured rather than written down.

Every layer type in the grad-sampler registry, psg's DP rewrites and a few notable torch layers
get a tiny example; each backend computes per-sample gradients (ghost: per-sample norms and the
clipped sum) for it with ``K=2`` and is compared with a sample-by-sample reference. A registered
type without an example shows up as "no example" until one is added to :data:`EXAMPLES`.

Refusals are stated, each with its condition (:data:`REFUSALS`: "ew refuses Embedding when
batch_first=False"), and checked: a stated refusal's example must raise a
:class:`~psg_core.errors.PsgError`, a layer refused in every configuration must be refused on its
own example, and any refusal nobody stated is shown as such. A cell reads ``✅`` (matches the
reference), then ``❌ <condition>`` for each stated refusal; ``⚠`` marks a statement the code
does not keep (the tests fail on it).

    python -m psg_core.coverage            # prints the Markdown table for the README

>>> rows = coverage_rows([nn.Linear])
>>> rows[0].cells["ghost"]
'✅ ghost norm'
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from psg_core._coverage_cases import EXAMPLES, REFUSALS, Example, Refusal
from psg_core._coverage_cases import K as _K
from psg_core._coverage_cases import SAMPLES as _SAMPLES
from psg_core.api import per_sample_gradients
from psg_core.backends.ghost import ghost_dp_gradient, ghost_norm_layers
from psg_core.config import DPConfig
from psg_core.errors import PsgError
from psg_core.grad_sample import GRAD_SAMPLERS
from psg_core.modes import GradSampleMode

__all__ = ["EXAMPLES", "REFUSALS", "Example", "Refusal", "CoverageRow", "coverage_rows", "refusal_holds",
           "render_markdown", "main"]

logger = logging.getLogger(__name__)

MODES = [m.value for m in GradSampleMode]


@dataclass(frozen=True)
class CoverageRow:
    """One layer: a cell per backend (✅ with how, then ❌ with each stated refusal's condition)."""

    layer: str
    cells: dict[str, str]


def _targets(model: nn.Module, args: tuple[Any, ...]) -> torch.Tensor:
    with torch.no_grad():
        return torch.randn_like(model(*args))


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


#: Tolerance of the autocast rows, relative to the reference's largest entry (psg_core.precision:
#: autocast's own forward is ~2e-2 off fp32 on these models).
AUTOCAST_TOLERANCE = 5e-2


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, atol: float = 1e-5,
           rtol: float = 1e-4) -> bool:
    """fp32 results against the fp64 reference, relative to the reference's largest entry."""
    if actual.keys() != expected.keys():
        return False
    scale = max((float(g.abs().max()) for g in expected.values() if g.numel()), default=0.0) or 1.0
    return all(actual[n].shape == g.shape and
               torch.allclose(actual[n].double() / scale, g / scale, rtol=rtol, atol=atol)
               for n, g in expected.items())


def _reason(err: Exception) -> str:
    text = str(err)
    for needle, short in (("mixes", "mixes samples"), ("fused", "fused kernel: fix_model"),
                          ("ExpandedWeights", "op not in torch's ExpandedWeights"),
                          ("cannot vmap", "no vmap batching rule: fix_model")):
        if needle in text:
            return short
    return type(err).__name__


def _run(mode: str, model: nn.Module, args: tuple[Any, ...], y: torch.Tensor, *, batch_first: bool = True) -> Any:
    """Per-sample gradients (ghost: the clipped sum with no clipping) of ``mse`` at ``K=2``."""
    loss_fn = nn.MSELoss(reduction="none")
    if mode == GradSampleMode.GHOST.value:
        config = DPConfig(mode=GradSampleMode.GHOST, augmentation_multiplicity=_K, max_grad_norm=1e9,
                          batch_first=batch_first)
        return ghost_dp_gradient(model, args, y, loss_fn=loss_fn, config=config)
    return per_sample_gradients(model, args, y, loss_fn=loss_fn, mode=mode, augmentation_multiplicity=_K,
                                batch_first=batch_first)


def _probe(mode: str, example: Example) -> str:
    """The row's own example: ``✅ ...`` when it matches the reference, else ``❌ <reason>``."""
    torch.manual_seed(0)
    model = example.model()
    args = example.inputs()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = _targets(model, args)
            expected = _reference(model, args[0], y)
            tolerance = {} if example.autocast is None else {"atol": AUTOCAST_TOLERANCE, "rtol": 0.0}
            with torch.autocast("cpu", dtype=example.autocast or torch.bfloat16, enabled=example.autocast is not None), \
                    _counting_fallbacks() as fallbacks:
                result = _run(mode, model, args, y)
            if mode == GradSampleMode.GHOST.value:
                norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)  # (N,)
                ok = _close({"norms": result.per_sample_norms}, {"norms": norms}, **tolerance) and \
                    _close(result.grads, {n: g.sum(0) for n, g in expected.items()}, **tolerance)
            else:
                ok = _close(result, expected, **tolerance)
            if example.autocast is not None:
                params = dict(model.named_parameters())
                grads = result.grads if mode == GradSampleMode.GHOST.value else result
                ok = ok and all(g.dtype == params[n].dtype for n, g in grads.items())
    except (PsgError, RuntimeError, NotImplementedError) as err:
        logger.debug("coverage: %s failed: %s", mode, err)
        return f"❌ {_reason(err)}" if isinstance(err, PsgError) else f"⚠ raw {type(err).__name__}"
    if not ok:
        return "❌ wrong result"
    slow = any("batching rule" in str(w.message) for w in caught)
    return "✅" + _how(mode, model, bool(fallbacks)) + (" (slow: vmap fallback)" if slow else "")


@contextlib.contextmanager
def _counting_fallbacks() -> Iterator[list[str]]:
    """Lists the layers the hooks and ghost backends ran under the per-layer torch.func fallback
    in the block (a layer without a grad sampler whose parameters meet the batch in pointwise ops
    only gets its per-sample gradients from meeting points instead)."""
    from psg_core.backends import capture

    ran: list[str] = []
    original = capture.functorch_layer_grad_sample

    def counting(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        ran.append(type(layer).__qualname__)
        return original(layer, *args, **kwargs)

    capture.functorch_layer_grad_sample = counting  # type: ignore[assignment]
    try:
        yield ran
    finally:
        capture.functorch_layer_grad_sample = original


def refusal_holds(refusal: Refusal) -> str | None:
    """Runs a stated refusal's example: None when it raises a PsgError, else what happened."""
    if refusal.example is None:
        raise ValueError(f"refusal_holds: {refusal.layer!r} under {refusal.mode.value} is refused always; "
                         "its row's own example shows it")
    example = refusal.example
    torch.manual_seed(0)
    model = example.model()
    args = example.inputs()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = _targets(model, args)
            _run(refusal.mode.value, model, args, y, batch_first=example.batch_first)
    except PsgError:
        return None
    except Exception as err:  # noqa: BLE001  (what a stated refusal raises instead is the finding)
        return f"raw {type(err).__name__}"
    return "not raised"


def _how(mode: str, model: nn.Module, fallback_ran: bool) -> str:
    layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    unsampled = any(GRAD_SAMPLERS.lookup(m) is None for m in layers)
    if mode == "hooks" and unsampled:
        return (" torch.func fallback" if fallback_ran else " meeting points") + " (strict=False)"
    if mode == "ghost":
        if all(isinstance(m, ghost_norm_layers()) for m in layers):
            return " ghost norm"
        if not unsampled:
            return " materialised"
        return " torch.func fallback" if fallback_ran else " meeting points"
    return ""


def _cell(mode: str, example: Example, refusals: Sequence[Refusal]) -> str:
    """The base probe, then each stated refusal for this row and mode, checked."""
    base = _probe(mode, example)
    always = [r for r in refusals if r.always]
    if always:
        statement = "; ".join(r.condition for r in always)
        text = f"❌ {statement}" if base.startswith("❌") and base != "❌ wrong result" \
            else f"⚠ stated refusal ({statement}) not kept: {base}"
    elif base.startswith("❌") and base != "❌ wrong result":
        text = f"⚠ unstated refusal: {base[2:]}"
    else:
        text = base
    for refusal in refusals:
        if refusal.always:
            continue
        problem = refusal_holds(refusal)
        text += f"; ❌ {refusal.condition}" if problem is None else \
            f"; ⚠ stated refusal ({refusal.condition}) {problem}"
    return text


def _label_of(layer_type: type[nn.Module]) -> str:
    return layer_type.__name__


def coverage_rows(extra_types: Sequence[type[nn.Module]] | None = None) -> list[CoverageRow]:
    """Probes every example (or only ``extra_types``' examples) under every backend, and checks
    each stated refusal of those rows.

    Rows: the registered layer types (sorted), then psg's DP rewrites and the other examples.
    """
    registered = [_label_of(t) for t in (extra_types if extra_types is not None else GRAD_SAMPLERS)]
    labels = registered + ([label for label in EXAMPLES if label not in registered]
                           if extra_types is None else [])
    if extra_types is None:
        unknown = sorted({r.layer for r in REFUSALS} - set(labels))
        if unknown:
            raise ValueError(f"coverage_rows: refusals stated for rows that do not exist: {unknown}")
    rows = []
    for label in labels:
        example = EXAMPLES.get(label)
        if example is None:
            cells = {mode: "no example" for mode in MODES}
            cells["hooks"] = "✅ registered sampler (no example in psg_core/_coverage_cases.py)"
        else:
            cells = {mode: _cell(mode, example, [r for r in REFUSALS if r.layer == label and r.mode.value == mode])
                     for mode in MODES}
        rows.append(CoverageRow(label, cells))
    return rows


def render_markdown(rows: Sequence[CoverageRow]) -> str:
    """A Markdown table: one row per layer, one column per backend."""
    lines = ["| layer | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    lines += [f"| {row.layer} | " + " | ".join(row.cells[m] for m in MODES) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m psg_core.coverage``: prints the table (measured on this torch build)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.parse_args(argv)
    sys.stdout.write(render_markdown(coverage_rows()))


if __name__ == "__main__":
    main()
