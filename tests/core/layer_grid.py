"""The layer grid: every layer family in many configurations, run through every mode.

A :class:`~tests.core.grid_cases.Case` is one layer configuration; a :class:`Cell` is a case under
one K, loss reduction, batch layout and mode. :func:`run_cell` runs a cell and says what happened
(:class:`Outcome`): the mode's result equals the microbatch oracle (``PASS``), or it raised a
:class:`psg_core.PsgError` whose message names the layer (``REFUSED``); anything else (a raw torch
error, a wrong value, a refusal that does not say which layer) is a ``FAILURE``.

Modes: ``hooks``, ``functorch`` and ``ew`` through :func:`psg_core.per_sample_gradients`;
``gsm``, the :class:`psg_core.GradSampleModule` wrapper with an ordinary ``loss.backward()``;
``ghost`` through :func:`psg_core.dp_gradient`, against :func:`psg_core.clip_and_sum` of the
oracle (the norms and the clipped sum).
"""

from __future__ import annotations

import enum
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

import psg_core
from psg_core import DPConfig, PsgError
from tests.core.grid_cases import Batch, Case, all_cases
from tests.devices import oracle_precision, to_device
from tests.oracle import assert_close_scaled, hooks_grad_samples, microbatch_oracle

__all__ = ["MODES", "SAMPLES", "Cell", "Outcome", "Result", "all_cases", "cells_of", "full_grid", "slice_grid",
           "prepare", "run_cell", "assert_all_close", "main"]

MODES = ("hooks", "gsm", "functorch", "ew", "ghost")
SAMPLES = 3  # N; rows are N*K


# ------------------------------------------------------------------------------ cells
@dataclass(frozen=True)
class Cell:
    case: Case
    K: int
    reduction: str
    batch_first: bool
    mode: str

    @property
    def id(self) -> str:
        layout = "bf" if self.batch_first else "tm"
        return f"{self.case.name}-K{self.K}-{self.reduction}-{layout}-{self.mode}"


def cells_of(case: Case, modes: Sequence[str] = MODES) -> list[Cell]:
    return [Cell(case, K, reduction, batch_first, mode)
            for K, reduction, batch_first, mode in itertools.product([1, 2], ["mean", "sum"], case.layouts, modes)]


def full_grid() -> list[Cell]:
    return [cell for case in all_cases() for cell in cells_of(case)]


def slice_grid(per_mode: int = 3) -> list[Cell]:
    """A fixed subset: each family, for every mode, ``per_mode`` of its cases, turning through
    its K / reduction / layout combinations so each family meets each of them."""
    families: dict[str, list[Case]] = {}
    for case in all_cases():
        families.setdefault(case.family, []).append(case)
    cells = []
    for cases in families.values():
        for m, mode in enumerate(MODES):
            for r in range(per_mode):
                case = cases[(m + len(MODES) * r) % len(cases)]
                combos = cells_of(case, [mode])
                cell = combos[(m + 3 * r) % len(combos)]
                if cell not in cells:
                    cells.append(cell)
    return cells


# ------------------------------------------------------------------------------ running a cell
class Outcome(enum.Enum):
    PASS = "pass"
    REFUSED = "refused"
    FAILURE = "failure"


@dataclass
class Result:
    outcome: Outcome
    detail: str = ""
    error: BaseException | None = None
    warnings: list[str] = field(default_factory=list)


