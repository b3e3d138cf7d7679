"""psg_core type-checks cleanly with mypy (STYLE habit 4), using the ``[tool.mypy]`` settings in
pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_mypy_reports_no_errors_on_psg_core() -> None:
    """psg_core itself, and a user's code that passes the choices as strings
    (tests/core/typing_samples)."""
    # The repository's .mypy_cache keeps a warm run to about a second; a cold one takes ~15 s.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "psg_core",
         str(REPO / "tests" / "core" / "typing_samples")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        pytest.fail(f"mypy psg_core exited with {result.returncode}:\n"
                    f"{(result.stdout + result.stderr).strip()}", pytrace=False)
