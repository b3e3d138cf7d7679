"""A module registered under two paths (``nn.Sequential(l, act, l)``): exact per-sample gradients,
and the model left as it was.

``torch.func.functional_call`` swaps such a module's tensors twice and left the swapped-in plain
tensors in it: after a functorch call the shared layer's weight was no longer the Parameter the
optimizer holds, so training would silently stop updating it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.oracle import check_mode, cross_entropy_rows as _loss


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch"])
@pytest.mark.parametrize("K", [1, 2])
def test_a_module_registered_twice_keeps_its_parameters_and_gets_exact_gradients(mode: str, K: int) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(6, 3))
    before = {name: p for name, p in model.named_parameters()}
    for p in before.values():
        p.grad = torch.full_like(p, 0.5)  # the caller's own accumulated gradient
    x, y = torch.randn(3 * K, 6), torch.randint(0, 3, (3 * K,))
    check_mode(model, x, y, K=K, mode=mode, loss=_loss)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, p in before.items():
        assert after[name] is p and isinstance(p, nn.Parameter), name
        assert torch.equal(p.grad, torch.full_like(p, 0.5)), name
    assert model[0].weight is model[2].weight is before["0.weight"]
