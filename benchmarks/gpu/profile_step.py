"""Where a training-suite step spends its time on a GPU: torch.profiler over a few steps.

``python -m benchmarks.gpu.profile_step [--models cnn transformer] [--methods psg-hooks psg-ghost]
[--steps 5] [--out DIR]`` prints, per (model, method), the wall time per step (CUDA synchronised),
the host-side time per step the profiler sees, the device time the kernels take, and the top
kernels and host ops, and writes each table to ``DIR/profile_<model>.txt`` (one file per model, so
that a lent machine's few returned files hold them all). A step whose wall time is far above its
kernels' time is launch-bound (host work between kernels): its fix is fewer ops on the host, not
faster kernels.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.training import Case, prepare_step

DEFAULT_METHODS = ("non-private", "psg-hooks", "psg-hooks-captured", "psg-hooks-graphed", "psg-ghost",
                   "psg-ghost-captured", "psg-ghost-graphed", "opacus-hooks")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _device_ms(event: object) -> float:
    # torch renamed cuda_time_total to device_time_total; read whichever this release has
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name)) / 1e3
    return 0.0


def profile_case(model: str, method: str, *, steps: int, size: str, device: str) -> str:
    """The report of one (model, method): timing lines and the top kernels and host ops."""
    case = Case(model=model, method=method, K=1, size=size, device=device, warmup=1, repeats=1,
                noise_multiplier=0.0, measure_memory=False)
    step = prepare_step(case)
    for _ in range(3):
        step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    wall = (time.perf_counter() - started) / steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    averages = prof.key_averages()
    kernels = sum(_device_ms(e) for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                          "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    syncs = sum(e.count for e in averages if "memcpy" in e.key.lower() and "dtoh" in e.key.lower())
    lines = [f"### {model} / {method}",
             f"wall {wall:.2f} ms/step; kernels {kernels / steps:.2f} ms/step; "
             f"{launches / steps:.0f} kernel launches/step; {syncs / steps:.1f} device-to-host copies/step",
             averages.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70),
             averages.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70)]
    del step
    if device == "cuda":
        torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cnn", "transformer", "lstm", "embedding_bag"])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of the report (host ops only)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch.cuda.is_available() is False)")
    for model in args.models:
        reports = []
        for method in args.methods:
            try:
                reports.append(profile_case(model, method, steps=args.steps, size=args.size,
                                            device=args.device))
            except Exception as err:  # noqa: BLE001 - one method's failure leaves the others' reports
                reports.append(f"### {model} / {method}\nerror: {type(err).__name__}: {err}")
            print(reports[-1].split("\n", 2)[0], reports[-1].split("\n", 2)[1], sep="\n", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"profile_{model}.txt").write_text("\n\n".join(reports) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
