"""The training suite on CUDA measures peak memory in the group's own process, not one process per
method (each paid ~15 s of CUDA start-up), and still runs every method, Opacus' ghost clipping
included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import benchmarks.training as training
from benchmarks.harness import RunOptions
from benchmarks.models import opacus_available

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


def test_cuda_suite_starts_one_process_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def fake_run_isolated(target: str, payload: dict[str, Any], *, timeout_s: float,
                          pin_mmap: bool = True) -> dict[str, Any]:
        assert not pin_mmap  # timed with the default allocator
        calls.append((target, payload))
        return {"rows": [{**training._row_header(training.Case(**case)), "median_ms": 1.0, "peak_memory_mib": 2.0}
                         for case in payload["cases"]]}

    monkeypatch.setattr(training, "run_isolated", fake_run_isolated)
    rows = training.run_suite(RunOptions(device="cuda", size="tiny", models=("cnn", "lstm"), multiplicities=(1, 4)))
    assert [target for target, _ in calls] == ["benchmarks.training:run_group"] * 4
    assert all(payload["memory"] for _, payload in calls)
    assert all(row["peak_memory_mib"] == 2.0 for row in rows)
    methods = {row["method"] for row in rows}
    assert "psg-ghost" in methods and ("opacus-ghost" in methods) == opacus_available()


def test_cpu_suite_keeps_a_process_per_memory_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    targets: list[str] = []

    def fake_run_isolated(target: str, payload: dict[str, Any], *, timeout_s: float,
                          pin_mmap: bool = True) -> dict[str, Any]:
        targets.append(target)
        # steps timed with glibc's default allocator; peak memory with the mmap threshold pinned
        assert pin_mmap == (not target.endswith("run_group"))
        if target.endswith("run_group"):
            assert not payload["memory"]
            return {"rows": [{**training._row_header(training.Case(**case)), "median_ms": 1.0}
                             for case in payload["cases"]]}
        return {"peak_memory_mib": 3.0}

    monkeypatch.setattr(training, "run_isolated", fake_run_isolated)
    rows = training.run_suite(RunOptions(device="cpu", size="tiny", models=("cnn",), multiplicities=(1,)))
    assert targets.count("benchmarks.training:run_group") == 1
    assert targets.count("benchmarks.training:run_case_in_child") == len(rows)


def test_group_measures_memory_after_timing() -> None:
    """On CPU the in-group path runs (the probe reports None there: resident memory cannot be
    attributed in-process); on CUDA it reports each method's peak."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [training.Case(model="cnn", method=method, K=1, size="tiny", device=device, warmup=1, repeats=2).to_json()
             for method in ("non-private", "psg-hooks", "psg-ghost")]
    rows = training.run_group({"cases": cases, "memory": True})["rows"]
    assert [row["method"] for row in rows] == ["non-private", "psg-hooks", "psg-ghost"]
    for row in rows:
        assert "error" not in row and "memory_error" not in row, row
        assert row["median_ms"] > 0
        if device == "cuda":
            assert row["peak_memory_mib"] > 0
        else:
            assert row["peak_memory_mib"] is None


def allocator_setting(payload: dict[str, Any]) -> dict[str, Any]:
    """Run in the child by the test below: what the child's allocator was told."""
    import os

    return {"threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


@pytest.mark.parametrize("pin", [True, False])
def test_only_memory_children_pin_the_mmap_threshold(pin: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that times steps runs with glibc's default allocator, even where the parent was
    started with the threshold pinned; a child that measures peak memory pins it."""
    from benchmarks.harness import run_isolated

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    result = run_isolated(f"{__name__}:allocator_setting", {}, timeout_s=120, pin_mmap=pin)
    assert result == {"threshold": "65536" if pin else None}


def test_the_step_profile_reports_wall_kernels_and_copies(tmp_path: Any) -> None:
    """benchmarks/gpu/profile_step.py (the GPU profiles in benchmarks/results) on the CPU: one file
    per model, a timing line and the op tables per method, a failing method reported beside the
    others."""
    from benchmarks.gpu.profile_step import main

    assert main(["--device", "cpu", "--size", "tiny", "--models", "embedding_bag", "--methods", "non-private",
                 "psg-ghost", "no-such-method", "--steps", "1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "profile_embedding_bag.txt").read_text()
    assert report.count("### embedding_bag / ") == 3
    assert "wall " in report and "kernel launches/step" in report and "device-to-host copies/step" in report
    assert "aten::embedding_bag" in report or "aten::_embedding_bag" in report
    assert "### embedding_bag / no-such-method\nerror: KeyError" in report