def _loss(reduction: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda out, y: F.mse_loss(out, y, reduction=reduction)


def _unreduced(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y, reduction="none")


def _double(value: Any) -> Any:
    if isinstance(value, PackedSequence):
        return value.to(torch.float64)
    if isinstance(value, tuple):
        return tuple(_double(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float64)
    return value


def prepare(cell: Cell, device: torch.device | str = "cpu"
            ) -> tuple[nn.Module, Batch, torch.Tensor, dict[str, torch.Tensor]]:
    """The model, batch, targets and oracle of a cell, on ``device`` (built on the CPU from the
    case's seeds, then moved: every device sees the same numbers)."""
    case, K = cell.case, cell.K
    model = case.build(cell.batch_first).to(device)
    built = case.batch(SAMPLES * K, cell.batch_first)
    batch = Batch(to_device(built.args, device), lambda n, k: to_device(built.sample(n, k), device))
    with torch.no_grad():
        out = model(*batch.args)
    targets = torch.randn(out.shape, generator=torch.Generator().manual_seed(14)).to(device)
    dim = 0 if cell.batch_first else 1
    samples = [(_double(batch.sample(n, K)), targets.narrow(dim, n * K, K)) for n in range(SAMPLES)]
    expected = microbatch_oracle(model, samples, _loss(cell.reduction))
    return model, batch, targets, {n: g.to_dense() if g.is_sparse else g for n, g in expected.items()}


def names_layer(err: BaseException, model: nn.Module) -> bool:
    """A refusal must say which layer: a module type of the model (the root's too: the module
    that takes a PackedSequence is the model), or a module path, in its message."""
    text = str(err)
    types = {type(m).__name__ for m in model.modules()}
    paths = {f"'{name}'" for name, _ in model.named_modules() if name}
    return any(t in text for t in types) or any(p in text for p in paths)


def compute(cell: Cell, model: nn.Module, batch: Batch, targets: torch.Tensor,
            expected: dict[str, torch.Tensor]) -> None:
    """Runs the cell's mode and compares with the oracle (AssertionError on a mismatch)."""
    K, reduction, batch_first = cell.K, cell.reduction, cell.batch_first
    if cell.mode == "ghost":
        per_sample = {n: g.to(torch.float32) for n, g in expected.items()}
        norms = torch.cat([g.flatten(1) for g in per_sample.values()], 1).norm(dim=1)
        bound = max(float(norms.median()) * 0.7, 1e-3)  # some samples clipped, some not
        reference = psg_core.clip_and_sum(per_sample, max_grad_norm=bound)
        result = psg_core.dp_gradient(model, batch.args, targets, loss_fn=_unreduced,
                                      config=DPConfig(mode="ghost", augmentation_multiplicity=K,
                                                      loss_reduction=reduction, batch_first=batch_first,
                                                      max_grad_norm=bound))
        assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
        actual = result.grads
        expected = reference.grads
    elif cell.mode == "gsm":
        actual, _ = hooks_grad_samples(model, batch.args, targets, _loss(reduction), K=K,
                                       loss_reduction=reduction, batch_first=batch_first)
    else:
        actual = psg_core.per_sample_gradients(model, batch.args, targets, loss_fn=_unreduced, mode=cell.mode,
                                               augmentation_multiplicity=K, loss_reduction=reduction,
                                               batch_first=batch_first)
    assert_all_close(actual, expected)


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda message: f"{prefix}: {message}"


def assert_all_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Each parameter against the oracle, scaled by its own largest entry; a gradient that is
    zero up to rounding (a key bias under softmax) is scaled by the model's largest entry."""
    assert set(actual) == set(expected), f"parameters {sorted(actual)} != {sorted(expected)}"
    overall = max((float(g.abs().max()) for g in expected.values() if g.numel()), default=0.0) or 1.0
    for name, ref in expected.items():
        got = actual[name]
        assert got is not None, f"{name}: missing"
        got = got.to_dense() if got.is_sparse else got
        own = float(ref.abs().max()) if ref.numel() else 0.0
        if own > 1e-6 * overall:
            assert_close_scaled(got, ref, name=name)
            continue
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        torch.testing.assert_close(got.double() / overall, ref.double() / overall, rtol=1e-4, atol=1e-6,
                                   msg=_prefixed(f"{name} (zero up to rounding)"))


def run_cell(cell: Cell, device: torch.device | str = "cpu") -> Result:
    """What one cell does on ``device``: the oracle's result, a refusal naming the layer, or a failure.

    Warnings are recorded on the result, not raised (torch warns about ``padding="same"`` with
    even kernels in the oracle's forward too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, batch, targets, expected = prepare(cell, device)
        try:
            compute(cell, model, batch, targets, expected)
            result = Result(Outcome.PASS)
        except AssertionError as err:
            result = Result(Outcome.FAILURE, f"mismatch: {err}".splitlines()[0], err)
        except PsgError as err:
            named = names_layer(err, model)
            result = Result(Outcome.REFUSED if named else Outcome.FAILURE,
                            ("" if named else "refusal without the layer: ") + f"{type(err).__name__}: {err}", err)
        except Exception as err:  # noqa: BLE001  (the grid reports every raw error)
            result = Result(Outcome.FAILURE, f"raw {type(err).__name__}: {err}".splitlines()[0], err)
        finally:
            for p in model.parameters():  # GradSampleModule leaves its outputs on the model
                p.grad = None
                p.grad_sample = None  # type: ignore[attr-defined]
    result.warnings = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return result


# ------------------------------------------------------------------------------ report
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.core.layer_grid [--slice]``: runs the grid and prints a tally by mode and
    outcome, then one line per failure. Exit status 1 when anything failed."""
    import argparse
    import collections
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--slice", action="store_true", help="only the slice that `make test` runs")
    parser.add_argument("--family", help="only this layer family (e.g. Conv2d)")
    parser.add_argument("--messages", action="store_true", help="print each distinct refusal message")
    parser.add_argument("--device", default="cpu", help="where the cells run (cpu, cuda; TF32 off on CUDA)")
    options = parser.parse_args(argv)
    cells = slice_grid() if options.slice else full_grid()
    if options.family:
        cells = [c for c in cells if c.case.family == options.family]
    tally: collections.Counter[tuple[str, str]] = collections.Counter()
    failures: list[str] = []
    warned: collections.Counter[str] = collections.Counter()
    messages: dict[tuple[str, str, str], list[str]] = {}
    refusals: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for cell in cells:
        with oracle_precision(options.device):
            result = run_cell(cell, options.device)
        warned.update(result.warnings)
        tally[(cell.mode, result.outcome.value)] += 1
        if result.outcome is Outcome.FAILURE:
            failures.append(f"{cell.id}: {result.detail}")
        elif result.outcome is Outcome.REFUSED:
            refusals[(cell.mode, cell.case.family, type(result.error).__name__)] += 1
            messages.setdefault((cell.mode, cell.case.family, result.detail[:300]), []).append(cell.id)
    out = sys.stdout
    out.write(f"{len(cells)} cells\n")
    for mode in MODES:
        counts = ", ".join(f"{o.value} {tally[(mode, o.value)]}" for o in Outcome)
        out.write(f"  {mode:9s} {counts}\n")
    out.write("refusals by mode and family:\n")
    for (mode, family, kind), count in sorted(refusals.items()):
        out.write(f"  {mode:9s} {family:22s} {kind:24s} {count}\n")
    if options.messages:
        for (mode, family, text), ids in sorted(messages.items()):
            out.write(f"REFUSAL {mode} {family} x{len(ids)} (e.g. {ids[0]}): {text}\n")
    for line in failures:
        out.write(f"FAILURE {line[:400]}\n")
    for text, count in warned.most_common():
        out.write(f"WARNING x{count}: {text[:300]}\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
