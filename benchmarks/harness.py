"""Timing, peak memory, process isolation and the registry of benchmark suites.

Timing: every step is timed on its own (``time.perf_counter``, with ``torch.cuda.synchronize``
around it on CUDA) after warm-up steps; the reported figure is the median. Steps that are compared
with each other can be timed interleaved (:func:`time_interleaved`: round after round, one step of
each), so that load drifting on a shared machine affects them alike.

Peak memory (see :func:`memory_method`):

* CUDA: ``torch.cuda.max_memory_allocated`` over one step, after resetting the peak statistics;
  it counts every tensor the step holds, model and batch included (memory allocated before the
  model was built is subtracted).
* CPU: the process's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``, reset
  through ``/proc/self/clear_refs`` just before the measured step), less its file-backed pages
  (library code paged in by the warm-up steps), less the anonymous memory measured after the
  imports and before the model was built, in a fresh subprocess per configuration.
  glibc's mmap threshold is pinned low in that subprocess (``MALLOC_MMAP_THRESHOLD_``), so every
  tensor larger than 64 KiB lives in its own mapping that is returned to the system when freed:
  the resident set follows the live tensors instead of malloc's cached heap. Steps are timed in
  other subprocesses, with glibc's defaults (see :func:`run_isolated`). An in-process run on
  CPU cannot separate one configuration from the previous ones and reports no peak memory.

A *suite* is a named group of benchmarks with its own table, targets and plots; suites register
themselves with :func:`register_suite` from the modules listed in
:data:`benchmarks.SUITE_MODULES`.

>>> timing = time_steps(lambda: None, warmup=1, repeats=3, device="cpu")
>>> len(timing.seconds)
3
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["RunOptions", "Timing", "MemoryProbe", "measure_step_memory", "TargetCheck", "Suite", "SUITES", "register_suite",
           "time_steps", "time_interleaved", "memory_method", "run_isolated", "load_callable", "relative_distance",
           "error_text", "warm_captured"]

logger = logging.getLogger(__name__)

#: glibc allocations above this many bytes get their own mapping (see the module docstring).
_MMAP_THRESHOLD = 65536
#: Marks the child's result line on stdout; everything else a child prints is passed through.
_RESULT_MARKER = "@@benchmarks-result@@ "


@dataclass(frozen=True)
class RunOptions:
    """How one benchmark run is carried out; built once from the command line."""

    #: "cpu" or "cuda".
    device: str = "cpu"
    #: model scale: "full" (the reported run), "quick" (a few minutes on 2 cores), "tiny" (tests).
    size: str = "full"
    #: models to run (names in benchmarks.models.MODELS); empty means all.
    models: tuple[str, ...] = ()
    #: untimed steps before the measured ones (the first step allocates lazily created state).
    warmup: int = 2
    #: timed steps; the median is reported.
    repeats: int = 7
    #: torch intra-op threads (None: torch's default, all cores).
    threads: int | None = None
    #: run every configuration in a fresh subprocess (needed for sound CPU peak memory).
    isolate: bool = True
    #: measure peak memory at all.
    measure_memory: bool = True
    #: augmentation multiplicities to run.
    multiplicities: tuple[int, ...] = (1, 4)
    #: seconds one isolated configuration may take before it is abandoned.
    timeout_s: float = 900.0
    #: the training suite's private steps add noise (False: noise multiplier 0 for every method,
    #: the step the GPU-speed issue times: forward, backward, norms, clipped sum, SGD).
    noise: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunOptions: device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"RunOptions: need warmup >= 0 and repeats >= 1, got {self.warmup}, "
                             f"{self.repeats}")
        if any(k < 1 for k in self.multiplicities):
            raise ValueError(f"RunOptions: multiplicities must be >= 1, got {self.multiplicities}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def in_child(cls, payload: dict[str, Any]) -> RunOptions:
        """The options a child process got in ``payload["options"]``, with torch's intra-op
        threads set as they say."""
        options = cls.from_json(payload["options"])
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        return options

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunOptions:
        return cls(**{**data, "models": tuple(data.get("models", ())),
                      "multiplicities": tuple(data.get("multiplicities", (1, 4)))})


# ------------------------------------------------------------------------------ timing
@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of each timed step."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def minimum(self) -> float:
        return min(self.seconds)

    @property
    def maximum(self) -> float:
        return max(self.seconds)

    def fields(self) -> dict[str, Any]:
        """A row's timing fields, in milliseconds: median, minimum, maximum and every step."""
        return {"median_ms": self.median * 1e3, "min_ms": self.minimum * 1e3, "max_ms": self.maximum * 1e3,
                "times_ms": [s * 1e3 for s in self.seconds]}


