"""Gradient accumulation in process: physical batches of a logical batch release the gradient of the
logical batch in one call (noise off, or the same seeded noise), with one accounted step and no
more per-sample gradients at once than a physical batch holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import psg_core.dp_step as dp_step_module
from psg_core.accounting import PrivacyAccountant
from psg_core.accumulate import GradientAccumulator, split_batch
from psg_core.config import DPConfig, DPGradient
from psg_core.dp_step import DPStep
from psg_core.errors import BatchLayoutError, BudgetExhaustedError, ConfigError


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 3, generator=generator)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run(config: DPConfig, inputs: torch.Tensor, targets: torch.Tensor, *, physical: int | None,
        seed: int = 5) -> tuple[dict[str, torch.Tensor], DPGradient, DPStep]:
    model = mlp()
    step = DPStep(model, loss_fn=nn.MSELoss(), config=config, sample_rate=0.1, expected_batch_size=16.0,
                  accountant=PrivacyAccountant("rdp"), generator=torch.Generator().manual_seed(seed))
    stats = step(inputs, targets, max_physical_batch_size=physical)
    return grads(model), stats, step


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("noise_multiplier", [0.0, 1.3])
@pytest.mark.parametrize("K", [1, 2])
def test_physical_batches_release_the_logical_batch_s_gradient(mode: str, noise_multiplier: float, K: int) -> None:
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.3, noise_multiplier=noise_multiplier)
    inputs, targets = batch(17 * K)
    whole, whole_stats, whole_step = run(config, inputs, targets, physical=None)
    parts, parts_stats, parts_step = run(config, inputs, targets, physical=5)  # 5 + 5 + 5 + 2 samples
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], rtol=1e-5, atol=1e-6)
    assert parts_stats.num_samples == whole_stats.num_samples == 17
    assert parts_stats.num_clipped == whole_stats.num_clipped
    torch.testing.assert_close(parts_stats.per_sample_norms, whole_stats.per_sample_norms)
    assert parts_stats.loss_sum == pytest.approx(whole_stats.loss_sum, rel=1e-5)
    assert parts_step.accountant.history == whole_step.accountant.history == [(noise_multiplier, 0.1, 1)]


def test_per_sample_gradients_exist_for_one_physical_batch_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    original = dp_step_module.dp_gradient

    def recording(module: nn.Module, inputs: Any, targets: torch.Tensor, **kwargs: Any) -> DPGradient:
        seen.append(targets.shape[0])
        return original(module, inputs, targets, **kwargs)

    monkeypatch.setattr(dp_step_module, "dp_gradient", recording)
    inputs, targets = batch(22)
    run(DPConfig(augmentation_multiplicity=2, noise_multiplier=1.0), inputs, targets, physical=4)
    assert seen == [8, 8, 6]  # rows: 4 + 4 + 3 samples of K = 2


def test_accumulate_takes_any_iterable_of_physical_batches() -> None:
    inputs, targets = batch(12)
    config = DPConfig(noise_multiplier=0.9)
    whole, _, _ = run(config, inputs, targets, physical=None)
    model = mlp()
    step = DPStep(model, loss_fn=nn.MSELoss(), config=config, sample_rate=0.1, expected_batch_size=16.0,
                  generator=torch.Generator().manual_seed(5))
    stats = step.accumulate((inputs[i:i + 3], targets[i:i + 3]) for i in range(0, 12, 3))
    assert stats.num_samples == 12 and step.accountant.steps == 1
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, whole[name], rtol=1e-5, atol=1e-6)


def test_the_budget_is_checked_before_the_first_physical_batch() -> None:
    accountant = PrivacyAccountant("rdp", target_epsilon=1.0, target_delta=1e-5)
    step = DPStep(mlp(), loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=0.5), sample_rate=1.0,
                  expected_batch_size=4.0, accountant=accountant)
    accumulator = GradientAccumulator(step)
    with pytest.raises(BudgetExhaustedError):
        accumulator.add(*batch(4))
    assert accumulator.num_batches == 0 and accountant.steps == 0


def test_the_accumulator_releases_once_per_logical_batch() -> None:
    step = DPStep(mlp(), loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0), sample_rate=0.1,
                  expected_batch_size=4.0)
    accumulator = GradientAccumulator(step)
    with pytest.raises(ConfigError, match="no physical batch"):
        accumulator.release()
    accumulator.add(*batch(3))
    accumulator.add(*batch(0))  # an empty physical batch adds nothing
    assert (accumulator.num_batches, accumulator.num_samples) == (2, 3)
    assert accumulator.release().num_samples == 3
    assert (accumulator.num_batches, accumulator.num_samples, step.accountant.steps) == (0, 0, 1)
    accumulator.add(*batch(2))
    accumulator.release()
    assert step.accountant.steps == 2


def test_an_empty_logical_batch_is_one_noised_step() -> None:
    grads_, stats, step = run(DPConfig(noise_multiplier=1.0), *batch(0), physical=4)
    assert stats.num_samples == 0 and step.accountant.steps == 1
    assert all(g.abs().sum() > 0 for g in grads_.values())


def _one_step_left(noise_multiplier: float = 1.0, sample_rate: float = 0.05) -> PrivacyAccountant:
    """An RDP accountant with a budget of which one step of (noise_multiplier, sample_rate) is left."""
    accountant = PrivacyAccountant("rdp", target_epsilon=3.0, target_delta=1e-5)
    left = accountant.steps_within_budget(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    accountant.step(noise_multiplier, sample_rate, num_steps=left - 1)
    return accountant


def test_a_release_the_budget_refuses_releases_nothing() -> None:
    """The budget is checked at the first add(), but it can be spent before release() (a shared
    accountant, interleaved accumulators, threads): release() charges the step first, atomically,
    and on refusal leaves p.grad as it was and discards the logical batch."""
    accountant = _one_step_left()
    model = mlp()
    step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0), sample_rate=0.05,
                  expected_batch_size=4.0, accountant=accountant)
    accumulator = GradientAccumulator(step)
    accumulator.add(*batch(4))  # one step left: accepted
    step(*batch(4, seed=1))  # another logical batch spends it
    steps = accountant.steps
    before = {name: torch.full_like(p, 7.0) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = before[name].clone()
    with pytest.raises(BudgetExhaustedError):
        accumulator.release()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, before[name]), name  # not the noised gradient
    assert accountant.steps == steps
    assert (accumulator.num_batches, accumulator.num_samples) == (0, 0)
    with pytest.raises(ConfigError, match="no physical batch"):
        accumulator.release()


def test_a_dp_step_whose_budget_is_spent_mid_accumulation_releases_nothing() -> None:
    """DPStep's own path: the budget spent while its physical batches are computed."""
    accountant = _one_step_left()
    allowed = accountant.steps + 1
    model = mlp()
    step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0), sample_rate=0.05,
                  expected_batch_size=4.0, accountant=accountant)
    other = DPStep(mlp(1), loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0), sample_rate=0.05,
                   expected_batch_size=4.0, accountant=accountant)

    def physical_batches() -> Any:
        yield batch(2)
        other(*batch(4, seed=1))  # spends the last step of the shared budget
        yield batch(2, seed=2)

    with pytest.raises(BudgetExhaustedError):
        step.accumulate(physical_batches())
    assert all(p.grad is None for p in model.parameters())
    assert accountant.steps == allowed  # the other step's only


