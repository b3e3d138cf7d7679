"""A step reads nothing back from the device except the numbers the API returns.

Every read of a tensor's value on the host (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``,
``nonzero``, a boolean-mask index, a copy to the CPU) makes the host wait for the device, which on
a GPU stalls the launch queue in the middle of a step. The per-step paths (grad samplers, the
backends' book-keeping, the ghost norms and clipped sums) make none; what remains is documented
here, read by read, and this test holds the count to it:

* ``per_sample_gradients`` (hooks): none.
* ``dp_gradient``: one per floating input or target tensor (``NonFiniteInputError`` is raised
  before anything runs), one for whether any sample was dropped (non-finite gradient), one for
  the number clipped and one for the loss sum (``DPGradient`` holds Python numbers); the hooks
  path reads "any dropped" twice (in ``clip_and_sum`` and again in ``dp_gradient``).

The reads are counted with a ``TorchDispatchMode`` (every op that needs a value on the host
passes through it) plus the tensor methods that read without dispatching (``tolist``, ``numpy``).
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import psg_core
from psg_core.layers import DPLSTM
from tests.devices import DEVICES, requires_cuda

ROOT = Path(psg_core.__file__).resolve().parent.parent
#: Ops whose result needs a value (or a data-dependent size) on the host.
READING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal",
               "aten::is_nonzero", "aten::bincount", "aten::_unique", "aten::_unique2", "aten::unique_dim",
               "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::histc"}
Site = tuple[str, str]  # (file relative to the repository, function)


def _site() -> Site:
    """The innermost psg_core frame that led to the read (psg_core._host's readers name their caller)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT / "psg_core") and path != ROOT / "psg_core" / "_host.py":
            return str(path.relative_to(ROOT)), frame.name
    return "<outside psg_core>", ""


def _reads_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = func._schema.name
    if name in READING_OPS:
        return True
    if name == "aten::repeat_interleave" and args and isinstance(args[0], torch.Tensor) and len(args) == 1:
        return True  # repeats given as a tensor: the output size is data-dependent
    if name in ("aten::index", "aten::index_put", "aten::index_put_") and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    if name in ("aten::_to_copy", "aten::copy_") and args:
        # A copy off the device to the host (a dtype cast on the device reads nothing).
        source = args[1] if name == "aten::copy_" else args[0]
        target = args[0].device if name == "aten::copy_" else kwargs.get("device") or source.device
        return isinstance(source, torch.Tensor) and source.device.type != "cpu" and torch.device(target).type == "cpu"
    return False


class HostReads(TorchDispatchMode):
    """Counts device-to-host reads by the psg_core site that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[Site] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if _reads_host(func, args, kwargs or {}):
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
    mode = HostReads()
    for method in ("tolist", "numpy"):
        original = getattr(torch.Tensor, method)

        def counting(self: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            mode.sites[_site()] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    yield mode


class Mixed(nn.Module):
    """Linear, Conv, Embedding, EmbeddingBag, GroupNorm and an LSTM in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.image_head = nn.Linear(4 * 6 * 6, 8)
        self.embedding = nn.Embedding(20, 8, padding_idx=0)
        self.lstm = DPLSTM(8, 8, batch_first=True)
        self.bag = nn.EmbeddingBag(20, 8, mode="mean", padding_idx=0)
        self.head = nn.Linear(24, 5)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        seen = self.image_head(torch.relu(self.norm(self.conv(images))).flatten(1))  # (B, 8)
        sequence, _ = self.lstm(self.embedding(tokens))  # (B, T, 8)
        return self.head(torch.cat([seen, sequence[:, -1], self.bag(tokens)], 1))  # (B, 5)


def _batch(device: torch.device, K: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    rows = 3 * K
    images, tokens = torch.randn(rows, 3, 6, 6), torch.randint(0, 20, (rows, 5))
    return Mixed().to(device), (images.to(device), tokens.to(device)), torch.randint(0, 5, (rows,)).to(device)


LOSS = nn.CrossEntropyLoss(reduction="none")
#: What a dp_gradient step reads, site by site (see the module docstring).
DP_READS: dict[str, dict[Site, int]] = {
    "hooks": {("psg_core/dp.py", "_check_finite"): 1,  # the images (token ids and labels are integers)
              ("psg_core/clipping.py", "dropped_samples"): 2,  # in clip_and_sum, then again in dp_gradient
              ("psg_core/clipping.py", "clip_and_sum"): 1,  # num_clipped
              ("psg_core/dp.py", "dp_gradient"): 1},  # loss_sum
    "ghost": {("psg_core/dp.py", "_check_finite"): 1,
              ("psg_core/clipping.py", "dropped_samples"): 1,
              ("psg_core/backends/ghost.py", "result"): 2},  # num_clipped and loss_sum, once the passes are in
}

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("strategy", ["rule", "auto"])
def test_per_sample_gradients_read_nothing(device: str, K: int, strategy: str, host_reads: HostReads) -> None:
    model, inputs, targets = _batch(torch.device(device), K)
    with psg_core.conv_strategy(strategy):
        psg_core.per_sample_gradients(model, inputs, targets, loss_fn=LOSS, augmentation_multiplicity=K)  # warm-up
        with host_reads:
            grads = psg_core.per_sample_gradients(model, inputs, targets, loss_fn=LOSS, augmentation_multiplicity=K)
    assert grads["conv.weight"].shape == (3, 4, 3, 3, 3)
    assert dict(host_reads.sites) == {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("strategy", ["rule", "auto"])
def test_dp_gradient_reads_only_what_it_returns(device: str, K: int, mode: str, strategy: str,
                                               host_reads: HostReads) -> None:
    model, inputs, targets = _batch(torch.device(device), K)
    config = psg_core.DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.1)
    with psg_core.conv_strategy(strategy):
        psg_core.dp_gradient(model, inputs, targets, loss_fn=LOSS, config=config)  # warm-up: measures once
        with host_reads:
            result = psg_core.dp_gradient(model, inputs, targets, loss_fn=LOSS, config=config)
    assert result.num_samples == 3
    assert dict(host_reads.sites) == DP_READS[mode], sorted(host_reads.sites.items())


@requires_cuda
@pytest.mark.filterwarnings("ignore:.*Profiler clears events at the end of each cycle:UserWarning")
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_cuda_step_copies_to_host_only_what_it_returns(mode: str) -> None:
    """torch.profiler's view: the device-to-host copies of a step are the documented reads."""
    from torch.profiler import ProfilerActivity, profile

    model, inputs, targets = _batch(torch.device("cuda"), 2)
    config = psg_core.DPConfig(mode=mode, augmentation_multiplicity=2, max_grad_norm=0.1)
    psg_core.dp_gradient(model, inputs, targets, loss_fn=LOSS, config=config)  # warm-up: measures once
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        psg_core.dp_gradient(model, inputs, targets, loss_fn=LOSS, config=config)
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "memcpy" in e.name.lower() and "dtoh" in e.name.lower()]
    assert len(copies) == sum(DP_READS[mode].values()), [e.name for e in copies]


def test_the_counter_sees_each_kind_of_read(host_reads: HostReads) -> None:
    """The mode counts what it should (the reads psg_core used to make in its samplers)."""
    x = torch.tensor([0.0, 1.0, 2.0])
    with host_reads:
        x.sum().item()
        bool(x.any())
        x.tolist()
        x.nonzero()
        x[x > 0]
        torch.bincount(torch.tensor([1, 2]))
        x.repeat_interleave(torch.tensor([1, 2, 1]))
        x * 2 + 1  # no read
        x.repeat_interleave(2)  # int repeats: no read
    assert sum(host_reads.sites.values()) == 7, host_reads.sites


@requires_cuda
def test_the_counter_tells_a_cast_from_a_copy_to_the_host(host_reads: HostReads) -> None:
    """A dtype cast on the device reads nothing (it counted as a read once: the EmbeddingBag
    sampler's two casts looked like host syncs on an H200); a copy to the CPU does."""
    x = torch.tensor([0.0, 1.0, 2.0], device="cuda")
    with host_reads:
        x.to(torch.float64)
        x.bool().float()
        x.to("cuda", torch.float16)
    assert dict(host_reads.sites) == {}
    with host_reads:
        x.cpu()
        x.to("cpu", torch.float64)
        torch.empty(3).copy_(x)
    assert sum(host_reads.sites.values()) == 3, host_reads.sites
