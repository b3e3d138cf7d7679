"""The floor of ghost clipping on the EmbeddingBag model: a ghost step written out by hand.

``python -m benchmarks.ghost_floor [--rounds 40] [--size gpu16]`` times, interleaved round by round
with the training suite's steps (non-private and psg ghost, and psg hooks and Opacus ghost, which
leave the caches cold as the suite's other methods do; Opacus' when installed), a DP-SGD step of
the :class:`~benchmarks.models.EmbeddingBagClassifier` that knows the model: forward, the per-sample losses, one ``autograd.grad`` for the three layer
outputs, each sample's squared norm from them (the Linear layers' ``||g||^2 (||a||^2 + 1)``, the
table's from psg's native keyed kernel), flat clipping, the clipped sums with ``1/N`` folded into
the factors (psg's native kernel for the table), and the optimizer's step.

It has none of what lets psg run on a model it does not know: no batch tracking (where the batch is,
proved op by op), no hooks, no book-keeping. So it is the time any ghost design reaches at best on
this model, and the distance between it and ``psg-ghost`` is psg's per-step machinery. At batch 32
(``gpu16``) the model's step is about a millisecond, so that machinery, not arithmetic, decides
issue 23's "ghost within 1.5x of non-private" target there.

:func:`floor_step` computes the same released gradient as ``dp_gradient(mode="ghost")`` divided by
N (tested: ``tests/integration/test_benchmarks.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import psg_core.native as native
from psg_core.clipping import FLAT_EPSILON
from benchmarks.models import MODELS, EmbeddingBagClassifier
from benchmarks.training import MAX_GRAD_NORM, METHODS, Case, prepare_step

__all__ = ["floor_step", "main"]

_INTERLEAVED = ("non-private", "psg-ghost", "psg-hooks", "opacus-ghost")


def floor_step(model: EmbeddingBagClassifier, tokens: torch.Tensor, targets: torch.Tensor, *,
               max_grad_norm: float = MAX_GRAD_NORM) -> dict[str, torch.Tensor]:
    """Sets ``p.grad`` of ``model`` to ``sum_n c_n grad_n / N`` (flat clipping at ``max_grad_norm``,
    no noise) for ``(N, L)`` ``tokens`` and returns the gradients by parameter name."""
    table = model.bag.weight
    first, second = model.mlp[0], model.mlp[2]
    assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
    bags, length = tokens.shape
    flat = tokens.reshape(-1)
    with torch.no_grad():  # the table's gradient comes from the kept entries, not from autograd
        pooled = F.embedding_bag(flat, table, torch.arange(0, bags * length, length), mode="mean")
    pooled.requires_grad_()
    hidden = F.linear(pooled, first.weight, first.bias)
    active = F.relu(hidden)
    logits = F.linear(active, second.weight, second.bias)
    losses = F.cross_entropy(logits, targets, reduction="none")  # (N,)
    g_pooled, g_hidden, g_logits = torch.autograd.grad(losses.sum(), [pooled, hidden, logits])
    with torch.no_grad():
        bag_of = torch.arange(bags).repeat_interleave(length)  # (N*L,): each token's bag = its sample
        left = torch.stack([bag_of, flat])  # (2, N*L): sample, table row
        weight = torch.full((bags * length,), 1.0 / length)  # mode mean
        table_squared = native.keyed_sq_norms(left, bag_of, weight, g_pooled, bags)  # (N,)
        if table_squared is None:  # no native library on this host: each token's own row
            table_squared = g_pooled.square().sum(1) * torch.stack(  # mode mean: count / L per row
                [torch.unique(row, return_counts=True)[1].square().sum() for row in tokens]) / length ** 2
        squared = (g_logits.square().sum(1) * (active.square().sum(1) + 1)
                   + g_hidden.square().sum(1) * (pooled.square().sum(1) + 1) + table_squared)  # (N,)
        factors = (max_grad_norm / (squared.sqrt() + FLAT_EPSILON)).clamp(max=1.0) / bags  # 1/N folded in
        scaled_logits, scaled_hidden = g_logits * factors[:, None], g_hidden * factors[:, None]
        second.weight.grad = scaled_logits.t() @ active
        second.bias.grad = scaled_logits.sum(0)
        first.weight.grad = scaled_hidden.t() @ pooled
        first.bias.grad = scaled_hidden.sum(0)
        table_sum = native.keyed_table_sum(left, bag_of, weight, g_pooled, factors, table.shape[0])
        if table_sum is None:  # no native library on this host: the same sum by torch ops
            rows = g_pooled[bag_of] * (weight * factors[bag_of])[:, None]
            table_sum = torch.zeros_like(table).index_add_(0, flat, rows)
        table.grad = table_sum
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _floor_runner(size: str) -> Callable[[], None]:
    spec = MODELS["embedding_bag"]
    model = spec.build("psg", size, seed=0)  # the model and batch prepare_step gives the suite's steps
    assert isinstance(model, EmbeddingBagClassifier)
    (tokens,), targets = spec.make_batch(rows=spec.samples(size), size=size,
                                         generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        floor_step(model, tokens, targets)
        optimizer.step()

    return run


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ghost_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--size", default="gpu16", choices=("full", "quick", "tiny", "gpu", "gpu16"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps: dict[str, Callable[[], None]] = {
        m: prepare_step(Case(model="embedding_bag", method=m, K=1, size=args.size, device="cpu", seed=0,
                             noise_multiplier=0.0)) for m in _INTERLEAVED if METHODS[m].available()}
    steps["ghost floor"] = _floor_runner(args.size)
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(args.rounds):
        for method, step in steps.items():
            start = time.perf_counter()
            step()
            times[method].append(time.perf_counter() - start)
    base = statistics.median(times["non-private"][3:])
    print(f"EmbeddingBag model, size {args.size}, one thread, median of {args.rounds - 3} interleaved rounds")
    for method in ("non-private", "psg-ghost", "ghost floor"):
        median = statistics.median(times[method][3:])
        print(f"  {method:12s} {median * 1e3:7.2f} ms  {median / base:5.2f}x non-private")


if __name__ == "__main__":
    main()
