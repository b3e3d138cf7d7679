"""The host work a step adds per hooked layer, held to a budget of dispatched ops.

On a GPU the small and medium models' steps are host-bound (session 21's H200 profiles: the
kernels finish before the host has launched the next ones), and every op psg dispatches, a view
included, is host time there (tens of microseconds each on that machine's host). These tests count
the aten ops one step dispatches (a ``TorchDispatchMode``) on MLPs of 2 and 6 ``Linear`` + ReLU
blocks, and hold the count per block (the slope, which the fixed per-step work does not enter) to
the budget below: a change that adds dispatches to every layer's path fails here, where wall-clock
time could not be asserted. The budgets are the counts measured with torch 2.13 on the CPU (session
22: hooks 26 and 31 per block on ``(N, d)`` and ``(N, T, d)`` inputs, ghost 31.25 and 41, from 34,
45, 33 and 49) with about a tenth of headroom; a torch upgrade that decomposes an op differently
may move them, and then the budget is re-measured, not widened for a psg change.

``benchmarks/host_overhead.py`` measures the same per-layer cost in microseconds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from psg_core import DPConfig, dp_gradient, per_sample_gradients
from psg_core.clipping import clip_and_sum

#: (mode, positions per sample) -> the most aten dispatches a step may add per Linear + ReLU block
BUDGET = {("hooks", 1): 29, ("hooks", 5): 34, ("ghost", 1): 34, ("ghost", 5): 45}


class _Dispatches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def _mlp(blocks: int) -> nn.Sequential:
    torch.manual_seed(blocks)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(8, 3))


def _step_dispatches(mode: str, blocks: int, positions: int) -> int:
    model = _mlp(blocks)
    generator = torch.Generator().manual_seed(0)
    shape = (4, 8) if positions == 1 else (4, positions, 8)
    x = torch.randn(*shape, generator=generator)
    y = torch.randint(0, 3, shape[:-1], generator=generator)

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = outputs if outputs.dim() == 2 else outputs.transpose(1, 2)  # classes on dim 1
        return nn.functional.cross_entropy(logits, targets, reduction="none")

    def step() -> None:
        if mode == "ghost":
            dp_gradient(model, x, y, loss_fn=loss, config=DPConfig(mode="ghost", max_grad_norm=1.0))
        else:
            clip_and_sum(per_sample_gradients(model, x, y, loss_fn=loss, mode=mode), max_grad_norm=1.0)

    step()  # first-call work (caches, lazy imports) out of the count
    with _Dispatches() as counter:
        step()
    return counter.count


@pytest.mark.parametrize(("mode", "positions"), sorted(BUDGET))
def test_a_step_dispatches_at_most_its_budget_per_layer(mode: str, positions: int) -> None:
    few, many = _step_dispatches(mode, 2, positions), _step_dispatches(mode, 6, positions)
    per_block = (many - few) / 4
    assert per_block > 0
    assert per_block <= BUDGET[(mode, positions)], (
        f"{mode} with {positions} position(s) per sample dispatches {per_block} aten ops per Linear + ReLU "
        f"block (budget {BUDGET[(mode, positions)]}; {few} ops with 2 blocks, {many} with 6): each one is "
        "host time on a GPU")
