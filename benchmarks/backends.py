"""The four backends on one transformer-size model: median step time and peak memory per mode.

One step is :func:`psg_core.dp.dp_gradient` (per-sample gradients -> clip -> sum; ghost: norms ->
re-weighted backward) on the benchmark transformer (``benchmarks.models``: token embedding, DP
multi-head attention, LayerNorm, MLP blocks) for every :class:`~psg_core.modes.GradSampleMode`,
with a non-private ``loss.backward()`` as the baseline. Each (mode, K) runs in a fresh
subprocess so that CPU peak memory belongs to that configuration alone (see
:mod:`benchmarks.harness` for how time and memory are measured). Numbers are printed and saved;
nothing is asserted.

    python -m benchmarks.backends --quick                 # a few minutes on 2 CPU cores
    python -m benchmarks.backends --device cuda           # the reported size on a GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import (MemoryProbe, RunOptions, Suite, memory_method, register_suite, run_isolated,
                                time_steps)
from benchmarks.models import MODELS, Variant

__all__ = ["MODES", "run_mode", "run_suite", "render", "main"]

logger = logging.getLogger(__name__)

#: Rows of the table: the non-private baseline, then psg's backends.
MODES = ("non-private", "hooks", "functorch", "ew", "ghost")
_MODEL = "transformer"
_RESULTS = Path(__file__).resolve().parent / "results"


def run_mode(payload: dict[str, Any]) -> dict[str, Any]:
    """One (mode, K) configuration: builds the model and batch, measures peak memory over one
    step and the median time of ``repeats`` steps. Runs in a subprocess (JSON in, JSON out)."""
    from psg_core.config import DPConfig
    from psg_core.dp import dp_gradient

    options = RunOptions.in_child(payload)
    mode, K = payload["mode"], int(payload["K"])
    probe = MemoryProbe(options.device, isolated=options.isolate)
    spec = MODELS[_MODEL]
    model = spec.build(Variant.PSG, options.size).to(options.device)
    samples = spec.samples(options.size)
    inputs, targets = spec.make_batch(rows=samples * K, size=options.size,
                                      generator=torch.Generator().manual_seed(0))
    inputs = tuple(t.to(options.device) for t in inputs)
    targets = targets.to(options.device)
    params = [p for p in model.parameters() if p.requires_grad]

    if mode == "non-private":
        def step() -> Any:
            loss = F.cross_entropy(model(*inputs), targets)
            return torch.autograd.grad(loss, params)
    else:
        config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1.0)

        def step() -> Any:
            return dp_gradient(model, inputs, targets, loss_fn=torch.nn.CrossEntropyLoss(reduction="none"),
                               config=config)

    for _ in range(options.warmup):
        step()
    peak: int | None = None
    if options.measure_memory:
        probe.reset()
        step()
        peak = probe.peak_bytes()
    timing = time_steps(step, warmup=0, repeats=options.repeats, device=options.device)
    return {"mode": mode, "K": K, "samples": samples, "parameters": sum(p.numel() for p in params),
            "median_s": timing.median, "min_s": timing.minimum, "max_s": timing.maximum,
            "peak_bytes": peak}


def run_suite(options: RunOptions, modes: Sequence[str] = MODES) -> list[dict[str, Any]]:
    """Every (mode, K) of ``options``, isolated when ``options.isolate``; failures become rows
    with an ``error`` field instead of ending the run."""
    rows = []
    for K in options.multiplicities:
        for mode in modes:
            payload = {"options": options.to_json(), "mode": mode, "K": K}
            logger.info("backends: %s K=%d (%s, %s)", mode, K, options.size, options.device)
            try:
                row = (run_isolated("benchmarks.backends:run_mode", payload, timeout_s=options.timeout_s)
                       if options.isolate else run_mode(payload))
            except Exception as err:  # one failed configuration must not end the run
                row = {"error": f"{type(err).__name__}: {err}"}
            rows.append({"mode": mode, "K": K, **row})
    return rows


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{1000 * seconds:.1f}"


def _mib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 2 ** 20:.1f}"


def render(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per (K, mode), time and memory also relative to the hooks backend."""
    lines = ["| K | mode | median step (ms) | min (ms) | peak memory (MiB) | time / hooks | memory / hooks |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['K']} | {row['mode']} | failed: {row['error']} | | | | |")
            continue
        hooks = next((r for r in rows if r["K"] == row["K"] and r["mode"] == "hooks" and "error" not in r), None)
        time_ratio = f"{row['median_s'] / hooks['median_s']:.2f}" if hooks else "—"
        memory_ratio = (f"{row['peak_bytes'] / hooks['peak_bytes']:.2f}"
                        if hooks and row.get("peak_bytes") and hooks.get("peak_bytes") else "—")
        lines.append(f"| {row['K']} | {row['mode']} | {_ms(row['median_s'])} | {_ms(row['min_s'])} | "
                     f"{_mib(row.get('peak_bytes'))} | {time_ratio} | {memory_ratio} |")
    return "\n".join(lines) + "\n"


register_suite(Suite(name="backends",
                     description="psg's four backends on the transformer: dp_gradient step time and memory",
                     run=run_suite, render=render))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: runs the suite, prints the table, saves JSON and Markdown under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller model and batch (2-core CPU)")
    parser.add_argument("--K", type=int, nargs="+", default=[1, 4], help="augmentation multiplicities")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-isolate", action="store_true",
                        help="run in this process (faster; no CPU peak memory)")
    parser.add_argument("--out", type=Path, default=_RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    options = RunOptions(device=args.device, size="quick" if args.quick else "full", warmup=args.warmup,
                         repeats=args.repeats, threads=args.threads, isolate=not args.no_isolate,
                         multiplicities=tuple(args.K))
    rows = run_suite(options, args.modes)
    spec = MODELS[_MODEL]
    header = (f"# psg backends: {spec.description}\n\n"
              f"size {options.size} ({spec.num_parameters(options.size):,} parameters, "
              f"N={spec.samples(options.size)} samples of {options.multiplicities} copies), device "
              f"{options.device}, torch {torch.__version__}, {platform.machine()} with "
              f"{torch.get_num_threads()} threads; median of {options.repeats} steps after "
              f"{options.warmup} warm-up; memory: {memory_method(options.device, isolate=options.isolate)}.\n\n")
    table = header + render(rows)
    sys.stdout.write(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"backends-{options.device}-{options.size}"
    stem.with_suffix(".md").write_text(table, encoding="utf-8")
    stem.with_suffix(".json").write_text(json.dumps({"options": options.to_json(), "rows": rows}, indent=2),
                                         encoding="utf-8")
    logger.info("backends: wrote %s.md and %s.json", stem, stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
