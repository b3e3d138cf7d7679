"""Results on disk: ``benchmarks/results/<machine>.json``, PNG plots, and ``BENCHMARKS.md``.

One JSON file per machine holds the latest run of every suite on it; ``BENCHMARKS.md`` is
regenerated from all the JSON files in the results folder, so a CPU run and a GPU run sit side by
side.

>>> machine_name("cpu").startswith("cpu-")
True
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import SUITES, RunOptions, TargetCheck, memory_method
from benchmarks.models import opacus_available

__all__ = ["machine_name", "machine_info", "write_results", "set_note", "load_results", "render_markdown",
           "write_markdown", "write_report", "RESULTS_DIR", "MARKDOWN_PATH"]

logger = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = _ROOT / "benchmarks" / "results"
MARKDOWN_PATH = _ROOT / "BENCHMARKS.md"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_name(device: str) -> str:
    """A file-name-safe name for this machine and device, e.g. ``cpu-2c-amd-epyc-7b13``."""
    if device == "cuda":
        return "cuda-" + _slug(torch.cuda.get_device_name())
    cpu = re.sub(r"\b(processor|cpu|with radeon graphics|\d+-core)\b|\(r\)|\(tm\)|@.*", "",
                 _cpu_model(), flags=re.IGNORECASE)
    return f"cpu-{os.cpu_count()}c-{_slug(cpu)}"[:60].rstrip("-")


def machine_info(options: RunOptions) -> dict[str, Any]:
    """What the numbers depend on: hardware, library versions, threads, how memory is measured."""
    info: dict[str, Any] = {
        "device": options.device,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": options.threads or torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "memory_method": memory_method(options.device, isolate=options.isolate),
    }
    if options.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    if opacus_available():
        import opacus

        info["opacus"] = opacus.__version__
    return info


def _results_path(out_dir: Path, machine: str) -> Path:
    return out_dir / f"{machine}.json"


def set_note(machine: str, note: str, out_dir: Path) -> Path:
    """Stores a free-text note (conditions of the run, e.g. a shared machine) in a results file."""
    path = _results_path(out_dir, machine)
    if not path.exists():
        raise FileNotFoundError(f"set_note: no results file {path}")
    document = json.loads(path.read_text())
    document["note"] = note
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def write_results(machine: str, options: RunOptions, suite_rows: Mapping[str, list[dict[str, Any]]],
                  out_dir: Path, *, note: str | None = None) -> Path:
    """Writes (or updates) ``<out_dir>/<machine>.json``; suites not run this time are kept."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = _results_path(out_dir, machine)
    previous: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    suites = dict(previous.get("suites", {}))
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    for name, rows in suite_rows.items():
        suite = SUITES[name]
        suites[name] = {"rows": rows, "targets": [t.to_json() for t in suite.targets(rows)],
                        "options": options.to_json(), "created": now}
    document = {"machine": machine, "info": machine_info(options), "updated": now, "suites": suites}
    if note is not None or previous.get("note"):
        document["note"] = note if note is not None else previous["note"]
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def load_results(out_dir: Path) -> list[dict[str, Any]]:
    """Every ``<machine>.json`` results file in ``out_dir``, sorted by file name."""
    documents = []
    for path in sorted(out_dir.glob("*.json")):
        try:
            document = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            logger.warning("report: skipping %s, not valid JSON (%s)", path, err)
            continue
        # Other tools may save their own JSON here; a results file names its machine and suites.
        if isinstance(document, dict) and {"machine", "suites"} <= document.keys():
            documents.append(document)
    return documents


def _targets_table(targets: list[TargetCheck]) -> list[str]:
    lines = ["| target | where | measured | bound | status | numbers |", "|---|---|---:|---:|---|---|"]
    for check in targets:
        status = {True: "met", False: "**not met**", None: "n/a"}[check.met]
        value = "—" if check.value is None else f"{check.value:.2f}"
        lines.append(f"| {check.target} | {check.subject} | {value} | {check.threshold:g} | {status} | "
                     f"{check.detail} |")
    return lines


