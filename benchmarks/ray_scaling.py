"""Ray pool scaling: DP-step throughput (samples/s) with 1 and 2 workers, one torch thread each.

Each configuration runs the same training-like step (``dp_gradient`` of a small CNN, hooks backend,
a new parameter version every step, the batch planned as the frontend plans it: one shard per
worker, weighed by measured throughput) through
:class:`psg_server.pool.WorkerPool` on a local Ray; an in-process run on one thread
(:class:`psg_server.executor.ShardRunner`, no Ray) is the reference: under the same allocator
settings (see below) the gap between it and the 1-worker pool is the pool's per-step overhead
(object store, actor calls).

The batch is large enough (1024 samples at full size, the server's default ``max_shard_samples``)
that the pool's fixed per-step costs are amortised as in training. The three configurations run in
interleaved rounds (one step each at full size, the order rotating every round) after warm-up
steps, so that load from other processes on a shared machine falls on all of them alike; both pools
stay up for the whole run (Ray is given one logical CPU per actor; only one pool computes at a
time). The figures are the batch size over the median step time of all timed steps; each round's
own 2-vs-1 speedup is recorded too, to show the spread, and so is the median CPU (in cores) that
processes outside the run used during each configuration's steps (Linux). Read the speedup only
where that is near 0: Linux's autogroup scheduling shares the CPUs between sessions, and the whole
run (driver, Ray, workers) is one session, so while another session keeps a core busy the two
workers share about one core and cannot beat one worker.

The pool's actors run with :data:`psg_server.pool.WORKER_ENV` (the C allocator keeps freed memory);
the in-process reference runs in this process with whatever allocator settings it started with
(``allocator`` in the result), so set those variables for the command to compare like with like.

    python -m benchmarks.ray_scaling [--quick] [--device cpu|cuda]

prints the table and writes ``benchmarks/results/ray_scaling-<device>-<size>.{json,md}``.
``run(quick, device)`` is the entry point other drivers (``benchmarks.run``) call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from benchmarks.harness import RunOptions, Suite, TargetCheck, register_suite
from psg_core.config import DPConfig
from psg_core.modes import GradSampleMode
from psg_server.config import ServerConfig
from psg_server.executor import ParameterSet, SessionSpec, ShardRunner
from psg_server.models import default_registry
from psg_server.pool import WORKER_ENV, WorkerPool
from psg_server.scheduler import ShardPlan, cut_shards, plan_shards
from psg_server.step import Batch

__all__ = ["TARGET_SPEEDUP", "main", "render", "render_rows", "run", "run_suite", "suite_targets"]

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_MODEL = "cnn_groupnorm"
_IN_PROCESS = "in-process (no Ray)"
_POOL = "Ray pool"
#: The server's default (ServerConfig.max_shard_samples): the batch fits one shard per worker.
_MAX_SHARD_SAMPLES = ServerConfig().max_shard_samples


#: The issue's bound: 2 workers give at least this multiple of 1 worker's throughput.
TARGET_SPEEDUP = 1.7


def _workload(quick: bool, tiny: bool = False) -> dict[str, Any]:
    if tiny:  # one step of a toy model: only checks that the pipeline runs (tests)
        return {"model_kwargs": {"in_channels": 3, "image_size": 8, "channels": [4], "groups": 2,
                                 "num_classes": 10},
                "samples": 8, "warmup": 0, "rounds": 1, "steps_per_round": 1}
    # A 1-worker step takes most of a second on one core at full size (a quarter of that quick).
    return {"model_kwargs": {"in_channels": 3, "image_size": 32, "channels": [16, 32], "groups": 4,
                             "num_classes": 10},
            "samples": 256 if quick else 1024, "warmup": 2, "rounds": 8 if quick else 15,
            "steps_per_round": 1}


#: A configuration: (executor, workers).
_Config = tuple[str, int]


def run(quick: bool = False, device: str = "cpu", *, tiny: bool = False) -> dict[str, Any]:
    """Measures 1- and 2-worker pool throughput (and the in-process reference); returns the rows.

    Args:
        quick: a smaller batch and fewer rounds.
        tiny: a toy model and one step (tests).
        device: "cpu" (one thread per worker) or "cuda" (one GPU per worker; needs 2 GPUs for the
            2-worker row).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"ray_scaling.run: device must be 'cpu' or 'cuda', got {device!r}")
    work = _workload(quick, tiny)
    registry = default_registry()
    kwargs = registry.parse_kwargs(_MODEL, json.dumps(work["model_kwargs"]))
    torch.manual_seed(0)
    model = registry.build(_MODEL, kwargs)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = DPConfig(mode=GradSampleMode.HOOKS, max_grad_norm=1.0)
    spec = SessionSpec(session_id="bench", model=_MODEL, loss="cross_entropy", dp_config=config,
                       model_kwargs_json=json.dumps(kwargs, sort_keys=True))
    generator = torch.Generator().manual_seed(0)
    size = work["model_kwargs"]["image_size"]
    samples = work["samples"]
    images = torch.randn(samples, 3, size, size, generator=generator)  # (N, C, H, W)
    labels = torch.randint(0, 10, (samples,), generator=generator)  # (N,)
    batch = Batch(inputs=(images,), targets=labels, num_samples=samples)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # other work on the host

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the in-process reference runs on this thread, interleaved with the pools
    owns_ray = not ray.is_initialized()
    if owns_ray:
        gpus = torch.cuda.device_count() if device == "cuda" else 0
        # One logical CPU per actor of both pools (3), so that both stay up; one computes at a time.
        ray.init(address="local", num_cpus=3, num_gpus=gpus, include_dashboard=False,
                 object_store_memory=256 << 20, log_to_driver=False)
    try:
        resources = ray.cluster_resources()
        have = int(resources.get("GPU", 0)) if device == "cuda" else int(resources.get("CPU", 0))
        if device == "cuda" and have < 2:
            logger.warning("ray_scaling: 2 workers need 2 GPUs; the cluster has %d", have)
        runner = ShardRunner(registry, "cuda" if device == "cuda" else "cpu")
        others: dict[_Config, list[float]] = {}
        timings, interleaved = asyncio.run(_measure(spec, tensors, batch, runner, device, work, others,
                                                    pools=[w for w in (1, 2) if device == "cpu" or w <= have],
                                                    together=have >= 3))
    finally:
        torch.set_num_threads(threads)
        if owns_ray:
            ray.shutdown()
    rows = [_row(executor, workers, samples, [t for round_ in timings[(executor, workers)] for t in round_],
                 others.get((executor, workers), [])) for executor, workers in timings]
    base = next((r["samples_per_s"] for r in rows if r["executor"] == _POOL and r["workers"] == 1), None)
    for row in rows:
        row["speedup_vs_1_worker"] = round(row["samples_per_s"] / base, 2) if base else None
    per_round = [round(statistics.median(one) / statistics.median(two), 2)
                 for one, two in zip(timings.get((_POOL, 1), []), timings.get((_POOL, 2), []))]
    return {"suite": "ray_scaling", "device": device, "size": "tiny" if tiny else "quick" if quick else "full",
            "model": _MODEL, "model_kwargs": work["model_kwargs"], "samples": samples,
            "mode": config.mode.value, "warmup": work["warmup"], "rounds": work["rounds"],
            "steps_per_round": work["steps_per_round"], "interleaved": interleaved,
            "round_speedups": per_round, "threads_per_worker": 1, "load_average": load,
            "allocator": "pool settings" if all(os.environ.get(k) == v for k, v in WORKER_ENV.items())
            else "defaults",
            "torch": torch.__version__, "ray": ray.__version__, "host_cpus": os.cpu_count(),
            "machine": platform.machine(), "rows": rows}


