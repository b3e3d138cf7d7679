"""Shard planning and cutting (psg_server.scheduler): pure policy, no Ray."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psg_core.config import DPConfig, DPGradient
from psg_server.executor import ParameterSet, SessionSpec, ShardRunner
from psg_server.models import default_registry
from psg_server.scheduler import (BALANCE_TOLERANCE, ShardPlan, cut_shards, observe_rate, plan_shards,
                                  proportional_sizes)
from tests.server.service_harness import MLP_KWARGS, build, local_dp, mlp_batch

rates = st.one_of(st.none(), st.floats(1.0, 1000.0))
throughput_maps = st.lists(rates, max_size=5).map(lambda values: {f"w{i}": r for i, r in enumerate(values)})


def test_the_scheduler_does_not_import_ray() -> None:
    # Policy stays importable and testable without Ray: only the pool's own modules import it.
    probe = "import sys, psg_server.scheduler; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


# ----------------------------------------------------------------------------- plans
@settings(max_examples=200, deadline=None)
@given(num_samples=st.integers(0, 300), throughputs=throughput_maps, max_shard=st.integers(1, 64))
def test_plans_cover_every_sample_once_in_order(num_samples: int, throughputs: dict[str, float | None],
                                                max_shard: int) -> None:
    plan = plan_shards(num_samples, throughputs, max_shard_samples=max_shard)
    assert sum(plan.sizes) == num_samples == plan.num_samples and len(plan.sizes) >= 1
    assert num_samples == 0 or all(size >= 1 for size in plan.sizes)
    wanted = max(1, min(num_samples, max(len(throughputs), math.ceil(num_samples / max_shard))))
    assert len(plan.sizes) == wanted
    if all(worker is None for worker in plan.workers):  # near-equal shards, for whichever worker is free
        assert max(plan.sizes) - min(plan.sizes) <= 1 and list(plan.sizes) == sorted(plan.sizes, reverse=True)
    else:  # one shard per chosen worker, never above the cap unless an even cut would be too
        assert len(set(plan.workers)) == len(plan.workers) and set(plan.workers) <= set(throughputs)
        assert max(plan.sizes) <= max(max_shard, math.ceil(num_samples / len(plan.sizes)))


@pytest.mark.parametrize("throughputs, sizes, workers", [
    ({"a": 300.0, "b": 100.0}, (9, 3), ("a", "b")),
    ({"a": 100.0, "b": 300.0}, (9, 3), ("b", "a")),  # the fastest takes the first (largest) shard
    ({"a": 300.0, "b": None, "c": 100.0}, (6, 4, 2), ("a", "b", "c")),  # unmeasured = mean of the rest
    ({"a": None, "b": None, "c": None}, (4, 4, 4), ("a", "b", "c")),
    ({"a": 110.0, "b": 100.0}, (6, 6), ("a", "b")),  # within the tolerance: equal
])
def test_plans_weigh_workers_by_throughput(throughputs: dict[str, float | None], sizes: tuple[int, ...],
                                           workers: tuple[str, ...]) -> None:
    plan = plan_shards(12, throughputs, max_shard_samples=1024)
    assert (plan.sizes, plan.workers) == (sizes, workers)


def test_throughputs_just_outside_the_tolerance_are_weighed() -> None:
    plan = plan_shards(100, {"a": 100.0 * BALANCE_TOLERANCE * 1.01, "b": 100.0}, max_shard_samples=1024)
    assert plan.sizes[0] > plan.sizes[1] and plan.workers == ("a", "b")


def test_equal_workers_get_the_split_an_even_cut_gives() -> None:
    for samples in range(1, 30):
        plan = plan_shards(samples, {"a": None, "b": 50.0, "c": 55.0}, max_shard_samples=1024)
        assert plan.sizes == ShardPlan.even(samples, 3).sizes


def test_more_workers_than_samples_go_to_the_fastest() -> None:
    plan = plan_shards(2, {"a": 100.0, "b": 300.0, "c": 200.0}, max_shard_samples=1024)
    assert (plan.sizes, plan.workers) == ((1, 1), ("b", "c"))
    assert plan_shards(1, {"a": None, "b": None}, max_shard_samples=1) == ShardPlan(sizes=(1,), workers=("a",))


def test_large_batches_queue_near_equal_shards_on_any_worker() -> None:
    plan = plan_shards(10, {"a": 100.0}, max_shard_samples=4)
    assert plan == ShardPlan(sizes=(4, 3, 3), workers=(None, None, None))
    # one per worker would overload the fast one beyond the cap: an even cut on any worker instead
    skewed = plan_shards(20, {"a": 1000.0, "b": 100.0}, max_shard_samples=12)
    assert skewed == ShardPlan(sizes=(10, 10), workers=(None, None))


def test_empty_batches_and_no_workers() -> None:
    assert plan_shards(0, {"a": 1.0, "b": None}, max_shard_samples=8) == ShardPlan(sizes=(0,), workers=(None,))
    assert plan_shards(5, {}, max_shard_samples=1024) == ShardPlan(sizes=(5,), workers=(None,))
    assert plan_shards(5, {}, max_shard_samples=2) == ShardPlan(sizes=(2, 2, 1), workers=(None, None, None))


@pytest.mark.parametrize("call, message", [
    (lambda: plan_shards(-1, {}, max_shard_samples=1), "num_samples must be >= 0, got -1"),
    (lambda: plan_shards(3, {}, max_shard_samples=0), "max_shard_samples must be >= 1, got 0"),
    (lambda: plan_shards(3, {"w": 0.0}, max_shard_samples=1), "worker 'w' must be > 0 or None, got 0.0"),
    (lambda: plan_shards(3, {"w": float("nan")}, max_shard_samples=1), "worker 'w' must be > 0"),
    (lambda: ShardPlan(sizes=(1, 2), workers=(None,)), "2 sizes but 1 workers"),
    (lambda: ShardPlan(sizes=(-1,), workers=(None,)), "must be >= 0"),
    (lambda: ShardPlan.even(3, 0), "num_shards >= 1"),
    (lambda: proportional_sizes(2, [1.0, 1.0, 1.0]), "need 1 to total=2 positive weights"),
    (lambda: proportional_sizes(2, [1.0, 0.0]), "positive weights"),
    (lambda: observe_rate(None, 0, 1.0), "samples must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_by_name(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6), extra=st.integers(0, 200))
def test_proportional_sizes_add_up_and_follow_the_weights(weights: list[float], extra: int) -> None:
    total = len(weights) + extra
    sizes = proportional_sizes(total, weights)
    assert sum(sizes) == total and all(size >= 1 for size in sizes)
    for size, weight in zip(sizes, weights):  # largest remainder: within one of the quota, bar the floor of 1
        assert size <= max(1, math.ceil(total * weight / sum(weights))) + 1


def test_proportional_sizes_examples() -> None:
    assert proportional_sizes(10, [2.0, 1.0]) == [7, 3]
    assert proportional_sizes(5, [1.0] * 5) == [1] * 5 and proportional_sizes(11, [1.0, 1.0]) == [6, 5]
    assert proportional_sizes(3, [100.0, 1.0, 1.0]) == [1, 1, 1]


def test_throughput_is_an_ewma_of_samples_per_second() -> None:
    assert observe_rate(None, 10, 0.5) == pytest.approx(20.0)
    assert observe_rate(100.0, 10, 0.05) == pytest.approx(130.0)
    assert observe_rate(None, 5, 0.0) == pytest.approx(5e6)  # a zero duration does not divide by zero


# ----------------------------------------------------------------------------- cuts
@settings(max_examples=60, deadline=None)
@given(samples=st.integers(0, 20), K=st.integers(1, 3), shards=st.integers(1, 8), batch_first=st.booleans())
def test_cuts_keep_the_K_rows_of_a_sample_together_in_order(samples: int, K: int, shards: int,
                                                            batch_first: bool) -> None:
    batch_dim = 0 if batch_first else 1
    rows = torch.arange(samples * K)  # (N*K,): row r belongs to sample r // K
    inputs = rows.view(-1, 1).float() if batch_first else rows.view(1, -1).float().expand(2, -1)
    targets = rows if batch_first else rows.view(1, -1)
    plan = ShardPlan.even(samples, shards)
    parts = cut_shards((inputs,), targets, plan, augmentation_multiplicity=K, batch_first=batch_first)
    assert len(parts) == max(1, min(shards, samples)) and [p.index for p in parts] == list(range(len(parts)))
    assert torch.equal(torch.cat([p.targets for p in parts], dim=batch_dim), targets)
    for part, size in zip(parts, plan.sizes):
        owners = part.targets.flatten() // K
        assert part.targets.shape[batch_dim] == size * K
        assert torch.equal(owners, owners.unique().repeat_interleave(K))  # whole samples only
        assert torch.equal(part.inputs[0].select(1 - batch_dim, 0).long().flatten(), part.targets.flatten())
        # a view of the batch: the frontend copies nothing to cut a step
        assert part.targets.untyped_storage().data_ptr() == targets.untyped_storage().data_ptr()


def test_cuts_carry_the_plan_s_workers() -> None:
    rows = torch.arange(12)
    plan = plan_shards(6, {"a": 300.0, "b": 100.0}, max_shard_samples=1024)
    parts = cut_shards((rows.view(12, 1),), rows, plan, augmentation_multiplicity=2, batch_first=True)
    assert [(p.worker, p.targets.tolist()) for p in parts] == [("a", list(range(10))), ("b", [10, 11])]


def test_cut_along_dimension_one_when_not_batch_first() -> None:
    inputs = torch.arange(12).view(2, 6)  # (T, rows)
    targets = torch.arange(12).view(2, 6) + 100  # (T, rows): targets follow the inputs' layout
    parts = cut_shards((inputs,), targets, ShardPlan.even(3, 2), augmentation_multiplicity=2, batch_first=False)
    assert [p.inputs[0].shape for p in parts] == [torch.Size([2, 4]), torch.Size([2, 2])]
    assert torch.equal(parts[1].targets, targets[:, 4:])


def test_cuts_refuse_a_plan_that_does_not_fit_the_batch() -> None:
    rows = torch.arange(6)
    with pytest.raises(ValueError, match="cut_shards: a plan of 4 samples with K=2 needs 8 rows"):
        cut_shards((rows.view(6, 1),), rows, ShardPlan.even(4, 2), augmentation_multiplicity=2, batch_first=True)
    with pytest.raises(ValueError, match="cut_shards"):
        cut_shards((rows.view(3, 2),), rows, ShardPlan.even(3, 1), augmentation_multiplicity=2, batch_first=True)


# ----------------------------------------------------------------------- exactness
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("throughputs", [
    {"a": None}, {"a": 300.0, "b": 100.0}, {"a": 10.0, "b": 200.0, "c": 30.0, "d": None},
    {f"w{i}": None for i in range(9)},  # more workers than samples
], ids=lambda t: f"{len(t)}workers")
def test_merged_shards_equal_dp_gradient_on_the_whole_batch(throughputs: dict[str, float | None], K: int) -> None:
    config = DPConfig(augmentation_multiplicity=K, max_grad_norm=0.5)
    model = build(seed=K)
    inputs, targets = mlp_batch(7 * K, seed=K)
    registry = default_registry()
    spec = SessionSpec(session_id="s", model="mlp",
                       model_kwargs_json=json.dumps(registry.parse_kwargs("mlp", json.dumps(MLP_KWARGS)),
                                                    sort_keys=True), loss="cross_entropy", dp_config=config)
    parameters = ParameterSet(version=1, tensors={n: p.detach().clone() for n, p in model.named_parameters()})
    runner = ShardRunner(registry)
    plan = plan_shards(7, throughputs, max_shard_samples=3)
    shards = cut_shards((inputs,), targets, plan, augmentation_multiplicity=K, batch_first=True)
    merged = DPGradient.merge([runner.run_shard(spec, parameters, shard) for shard in shards])
    expected = local_dp(model, inputs, targets, config)
    for name, grad in merged.grads.items():
        torch.testing.assert_close(grad, expected.grads[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.per_sample_norms, expected.per_sample_norms, rtol=1e-5, atol=1e-6)
    assert (merged.num_samples, merged.num_clipped) == (expected.num_samples, expected.num_clipped)
