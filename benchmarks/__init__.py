"""Reproducible benchmarks of psg against Opacus and non-private training.

Run ``python -m benchmarks.run`` (``make bench``); results go to ``benchmarks/results/<machine>.json``,
plots next to them, and the tables to ``BENCHMARKS.md``.

Benchmarks are grouped in *suites* (:class:`benchmarks.harness.Suite`). A suite module registers
its suite with :func:`benchmarks.harness.register_suite` when imported; to add one (the gRPC
service overhead, the Ray pool scaling), write ``benchmarks/<name>.py`` and list it in
:data:`SUITE_MODULES`.
"""

from __future__ import annotations

import importlib

from benchmarks.harness import SUITES, Suite

__all__ = ["SUITE_MODULES", "load_suites"]

#: Modules that register a suite when imported, in the order their sections appear.
SUITE_MODULES: tuple[str, ...] = ("benchmarks.training", "benchmarks.backends", "benchmarks.service",
                                  "benchmarks.ray_scaling", "benchmarks.gpt2", "benchmarks.families")


def load_suites() -> dict[str, Suite]:
    """Imports every module of :data:`SUITE_MODULES` and returns the registered suites by name."""
    for module in SUITE_MODULES:
        importlib.import_module(module)
    return dict(SUITES)
