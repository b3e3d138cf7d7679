"""The layer grid (``tests/core/layer_grid.py``): every layer family in many configurations ×
K ∈ {1, 2} × mean/sum × batch_first where it applies × every mode (hooks, GradSampleModule,
functorch, ew, ghost). Each cell must equal the microbatch oracle or raise a ``PsgError`` that
names the layer; a raw torch error, a wrong value or an anonymous refusal fails.

``make test`` runs a fixed slice (each family under every mode, turning through K, reduction and
layout); ``PSG_FULL_GRID=1`` runs every cell. ``python -m tests.core.layer_grid`` prints a tally.
"""

from __future__ import annotations

import os

import pytest

from tests.core.layer_grid import MODES, Cell, Outcome, all_cases, full_grid, run_cell, slice_grid

FULL_GRID = os.environ.get("PSG_FULL_GRID") == "1"
CELLS = full_grid() if FULL_GRID else slice_grid()


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.id)
def test_layer_grid_cell(cell: Cell) -> None:
    result = run_cell(cell)
    if result.outcome is Outcome.FAILURE:
        pytest.fail(f"{cell.id}: {result.detail}", pytrace=False)


def test_slice_runs_every_family_under_every_mode() -> None:
    families = {case.family for case in all_cases()}
    covered = {(cell.case.family, cell.mode) for cell in slice_grid()}
    assert covered == {(family, mode) for family in families for mode in MODES}
    for family in families:  # and both K, both reductions
        cells = [cell for cell in slice_grid() if cell.case.family == family]
        assert {cell.K for cell in cells} == {1, 2}, family
        assert {cell.reduction for cell in cells} == {"mean", "sum"}, family


def test_grid_is_deterministic() -> None:
    assert [cell.id for cell in full_grid()] == [cell.id for cell in full_grid()]
    assert len({cell.id for cell in full_grid()}) == len(full_grid())
