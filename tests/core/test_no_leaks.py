"""Nothing a step builds outlives it: hook state, autograd nodes and saved activations are freed.

Gradient hooks live on autograd nodes; a hook that refers back (directly or through its
owner) to those nodes forms a cycle through C++ objects that Python's garbage collector cannot
see, and every step would leak its activations. These tests count what is alive after steps.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from psg_core import DPConfig, GradSampleModule, dp_gradient, per_sample_gradients
from psg_core.backends.ghost import _GhostBookkeeping
from psg_core.layers import DPLSTM, DPMultiheadAttention

# Each test walks the whole heap (gc.get_objects) after its steps: seconds apiece once the test
# process holds thousands of objects, a third of the unit tests' time. `make test` runs them.
pytestmark = pytest.mark.slow

_MARK = 13  # a feature size no other tensor in the process has


class _Block(nn.Module):
    """Attention (three projections sharing an input), an LSTM (multi-output cells) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, _MARK)
        self.attention = DPMultiheadAttention(_MARK, 1, batch_first=True)
        self.lstm = DPLSTM(_MARK, _MARK, batch_first=True)
        self.norm = nn.LayerNorm(_MARK)
        self.head = nn.Linear(_MARK, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, T, 13)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        h = self.lstm(h)[0]  # (B, T, 13)
        return self.head(self.norm(h).mean(1))  # (B, 3)


def _alive() -> tuple[int, int, int]:
    gc.collect()
    # One pass that allocates nothing per object: a list of (type, object) pairs as long as the
    # heap made the collector run full collections while it grew (most of a test's time).
    marked = passes = wrappers = 0
    for o in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some module proxies warn about.
        kind = type(o)
        if kind is torch.Tensor:
            marked += bool(o.dim() and o.shape[-1] == _MARK)
        elif kind is _GhostBookkeeping:
            passes += 1
        elif kind is GradSampleModule:
            wrappers += 1
    return marked, passes, wrappers


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
@pytest.mark.parametrize("K", [1, 2])
def test_dp_gradient_leaves_nothing_behind(mode: str, K: int) -> None:
    torch.manual_seed(0)
    model = _Block()
    x, y = torch.randn(4 * K, 5, 4), torch.randint(0, 3, (4 * K,))
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.5)
    dp_gradient(model, x, y, loss_fn=nn.CrossEntropyLoss(), config=config)  # warm-up
    before = _alive()
    for _ in range(3):
        dp_gradient(model, x, y, loss_fn=nn.CrossEntropyLoss(), config=config)
    assert _alive() == before


def test_per_sample_gradients_and_the_wrapper_leave_nothing_behind() -> None:
    torch.manual_seed(0)
    model = _Block()
    x, y = torch.randn(4, 5, 4), torch.randint(0, 3, (4,))
    per_sample_gradients(model, x, y, loss_fn=nn.CrossEntropyLoss())
    before = _alive()
    for _ in range(3):
        per_sample_gradients(model, x, y, loss_fn=nn.CrossEntropyLoss())
    assert _alive() == before
    wrapped = GradSampleModule(model)
    for _ in range(3):
        nn.functional.cross_entropy(wrapped(x), y).backward()
        wrapped.zero_grad(set_to_none=True)
        wrapped.clear_grad_samples()
    marked, _, _ = _alive()
    assert marked == before[0]


def test_a_forward_without_backward_frees_its_activations() -> None:
    """A step that fails between forward and backward must not pin the graph either."""
    model = _Block()
    wrapped = GradSampleModule(model)
    x = torch.randn(4, 5, 4)
    before = _alive()[0]
    for _ in range(3):
        out = wrapped(x)
        del out
    assert _alive()[0] == before
