"""A module that keeps state in a plain tensor attribute, which its call reads and replaces.

Hugging Face's RecurrentGemma sets its RG-LRU's ``recurrent_states`` (None without a cache) before
each call, and the call stores the batch's last state there. Where hooks and ghost differentiate
such a call by running it again per sample (the per-layer fallback, a unit), the run read the
state the batch's call *left*, not the one it began with: with another shape an error, with the
same shape a wrong per-sample gradient, returned silently. Each run now begins with the state of
the batch's call, and the module keeps what the batch's call left (not what a run stored).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import psg_core
from psg_core import DPConfig, dp_gradient, per_sample_gradients
from tests.oracle import assert_close_scaled, check_ghost_clipped, cross_entropy_rows, microbatch_oracle, split_samples

WIDTH = 4


class Memory(nn.Module):
    """No grad sampler (its weight meets the batch in a product): the fallback's. Reads
    ``self.memory`` (set by its caller) and replaces it with a value of the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.5)
        self.memory: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = torch.zeros(WIDTH) if self.memory is None else self.memory
        out = torch.tanh((x + shift) @ self.weight)
        self.memory = torch.full((WIDTH,), 3.0)
        return out


@psg_core.unit_module
class Recurrent(nn.Module):
    """A unit whose submodule keeps a per-row state: None when called, the batch's last state after
    (RecurrentGemma's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.cell = Cell()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        return self.cell(self.proj(x))


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.rand(WIDTH) * 0.5 + 0.2)
        self.states: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[:, 0]) if self.states is None else self.states
        out = []
        for t in range(x.shape[1]):
            h = self.decay * h + x[:, t]
            out.append(h)
        self.states = h
        return torch.stack(out, 1)


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.inner = Memory() if how == "memory" else Recurrent()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        if isinstance(self.inner, Memory):
            self.inner.memory = torch.full((WIDTH,), 0.5)  # what the call reads
        else:
            self.inner.cell.states = None
        return self.head(self.inner(torch.tanh(self.inp(x))).mean(1))


def _state(model: Net) -> torch.Tensor | None:
    return model.inner.memory if isinstance(model.inner, Memory) else model.inner.cell.states


def _batch(K: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(K)
    return torch.randn(3 * K, 3, WIDTH, generator=generator), torch.randint(0, 3, (3 * K,), generator=generator)


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, K: int, reduction: str) -> dict[str, torch.Tensor]:
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows = cross_entropy_rows(out, target)
        return rows.mean() if reduction == "mean" else rows.sum()
    return microbatch_oracle(model, split_samples(x, y, K), loss)


def _left_by_the_batch(model: Net, x: torch.Tensor) -> torch.Tensor | None:
    with torch.no_grad():
        model(x)
    left = _state(model)
    return None if left is None else left.clone()


@pytest.mark.parametrize("how", ["memory", "unit"])
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 2])
def test_each_sample_s_run_begins_with_the_state_the_call_began_with(how: str, mode: str, reduction: str,
                                                                     K: int) -> None:
    torch.manual_seed(0)
    model = Net(how)
    x, y = _batch(K)
    expected = _oracle(model, x, y, K, reduction)
    left = _left_by_the_batch(model, x)
    got = per_sample_gradients(model, x, y, loss_fn=cross_entropy_rows, mode=mode, augmentation_multiplicity=K,
                               loss_reduction=reduction)
    for name, value in expected.items():
        assert_close_scaled(got[name], value, name=name)
    if mode == "hooks":  # the module keeps what the batch's call left: a plain tensor, the batch's value
        state = _state(model)
        assert type(state) is torch.Tensor and left is not None
        torch.testing.assert_close(state, left)


@pytest.mark.parametrize("how", ["memory", "unit"])
@pytest.mark.parametrize("K", [1, 2])
def test_ghost_norms_and_clipped_sum_use_the_state_the_call_began_with(how: str, K: int) -> None:
    torch.manual_seed(1)
    model = Net(how)
    x, y = _batch(K)
    check_ghost_clipped(model, x, y, _oracle(model, x, y, K, "mean"), K=K, loss=cross_entropy_rows)


@pytest.mark.parametrize("how", ["memory", "unit"])
def test_grad_sample_module_and_force_functorch_use_the_state_the_call_began_with(how: str) -> None:
    torch.manual_seed(2)
    for force in (False, True):
        model = Net(how)
        x, y = _batch(2)
        expected = _oracle(model, x, y, 2, "mean")
        wrapped = psg_core.GradSampleModule(model, augmentation_multiplicity=2, strict=False, force_functorch=force)
        cross_entropy_rows(wrapped(x), y).mean().backward()
        for name, p in model.named_parameters():
            assert_close_scaled(p.grad_sample, expected[name], name=f"{name} (force_functorch={force})")  # type: ignore[attr-defined]


def test_a_captured_step_replays_with_the_call_s_state() -> None:
    from psg_core.capture import CapturedStep

    torch.manual_seed(3)
    model = Net("memory")
    config = DPConfig(mode="hooks", max_grad_norm=0.05, augmentation_multiplicity=2)
    step = CapturedStep(model, loss_fn=cross_entropy_rows, config=config)
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(6, 3, WIDTH, generator=generator), torch.randint(0, 3, (6,), generator=generator)
        got = step(x, y)
        reference = psg_core.clip_and_sum(_oracle(model, x, y, 2, "mean"), max_grad_norm=0.05)
        for name, value in reference.grads.items():
            assert_close_scaled(got.grads[name], value, name=f"{name} ({step.last_path})")
    assert step.stats["replayed"] >= 2 and step.stats["refused"] == 0, step.stats


def test_a_layer_with_a_grad_sampler_keeps_no_state() -> None:
    """Only calls that run again per sample keep their state: a Linear's call does not."""
    from psg_core.backends.capture import runs_whole

    assert not runs_whole(nn.Linear(2, 2))
    assert runs_whole(Memory()) and runs_whole(Recurrent())
    model = Net("memory")
    x, y = _batch(1)
    result = dp_gradient(model, x, y, loss_fn=cross_entropy_rows, config=DPConfig(mode="ghost", max_grad_norm=1.0))
    assert set(result.grads) == {name for name, _ in model.named_parameters()}


