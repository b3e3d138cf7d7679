"""The README's core example runs, and its coverage table is what the code does."""

from __future__ import annotations

import re
from pathlib import Path

from psg_core.coverage import coverage_rows, render_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_coverage_table_matches_the_code() -> None:
    text = README.read_text()
    match = re.search(r"<!-- coverage:start -->\n(.*?)\n<!-- coverage:end -->", text, re.S)
    assert match, "README.md lost its coverage markers"
    assert match.group(1).strip() == render_markdown(coverage_rows()).strip(), (
        "README coverage table is stale: regenerate it with `python -m psg_core.coverage`")


def test_readme_core_example_runs() -> None:
    text = README.read_text()
    section = text.split("## psg_core in ten lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert tuple(namespace["model"].weight.grad_sample.shape) == (8, 4, 16)  # type: ignore[attr-defined]
    assert namespace["grads"]["weight"].shape == (8, 4, 16)  # type: ignore[index]
    assert namespace["step"].num_samples == 8  # type: ignore[attr-defined]