def render_markdown(documents: list[dict[str, Any]], *, out_dir: Path, markdown_path: Path) -> str:
    """The whole ``BENCHMARKS.md``: how to run, then per machine the targets and each suite's tables."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.run` (`make bench`) from `benchmarks/results/*.json`; do not "
        "edit by hand. Targets are reported, never asserted: a test runs every benchmark for one tiny "
        "step so that they keep working (`tests/integration/test_benchmarks.py`).",
        "",
        "```",
        "python -m benchmarks.run                 # full run on CPU (or --device cuda)",
        "python -m benchmarks.run --quick         # smaller models and batches, fewer repeats",
        "python -m benchmarks.run --models cnn transformer --suites training",
        "```",
        "",
        "On a GPU machine without network access (the lent H100/H200): `bash benchmarks/gpu/prepare.sh` "
        "here fetches the cp312 wheels it lacks into `.whl/` (Ray trimmed to ~40 MB; the gpt2 suite's "
        "transformers, peft and their needs in `.whl/hf/`, transformers cut to the model families they "
        "import: 59 MB in all, within the 64 MiB a call carries with the tree), then "
        "`bash benchmarks/gpu/on_device.sh all` there (carrying `.whl`) runs the GPU training suite "
        "(about 100 s on an H200) and then the CUDA tests over the machine's cores (about 160 s), in one "
        "machine start; `tests`, `bench`, `profile` (torch.profiler over the suite's steps: wall against "
        "kernel time, launches, device-to-host copies), `host` and `gpt2` (the gpt2 suite on the GPU) run "
        "parts, several in one call. Copy the JSON it "
        "writes into `benchmarks/results/` and run `python -m benchmarks.run --report-only` to add its "
        "section.",
        "",
        "Timing: median of the timed steps after warm-up steps (min–max shown too). Peak memory: see each "
        "machine's *memory method*. Per-sample gradient memory: bytes of the per-sample gradient tensors "
        "a step holds (— for ghost clipping, which never materialises them). Numbers from a shared "
        "machine are noisy; the min–max spread shows how much.",
        "",
    ]
    if not documents:
        lines += ["No results yet.", ""]
    rel = os.path.relpath(out_dir, markdown_path.parent)
    for document in documents:
        machine, info = document["machine"], document.get("info", {})
        lines += [f"## {machine}", ""]
        described = ", ".join(f"{key} {info[key]}" for key in ("cpu", "cpu_count", "gpu", "torch_threads",
                                                                "torch", "opacus", "python") if key in info)
        lines += [f"{described}. Updated {document.get('updated', '?')}.", "",
                  f"Memory method: {info.get('memory_method', '?')}.", ""]
        if document.get("note"):
            lines += [f"Note: {document['note']}", ""]
        suites = document.get("suites", {})
        targets = [TargetCheck(**t) for name in suites for t in suites[name].get("targets", [])]
        if targets:
            lines += ["### Targets", ""] + _targets_table(targets) + [""]
        for name, section in suites.items():
            suite = SUITES.get(name)
            options = section.get("options", {})
            lines += [f"### Suite `{name}`", ""]
            if suite is None:
                lines += [f"(no renderer loaded for suite {name!r})", ""]
                continue
            lines += [f"{suite.description}. Scale `{options.get('size', '?')}`, "
                      f"{options.get('warmup', '?')} warm-up + {options.get('repeats', '?')} timed steps.",
                      ""]
            lines.append(suite.render(section.get("rows", [])))
            pngs = sorted(out_dir.glob(f"{machine}_{name}_*.png"))
            lines += [f"![{png.stem}]({rel}/{png.name})" for png in pngs]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_markdown(out_dir: Path = RESULTS_DIR, markdown_path: Path = MARKDOWN_PATH) -> Path:
    """Regenerates ``BENCHMARKS.md`` from every results file in ``out_dir``."""
    markdown_path.write_text(render_markdown(load_results(out_dir), out_dir=out_dir,
                                             markdown_path=markdown_path))
    return markdown_path


def write_report(machine: str, options: RunOptions, suite_rows: Mapping[str, list[dict[str, Any]]], *,
                 out_dir: Path = RESULTS_DIR, markdown_path: Path = MARKDOWN_PATH,
                 note: str | None = None) -> list[Path]:
    """Writes the machine's JSON, the plots of the suites run, and regenerates ``BENCHMARKS.md``.

    Returns the paths written.
    """
    written = [write_results(machine, options, suite_rows, out_dir, note=note)]
    for name, rows in suite_rows.items():
        written += SUITES[name].plot(rows, out_dir, machine)
    written.append(write_markdown(out_dir, markdown_path))
    return written
