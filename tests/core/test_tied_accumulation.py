"""A tied weight's per-sample gradient in the hooks backend, made in one ``(N, V, d)`` tensor.

GPT-2's token table is also its LM head's weight. The head's backward runs first and makes the
weight's ``(N, V, d)`` per-sample gradient; the table's sampler is then offered that tensor
(:func:`psg_core.grad_sample._utils.accumulating_into`) and adds its lookups into it in place,
instead of a second ``(N, V, d)`` buffer of zeros added afterwards. Checked against the microbatch
oracle (K, reduction, ``padding_idx``, whose row keeps the head's part), with non-finite gradients
at the padding positions, across two accumulated backward passes, and by counting the
``(N, V, d)`` tensors a pass makes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import psg_core
import psg_core.grad_sample.embedding as embedding_module
from psg_core import DPConfig, dp_gradient, per_sample_gradients
from psg_core.grad_sample._utils import accumulating_into, accumulation_target
from tests.core.test_ghost_tied import TiedLM, _lm_batch, _reduced, _token_loss
from tests.oracle import assert_close_scaled, microbatch_oracle, split_samples

VOCAB, DIM, STEPS = 64, 32, 3


class _Scatters:
    """Counts the table sampler's own ``(N, V, d)`` scatters (the path a tied weight no longer takes)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        scatter = embedding_module._per_sample_scatter

        def counted(*args: Any) -> torch.Tensor:
            self.calls += 1
            return scatter(*args)

        monkeypatch.setattr(embedding_module, "_per_sample_scatter", counted)


class _TableSized(TorchDispatchMode):
    """The distinct storages of ``numel`` elements that ops return while the mode is on."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.storages = numel, set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.numel() == self.numel:
                self.storages.add(value.untyped_storage().data_ptr())
        return out


class _PaddingPoison(nn.Module):
    """A tied LM whose padding positions (id 0) get a NaN gradient: their embedding is multiplied by
    inf and the product masked out, so the loss is finite and the gradient reaching those rows is
    ``0 * inf``. torch gives the padding row no gradient at all, so the table's stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM(VOCAB, DIM, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        embedded = lm.embed(ids)  # (N*K, T, d)
        pad = (ids == 0)[..., None]
        scale = torch.where(pad, torch.full_like(embedded, float("inf")), torch.ones_like(embedded))
        hidden = torch.where(pad, torch.zeros_like(embedded), embedded * scale)
        return lm.head(torch.tanh(lm.mix(hidden)))


def _oracle(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, K: int, reduction: str
            ) -> dict[str, torch.Tensor]:
    return microbatch_oracle(model, split_samples(ids, targets, K), _reduced(_token_loss, reduction))


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_a_tied_table_adds_into_the_heads_per_sample_gradient(K: int, reduction: str, padding_idx: int | None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(5)
    model = TiedLM(VOCAB, DIM, padding_idx=padding_idx, head_bias=padding_idx is None)
    ids, targets = _lm_batch(4 * K, VOCAB, STEPS)
    expected = _oracle(model, ids, targets, K, reduction)
    scatters = _Scatters(monkeypatch)
    got = per_sample_gradients(model, ids, targets, loss_fn=_token_loss, augmentation_multiplicity=K,
                               loss_reduction=reduction)
    assert scatters.calls == 0  # the table's lookups went into the head's tensor
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)
    if padding_idx is not None:  # the padding row holds the head's part alone, not zero
        assert expected["embed.weight"][:, padding_idx].abs().max() > 0
        assert_close_scaled(got["embed.weight"][:, padding_idx], expected["embed.weight"][:, padding_idx],
                            name="padding row")


def test_an_untied_table_keeps_its_own_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(6)
    model = TiedLM(VOCAB, DIM, padding_idx=0)
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # untied
    ids, targets = _lm_batch(4, VOCAB, STEPS)
    expected = _oracle(model, ids, targets, 1, "mean")
    scatters = _Scatters(monkeypatch)
    got = per_sample_gradients(model, ids, targets, loss_fn=_token_loss)
    assert scatters.calls == 1
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)


def test_non_finite_gradients_at_padding_positions_add_nothing() -> None:
    torch.manual_seed(7)
    model = _PaddingPoison()
    ids, targets = _lm_batch(4, VOCAB, STEPS)
    expected = _oracle(model, ids, targets, 1, "mean")
    assert all(bool(torch.isfinite(g).all()) for g in expected.values())
    got = per_sample_gradients(model, ids, targets, loss_fn=_token_loss)
    for name, value in expected.items():
        assert bool(torch.isfinite(got[name]).all()), name
        assert_close_scaled(got[name], value, name=name)
    # and the clipped sum through dp_gradient (hooks) is finite, every sample kept
    out = dp_gradient(model, ids, targets, loss_fn=_token_loss, config=DPConfig(mode="hooks", max_grad_norm=0.05))
    assert out.num_dropped == 0 and all(bool(torch.isfinite(g).all()) for g in out.grads.values())