def relative_distance(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest ``||got - expected|| / ||expected||`` over the parameters (inf when a name is
    missing): how far apart two methods' clipped sums are."""
    if set(got) != set(expected):
        return float("inf")
    return max(float((got[name].double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))
               for name, ref in expected.items())


def error_text(err: BaseException) -> str:
    """An error as a row's note: its type and message on one line, at most 400 characters."""
    return " ".join(f"{type(err).__name__}: {err}".split())[:400]


def warm_captured(captured: Any, step: Callable[[], Any]) -> None:
    """A :class:`psg_core.CapturedStep` made ready to time: ``step()`` (one training step through it)
    run eagerly, recorded and checked against the eager step, as a trainer's first steps run; with
    ``captured.cuda_graphs`` once more (the first replay captures the CUDA graph and checks it).
    Raises when the step is not captured (or, asked, not as a CUDA graph), with the reasons."""
    for _ in range(3):
        step()
    if captured.stats["validated"] != 1:
        raise RuntimeError(f"the step was not captured: {'; '.join(captured.refusals)}")
    if captured.cuda_graphs:
        step()
        if captured.cuda_graph_refusals:
            raise RuntimeError(f"the step was not captured as a CUDA graph: {'; '.join(captured.cuda_graph_refusals)}")


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Callable[[], Any], *, warmup: int, repeats: int, device: str) -> Timing:
    """Runs ``warmup`` untimed steps, then times ``repeats`` steps one by one.

    Garbage collection runs before the timed steps and is then paused, so a collection cycle
    does not land in one step's time.
    """
    for _ in range(warmup):
        step()
    _synchronize(device)
    gc.collect()
    seconds = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            step()
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(tuple(seconds))


def time_interleaved(steps: dict[str, Callable[[], Any]], *, warmup: int, repeats: int,
                     device: str) -> dict[str, Timing]:
    """Times several steps in rounds: each round runs every step once, in order.

    On a shared or throttling machine the load drifts over a run; interleaving spreads that drift
    evenly over the steps being compared, so their ratios stay meaningful even when the absolute
    times move. Each step gets ``warmup`` untimed calls first.

    >>> timings = time_interleaved({"a": lambda: None, "b": lambda: None}, warmup=0, repeats=2,
    ...                            device="cpu")
    >>> sorted(timings), len(timings["a"].seconds)
    (['a', 'b'], 2)
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    _synchronize(device)
    gc.collect()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, step in steps.items():
                _synchronize(device)
                start = time.perf_counter()
                step()
                _synchronize(device)
                seconds[name].append(time.perf_counter() - start)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Timing(tuple(values)) for name, values in seconds.items()}


# ------------------------------------------------------------------------------ memory
def measure_step_memory(make_step: Callable[[], Callable[[], Any]], device: str, *, warmup: int, isolated: bool,
                        describe_error: Callable[[BaseException], str]) -> dict[str, Any]:
    """``{"peak_memory_mib": ...}`` of one step: a :class:`MemoryProbe` baseline taken before
    ``make_step()`` builds the model, ``warmup`` steps (at least one), then the peak of one more;
    ``{"peak_memory_mib": None, "memory_error": describe_error(err)}`` when it fails (the run goes on)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    try:
        probe = MemoryProbe(device, isolated=isolated)
        step = make_step()
        for _ in range(max(1, warmup)):
            step()
        probe.reset()
        step()
        peak = probe.peak_bytes()
        del step
    except Exception as err:  # noqa: BLE001 - recorded in the table, the run goes on
        return {"peak_memory_mib": None, "memory_error": describe_error(err)}
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"peak_memory_mib": None if peak is None else peak / (1 << 20)}


def memory_method(device: str, *, isolate: bool) -> str:
    """One line naming how peak memory is measured (stored with the results)."""
    if device == "cuda":
        return ("torch.cuda.max_memory_allocated over one step (model, batch, optimizer state and "
                "step transients)")
    if isolate:
        return ("process RSS high-water mark over one step (VmHWM, reset via /proc/self/clear_refs), "
                "less file-backed pages (library code) and the anonymous RSS before the model was built; "
                f"fresh subprocess per configuration, MALLOC_MMAP_THRESHOLD_={_MMAP_THRESHOLD} (timing: "
                "other subprocesses, glibc's default allocator settings)")
    return "not measured (CPU peak memory needs one subprocess per configuration)"


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"MemoryProbe: /proc/self/status has no {field_name} field")


