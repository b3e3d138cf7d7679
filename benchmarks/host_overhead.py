"""What a private step costs the host per hooked layer: the figure that decides a GPU step.

``python -m benchmarks.host_overhead [--layers 4 20] [--width 16] [--batch 4] [--rounds 200]``
times the training suite's steps (:mod:`benchmarks.training`'s methods: non-private, psg hooks and
ghost, eager and captured (:class:`psg_core.capture.CapturedStep`; on a GPU also replayed as one
CUDA graph), and Opacus' hooks and ghost when installed) on MLPs of ``Linear(width, width)`` + ReLU
blocks that differ only in how many blocks they have, at a width and batch so small that every
kernel costs next to nothing. A method's step time then grows with the block count by its host
work per layer: Python in the hooks, the batch tracker's frames and ops, the backward pass's
per-layer book-keeping and the dispatch of each small op. The slope between the two block counts
is that cost per block (one hooked Linear layer and its activation); the intercept, what a step
costs whatever the model (the head layer included).

On a GPU the kernels of a small or medium model finish before the host has launched the next
ones, so these two numbers (times the host's speed) set the step time: the H200 profiles in
benchmarks/results/cuda-nvidia-h200_profile_*.txt show psg's steps there host-bound (issue 23).
Measured on a CPU they track that cost without a GPU. Methods are timed interleaved, round by
round, and each figure is the median over rounds; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from benchmarks.training import LEARNING_RATE, METHODS, Case, Step

__all__ = ["HOST_METHODS", "host_step", "mlp", "per_layer_costs", "main"]

#: The methods compared (those whose library is installed).
HOST_METHODS = ("non-private", "psg-hooks", "psg-hooks-captured", "psg-hooks-graphed", "psg-ghost",
                "psg-ghost-captured", "psg-ghost-graphed", "opacus-hooks", "opacus-ghost")


def mlp(blocks: int, width: int, classes: int = 4, *, seed: int = 0) -> nn.Sequential:
    """``blocks`` x (``Linear(width, width)``, ReLU), then a ``Linear(width, classes)`` head,
    initialised from ``seed`` (the global generator's state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, classes))


def host_step(method: str, blocks: int, *, width: int = 16, batch: int = 4,
              learning_rate: float = LEARNING_RATE, device: str = "cpu") -> Step:
    """The training suite's ``method`` step (no noise) on :func:`mlp` ``(blocks, width)`` and a
    fixed batch of ``batch`` samples, on ``device``."""
    model = mlp(blocks, width).to(device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=generator).to(device)
    y = torch.randint(0, 4, (batch,), generator=generator).to(device)
    case = Case(model="mlp", method=method, K=1, device=device, noise_multiplier=0.0, measure_memory=False,
                learning_rate=learning_rate)
    return METHODS[method].prepare(model, (x,), y, case)


def per_layer_costs(layers: Sequence[int] = (4, 20), *, width: int = 16, batch: int = 4, rounds: int = 200,
                    methods: Sequence[str] = HOST_METHODS, device: str = "cpu") -> dict[str, dict[str, float]]:
    """``{method: {"per_block_us", "fixed_us", "step_us@L" for each L}}``: the median step time of each
    method on MLPs of ``layers[0]`` and ``layers[1]`` blocks, the slope between them per block and
    the intercept at no block, in microseconds. On a GPU each step is timed to its end
    (``torch.cuda.synchronize``): the host's launches and the kernels they queue."""
    if len(layers) != 2 or layers[0] >= layers[1]:
        raise ValueError(f"layers: two increasing block counts, got {tuple(layers)}")
    chosen = [m for m in methods if METHODS[m].available(device)]
    steps = {(m, n): host_step(m, n, width=width, batch=batch, device=device) for m in chosen for n in layers}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for step in steps.values():  # warm-up: first-call costs (imports, caches, allocator) out
        for _ in range(3):
            step()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[key].append(time.perf_counter() - start)
    out: dict[str, dict[str, float]] = {}
    low, high = layers
    for m in chosen:
        t_low = statistics.median(times[(m, low)]) * 1e6
        t_high = statistics.median(times[(m, high)]) * 1e6
        per_block = (t_high - t_low) / (high - low)
        out[m] = {"per_block_us": per_block, "fixed_us": t_low - per_block * low,
                  f"step_us@{low}": t_low, f"step_us@{high}": t_high}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs=2, default=(4, 20), metavar=("FEW", "MANY"),
                        help="the two block counts (default 4 20)")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--device", default="cpu", help="cpu (one torch thread) or cuda")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    costs = per_layer_costs(args.layers, width=args.width, batch=args.batch, rounds=args.rounds,
                            device=args.device)
    low, high = args.layers
    where = "one thread" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"MLP of Linear({args.width}, {args.width}) + ReLU blocks, batch {args.batch}, {args.device} ({where}), "
          f"median of {args.rounds} interleaved rounds")
    print(f"  {'method':20s} {'per block':>10s} {'fixed':>9s} {f'step @{low}':>11s} {f'step @{high}':>11s}")
    for method, c in costs.items():
        print(f"  {method:20s} {c['per_block_us']:8.1f}us {c['fixed_us']:7.0f}us "
              f"{c[f'step_us@{low}']:9.0f}us {c[f'step_us@{high}']:9.0f}us")


if __name__ == "__main__":
    main()