def test_two_accumulated_passes_sum_per_sample() -> None:
    """A second backward pass (accumulation allowed) adds into a new tensor, the first pass's kept."""
    torch.manual_seed(8)
    model = TiedLM(VOCAB, DIM, padding_idx=0)
    (ids_a, targets_a), (ids_b, targets_b) = _lm_batch(4, VOCAB, STEPS, seed=1), _lm_batch(4, VOCAB, STEPS, seed=2)
    expected = {name: a + b for (name, a), b in zip(_oracle(model, ids_a, targets_a, 1, "sum").items(),
                                                    _oracle(model, ids_b, targets_b, 1, "sum").values())}
    wrapped = psg_core.GradSampleModule(model, loss_reduction="sum")
    wrapped.allow_grad_accumulation()
    _token_loss(wrapped(ids_a), targets_a).sum().backward()
    first = model.embed.weight.grad_sample
    first_values = first.clone()
    _token_loss(wrapped(ids_b), targets_b).sum().backward()
    wrapped.remove_hooks()
    assert torch.equal(first, first_values)  # the caller's tensor of the first pass is left as it was
    assert_close_scaled(model.embed.weight.grad_sample, expected["embed.weight"], name="embed.weight")
    assert_close_scaled(model.mix.weight.grad_sample, expected["mix.weight"], name="mix.weight")


@pytest.mark.parametrize("K", [1, 2])
def test_a_tied_pass_makes_one_table_sized_tensor(K: int) -> None:
    torch.manual_seed(9)
    n = 4
    model = TiedLM(VOCAB, DIM, padding_idx=0)
    ids, targets = _lm_batch(n * K, VOCAB, STEPS)
    counted = _TableSized(n * VOCAB * DIM)
    with counted:
        per_sample_gradients(model, ids, targets, loss_fn=_token_loss, augmentation_multiplicity=K)
    assert len(counted.storages) == 1, len(counted.storages)


def test_a_target_is_offered_only_when_it_fits() -> None:
    weight, total = torch.zeros(5, 3), torch.zeros(2, 5, 3)
    with accumulating_into({id(weight): total}):
        assert accumulation_target(weight, (2, 5, 3), torch.float32, total.device) is total
        assert accumulation_target(weight, (3, 5, 3), torch.float32, total.device) is None  # other N
        assert accumulation_target(weight, (2, 5, 3), torch.float64, total.device) is None  # other dtype
        assert accumulation_target(torch.zeros(5, 3), (2, 5, 3), torch.float32, total.device) is None
        with accumulating_into({}):  # an inner offer replaces the outer one
            assert accumulation_target(weight, (2, 5, 3), torch.float32, total.device) is None
        assert accumulation_target(weight, (2, 5, 3), torch.float32, total.device) is total
    strided = torch.zeros(2, 3, 5).transpose(1, 2)
    with accumulating_into({id(weight): strided}):
        assert accumulation_target(weight, (2, 5, 3), torch.float32, strided.device) is None  # not contiguous
    assert accumulation_target(weight, (2, 5, 3), torch.float32, total.device) is None


class _SharedTable(nn.Module):
    """One table looked up twice in a pass (T5's shared table, read by its encoder and decoder):
    the second call's backward adds into the first's per-sample gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        encoded = self.embed(ids).mean(1, keepdim=True)  # (N*K, 1, d)
        decoded = self.embed(ids.flip(1))  # (N*K, T, d)
        return self.head(torch.tanh(decoded + encoded))


@pytest.mark.parametrize("K", [1, 2])
def test_a_table_called_twice_adds_its_second_call_in_place(K: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(10)
    model = _SharedTable()
    ids, targets = _lm_batch(3 * K, VOCAB, STEPS)
    expected = _oracle(model, ids, targets, K, "mean")
    scatters = _Scatters(monkeypatch)
    got = per_sample_gradients(model, ids, targets, loss_fn=_token_loss, augmentation_multiplicity=K)
    assert scatters.calls == 1  # the first call to arrive scatters; the second adds into it
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)


class _SharedBlock(nn.Module):
    """One Linear applied three times in a pass (ALBERT's shared layers, a cell in a loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.tanh(self.block(x))
        return self.head(x)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("steps", [0, STEPS])  # (N*K, d) inputs and (N*K, T, d) sequences
def test_a_linear_called_three_times_adds_into_one_tensor(K: int, steps: int) -> None:
    torch.manual_seed(11)
    n = 3
    model = _SharedBlock()
    shape = (n * K, steps, DIM) if steps else (n * K, DIM)
    x, y = torch.randn(*shape), torch.randn(*shape[:-1], 4)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).flatten(1).sum(1)

    expected = microbatch_oracle(model, split_samples(x, y, K), lambda out, t: loss(out, t).mean())
    counted = _TableSized(n * DIM * DIM)
    with counted:
        got = per_sample_gradients(model, x, y, loss_fn=loss, augmentation_multiplicity=K)
    assert len(counted.storages) == 1, len(counted.storages)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)


