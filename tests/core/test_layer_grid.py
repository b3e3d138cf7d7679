"""The layer grid (``tests/core/layer_grid.py``): every layer family in many configurations ×
K ∈ {1, 2} × mean/sum × batch_first where it applies × every mode (hooks, GradSampleModule,
functorch, ew, ghost). Each cell must equal the microbatch oracle or raise a ``PsgError`` that
names the layer; a raw torch error, a wrong value or an anonymous refusal fails. And the coverage
table (``psg_core.coverage``) must state exactly the refusals the grid meets: a cell is refused if
and only if one of the table's refusals for its layer and mode covers its configuration.

``make test`` runs a fixed slice (each family under every mode, turning through K, reduction and
layout); ``PSG_FULL_GRID=1`` runs every cell. ``python -m tests.core.layer_grid`` prints a tally.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from psg_core.coverage import REFUSALS
from tests.core.layer_grid import MODES, Cell, Outcome, all_cases, full_grid, run_cell, slice_grid

FULL_GRID = os.environ.get("PSG_FULL_GRID") == "1"

Predicate = Callable[[Cell], bool]


def _option(name: str, value: Any = True) -> Predicate:
    return lambda cell: cell.case.options.get(name) == value


def _time_major(cell: Cell) -> bool:
    return not cell.batch_first


_RECURRENT = ("DPRNN", "DPGRU", "DPLSTM")
_INSTANCE_NORMS = ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d")

#: The coverage table's conditional refusals, as predicates on grid cells: (mode, row, condition).
#: A refusal stated "always" covers every cell of its row and mode.
STATED: dict[tuple[str, str, str], Predicate] = {
    ("hooks", "Embedding", "with scale_grad_by_freq=True"): _option("scale_grad_by_freq"),
    ("functorch", "Embedding", "with sparse=True"): _option("sparse"),
    ("functorch", "EmbeddingBag", "with 1-D input and offsets"): _option("input", "offsets"),
    **{("functorch", family, "with track_running_stats=True"): _option("track_running_stats")
       for family in _INSTANCE_NORMS},
    ("functorch", "DPMultiheadAttention", "with key_padding_mask and batch_first=False"):
        lambda cell: cell.case.options.get("key_padding_mask") and not cell.batch_first,
    **{("functorch", family, "with a PackedSequence input"): _option("packed") for family in _RECURRENT},
    **{("functorch", family, "with an initial state and batch_first=True"):
       (lambda cell: cell.case.options["initial_state"] and cell.batch_first) for family in _RECURRENT},
    ("ew", "Conv3d", "with groups > 1 and dilation > 1"):
        lambda cell: cell.case.options["groups"] > 1 and cell.case.options["dilation"] != 1,
    ("ew", "Embedding", "when batch_first=False"): _time_major,
    ("ew", "Embedding", "with 1-D input"): _option("shape", ()),
    ("ew", "Embedding", "with scale_grad_by_freq=True"): _option("scale_grad_by_freq"),
    ("ew", "LayerNorm", "when batch_first=False"):  # a parameter-free LayerNorm is no refusal
        lambda cell: not cell.batch_first and cell.case.options.get("affine", True),
    ("ew", "DPMultiheadAttention", "with add_bias_kv=True"): _option("add_bias_kv"),
    ("ghost", "Embedding", "with scale_grad_by_freq=True"): _option("scale_grad_by_freq"),
}

#: Cells that fail today through psg_core defects (reported with reproducers); strict, so a fix
#: shows up as XPASS and its entry must go.
KNOWN_DEFECTS: dict[str, Predicate] = {}


def _table_mode(cell: Cell) -> str:
    return "hooks" if cell.mode == "gsm" else cell.mode


def stated_refusals(cell: Cell) -> list[str]:
    """The coverage table's refusals that cover this cell."""
    mode, family = _table_mode(cell), cell.case.family
    out = []
    for refusal in REFUSALS:
        if refusal.mode.value != mode or refusal.layer != family:
            continue
        if refusal.always or STATED[(mode, family, refusal.condition)](cell):
            out.append(refusal.condition)
    return out


def _param(cell: Cell) -> Any:
    defects = [reason for reason, applies in KNOWN_DEFECTS.items() if applies(cell)]
    marks = [pytest.mark.xfail(strict=True, reason="; ".join(defects))] if defects else []
    return pytest.param(cell, id=cell.id, marks=marks)


CELLS = [_param(cell) for cell in (full_grid() if FULL_GRID else slice_grid())]


@pytest.mark.parametrize("cell", CELLS)
def test_layer_grid_cell(cell: Cell, device: torch.device) -> None:
    result = run_cell(cell, device)
    if result.outcome is Outcome.FAILURE:
        pytest.fail(f"{cell.id}: {result.detail}", pytrace=False)
    stated = stated_refusals(cell)
    if result.outcome is Outcome.REFUSED and not stated:
        pytest.fail(f"{cell.id}: refused, and the coverage table states no refusal that covers it: "
                    f"{result.detail}", pytrace=False)
    if result.outcome is Outcome.PASS and stated:
        pytest.fail(f"{cell.id}: the coverage table states a refusal ({'; '.join(stated)}), but it "
                    "computed the oracle's result", pytrace=False)


def test_grid_predicates_are_the_tables_refusals() -> None:
    """Every conditional refusal the table states for a grid family has its predicate here, and
    every predicate here is a refusal the table states."""
    families = {case.family for case in all_cases()}
    table = {(r.mode.value, r.layer, r.condition) for r in REFUSALS if not r.always and r.layer in families}
    assert table == set(STATED)


def test_every_stated_refusal_meets_the_grid() -> None:
    """Each stated refusal of a grid family covers at least one cell of the full grid."""
    families = {case.family for case in all_cases()}
    cells = full_grid()
    for refusal in REFUSALS:
        if refusal.layer not in families:
            continue
        mode = refusal.mode.value
        covered = [cell for cell in cells if cell.case.family == refusal.layer and _table_mode(cell) == mode
                   and (refusal.always or STATED[(mode, refusal.layer, refusal.condition)](cell))]
        assert covered, (mode, refusal.layer, refusal.condition)


def test_slice_runs_every_family_under_every_mode() -> None:
    families = {case.family for case in all_cases()}
    cells = slice_grid()
    assert {(cell.case.family, cell.mode) for cell in cells} == {(f, m) for f in families for m in MODES}
    for family in families:  # and both K, both reductions
        assert {cell.K for cell in cells if cell.case.family == family} == {1, 2}, family
        assert {cell.reduction for cell in cells if cell.case.family == family} == {"mean", "sum"}, family


def test_grid_is_deterministic() -> None:
    ids = [cell.id for cell in full_grid()]
    assert ids == [cell.id for cell in full_grid()]
    assert len(set(ids)) == len(ids)
