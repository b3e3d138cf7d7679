"""psg_core._module_hooks.ModuleHooks: the same hooks torch's register_forward_(pre_)hook would add."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psg_core._module_hooks import ModuleHooks


def _calls(register) -> list[str]:
    """The order in which a layer's hooks run, with hooks added by ``register(layer, log)``."""
    layer, log = nn.Linear(2, 2), []
    layer.register_forward_hook(lambda m, a, o: log.append("user-forward"))
    layer.register_forward_pre_hook(lambda m, a: log.append("user-pre"))
    register(layer, log)
    layer(torch.zeros(1, 2))
    return log


def _with_torch(layer: nn.Module, log: list[str]) -> None:
    layer.register_forward_pre_hook(lambda m, a, k: log.append(f"pre kwargs={sorted(k)}"), with_kwargs=True)
    layer.register_forward_hook(lambda m, a, k, o: log.append("forward with kwargs"), with_kwargs=True)
    layer.register_forward_hook(lambda m, a, o: log.append("prepended"), prepend=True)
    layer.register_forward_hook(lambda m, a, o: log.append("always"), always_call=True)


def _with_module_hooks(layer: nn.Module, log: list[str]) -> ModuleHooks:
    hooks = ModuleHooks()
    hooks.pre(layer, lambda m, a, k: log.append(f"pre kwargs={sorted(k)}"), with_kwargs=True)
    hooks.forward(layer, lambda m, a, k, o: log.append("forward with kwargs"), with_kwargs=True)
    hooks.forward(layer, lambda m, a, o: log.append("prepended"), prepend=True)
    hooks.forward(layer, lambda m, a, o: log.append("always"), always_call=True)
    return hooks


def test_hooks_run_where_and_how_torch_registration_runs_them() -> None:
    assert _calls(_with_module_hooks) == _calls(_with_torch)
    assert _calls(_with_torch) == ["user-pre", "pre kwargs=[]", "prepended", "user-forward", "forward with kwargs",
                                   "always"]


def test_remove_takes_off_exactly_its_own_hooks_and_flags() -> None:
    layer, log = nn.Linear(2, 2), []
    user = layer.register_forward_hook(lambda m, a, o: log.append("user"), always_call=True)
    before = [dict(d) for d in (layer._forward_pre_hooks, layer._forward_pre_hooks_with_kwargs, layer._forward_hooks,
                                layer._forward_hooks_with_kwargs, layer._forward_hooks_always_called)]
    hooks = _with_module_hooks(layer, log)
    later = layer.register_forward_pre_hook(lambda m, a: log.append("later"))  # keys never collide
    assert len(hooks) == 4 and later.id not in {key for _, _, key in hooks._added}
    hooks.remove()
    hooks.remove()  # idempotent
    later.remove()
    after = [dict(d) for d in (layer._forward_pre_hooks, layer._forward_pre_hooks_with_kwargs, layer._forward_hooks,
                               layer._forward_hooks_with_kwargs, layer._forward_hooks_always_called)]
    assert after == before and not hooks
    layer(torch.zeros(1, 2))
    assert log == ["user"]
    user.remove()


def test_an_always_call_hook_runs_when_the_forward_raises() -> None:
    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    layer, log = Failing(), []
    hooks = ModuleHooks()
    hooks.forward(layer, lambda m, a, o: log.append("always"), always_call=True)
    hooks.forward(layer, lambda m, a, o: log.append("not on error"))
    with pytest.raises(ValueError, match="boom"):
        layer(torch.zeros(1))
    hooks.remove()
    assert log == ["always"]