class _Doubled(nn.Module):
    """A custom layer, ``2 * x W^T``, whose sampler builds on psg's Linear sampler."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.nn.functional.linear(x, self.weight)


class _DoubledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Doubled()
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


def test_a_custom_sampler_built_on_the_linear_one_is_offered_no_target() -> None:
    """Only a sampler that adds into a target and gives it back is offered one: a custom layer's
    sampler that scales what psg's Linear sampler returns would otherwise get (and scale) the
    earlier call's gradient too."""
    from psg_core.grad_sample.linear import linear_grad_sample

    def doubled_grad_sample(layer: _Doubled, activations: list[torch.Tensor], backprops: torch.Tensor,
                            K: int) -> dict[torch.Tensor, torch.Tensor]:
        return {layer.weight: 2 * linear_grad_sample(layer, activations, backprops, K)[layer.weight]}  # type: ignore[arg-type]

    psg_core.register_grad_sampler(_Doubled, k_aware=True)(doubled_grad_sample)
    try:
        torch.manual_seed(12)
        model = _DoubledTwice()
        x, y = torch.randn(6, DIM), torch.randn(6, 4)

        def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return ((out - target) ** 2).sum(1)

        expected = microbatch_oracle(model, split_samples(x, y, 2), lambda out, t: loss(out, t).mean())
        got = per_sample_gradients(model, x, y, loss_fn=loss, augmentation_multiplicity=2)
        for name, value in expected.items():
            assert_close_scaled(got[name], value, name=name)
    finally:
        psg_core.GRAD_SAMPLERS.unregister(_Doubled)


@pytest.mark.parametrize("which", ["tied", "shared"])
def test_a_recorded_step_replays_the_in_place_sums(which: str) -> None:
    """psg_core.CapturedStep records the in-place adds (index_add_, baddbmm_) into the first call's
    tensor, and its replays on new batches give dp_gradient's clipped sum."""
    from psg_core.capture import CapturedStep

    torch.manual_seed(13)
    model: nn.Module
    if which == "tied":
        model, loss = TiedLM(VOCAB, DIM, padding_idx=0), _token_loss

        def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            return _lm_batch(6, VOCAB, STEPS, seed=seed)
    else:
        model = _SharedBlock()

        def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return ((out - target) ** 2).flatten(1).sum(1)

        def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
            generator = torch.Generator().manual_seed(seed)
            return torch.randn(6, STEPS, DIM, generator=generator), torch.randn(6, STEPS, 4, generator=generator)

    config = DPConfig(mode="hooks", max_grad_norm=0.1, augmentation_multiplicity=2)
    step = CapturedStep(model, loss_fn=loss, config=config)
    for seed in range(5):
        inputs, targets = batch(seed)
        got = step(inputs, targets)
        expected = dp_gradient(model, inputs, targets, loss_fn=loss, config=config)
        for name, value in expected.grads.items():
            assert_close_scaled(got.grads[name], value, name=f"{name} ({step.last_path})")
    assert step.stats["replayed"] == 2 and step.stats["refused"] == 0


def test_under_bf16_autocast_the_table_still_adds_into_the_heads_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast leaves bfloat16 output gradients; the samplers run in the parameters' float32
    (psg_core.precision), so the target fits and the result is float32, within bfloat16's rounding
    of the float32 step's."""
    torch.manual_seed(14)
    model = TiedLM(VOCAB, DIM, padding_idx=0)
    ids, targets = _lm_batch(8, VOCAB, STEPS)
    reference = per_sample_gradients(model, ids, targets, loss_fn=_token_loss, augmentation_multiplicity=2)
    scatters = _Scatters(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = per_sample_gradients(model, ids, targets, loss_fn=_token_loss, augmentation_multiplicity=2)
    assert scatters.calls == 0
    for name, value in reference.items():
        assert got[name].dtype == torch.float32
        assert float((got[name] - value).norm() / value.norm()) < 3e-2, name
