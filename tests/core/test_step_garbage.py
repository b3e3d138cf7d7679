"""A step leaves no reference cycle behind that holds the caller's batch.

A cycle is freed only when Python's garbage collector runs (and never while it is disabled, as
benchmarks and some training loops do): a batch of images held by one would stay in memory one
step longer, or for good. ``ModelInputs`` walked its arguments with a nested recursive function,
and torch's ``tree_flatten`` does so too: each call made a cycle through the input tensors.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import psg_core
from psg_core.layout import ModelInputs


class _BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="mean")
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens, offsets))


@pytest.mark.parametrize("mode", ["hooks", "ghost", "functorch", "ew"])
def test_the_batch_is_freed_when_the_caller_drops_it(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    config = psg_core.DPConfig(mode=mode, max_grad_norm=0.5)
    loss = nn.MSELoss(reduction="none")
    for _ in range(2):  # first calls initialise caches (torch.func's among them)
        psg_core.dp_gradient(model, (torch.randn(6, 4),), torch.randn(6, 2), loss_fn=loss, config=config)
    gc.collect()
    gc.disable()
    try:
        inputs, targets = torch.randn(6, 4), torch.randn(6, 2)
        held = weakref.ref(inputs), weakref.ref(targets)
        result = psg_core.dp_gradient(model, (inputs,), targets, loss_fn=loss, config=config)
        del inputs, targets, result
        assert held[0]() is None and held[1]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_ghost_or_hooks_step_makes_no_cyclic_garbage(mode: str) -> None:
    model = _BagModel()
    tokens, offsets = torch.randint(0, 20, (12,)), torch.tensor([0, 3, 5, 9])
    config = psg_core.DPConfig(mode=mode, max_grad_norm=0.5)
    loss = nn.CrossEntropyLoss(reduction="none")
    targets = torch.randint(0, 2, (4,))
    psg_core.dp_gradient(model, {"tokens": tokens, "offsets": offsets}, targets, loss_fn=loss, config=config)
    gc.collect()
    gc.disable()
    try:
        psg_core.dp_gradient(model, {"tokens": tokens, "offsets": offsets}, targets, loss_fn=loss, config=config)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_leaves_are_tree_flattens_leaves() -> None:
    """ModelInputs.leaves walks plain containers itself and gives what tree_flatten gives."""
    from torch.nn.utils.rnn import pack_sequence
    from torch.utils._pytree import tree_flatten

    packed = pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    args = (torch.ones(2), [None, 3, {"a": torch.zeros(1), "b": (1.5, "s")}], packed)
    inputs = ModelInputs.parse(args, where="test")
    expected = tree_flatten((inputs.args, inputs.kwargs))[0]
    got = inputs.leaves()
    assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected))