def test_every_physical_batch_is_clipped_at_the_first_one_s_configuration() -> None:
    """The noise is calibrated for the configuration of the first add(): a configuration changed
    between physical batches applies from the next logical batch, not to the open one."""
    model = mlp()
    step = DPStep(model, loss_fn=nn.MSELoss(), config=DPConfig(max_grad_norm=0.1, noise_multiplier=1e-9),
                  sample_rate=0.05, expected_batch_size=1.0, accountant=PrivacyAccountant("rdp"))
    accumulator = GradientAccumulator(step)
    accumulator.add(*batch(0))  # the logical batch's settings: C = 0.1
    step.config = DPConfig(max_grad_norm=50.0, noise_multiplier=1e-9, loss_reduction="sum")
    inputs, targets = batch(1)
    inputs, targets = inputs * 100, targets - 100  # one sample of a large gradient
    part = accumulator.add(inputs, targets)
    assert part.per_sample_norms[0] > 50.0 and part.num_clipped == 1
    norm = torch.cat([g.reshape(-1) for g in part.grads.values()]).norm()
    assert norm == pytest.approx(0.1, rel=1e-4)
    stats = accumulator.release()
    released = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert released == pytest.approx(0.1, rel=1e-4)  # normalised by the first config's mean reduction
    assert stats.num_clipped == 1
    # The next logical batch has the new configuration.
    assert step(inputs, targets).num_clipped == 1
    released = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert released == pytest.approx(50.0, rel=1e-4)


