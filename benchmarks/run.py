"""Command line: ``python -m benchmarks.run [--quick] [--device cpu|cuda] [--models ...] [--out DIR]``.

Runs the selected suites (all by default), prints each suite's table, and writes
``<out>/<machine>.json``, PNG plots and ``BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import load_suites
from benchmarks.harness import RunOptions
from benchmarks.models import model_names
from benchmarks.report import (MARKDOWN_PATH, RESULTS_DIR, machine_name, set_note, write_markdown,
                               write_report)

__all__ = ["main", "parse_args"]

logger = logging.getLogger("benchmarks")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line (see the module docstring)."""
    suites = load_suites()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smaller models and batches, 3 timed rounds (= --size quick)")
    parser.add_argument("--size", choices=("full", "quick", "tiny", "gpu", "gpu16"), default=None,
                        help="model scale (default: full on CPU, gpu on CUDA; tiny is for smoke tests; "
                             "gpu16 is the GPU models at 1/16 of their batch, for a CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-noise", action="store_true",
                        help="training suite: noise multiplier 0 for every method (time the per-sample "
                             "work without the noise draw, as the GPU-speed issue's step does)")
    parser.add_argument("--models", nargs="+", choices=model_names(), default=None,
                        help="models of the training suite (default: all)")
    parser.add_argument("--suites", nargs="+", choices=sorted(suites), default=None,
                        help="suites to run (default: all)")
    parser.add_argument("-K", "--multiplicities", nargs="+", type=int, default=[1, 4],
                        help="augmentation multiplicities (default: 1 4)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--markdown", type=Path, default=MARKDOWN_PATH, help="Markdown report to write")
    parser.add_argument("--machine", default=None, help="name of the results file (default: derived "
                        "from the CPU or GPU model)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per method (default 1)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds, one step of every method each (default 5, quick 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 on CPU, where single-threaded steps "
                        "give stable numbers on a shared machine; torch's default on CUDA; 0: torch's "
                        "default)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every configuration in this process (faster; no CPU peak memory)")
    parser.add_argument("--note", default=None,
                        help="free text stored with this machine's results and shown in BENCHMARKS.md "
                        "(e.g. 'shared machine, other jobs running')")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: store --note (if given) and regenerate BENCHMARKS.md from --out")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    if args.device == "cuda" and not torch.cuda.is_available():
        logger.error("benchmarks: --device cuda, but torch sees no CUDA device")
        return 2
    size = args.size or ("quick" if args.quick else ("gpu" if args.device == "cuda" else "full"))
    small = size in ("quick", "tiny")
    threads = args.threads if args.threads is not None else (1 if args.device == "cpu" else 0)
    options = RunOptions(device=args.device, size=size, models=tuple(args.models or ()),
                         warmup=args.warmup if args.warmup is not None else 1,
                         repeats=args.repeats if args.repeats is not None else (3 if small else 5),
                         threads=threads or None, isolate=not args.in_process,
                         multiplicities=tuple(args.multiplicities), noise=not args.no_noise)
    suites = load_suites()
    selected = args.suites or list(suites)
    machine = args.machine or machine_name(args.device)
    if args.report_only:
        if args.note is not None:
            set_note(machine, args.note, args.out)
        logger.info("wrote %s", write_markdown(args.out, args.markdown))
        return 0
    results = {}
    for name in selected:
        started = time.perf_counter()
        logger.info("suite %s: %s", name, suites[name].description)
        rows = suites[name].run(options)
        results[name] = rows
        logger.info("suite %s done in %.0f s", name, time.perf_counter() - started)
        sys.stdout.write(suites[name].render(rows) + "\n")
    for path in write_report(machine, options, results, out_dir=args.out, markdown_path=args.markdown,
                             note=args.note):
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
