"""GradSampleModule lifecycle, validation and semantics (layer maths is tested per family)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import psg_core
from psg_core import (ConfigError, GradAccumulationError, GradSampleModule, GradSamplerRegistry,
                      UnsupportedModuleError, register_grad_sampler)
from psg_core.grad_sample import GRAD_SAMPLERS
from tests.oracle import check_against_oracle, mse_loss


class BareScale(nn.Module):
    """A custom layer with a bare parameter and no registered sampler."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))


def test_grad_sample_shapes_and_grad_untouched_semantics() -> None:
    model = mlp()
    wrapped = GradSampleModule(model, augmentation_multiplicity=2)
    wrapped(torch.randn(6, 4)).sum().backward()
    for p in model.parameters():
        assert p.grad_sample.shape == (3, *p.shape)
        assert p.grad is not None


def test_rows_not_divisible_by_k_names_both_numbers() -> None:
    wrapped = GradSampleModule(mlp(), augmentation_multiplicity=3)
    with pytest.raises(ValueError, match=r"7 rows.*K=3"):
        wrapped(torch.randn(7, 4))


def test_empty_batch_gives_empty_grad_samples() -> None:
    model = mlp()
    wrapped = GradSampleModule(model, loss_reduction="sum", augmentation_multiplicity=2)
    wrapped(torch.randn(0, 4)).sum().backward()
    for p in model.parameters():
        assert p.grad_sample.shape == (0, *p.shape)


def test_frozen_parameters_get_no_grad_sample(device: torch.device) -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    actual = check_against_oracle(model, torch.randn(4, 4), torch.randn(4, 3), K=2, loss_reduction="mean",
                                  device=device)
    assert "0.weight" not in actual
    assert getattr(model[0].weight, "grad_sample", None) is None


def test_parameter_used_twice_gets_both_uses(device: torch.device) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(torch.tanh(self.layer(x)))

    for K in (1, 3):
        for reduction in ("mean", "sum"):
            check_against_oracle(Tied(), torch.randn(2 * K, 3), torch.randn(2 * K, 3), K=K,
                                 loss_reduction=reduction, device=device)


def test_shared_parameter_across_modules(device: torch.device) -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    check_against_oracle(Shared(), torch.randn(6, 3), torch.randn(6, 3), K=2, loss_reduction="mean",
                         device=device)


def test_inplace_activation_after_layer(device: torch.device) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    check_against_oracle(model, torch.randn(6, 3), torch.randn(6, 2), K=3, loss_reduction="sum", device=device)


def test_accumulation_forbidden_by_default() -> None:
    model = mlp()
    wrapped = GradSampleModule(model)
    x = torch.randn(4, 4)
    wrapped(x).sum().backward()
    with pytest.raises(ValueError, match="second backward"):
        wrapped(x).sum().backward()
    assert isinstance(GradAccumulationError("x"), ValueError)


def test_accumulation_cleared_by_zero_grad() -> None:
    model = mlp()
    wrapped = GradSampleModule(model)
    x = torch.randn(4, 4)
    wrapped(x).sum().backward()
    first = model[0].weight.grad_sample.clone()
    wrapped.zero_grad()
    assert model[0].weight.grad_sample is None
    wrapped(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad_sample, first)


def test_accumulation_allowed_sums() -> None:
    model = mlp()
    wrapped = GradSampleModule(model, augmentation_multiplicity=2)
    wrapped.allow_grad_accumulation()
    x1, x2 = torch.randn(4, 4), torch.randn(4, 4)
    wrapped(x1).sum().backward()
    first = model[2].weight.grad_sample.clone()
    wrapped.zero_grad()
    wrapped(x2).sum().backward()
    second = model[2].weight.grad_sample.clone()
    wrapped.zero_grad()
    wrapped(x1).sum().backward()
    wrapped(x2).sum().backward()
    torch.testing.assert_close(model[2].weight.grad_sample, first + second)
    wrapped.forbid_grad_accumulation()
    with pytest.raises(GradAccumulationError):
        wrapped(x1).sum().backward()


def test_disable_and_enable_hooks() -> None:
    model = mlp()
    wrapped = GradSampleModule(model)
    wrapped.disable_hooks()
    wrapped(torch.randn(4, 4)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters())
    wrapped.enable_hooks()
    wrapped(torch.randn(4, 4)).sum().backward()
    assert all(p.grad_sample is not None for p in model.parameters())


def test_remove_hooks_leaves_model_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(4, 5), BareScale(5), nn.Linear(5, 3))
    before_attrs = {name: set(vars(m)) for name, m in model.named_modules()}
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = GradSampleModule(model, strict=False)
    assert any(m._forward_hooks for m in model.modules())
    wrapped(torch.randn(2, 4)).sum().backward()
    wrapped.remove_hooks()
    wrapped.clear_grad_samples()
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._backward_hooks and not m._forward_pre_hooks
        assert set(vars(m)) == before_attrs[name], name
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before_state[k])
    for p in model.parameters():
        p.grad = None
        assert getattr(p, "grad_sample", None) is None
    model(torch.randn(2, 4)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    wrapped.add_hooks()
    wrapped(torch.randn(2, 4)).sum().backward()
    assert model[0].weight.grad_sample.shape == (2, 5, 4)


def test_strict_rejects_unsupported_module_with_path_and_type() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Sequential(BareScale(5)))
    with pytest.raises(NotImplementedError, match=r"'1\.0' \(BareScale\)"):
        GradSampleModule(model)
    errors = GradSampleModule.validate(model, strict=False)
    assert len(errors) == 1 and isinstance(errors[0], UnsupportedModuleError)
    assert not GradSampleModule.is_supported(model[1][0])
    assert GradSampleModule.is_supported(model[0])
    assert GradSampleModule.is_supported(nn.ReLU())


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("force_functorch", [False, True])
def test_functorch_fallback_matches_oracle(loss_reduction: str, K: int, force_functorch: bool,
                                           device: torch.device) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 5), BareScale(5), nn.Linear(5, 3))
    check_against_oracle(model, torch.randn(2 * K, 4), torch.randn(2 * K, 3), K=K,
                         loss_reduction=loss_reduction, strict=False, force_functorch=force_functorch, device=device)