def test_a_run_sees_the_state_as_the_call_began_and_the_module_keeps_what_the_call_left() -> None:
    from psg_core.support import call_state, state_of_call

    module = Memory()
    began = call_state(module)  # memory None, no 'extra'
    left = torch.ones(WIDTH)
    module.memory = left  # what the call stores
    module.extra = torch.zeros(1)  # an attribute the call adds
    module.weight_scale = 2.0  # not state: neither a tensor nor None
    with state_of_call(began):
        assert module.memory is None and not hasattr(module, "extra") and module.weight_scale == 2.0
        module.memory = torch.full((WIDTH,), 7.0)  # what a per-sample run stores: dropped after
    assert module.memory is left and torch.equal(module.extra, torch.zeros(1))
    assert isinstance(module.weight, nn.Parameter) and "weight" in module._parameters


class ToyCache:
    """A key cache in the shape of transformers' (a class named ``...Cache``, ``update`` and
    ``get_seq_length(layer_idx)``), holding one tensor per layer."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[layer_idx].shape[1]) if layer_idx in self.keys else 0

    def update(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if layer_idx in self.keys:
            keys = torch.cat([self.keys[layer_idx], keys], 1)
        self.keys[layer_idx] = keys
        return keys


class CachedAttention(nn.Module):
    """No grad sampler (its weight meets the batch in a product): attends over the cache's keys
    and its own, as a decoder layer's attention does with ``use_cache=True``."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.5)

    def forward(self, x: torch.Tensor, cache: ToyCache | None = None) -> torch.Tensor:  # (B, T, WIDTH)
        keys = x @ self.weight
        if cache is not None:
            keys = cache.update(keys, self.layer_idx)
        return torch.softmax(x @ keys.transpose(1, 2), -1) @ keys


class CachedNet(nn.Module):
    def __init__(self, prefix: bool) -> None:
        super().__init__()
        self.prefix = prefix
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList([CachedAttention(0), CachedAttention(1)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = ToyCache()  # made by the forward, as transformers' models do with use_cache=True
        if self.prefix:  # keys of earlier steps: the batch's, every sample's
            cache.keys[1] = torch.ones(x.shape[0], 1, WIDTH)
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = layer(h, cache)
        return self.head(h.mean(1))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_cache_empty_when_the_call_began_is_left_out_of_each_sample_s_run(mode: str, K: int) -> None:
    """A training forward with the cache on fills an empty cache: each sample's run of a layer
    computes the same without it (it was refused, with the use_cache=False remedy)."""
    torch.manual_seed(4)
    model = CachedNet(prefix=False)
    x, y = _batch(K)
    expected = _oracle(model, x, y, K, "mean")
    if mode == "ghost":
        check_ghost_clipped(model, x, y, expected, K=K, loss=cross_entropy_rows)
    else:
        got = per_sample_gradients(model, x, y, loss_fn=cross_entropy_rows, augmentation_multiplicity=K)
        for name, value in expected.items():
            assert_close_scaled(got[name], value, name=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_cache_that_held_the_batch_s_keys_is_refused(mode: str) -> None:
    """Layer 1's cache held keys when its call began: a sample's run cannot use the batch's."""
    x, y = _batch(1)
    with pytest.raises(psg_core.UnsupportedModuleError, match=r"CachedAttention runs per sample under torch.func, "
                                                              r"but its call was given a ToyCache object.*use_cache=False"):
        dp_gradient(CachedNet(prefix=True), x, y, loss_fn=cross_entropy_rows,
                    config=DPConfig(mode=mode, max_grad_norm=1.0))
