"""Flat buffers (psg_wire.flat): the aligned layout both ends of the wire follow, packing without a
copy when the tensors already lie so, in-place sums, casts and moves."""

from __future__ import annotations

import pytest
import torch

from psg_wire.flat import ALIGNMENT, FlatLayout, FlatTensors
from tests.devices import requires_cuda

cuda = requires_cuda  # marked ``cuda`` (``pytest -m cuda``), skipped without a device


def test_every_tensor_starts_aligned_and_gaps_are_zero() -> None:
    named = [("a", torch.randn(3)), ("i", torch.arange(5)), ("h", torch.ones(7, dtype=torch.float16)),
             ("e", torch.zeros(0)), ("z", torch.ones(2, 2))]
    flat = FlatTensors.pack(named)
    offsets = [entry.offset for entry in flat.layout.entries]
    assert offsets == [0, 64, 128, 192, 192] and all(o % ALIGNMENT == 0 for o in offsets)
    assert flat.layout.num_bytes == 192 + 16
    assert all(torch.equal(flat.views()[name], tensor) for name, tensor in named)
    covered = torch.zeros(flat.layout.num_bytes, dtype=torch.bool)
    for entry in flat.layout.entries:
        covered[entry.offset:entry.offset + entry.num_bytes] = True
    assert not flat.buffer[~covered].any()


def test_pack_copies_only_when_the_tensors_are_not_laid_out_already() -> None:
    flat = FlatTensors.pack({"w": torch.randn(4, 4), "b": torch.randn(4)})
    again = FlatTensors.pack(flat.views())
    assert again.buffer.data_ptr() == flat.buffer.data_ptr() and again.layout == flat.layout
    reordered = FlatTensors.pack({"b": flat.views()["b"], "w": flat.views()["w"]})
    assert reordered.buffer.data_ptr() != flat.buffer.data_ptr()
    assert torch.equal(reordered.views()["w"], flat.views()["w"])
    subset = FlatTensors.pack({"w": flat.views()["w"]})  # a prefix of the same buffer: still a view
    assert subset.buffer.data_ptr() == flat.buffer.data_ptr() and subset.layout.num_bytes == 64


def test_add_sums_in_place_whatever_the_dtypes() -> None:
    uniform = FlatTensors.pack({"w": torch.ones(3), "b": torch.full((2,), 2.0)})
    uniform.add_(FlatTensors.pack({"w": torch.ones(3), "b": torch.ones(2)}))
    assert uniform.views()["w"].tolist() == [2.0] * 3 and uniform.views()["b"].tolist() == [3.0] * 2
    mixed = FlatTensors.pack({"w": torch.ones(3), "h": torch.ones(2, dtype=torch.float64)})
    assert mixed.typed() is None
    mixed.add_(mixed)
    assert mixed.views()["h"].tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="layouts differ"):
        uniform.add_(mixed)


def test_cast_keeps_integer_tensors_and_rounds_floating_ones() -> None:
    flat = FlatTensors.pack({"w": torch.tensor([1.0 + 2 ** -10, 3.0]), "n": torch.arange(3)})
    half = flat.cast(torch.bfloat16)
    assert half.layout.entries[0].dtype == torch.bfloat16 and half.layout.entries[1].dtype == torch.int64
    assert half.views()["w"].tolist() == [1.0, 3.0] and half.views()["n"].tolist() == [0, 1, 2]
    assert flat.cast(torch.float32) is flat
    assert FlatLayout.of([("w", torch.float32, (4,))]).with_dtype(torch.bfloat16).num_bytes == 8


@cuda
def test_a_flat_buffer_moves_to_the_device_in_one_copy() -> None:
    flat = FlatTensors.pack({"w": torch.randn(3, 3), "b": torch.randn(3)})
    pinned = flat.to("cpu", pin_memory=True) if flat.device.type != "cpu" else FlatTensors(
        flat.layout, flat.buffer.pin_memory())
    on_device = pinned.to("cuda", non_blocking=True)
    assert on_device.device.type == "cuda"
    assert all(torch.equal(on_device.views()[n].cpu(), t) for n, t in flat.views().items())
