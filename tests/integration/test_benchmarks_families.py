"""Rot guard for the ``families`` benchmark suite (``benchmarks/families.py``): at the tiny size every
row runs in process (and one family in a subprocess), and psg's three modes compute the same
clipped sum. No timing is asserted (benchmarks report, they never assert)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import load_suites
from benchmarks.families import FAMILIES, METHODS, run_family
from benchmarks.harness import SUITES, RunOptions, run_isolated
from benchmarks.models import opacus_available
from benchmarks.run import parse_args
from tests.integration.test_benchmarks import assert_reported

pytestmark = [
    # Opacus' hooks register full backward hooks on modules whose inputs need no gradient.
    pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
    # vmap runs torch's fused CPU attention kernel without a batching rule (BEiT under functorch).
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]
OPTIONS = RunOptions(size="tiny", isolate=False, warmup=1, repeats=1, threads=1)


def test_families_suite_is_registered_and_selectable() -> None:
    assert "families" in load_suites()
    assert parse_args(["--suites", "families", "--size", "tiny"]).suites == ["families"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_psg_row_runs_and_agrees(family: str) -> None:
    rows = {row["method"]: row for row in run_family({"options": OPTIONS.to_json(), "family": family})["rows"]}
    assert list(rows) == list(METHODS)
    for method in ("non-private", "psg-hooks", "psg-ghost", "psg-functorch"):
        assert "error" not in rows[method], rows[method]
        assert rows[method]["median_ms"] > 0 and rows[method]["parameters"] > 0
    for method in ("psg-ghost", "psg-functorch"):
        assert rows[method]["max_rel_diff"] < 1e-4, (method, rows[method]["max_rel_diff"])
    if not opacus_available():
        assert "opacus is not installed" in rows["opacus-hooks"]["error"]


def test_the_suite_renders_a_row_per_family_and_method(tmp_path: Path) -> None:
    payload = {"options": RunOptions(size="tiny", warmup=0, repeats=1, threads=1).to_json(), "family": "llama"}
    isolated = run_isolated("benchmarks.families:run_family", payload, timeout_s=300)["rows"]
    assert [row["method"] for row in isolated] == list(METHODS)
    table = SUITES["families"].render(isolated)
    assert table.count("\n| llama |") == len(METHODS)
    assert_reported("families", isolated, tmp_path)