def test_adaptive_clipping_does_not_move_the_bound_of_an_open_accumulation() -> None:
    """Two accumulators of one DPStep with adaptive clipping, interleaved: the first one's release
    moves the bound, the second one's later physical batches are still clipped at the bound its
    noise is calibrated for."""
    from psg_core.adaptive_clipping import QuantileClipping
    step = DPStep(mlp(), loss_fn=nn.MSELoss(), config=DPConfig(max_grad_norm=0.05, noise_multiplier=1.0),
                  sample_rate=0.05, expected_batch_size=4.0, accountant=PrivacyAccountant("rdp"),
                  generator=torch.Generator().manual_seed(3),
                  adaptive_clipping=QuantileClipping(learning_rate=2.0, count_noise_multiplier=2.0))
    first, second = GradientAccumulator(step), GradientAccumulator(step)
    inputs, targets = batch(4)
    first.add(inputs, targets)
    second.add(inputs, targets)
    first.release()
    assert step.config.max_grad_norm != pytest.approx(0.05)  # the bound moved
    part = second.add(inputs[:1] * 100, targets[:1] - 100)
    assert part.per_sample_norms[0] > 1.0
    norm = torch.cat([g.reshape(-1) for g in part.grads.values()]).norm()
    assert norm == pytest.approx(0.05, rel=1e-4)
    second.release()
    assert step.accountant.steps == 2


# ------------------------------------------------------------------------------------ split_batch
def test_split_keeps_samples_whole_and_inputs_in_their_form() -> None:
    inputs, targets = batch(10)
    extra = torch.ones(4)  # no batch axis: goes whole to every part
    parts = list(split_batch((inputs, extra), targets, max_samples=2, augmentation_multiplicity=2))
    assert [p[0][0].shape[0] for p in parts] == [4, 4, 2] and all(p[0][1] is extra for p in parts)
    assert all(isinstance(p[0], tuple) for p in parts)
    torch.testing.assert_close(torch.cat([p[0][0] for p in parts]), inputs)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), targets)
    named = list(split_batch({"x": inputs, "mask": inputs > 0}, targets, max_samples=4))
    assert [sorted(p[0]) for p in named] == [["mask", "x"]] * 3 and named[2][0]["mask"].shape[0] == 2


def test_split_follows_the_batch_dimension() -> None:
    inputs = torch.randn(7, 6, 4)  # (T, N, features): time-major
    targets = torch.randn(7, 6, 3)
    parts = list(split_batch(inputs, targets, max_samples=4, batch_first=False))
    assert [tuple(p[0].shape) for p in parts] == [(7, 4, 4), (7, 2, 4)]
    assert [tuple(p[1].shape) for p in parts] == [(7, 4, 3), (7, 2, 3)]


def test_split_of_a_small_or_empty_batch_is_the_batch() -> None:
    inputs, targets = batch(3)
    [(same_inputs, same_targets)] = split_batch(inputs, targets, max_samples=3)
    assert same_inputs is inputs and same_targets is targets
    assert len(list(split_batch(*batch(0), max_samples=3))) == 1


def test_split_refuses_what_it_cannot_cut() -> None:
    with pytest.raises(ConfigError, match="max_samples"):
        list(split_batch(*batch(4), max_samples=0))
    with pytest.raises(BatchLayoutError, match="not divisible"):
        list(split_batch(*batch(5), max_samples=2, augmentation_multiplicity=2))
    packed = pack_sequence([torch.randn(3, 4), torch.randn(2, 4)])
    with pytest.raises(ConfigError, match="PackedSequence"):
        list(split_batch(packed, torch.randn(2, 3), max_samples=1))