async def _measure(spec: SessionSpec, tensors: dict[str, torch.Tensor], batch: Batch, runner: ShardRunner,
                   device: str, work: dict[str, Any], others: dict[_Config, list[float]], *,
                   pools: Sequence[int], together: bool) -> tuple[dict[_Config, list[list[float]]], bool]:
    """Step times per configuration and round; and whether the rounds were interleaved (both pools
    up at once), else each configuration ran its rounds in one block. Fills ``others`` with the CPU
    cores that processes outside this run used during each timed step (where that can be read)."""
    version = 0

    def parameters() -> ParameterSet:  # a training loop pushes a new version every step
        nonlocal version
        version += 1
        return ParameterSet(version=version, tensors=tensors)

    (whole,) = cut_shards(batch.inputs, batch.targets, ShardPlan.even(batch.num_samples, 1),
                          augmentation_multiplicity=1, batch_first=True)

    async def in_process() -> None:
        runner.run_shard(spec, parameters(), whole)
        if device == "cuda":
            torch.cuda.synchronize()

    steps: dict[_Config, Callable[[], Awaitable[None]]] = {(_IN_PROCESS, 1): in_process}
    timings: dict[_Config, list[list[float]]] = {(_IN_PROCESS, 1): []}
    pool_of: dict[_Config, WorkerPool] = {}
    started: list[WorkerPool] = []
    try:
        for workers in pools:
            pool = pool_of[(_POOL, workers)] = WorkerPool(num_workers=workers, cpus_per_worker=1,
                                                          use_gpus=device == "cuda")
            steps[(_POOL, workers)] = _pool_step(pool, spec, parameters, batch)
            timings[(_POOL, workers)] = []
            if together:
                await pool.start()
                started.append(pool)
        configs = list(steps)
        if together:
            for config in configs:
                await _timed(steps[config], work["warmup"])
            for index in range(work["rounds"]):
                shift = index % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    timings[config].append(await _timed(steps[config], work["steps_per_round"],
                                                        others.setdefault(config, [])))
            return timings, True
        for config in configs:  # too few CPUs/GPUs for both pools: one configuration at a time
            pool = pool_of.get(config)
            if pool is not None:
                await pool.start()
            try:
                await _timed(steps[config], work["warmup"])
                timings[config] = [await _timed(steps[config], work["steps_per_round"],
                                                others.setdefault(config, [])) for _ in range(work["rounds"])]
            finally:
                if pool is not None:
                    await pool.close()
        return timings, False
    finally:
        for pool in started:
            await pool.close()


