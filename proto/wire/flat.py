"""Flat buffers: several tensors in one contiguous byte buffer, each at an aligned offset.

A parameter set, a step's gradient or a batch travels best as one buffer: one allocation, one
host-to-device copy, one object in Ray's store, one in-place sum, and few wire messages (a
``TensorGroup`` frame carries the headers of several tensors and then their bytes laid out by this
module). :class:`FlatLayout` is the rule both ends of the wire follow: tensor ``i`` starts at the
end of tensor ``i - 1`` rounded up to :data:`ALIGNMENT` bytes (the first at 0); the gaps between
tensors are zero bytes. :class:`FlatTensors` is a buffer so laid out, on any device, with a view
per tensor.

>>> import torch
>>> flat = FlatTensors.pack([("w", torch.ones(2, 3)), ("b", torch.arange(2.0))])
>>> [(e.name, e.offset, e.num_bytes) for e in flat.layout.entries], flat.layout.num_bytes
([('w', 0, 24), ('b', 64, 8)], 72)
>>> flat.views()["b"]
tensor([0., 1.])
>>> FlatTensors.pack(flat.views()).buffer.data_ptr() == flat.buffer.data_ptr()  # already flat: no copy
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ALIGNMENT", "FlatEntry", "FlatLayout", "FlatTensors"]

#: Byte alignment of every tensor in a flat buffer: a multiple of every itemsize, and of the
#: 64-byte lines that vector loads and DMA engines like.
ALIGNMENT = 64


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class FlatEntry:
    """One tensor of a :class:`FlatLayout`: its name, dtype, shape and byte offset."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        """``prod(shape) * itemsize``."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a flat buffer lies (see the module docstring for the rule)."""

    entries: tuple[FlatEntry, ...]
    #: The buffer's size: the end of the last tensor (0 for no tensors).
    num_bytes: int

    @classmethod
    def of(cls, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> FlatLayout:
        """The layout of ``(name, dtype, shape)`` in order.

        >>> FlatLayout.of([("a", torch.int8, (3,)), ("b", torch.float64, ())]).num_bytes
        72
        """
        entries: list[FlatEntry] = []
        end = 0
        for name, dtype, shape in specs:
            entry = FlatEntry(name=name, dtype=dtype, shape=tuple(int(d) for d in shape),
                              offset=_align(end) if entries else 0)
            entries.append(entry)
            end = entry.offset + entry.num_bytes
        return cls(entries=tuple(entries), num_bytes=end)

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names, in order."""
        return tuple(entry.name for entry in self.entries)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype every tensor has, or None when they differ (or there are none)."""
        dtypes = {entry.dtype for entry in self.entries}
        return dtypes.pop() if len(dtypes) == 1 else None

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors themselves (the gaps left out)."""
        return sum(entry.num_bytes for entry in self.entries)

    def with_dtype(self, dtype: torch.dtype) -> FlatLayout:
        """The same tensors with every floating one in ``dtype`` (a reduced-precision wire copy).

        >>> FlatLayout.of([("w", torch.float32, (4,))]).with_dtype(torch.bfloat16).num_bytes
        8
        """
        return FlatLayout.of((e.name, dtype if e.dtype.is_floating_point else e.dtype, e.shape)
                             for e in self.entries)


@dataclass(frozen=True, eq=False)
class FlatTensors:
    """Tensors sharing one flat ``uint8`` buffer laid out by :attr:`layout` (on any device)."""

    layout: FlatLayout
    #: ``(layout.num_bytes,)`` uint8, contiguous.
    buffer: torch.Tensor

    @classmethod
    def empty(cls, layout: FlatLayout, *, device: torch.device | str = "cpu",
              pin_memory: bool = False) -> FlatTensors:
        """An uninitialised buffer for ``layout`` whose gaps are zero."""
        buffer = torch.empty(layout.num_bytes, dtype=torch.uint8, device=device,
                             pin_memory=pin_memory)  # (num_bytes,)
        flat = cls(layout, buffer)
        flat.zero_gaps()
        return flat

    @classmethod
    def pack(cls, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
             device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> FlatTensors:
        """The tensors in one flat buffer: a view of their own storage, without a copy, when they
        already lie in one laid out as :class:`FlatLayout` says (a decoded ``TensorGroup``, a
        :meth:`views` result); otherwise one copy into a new buffer.

        Args:
            named: ``(name, tensor)`` pairs, or a mapping, in the buffer's order.
            device: where the buffer must be (default: the first tensor's device, else the CPU).
            dtype: cast the floating tensors to this dtype on the way (always a copy).
        """
        pairs = list(named.items()) if isinstance(named, Mapping) else list(named)
        target = torch.device(device) if device is not None else (
            pairs[0][1].device if pairs else torch.device("cpu"))
        layout = FlatLayout.of((name, dtype if dtype is not None and t.is_floating_point() else t.dtype, t.shape)
                               for name, t in pairs)
        if dtype is None:
            shared = _shared_buffer([t for _, t in pairs], layout, target)
            if shared is not None:
                return cls(layout, shared)
        flat = cls.empty(layout, device=target)
        for (_, tensor), view in zip(pairs, flat.views().values()):
            view.copy_(tensor.detach())
        return flat

    @classmethod
    def find(cls, named: Mapping[str, torch.Tensor]) -> FlatTensors | None:
        """The flat buffer the tensors already lie in, in order (a decoded group), or None: never
        a copy."""
        pairs = list(named.items())
        layout = FlatLayout.of((name, t.dtype, t.shape) for name, t in pairs)
        device = pairs[0][1].device if pairs else torch.device("cpu")
        shared = _shared_buffer([t for _, t in pairs], layout, device)
        return None if shared is None else cls(layout, shared)

    @property
    def device(self) -> torch.device:
        """The buffer's device."""
        return self.buffer.device

    def view(self, entry: FlatEntry) -> torch.Tensor:
        """The tensor of ``entry``, a view of the buffer."""
        piece = self.buffer[entry.offset:entry.offset + entry.num_bytes]  # (num_bytes,)
        return piece.view(entry.dtype).view(entry.shape)

    def views(self) -> dict[str, torch.Tensor]:
        """``{name: tensor}``, every tensor a view of the buffer, in layout order."""
        typed: dict[torch.dtype, torch.Tensor] = {}
        out = {}
        for entry in self.layout.entries:
            # One strided view per tensor of a typed view of the whole buffer (one per dtype): a
            # view costs microseconds, and a small step makes a few dozen.
            whole = typed.get(entry.dtype)
            if whole is None:
                usable = self.layout.num_bytes // entry.dtype.itemsize * entry.dtype.itemsize
                whole = typed[entry.dtype] = self.buffer[:usable].view(entry.dtype)
            out[entry.name] = whole.as_strided(entry.shape, _contiguous_strides(entry.shape),
                                               whole.storage_offset() + entry.offset // entry.dtype.itemsize)
        return out

    def typed(self) -> torch.Tensor | None:
        """The whole buffer as its one dtype (gaps included, as zeros), or None when the tensors'
        dtypes differ: what one in-place operation over every tensor runs on."""
        dtype = self.layout.dtype
        return None if dtype is None else self.buffer.view(dtype)

    def zero_gaps(self) -> None:
        """Writes zeros between the tensors (a fresh buffer holds whatever memory held before)."""
        end = 0
        for entry in self.layout.entries:
            if entry.offset > end:
                self.buffer[end:entry.offset].zero_()
            end = entry.offset + entry.num_bytes

    def add_(self, other: FlatTensors) -> FlatTensors:
        """Adds ``other`` (same layout) into this buffer, tensor by tensor, and returns self."""
        if other.layout != self.layout:
            raise ValueError("FlatTensors.add_: the layouts differ")
        mine, theirs = self.typed(), other.typed()
        if mine is not None and theirs is not None:
            mine.add_(theirs.to(mine.device, non_blocking=True))  # (num_bytes / itemsize,)
            return self
        for entry in self.layout.entries:
            self.view(entry).add_(other.view(entry).to(self.device, non_blocking=True))
        return self

    def to(self, device: torch.device | str, *, non_blocking: bool = False, pin_memory: bool = False) -> FlatTensors:
        """This buffer on ``device`` (self when it is there already): one copy of the whole buffer."""
        device = torch.device(device)
        if self.buffer.device == device:
            return self
        if pin_memory and device.type == "cpu":
            out = torch.empty(self.layout.num_bytes, dtype=torch.uint8, pin_memory=True)  # (num_bytes,)
            return FlatTensors(self.layout, out.copy_(self.buffer, non_blocking=non_blocking))
        return FlatTensors(self.layout, self.buffer.to(device, non_blocking=non_blocking))

    def cast(self, dtype: torch.dtype) -> FlatTensors:
        """A new buffer with every floating tensor in ``dtype`` (self when that changes nothing)."""
        layout = self.layout.with_dtype(dtype)
        if layout == self.layout:
            return self
        out = FlatTensors.empty(layout, device=self.device)
        for target, source in zip(out.views().values(), self.views().values()):
            target.copy_(source)
        return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _shared_buffer(tensors: list[torch.Tensor], layout: FlatLayout, device: torch.device) -> torch.Tensor | None:
    """The ``uint8`` buffer the tensors already lie in, laid out as ``layout``, or None."""
    anchor = next(((entry, tensor) for entry, tensor in zip(layout.entries, tensors) if tensor.numel()), None)
    if anchor is None or anchor[1].device != device:
        return None
    storage = anchor[1].untyped_storage()
    start = anchor[1].data_ptr() - anchor[0].offset  # the buffer's byte 0
    for entry, tensor in zip(layout.entries, tensors):
        if tensor.numel() == 0:
            continue  # lies nowhere; its view of the buffer is empty whatever the buffer holds
        if (type(tensor) is not torch.Tensor or tensor.requires_grad or not tensor.is_contiguous()
                or tensor.device != device or tensor.untyped_storage().data_ptr() != storage.data_ptr()
                or tensor.data_ptr() - start != entry.offset):
            return None
    byte_offset = start - storage.data_ptr()
    if byte_offset < 0 or byte_offset + layout.num_bytes > storage.nbytes():
        return None
    buffer = torch.empty(0, dtype=torch.uint8, device=device)
    return buffer.set_(storage, byte_offset, (layout.num_bytes,), (1,))  # (num_bytes,)
