"""The grad-sampler and ghost-norm registries: declared options, registration by dotted name."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from psg_core import GHOST_NORMS, GRAD_SAMPLERS, ConfigError, GhostFactors
from psg_core.grad_sample import GhostNormRegistry, GradSamplerRegistry
from psg_core.grad_sample.ghost_norm import WeightLayout


def test_builtin_sampler_options_are_declared() -> None:
    conv, bag, linear = (GRAD_SAMPLERS.lookup(t) for t in (nn.Conv2d, nn.EmbeddingBag, nn.Linear))
    assert conv is not None and conv.batch_first_only and conv.row_counter is None
    assert bag is not None and bag.batch_first_only and bag.row_counter is not None and bag.with_kwargs
    assert linear is not None and linear.k_aware and not linear.batch_first_only and not linear.with_kwargs
    assert all(GRAD_SAMPLERS.lookup(t).batch_first_only  # type: ignore[union-attr]
               for t in (nn.GroupNorm, nn.InstanceNorm2d, nn.ConvTranspose1d))
    bags = nn.EmbeddingBag(5, 2)
    assert bag.count_rows(bags, (torch.tensor([1, 2, 3]), torch.tensor([0, 2])), {}) == 2


def test_k_aware_declared_or_read_from_the_signature() -> None:
    registry = GradSamplerRegistry()

    def per_row(layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor,
                scale: float = 1.0) -> dict[torch.Tensor, torch.Tensor]:
        return {layer.bias: backprops * scale}  # (N*K, d_out): one gradient per row

    registry.register(nn.Linear)(per_row)
    assert registry.lookup(nn.Linear).k_aware  # type: ignore[union-attr]  (four positional parameters)
    registry.register(nn.Linear, replace=True, k_aware=False)(per_row)
    entry = registry.lookup(nn.Linear)
    assert entry is not None and not entry.k_aware
    layer = nn.Linear(3, 2)
    grads = entry.compute(layer, [torch.randn(6, 3)], {}, torch.ones(6, 2), 3, 0)
    assert grads[layer.bias].tolist() == [[3.0, 3.0], [3.0, 3.0]]  # folded over the K=3 copies
    with pytest.raises(ConfigError, match="k_aware"):
        registry.register(nn.Linear, replace=True, k_aware="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="count_rows"):
        registry.register(nn.Linear, replace=True, count_rows=3)  # type: ignore[arg-type]


def _fake_library(monkeypatch: pytest.MonkeyPatch) -> type[nn.Module]:
    """A layer class in a module that is in sys.modules only from now on."""

    class Fancy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    Fancy.__module__, Fancy.__qualname__ = "psg_fake_library.layers", "Fancy"
    library = types.ModuleType("psg_fake_library.layers")
    library.Fancy = Fancy  # type: ignore[attr-defined]
    library.NOT_A_LAYER = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "psg_fake_library.layers", library)
    return Fancy


def test_registration_by_dotted_name(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = GradSamplerRegistry()

    @registry.register("psg_fake_library.layers.Fancy", k_aware=True)
    def fancy_sampler(layer, activations, backprops, K):  # type: ignore[no-untyped-def]
        return {}

    assert registry.deferred_names() == ["psg_fake_library.layers.Fancy"]
    with pytest.raises(ConfigError, match="already has a grad sampler"):
        registry.register("psg_fake_library.layers.Fancy")(fancy_sampler)
    fancy = _fake_library(monkeypatch)  # the model's library is imported after psg_core
    with pytest.raises(ConfigError, match="already has a grad sampler"):  # the same layer by type
        registry.register(fancy)(fancy_sampler)
    entry = registry.lookup(fancy())
    assert entry is not None and entry.fn is fancy_sampler and entry.layer_type is fancy
    assert list(registry) == [] and len(registry) == 0  # listings hold the types registered as types
    registry.unregister("psg_fake_library.layers.Fancy")
    assert registry.lookup(fancy) is None and registry.deferred_names() == []
    with pytest.raises(KeyError):
        registry.unregister("psg_fake_library.layers.Fancy")
    registry.register("psg_fake_library.layers.NOT_A_LAYER")(fancy_sampler)
    with pytest.raises(ConfigError, match="not an nn.Module subclass"):
        registry.lookup(nn.Linear)
    for bad in ("Fancy", "psg_fake_library..Fancy", "psg_fake_library.layers.Fan cy"):
        with pytest.raises(ConfigError, match="package.module.Class"):
            registry.register(bad)


def test_registration_by_type_replaces_a_name_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = GradSamplerRegistry()
    fancy = _fake_library(monkeypatch)

    @registry.register("psg_fake_library.layers.Fancy")
    def by_name(layer, activations, backprops, K):  # type: ignore[no-untyped-def]
        return {}

    @registry.register(fancy, replace=True)
    def by_type(layer, activations, backprops, K):  # type: ignore[no-untyped-def]
        return {}

    assert registry.lookup(fancy).fn is by_type  # type: ignore[union-attr]
    assert list(registry) == [fancy] and registry.deferred_names() == []


def test_ghost_norm_registry_rules() -> None:
    registry = GhostNormRegistry()

    def weight_sum(layer, a, g):  # type: ignore[no-untyped-def]
        return g.T @ a

    def positions(layer, x, output, batch_dim):  # type: ignore[no-untyped-def]
        return 1

    @registry.register(nn.Linear, weight_sum=weight_sum, positions=positions)
    def factors(layer, a, g, K):  # type: ignore[no-untyped-def]
        return GhostFactors.dot(a.view(-1, 1, K, a.shape[-1]), g.view(-1, 1, K, g.shape[-1])), {}

    class ScaledLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    entry = registry.lookup(nn.modules.linear.NonDynamicallyQuantizableLinear(4, 4))
    assert entry is not None and entry.fn is factors
    assert registry.lookup(ScaledLinear(2, 2)) is None  # its own forward: no inherited ghost norm
    assert entry.is_cheaper(nn.Linear(4, 4), 2) and not entry.is_cheaper(nn.Linear(4, 4), 3)  # 2T^2 <= 16
    with pytest.raises(ConfigError, match="already has a ghost norm"):
        registry.register(nn.Linear, weight_sum=weight_sum, positions=positions)(factors)
    with pytest.raises(ConfigError, match="weight_sum must be callable"):
        registry.register(nn.Embedding, weight_sum=None, positions=positions)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="parameter"):
        registry.register(nn.Embedding, weight_sum=weight_sum, positions=positions, parameter="")
    # A lookup table needs no weight_sum: its clipped sum comes from its factors.
    registry.register(nn.Embedding, positions=positions, layout=WeightLayout.TABLE)(factors)
    table = registry.lookup(nn.Embedding(5, 2))
    assert table is not None and table.weight_sum is None and table.sums_from_factors
    assert not entry.sums_from_factors
    with pytest.raises(ConfigError, match="GhostFactors.dot"):
        GhostFactors.dot(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 5, 4))
    with pytest.raises(ConfigError, match="GhostFactors.index"):
        GhostFactors.index(torch.zeros(2, 3), torch.zeros(2, 4, 5))


def test_builtin_ghost_norms() -> None:
    assert {nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
            nn.ConvTranspose2d, nn.ConvTranspose3d} == set(GHOST_NORMS)
    assert GHOST_NORMS.lookup(nn.LayerNorm) is None
    bag = GHOST_NORMS.lookup(nn.EmbeddingBag)
    assert bag is not None and bag.whole_call  # its rows are its offsets' bags, not its input's
    grouped = GHOST_NORMS.lookup(nn.Conv2d)
    assert grouped is not None
    conv = nn.Conv2d(64, 64, 3, groups=2)  # per group O 32, I 288: T (I + O) <= O I up to T = 28
    assert grouped.is_cheaper(conv, 28) and not grouped.is_cheaper(conv, 29)
    wide = nn.Conv2d(192, 192, 3)  # O 192, I 1728: the Grams cost more than the gradient past T = 172
    assert grouped.is_cheaper(wide, 172) and not grouped.is_cheaper(wide, 256)
    deconv = nn.ConvTranspose2d(8, 64, 3)  # weight (8, 64, 3, 3): O 8 (its C_in), I 576
    assert grouped.is_cheaper(deconv, 7) and not grouped.is_cheaper(deconv, 8)