def _pool_step(pool: WorkerPool, spec: SessionSpec, parameters: Callable[[], ParameterSet],
               batch: Batch) -> Callable[[], Awaitable[None]]:
    async def step() -> None:  # what the frontend's step does around the pool (views: no copy)
        plan = plan_shards(batch.num_samples, pool.throughputs(), max_shard_samples=_MAX_SHARD_SAMPLES)
        shards = cut_shards(batch.inputs, batch.targets, plan, augmentation_multiplicity=1, batch_first=True)
        await pool.run(spec, parameters(), shards)
    return step


async def _timed(step: Callable[[], Awaitable[None]], count: int,
                 others: list[float] | None = None) -> list[float]:
    """Times ``count`` steps; appends to ``others`` the cores other processes used during each."""
    timings = []
    for _ in range(count):
        before = _cpu_seconds() if others is not None else None
        started = time.perf_counter()
        await step()
        seconds = time.perf_counter() - started
        timings.append(seconds)
        after = _cpu_seconds() if before is not None else None
        if others is not None and before is not None and after is not None:
            others.append(max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / seconds)
    return timings


def _cpu_seconds() -> tuple[float, float] | None:
    """Busy CPU seconds so far of the whole host (steal included) and of this process and its
    descendants (the embedded Ray and its workers); None where ``/proc`` cannot tell (not Linux).
    Not timed: read between steps."""
    try:
        with open("/proc/stat") as file:
            ticks = [int(field) for field in file.readline().split()[1:]]
        parents: dict[int, int] = {}
        used: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
            except OSError:  # gone meanwhile
                continue
            parents[int(entry.name)] = int(fields[1])
            used[int(entry.name)] = int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    ours, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        ours += used.get(pid, 0)
        todo.extend(children.get(pid, []))
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / tick, ours / tick  # all but idle and iowait


def _row(executor: str, workers: int, samples: int, seconds: Sequence[float],
         others: Sequence[float]) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {"executor": executor, "workers": workers, "median_step_ms": round(1000 * median, 1),
            "min_step_ms": round(1000 * min(seconds), 1), "samples_per_s": round(samples / median, 1),
            "other_cores": round(statistics.median(others), 2) if others else None}