class MemoryProbe:
    """Measures the peak memory of a stretch of work, relative to when the probe was created.

    Create it before building the model; call :meth:`reset` right before the measured step and
    :meth:`peak_bytes` right after it.

    >>> probe = MemoryProbe("cpu", isolated=False)
    >>> probe.reset(); probe.peak_bytes() is None
    True
    """

    def __init__(self, device: str, *, isolated: bool) -> None:
        self.device = device
        self.enabled = device == "cuda" or (isolated and sys.platform.startswith("linux"))
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
            self._baseline = torch.cuda.memory_allocated()
        elif self.enabled:
            self._baseline = _proc_status_kib("RssAnon") * 1024
        else:
            self._baseline = 0

    def reset(self) -> None:
        """Starts the measured stretch: forgets earlier peaks."""
        if not self.enabled:
            return
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            # "5" resets the peak resident set size to the current one (Linux >= 4.0).
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
                clear_refs.write("5")
        except OSError:
            # Without the reset the peak covers the whole (fresh) process: the same steps, so
            # the same peak, plus the one-off allocations of the first step.
            logger.warning("MemoryProbe: cannot reset VmHWM; the peak covers the whole process")

    def peak_bytes(self) -> int | None:
        """Peak bytes since :meth:`reset`, above the probe's baseline; None when not measurable."""
        if not self.enabled:
            return None
        if self.device == "cuda":
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - self._baseline)
        # VmHWM counts file-backed pages too: shared-library code that the first steps paged in
        # (tens of MiB of libtorch kernels). Those pages stay resident, so the ones present now
        # are the ones present at the peak; what remains is anonymous memory: tensors and heap.
        file_backed = (_proc_status_kib("RssFile") + _proc_status_kib("RssShmem")) * 1024
        return max(0, _proc_status_kib("VmHWM") * 1024 - file_backed - self._baseline)


# ------------------------------------------------------------------------------ isolation
def load_callable(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"load_callable: expected 'module:function', got {target!r}")
    return getattr(importlib.import_module(module_name), attribute)  # type: ignore[no-any-return]


def run_isolated(target: str, payload: dict[str, Any], *, timeout_s: float, pin_mmap: bool = True) -> dict[str, Any]:
    """Calls ``target(payload)`` in a fresh Python process and returns its (JSON) result.

    The child runs from the repository root, with glibc's mmap threshold pinned where ``pin_mmap``
    (a child that measures CPU peak memory, see the module docstring). A child that only times
    steps runs with glibc's defaults, as a training process does: pinned, every tensor over 64 KiB
    is a fresh mapping whose pages fault on first touch each step (a BEiT step's non-private
    backward took 130 ms pinned against 69 ms), a cost no real run pays and that falls unevenly on
    the methods. A child that crashes, times out or prints no result gives
    ``{"error": "<what happened>"}`` instead of raising, so one configuration cannot end a run.
    """
    env = dict(os.environ)
    if pin_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = str(_MMAP_THRESHOLD)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    command = [sys.executable, "-m", "benchmarks.harness", target, json.dumps(payload)]
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_RESULT_MARKER):
            return json.loads(line[len(_RESULT_MARKER):])  # type: ignore[no-any-return]
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"subprocess exited with {done.returncode}: {' | '.join(tail)}"}


# ------------------------------------------------------------------------------ suites
@dataclass(frozen=True)
class TargetCheck:
    """One quantitative target of the issue, evaluated on measured numbers (never asserted)."""

    #: the target in words, e.g. "psg hooks time <= 0.8 x Opacus hooks".
    target: str
    #: where it was evaluated, e.g. "cnn, K=1".
    subject: str
    #: the measured ratio (or value); None when a needed row is missing or failed.
    value: float | None
    #: the bound the value is compared with.
    threshold: float
    #: True / False, or None when not evaluable.
    met: bool | None
    #: how the value was formed, e.g. "412.0 ms / 530.1 ms".
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Suite:
    """A named group of benchmarks.

    ``run(options)`` returns JSON-ready rows; ``render(rows)`` the suite's Markdown section;
    ``targets(rows)`` the target checks; ``plot(rows, out_dir, machine)`` writes PNGs and returns
    their paths.
    """

    name: str
    description: str
    run: Callable[[RunOptions], list[dict[str, Any]]]
    render: Callable[[Sequence[dict[str, Any]]], str]
    targets: Callable[[Sequence[dict[str, Any]]], list[TargetCheck]] = field(default=lambda rows: [])
    plot: Callable[[Sequence[dict[str, Any]], Path, str], list[Path]] = field(
        default=lambda rows, out_dir, machine: [])


SUITES: dict[str, Suite] = {}


def register_suite(suite: Suite) -> Suite:
    """Adds ``suite`` to :data:`SUITES` (a second suite with the same name is an error)."""
    if suite.name in SUITES and SUITES[suite.name] is not suite:
        raise ValueError(f"register_suite: a suite named {suite.name!r} is already registered")
    SUITES[suite.name] = suite
    return suite


def _child_main(argv: list[str]) -> int:
    """``python -m benchmarks.harness module:function '<json payload>'`` (used by run_isolated)."""
    if len(argv) != 2:
        sys.stderr.write("usage: python -m benchmarks.harness module:function '<json payload>'\n")
        return 2
    logging.basicConfig(level=logging.WARNING)
    result = load_callable(argv[0])(json.loads(argv[1]))
    sys.stdout.write(_RESULT_MARKER + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