def _eager_and_captured_steps() -> tuple[list[nn.Module], list[DPStep], list[torch.optim.Optimizer]]:
    """Two copies of one model, an eager DPStep and a captured one (same noise), their optimizers."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    config = DPConfig(mode="ghost", noise_multiplier=0.7, max_grad_norm=0.5, augmentation_multiplicity=2)
    steps = [DPStep(model, loss_fn=nn.MSELoss(), config=config, sample_rate=0.5, expected_batch_size=11.0,
                    generator=torch.Generator().manual_seed(3), capture=capture)
             for model, capture in zip(models, (False, True))]
    return models, steps, [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]


@pytest.mark.parametrize("physical", [None, 4])
def test_a_captured_step_releases_the_eager_step_s_gradient(physical: int | None) -> None:
    """DPStep(capture=True): the same p.grad, noise and ledger as the eager DPStep, step after step
    (physical batches of 4 samples: two signatures, 4 and 3 samples)."""
    models, steps, optimizers = _eager_and_captured_steps()
    for seed in range(6):
        inputs, targets = batch(22, seed)  # 11 samples of K = 2
        for step, optimizer in zip(steps, optimizers):
            optimizer.zero_grad()
            step(inputs, targets, max_physical_batch_size=physical)
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
        for optimizer in optimizers:
            optimizer.step()
    captured = steps[1]._captured
    assert captured is not None and captured.stats["replayed"] > 0 and not captured.refusals
    assert steps[0].accountant.steps == steps[1].accountant.steps == 6
    steps[1].cuda_graphs = True  # the captured step is made again with it (inert on a CPU batch)
    inputs, targets = batch(22, 0)
    steps[1](inputs, targets)
    assert steps[1]._captured is not captured and steps[1]._captured.cuda_graphs


def test_a_captured_step_pads_poisson_sized_physical_batches_to_one_shape() -> None:
    """Poisson batches vary in size: with max_physical_batch_size, every physical batch is computed
    as that many samples (the last one padded, the padding weighing nothing), so one signature
    replays step after step, and p.grad is the eager DPStep's."""
    models, steps, optimizers = _eager_and_captured_steps()
    for seed, samples in enumerate([11, 9, 13, 10, 12, 11, 6]):
        inputs, targets = batch(2 * samples, seed)
        for step, optimizer in zip(steps, optimizers):
            optimizer.zero_grad()
            stats = step(inputs, targets, max_physical_batch_size=4)
            assert stats.num_samples == samples and stats.per_sample_norms.shape == (samples,)
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
        for optimizer in optimizers:
            optimizer.step()
    captured = steps[1]._captured
    assert captured is not None and captured.pad_to_multiple == 4 and len(captured._entries) == 1
    assert captured.stats["replayed"] >= 15 and not captured.refusals, captured.stats


def test_padding_needs_capture_and_a_whole_batch_loss() -> None:
    for options, match in (({"pad_to_multiple": 4}, "capture=True"),
                           ({"cuda_graphs": True}, "capture=True"),
                           ({"cuda_graphs": "yes", "capture": True}, "must be a bool"),
                           ({"pad_to_multiple": 0, "capture": True}, "positive int"),
                           ({"pad_to_multiple": 4, "capture": True, "mode": "functorch"}, "functorch")):
        mode = options.pop("mode", "ghost")
        with pytest.raises(ConfigError, match=match):
            DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(mode=mode, noise_multiplier=1.0),
                   sample_rate=0.5, expected_batch_size=4.0, **options)


def test_capture_and_adaptive_clipping_are_refused_together() -> None:
    from psg_core.adaptive_clipping import QuantileClipping
    with pytest.raises(ConfigError, match="adaptive clipping"):
        DPStep(nn.Linear(3, 1), loss_fn=nn.MSELoss(), config=DPConfig(noise_multiplier=1.0), sample_rate=0.5,
               expected_batch_size=4.0, adaptive_clipping=QuantileClipping(), capture=True)