def render(result: dict[str, Any]) -> str:
    """The result as a Markdown section."""
    lines = [f"# Ray pool scaling ({result['device']}, {result['size']})", "",
             f"{result['model']} {result['model_kwargs']}, {result['samples']} samples per step, mode "
             f"{result['mode']}, a new parameter version every step, one torch thread per worker; median "
             f"of {result['rounds'] * result['steps_per_round']} steps per configuration "
             f"({_schedule(result)}) after {result['warmup']} warm-up; host with {result['host_cpus']} "
             f"CPUs{_load(result)}, torch {result['torch']}, ray {result['ray']}; the workers' C "
             f"allocator keeps freed memory, the in-process run's has {result.get('allocator', 'defaults')}. "
             f"Timings on a shared machine are noisy.{_spread(result)}", "",
             "| executor | workers | median step (ms) | min (ms) | samples/s | speedup vs 1 worker | "
             "other processes (cores) |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        other = "n/a" if row.get("other_cores") is None else f"{row['other_cores']:.2f}"
        lines.append(f"| {row['executor']} | {row['workers']} | {row['median_step_ms']} | "
                     f"{row['min_step_ms']} | {row['samples_per_s']} | {row['speedup_vs_1_worker']} | "
                     f"{other} |")
    return "\n".join(lines) + "\n"


def _schedule(result: dict[str, Any]) -> str:
    how = "interleaved" if result.get("interleaved") else "consecutive"
    return f"{result['rounds']} {how} rounds of {result['steps_per_round']}"


def _load(result: dict[str, Any]) -> str:
    load = result.get("load_average")
    return "" if load is None else f" (1-minute load average {load:.2f} before the run)"


def _spread(result: dict[str, Any]) -> str:
    speedups = result.get("round_speedups") or []
    if len(speedups) < 2:
        return ""
    return (f" The 2-vs-1-worker speedup of each round (median step times): median "
            f"{statistics.median(speedups):.2f}, range {min(speedups):.2f}-{max(speedups):.2f}.")


def run_suite(options: RunOptions) -> list[dict[str, Any]]:
    """The suite's entry point (:mod:`benchmarks.run`): :func:`run` at ``options``' size, each row
    carrying the run's settings; a failure becomes one ``error`` row."""
    try:
        result = run(quick=options.size == "quick", device=options.device, tiny=options.size == "tiny")
    except Exception as err:  # a failed measurement must not end the run
        return [{"executor": "Ray pool", "error": f"{type(err).__name__}: {err}"}]
    common = {key: value for key, value in result.items() if key not in ("rows", "suite")}
    return [{**common, **row} for row in result["rows"]]


def suite_targets(rows: Sequence[dict[str, Any]]) -> list[TargetCheck]:
    """2 workers >= 1.7 x the throughput of 1 worker (evaluated, never asserted).

    >>> rows = [{"executor": "Ray pool", "workers": 1, "samples_per_s": 100.0},
    ...         {"executor": "Ray pool", "workers": 2, "samples_per_s": 180.0}]
    >>> suite_targets(rows)[0].met
    True
    """
    pool = {row["workers"]: row for row in rows if row.get("executor") == "Ray pool" and "error" not in row}
    one, two = pool.get(1), pool.get(2)
    if one is None or two is None or not one["samples_per_s"]:
        value, detail = None, "missing: " + ", ".join(f"{w} worker(s)" for w in (1, 2) if w not in pool)
    else:
        value = two["samples_per_s"] / one["samples_per_s"]
        detail = f"{two['samples_per_s']:.1f} / {one['samples_per_s']:.1f} samples/s"
    # The bound is a lower one: met when the speedup reaches it.
    return [TargetCheck(target=f"Ray 2 workers >= {TARGET_SPEEDUP} x 1 worker throughput",
                        subject="cnn_groupnorm, one thread per worker", value=value, threshold=TARGET_SPEEDUP,
                        met=None if value is None else value >= TARGET_SPEEDUP - 1e-9, detail=detail)]


def render_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The suite's rows (from :func:`run_suite`) as Markdown."""
    errors = [row for row in rows if "error" in row]
    if errors or not rows:
        return "\n".join(f"Ray scaling benchmark failed: {row['error']}" for row in errors) + "\n"
    result = {**rows[0], "rows": rows}
    return render(result).split("\n", 2)[2]  # without render's own title line


RAY_SCALING_SUITE = register_suite(Suite(
    name="ray_scaling", description="Ray pool scaling: DP-step throughput with 1 and 2 workers, one thread each",
    run=run_suite, render=render_rows, targets=suite_targets))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the table and writes the results; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller images and batch, fewer steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    result = run(quick=args.quick, device=args.device)
    text = render(result)
    sys.stdout.write(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"ray_scaling-{result['device']}-{result['size']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(text)
    logger.warning("ray_scaling: wrote %s.json and .md", stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