@pytest.mark.parametrize("K", [1, 2])
def test_functorch_fallback_batch_second(K: int, device: torch.device) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), BareScale(5), nn.Linear(5, 3))
    x = torch.randn(6, 2 * K, 4)  # (T, N*K, d)
    y = torch.randn(6, 2 * K, 3)
    check_against_oracle(model, x, y, K=K, loss_reduction="mean", batch_first=False, strict=False, device=device)


def test_batchnorm_always_rejected() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(UnsupportedModuleError, match="fix_model"):
        GradSampleModule(model, strict=False)


def test_fused_layers_rejected() -> None:
    with pytest.raises(UnsupportedModuleError, match="fix_model"):
        GradSampleModule(nn.LSTM(3, 4))


def test_opacus_style_sampler_without_k_is_folded(device: torch.device) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    @register_grad_sampler(Scale)
    def scale_per_row(layer: Scale, activations: list[torch.Tensor], backprops: torch.Tensor):
        return {layer.weight: activations[0] * backprops}  # (N*K, 3): one row each

    try:
        for K in (1, 3):
            for reduction in ("mean", "sum"):
                check_against_oracle(nn.Sequential(Scale(), nn.Tanh(), nn.Linear(3, 2)),
                                     torch.randn(2 * K, 3), torch.randn(2 * K, 2), K=K,
                                     loss_reduction=reduction, device=device)
    finally:
        GRAD_SAMPLERS.unregister(Scale)


def test_registry_rules() -> None:
    registry = GradSamplerRegistry()

    @registry.register(nn.Linear)
    def sampler(layer, activations, backprops, K):  # type: ignore[no-untyped-def]
        return {}

    class MyLinear(nn.Linear):
        pass

    class ScaledLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert registry.lookup(MyLinear(2, 2)).fn is sampler  # MRO walk
    assert registry.lookup(ScaledLinear(2, 2)) is None  # own forward: no inherited sampler
    assert registry.lookup(nn.Linear).k_aware
    assert registry.lookup(nn.Conv1d) is None
    with pytest.raises(ConfigError, match="already has a grad sampler"):
        registry.register(nn.Linear)(sampler)
    registry.register(nn.Linear, replace=True)(sampler)
    with pytest.raises(ConfigError):
        registry.register(int)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="augmentation_multiplicity"):
        GradSampleModule(mlp(), augmentation_multiplicity=0)
    with pytest.raises(ConfigError, match="loss_reduction"):
        GradSampleModule(mlp(), loss_reduction="avg")
    with pytest.raises(ConfigError, match="already wrapped"):
        GradSampleModule(GradSampleModule(mlp()))


def test_no_grad_forward_captures_nothing() -> None:
    model = mlp()
    wrapped = GradSampleModule(model)
    with torch.no_grad():
        wrapped(torch.randn(3, 4))
    wrapped(torch.randn(3, 4)).sum().backward()
    assert model[0].weight.grad_sample.shape[0] == 3


def test_per_sample_gradients_functional_leaves_model_untouched(device: torch.device) -> None:
    model = mlp().to(device)
    x, y = torch.randn(6, 4).to(device), torch.randn(6, 3).to(device)
    grads = psg_core.per_sample_gradients(model, x, y, loss_fn=nn.MSELoss(), augmentation_multiplicity=2)
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())
    check = check_against_oracle(model, x, y, K=2, loss_reduction="mean", loss=mse_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, check[name])


def test_second_backward_through_a_retained_graph_is_a_clear_error() -> None:
    wrapped = GradSampleModule(mlp())
    loss = wrapped(torch.randn(3, 4)).sum()
    loss.backward(retain_graph=True)
    wrapped.allow_grad_accumulation()
    with pytest.raises(UnsupportedModuleError, match="retain_graph"):
        loss.backward()


def test_repeated_calls_in_one_pass_accumulate_without_touching_earlier_results() -> None:
    layer = nn.Linear(3, 3)
    wrapped = GradSampleModule(layer, augmentation_multiplicity=2)
    wrapped.allow_grad_accumulation()
    x = torch.randn(4, 3)
    out = x
    for _ in range(3):  # one layer, three calls: grad_sample sums them in place after the first
        out = torch.tanh(layer(out))
    out.sum().backward()
    first = layer.weight.grad_sample
    snapshot = first.clone()
    out = x
    for _ in range(3):
        out = torch.tanh(layer(out))
    out.sum().backward()  # a new pass: the tensor handed out before must not change
    torch.testing.assert_close(first, snapshot)
    torch.testing.assert_close(layer.weight.grad_sample, 2 * snapshot)


def test_a_parameter_the_backward_never_reaches_has_grad_sample_none() -> None:
    """Reading ``p.grad_sample`` on every trainable parameter is safe (an AttributeError before)."""

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Branches()
    wrapped = GradSampleModule(model)
    try:
        wrapped(torch.randn(4, 3)).sum().backward()
        grad_samples = {name: p.grad_sample for name, p in model.named_parameters()}
    finally:
        wrapped.remove_hooks()
    assert grad_samples["unused.weight"] is None and grad_samples["used.weight"].shape == (4, 2, 3)
