"""Tensor wire codec: ``{name, dtype, shape, raw little-endian bytes}`` as a header plus chunks.

No pickle is involved anywhere: a tensor is its dtype name, its shape and its raw bytes. Encoding
yields a :class:`~psg_wire.v1.tensor_pb2.TensorHeader` followed by ``bytes`` chunks of at
most ``chunk_bytes``; decoding (:class:`TensorDecoder`) checks the dtype against :data:`DTYPES`,
``num_bytes == prod(shape) * itemsize`` and the declared sizes against :class:`CodecLimits`
*before* it allocates, then copies each chunk once into the tensor's buffer.

Several tensors can also travel as one *group* (``TensorGroup``): their headers, then their bytes
laid out as :class:`~psg_wire.flat.FlatLayout` says (each tensor at a 64-byte aligned offset), so a
whole parameter set or batch is a couple of messages and is decoded into one flat buffer.

The frames travel as the ``tensor``, ``group`` and ``chunk`` members of a stream message's
``frame`` oneof. :class:`FrameWire` serialises and parses those messages with a fast path for
chunk and group frames, which carry nearly all the bytes: the sender copies each payload once into
the serialised message and the receiver reads the payload in place, instead of protobuf's extra
copies on both sides.

>>> import torch
>>> frames = list(encode_tensors([("w", torch.arange(6.0).reshape(2, 3))], chunk_bytes=8))
>>> decoder = TensorDecoder(CodecLimits())
>>> for frame in frames:
...     decoder.add(frame)
>>> decoder.finish()["w"]
tensor([[0., 1., 2.],
        [3., 4., 5.]])
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from google.protobuf.descriptor import FieldDescriptor

from psg_core.errors import PsgError
from psg_wire.flat import ALIGNMENT, FlatLayout, FlatTensors
from psg_wire.v1.tensor_pb2 import TensorGroup, TensorHeader

__all__ = [
    "DTYPES",
    "DEFAULT_CHUNK_BYTES",
    "CodecError",
    "ChunkFrame",
    "CodecLimits",
    "FrameWire",
    "GroupFrame",
    "TensorLimitError",
    "TensorDecoder",
    "dtype_name",
    "encode_tensor",
    "encode_tensors",
]

#: The dtypes that may cross the wire, by their torch name without the ``torch.`` prefix.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

#: Chunk size used unless the caller asks for another (well under gRPC's 4 MiB default).
DEFAULT_CHUNK_BYTES = 1 << 20
_MAX_NAME_CHARS = 512
_MAX_DIMS = 16
_LITTLE_ENDIAN = sys.byteorder == "little"

#: A frame of an encoded tensor stream: a header, or a chunk of the current tensor's bytes.
Frame: TypeAlias = "TensorHeader | bytes"


class CodecError(PsgError, ValueError):
    """Malformed tensor data: unknown dtype, byte count that does not match the shape, truncated
    or excess bytes, duplicate names, frames out of order."""


class TensorLimitError(PsgError, ValueError):
    """A declared tensor (or the request as a whole) is larger than the receiver's limits."""


@dataclass(frozen=True)
class CodecLimits:
    """What a :class:`TensorDecoder` accepts; checked against headers before allocating."""

    #: Largest single tensor, in bytes.
    max_tensor_bytes: int = 1 << 34
    #: Largest sum of tensor bytes in one stream.
    max_total_bytes: int = 1 << 36
    #: Most tensors in one stream.
    max_tensors: int = 100_000
    #: Largest chunk accepted (a sender may use smaller ones).
    max_chunk_bytes: int = 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype, or :class:`CodecError` when it may not cross the wire.

    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    name = _NAMES.get(dtype)
    if name is None:
        raise CodecError(f"dtype_name: dtype {dtype} cannot be sent; supported: {', '.join(DTYPES)}")
    return name


def _swap_bytes(buffer: bytearray, itemsize: int) -> bytearray:
    """Reverses the byte order of every ``itemsize``-byte element (big-endian hosts only)."""
    if itemsize == 1:
        return buffer
    swapped = bytearray(len(buffer))
    for i in range(itemsize):
        swapped[i::itemsize] = buffer[itemsize - 1 - i::itemsize]
    return swapped


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in little-endian row-major order; no copy for a contiguous CPU tensor."""
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)  # (numel,)
    if flat.numel() == 0:
        return memoryview(b"")
    data = flat.view(torch.uint8).numpy().data  # (numel * itemsize,), a view of the same bytes
    if not _LITTLE_ENDIAN:
        data = memoryview(_swap_bytes(bytearray(data), tensor.element_size()))
    return data


def _tensor_views(name: str, tensor: torch.Tensor, chunk_bytes: int) -> Iterator[TensorHeader | memoryview]:
    """The header of ``tensor``, then views (no copies) of its bytes, ``chunk_bytes`` at most each."""
    if chunk_bytes < 1:
        raise CodecError(f"encode_tensor: chunk_bytes must be >= 1, got {chunk_bytes}")
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"encode_tensor: {name!r} is a {type(tensor).__name__}, not a tensor")
    data = _raw_bytes(tensor)
    yield TensorHeader(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                       num_bytes=len(data))
    for start in range(0, len(data), chunk_bytes):
        yield data[start:start + chunk_bytes]


def encode_tensor(name: str, tensor: torch.Tensor, *,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Frame]:
    """Yields the header of ``tensor`` and then its bytes in chunks of at most ``chunk_bytes``.

    A tensor with no elements is a header alone.

    >>> [type(f).__name__ for f in encode_tensor("b", torch.zeros(3), chunk_bytes=8)]
    ['TensorHeader', 'bytes', 'bytes']
    """
    for frame in _tensor_views(name, tensor, chunk_bytes):
        yield frame if isinstance(frame, TensorHeader) else bytes(frame)


def encode_tensors(named: Iterable[tuple[str, torch.Tensor]], *,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Frame]:
    """:func:`encode_tensor` for each ``(name, tensor)`` in turn."""
    for name, tensor in named:
        yield from encode_tensor(name, tensor, chunk_bytes=chunk_bytes)


def _header(name: str, tensor: torch.Tensor) -> TensorHeader:
    return TensorHeader(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                        num_bytes=tensor.numel() * tensor.element_size())


_GAP = bytes(ALIGNMENT)


def _group_views(named: Iterable[tuple[str, torch.Tensor]] | FlatTensors
                 ) -> tuple[list[TensorHeader], list[memoryview | bytes]]:
    """The headers of a group and its bytes as pieces to concatenate (views of the tensors and
    zero gaps; for :class:`FlatTensors` on the CPU, one view of the whole buffer)."""
    if isinstance(named, FlatTensors):
        headers = [TensorHeader(name=e.name, dtype=dtype_name(e.dtype), shape=list(e.shape), num_bytes=e.num_bytes)
                   for e in named.layout.entries]
        return headers, [_raw_bytes(named.buffer)]
    pairs = list(named)
    for name, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            raise CodecError(f"encode_group: {name!r} is a {type(tensor).__name__}, not a tensor")
    layout = FlatLayout.of((name, tensor.dtype, tensor.shape) for name, tensor in pairs)
    pieces: list[memoryview | bytes] = []
    end = 0
    for entry, (name, tensor) in zip(layout.entries, pairs):
        if entry.offset > end:
            pieces.append(_GAP[:entry.offset - end])
        pieces.append(_raw_bytes(tensor))
        end = entry.offset + entry.num_bytes
    return [_header(name, tensor) for name, tensor in pairs], pieces


def _split(pieces: list[memoryview | bytes], chunk_bytes: int) -> Iterator[list[memoryview | bytes]]:
    """``pieces`` regrouped into runs of exactly ``chunk_bytes`` (the last one shorter), as views."""
    current: list[memoryview | bytes] = []
    filled = 0
    for piece in pieces:
        view = memoryview(piece)
        start = 0
        while start < len(view):
            take = min(chunk_bytes - filled, len(view) - start)
            current.append(view[start:start + take])
            filled += take
            start += take
            if filled == chunk_bytes:
                yield current
                current, filled = [], 0
    if current:
        yield current


def encode_group(named: Iterable[tuple[str, torch.Tensor]] | FlatTensors, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[TensorGroup | bytes]:
    """The tensors as one group: a :class:`TensorGroup` holding every header and the first
    ``chunk_bytes`` of their bytes, then the rest in chunks of at most ``chunk_bytes``.

    >>> frames = list(encode_group([("a", torch.ones(3)), ("b", torch.zeros(2))], chunk_bytes=64))
    >>> [h.name for h in frames[0].tensors], len(frames[0].data), [len(f) for f in frames[1:]]
    (['a', 'b'], 64, [8])
    """
    if chunk_bytes < 1:
        raise CodecError(f"encode_group: chunk_bytes must be >= 1, got {chunk_bytes}")
    headers, pieces = _group_views(named)
    chunks = _split(pieces, chunk_bytes)
    first = next(chunks, [])
    yield TensorGroup(tensors=headers, data=b"".join(first))
    for chunk in chunks:
        yield b"".join(chunk)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes | memoryview, offset: int) -> tuple[int, int] | None:
    """``(value, offset after it)`` of the varint at ``offset``, or None when it is cut short or
    longer than protobuf's 10 bytes."""
    value = shift = 0
    for position in range(offset, min(offset + 10, len(data))):
        byte = data[position]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position + 1
        shift += 7
    return None


class ChunkFrame:
    """A chunk frame read by :meth:`FrameWire.parse` without protobuf.

    It stands in for the message: ``WhichOneof("frame")`` is ``"chunk"`` and :attr:`chunk` is a
    view of the payload inside the received bytes, so :meth:`TensorDecoder.add_message` copies it
    once, into the tensor's buffer.
    """

    __slots__ = ("chunk",)

    def __init__(self, chunk: memoryview) -> None:
        #: The payload, a view into the received message (no copy).
        self.chunk = chunk

    def WhichOneof(self, oneof_group: str) -> str | None:  # noqa: N802 (protobuf's name)
        """``"chunk"`` for the ``frame`` oneof, as the message it stands for would answer."""
        return "chunk" if oneof_group == "frame" else None


class GroupFrame:
    """A group frame read by :meth:`FrameWire.parse` without protobuf.

    It stands in for the message and for its ``TensorGroup``: ``WhichOneof("frame")`` is
    ``"group"``, :attr:`group` is the frame itself, :attr:`tensors` the headers and :attr:`data` a
    view of the payload inside the received bytes (copied once, by the decoder, into the group's
    buffer).
    """

    __slots__ = ("data", "tensors")

    def __init__(self, tensors: list[TensorHeader], data: memoryview) -> None:
        self.tensors = tensors
        self.data = data

    @property
    def group(self) -> GroupFrame:
        """The ``TensorGroup`` of the message: this frame."""
        return self

    def WhichOneof(self, oneof_group: str) -> str | None:  # noqa: N802 (protobuf's name)
        """``"group"`` for the ``frame`` oneof, as the message it stands for would answer."""
        return "group" if oneof_group == "frame" else None


def _read_group(raw: memoryview, offset: int) -> GroupFrame | None:
    """The ``TensorGroup`` whose length-prefixed bytes start at ``offset`` and end ``raw``, or None
    when the bytes are anything else (protobuf then parses, or refuses, the message)."""
    read = _read_varint(raw, offset)
    if read is None or read[0] + read[1] != len(raw):
        return None
    position, end = read[1], len(raw)
    headers: list[TensorHeader] = []
    data = memoryview(b"")
    while position < end:
        key = _read_varint(raw, position)
        if key is None or key[0] & 7 != 2:
            return None  # only length-delimited fields here; anything else goes through protobuf
        size = _read_varint(raw, key[1])
        if size is None or size[1] + size[0] > end:
            return None
        field, value = key[0] >> 3, raw[size[1]:size[1] + size[0]]
        if field == 1:
            headers.append(TensorHeader.FromString(bytes(value)))
        elif field == 2:
            data = value  # the payload, in place
        position = size[1] + size[0]
    return GroupFrame(headers, data)


class FrameWire:
    """Serialises and parses a stream message type whose ``frame`` oneof has a ``bytes chunk`` field
    (``PushParametersRequest``, ``ComputeGradientsRequest``, ``ComputeGradientsResponse``).

    A chunk frame is written and read directly in protobuf's wire format (the field's tag, the
    payload's length as a varint, the payload), which is exactly what protobuf produces for a
    message holding only that field: the sender copies the payload once, the receiver not at all.
    Every other message goes through protobuf, and so does any received message that is not
    exactly one chunk field (protobuf then accepts or refuses it as usual).

    >>> from psg_wire.v1 import gradient_service_pb2 as pb
    >>> wire = FrameWire(pb.PushParametersRequest)
    >>> wire.chunk(b"abc") == pb.PushParametersRequest(chunk=b"abc").SerializeToString()
    True
    >>> bytes(wire.parse(wire.chunk(b"abc")).chunk)
    b'abc'
    """

    def __init__(self, message_type: Any) -> None:
        if not FrameWire.handles(message_type):
            raise TypeError(f"FrameWire: {message_type.DESCRIPTOR.full_name} has no 'bytes chunk' field in a "
                            "'frame' oneof")
        self.message_type = message_type
        number = message_type.DESCRIPTOR.fields_by_name["chunk"].number
        self._tag = _varint((number << 3) | 2)  # wire type 2: length-delimited
        group = message_type.DESCRIPTOR.fields_by_name.get("group")
        self._group_tag = (_varint((group.number << 3) | 2) if group is not None
                           and group.message_type.full_name == TensorGroup.DESCRIPTOR.full_name else None)
        self._from_string = message_type.FromString

    @staticmethod
    def handles(message_type: Any) -> bool:
        """Whether ``message_type`` has a ``bytes chunk`` field in a ``frame`` oneof."""
        field = message_type.DESCRIPTOR.fields_by_name.get("chunk")
        oneof = field.containing_oneof if field is not None else None
        return (field is not None and field.type == FieldDescriptor.TYPE_BYTES and oneof is not None
                and oneof.name == "frame")

    def chunk(self, payload: bytes | memoryview) -> bytes:
        """The serialised ``message_type(chunk=payload)``."""
        return self._tag + _varint(len(payload)) + payload

    def group(self, headers: list[TensorHeader], data: list[memoryview | bytes]) -> bytes:
        """The serialised ``message_type(group=TensorGroup(tensors=headers, data=b"".join(data)))``,
        the payload copied once."""
        if self._group_tag is None:
            raise TypeError(f"FrameWire: {self.message_type.DESCRIPTOR.full_name} has no 'TensorGroup group' field")
        return b"".join(_field(self._group_tag, _group_body(headers, data)))

    def lead(self, field: str, message: Any, group_field: str, headers: list[TensorHeader],
             data: list[memoryview | bytes]) -> bytes:
        """The serialised ``message_type(**{field: message})`` with ``message``'s TensorGroup field
        ``group_field`` holding the group: a header (or a step's stats) and the first group in one
        message, the payload copied once."""
        outer = self.message_type.DESCRIPTOR.fields_by_name[field]
        inner = message.DESCRIPTOR.fields_by_name[group_field]
        pieces = [message.SerializeToString(), *_field(_varint((inner.number << 3) | 2), _group_body(headers, data))]
        return b"".join(_field(_varint((outer.number << 3) | 2), pieces))

    def messages(self, named: Iterable[tuple[str, torch.Tensor]] | FlatTensors, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, group: bool = False,
                 lead: tuple[str, Any, str] | None = None) -> Iterator[Any]:
        """The frames of :func:`encode_tensors`: ``message_type(tensor=header)`` for each header and
        serialised chunk messages (``bytes``, for :meth:`serialize`) for the chunks; with ``group``
        (always for :class:`FlatTensors`), those of :func:`encode_group`, serialised. ``lead``
        ``(field, message, group_field)`` puts the group frame inside ``message`` (see :meth:`lead`)."""
        if group or lead is not None or isinstance(named, FlatTensors):
            if chunk_bytes < 1:
                raise CodecError(f"encode_group: chunk_bytes must be >= 1, got {chunk_bytes}")
            headers, pieces = _group_views(named)
            chunks = _split(pieces, chunk_bytes)
            first = next(chunks, [])
            yield self.group(headers, first) if lead is None else self.lead(*lead, headers, first)
            for chunk in chunks:
                yield b"".join([self._tag, _varint(sum(len(piece) for piece in chunk)), *chunk])
            return
        tensor_message = self.message_type
        for name, tensor in named:
            for frame in _tensor_views(name, tensor, chunk_bytes):
                yield tensor_message(tensor=frame) if isinstance(frame, TensorHeader) else self.chunk(frame)

    @staticmethod
    def serialize(message: Any) -> bytes:
        """gRPC serializer: a message's bytes; ``bytes`` (from :meth:`chunk`) pass as they are."""
        return message if isinstance(message, bytes) else message.SerializeToString()

    def parse(self, raw: bytes) -> Any:
        """gRPC deserializer: a :class:`ChunkFrame` for a message that is exactly one chunk field, a
        :class:`GroupFrame` for one that is exactly one group field, otherwise
        ``message_type.FromString(raw)``."""
        tag = self._tag
        if raw.startswith(tag):
            read = _read_varint(raw, len(tag))
            if read is not None and read[0] + read[1] == len(raw):
                return ChunkFrame(memoryview(raw)[read[1]:])
        group_tag = self._group_tag
        if group_tag is not None and raw.startswith(group_tag):
            frame = _read_group(memoryview(raw), len(group_tag))
            if frame is not None:
                return frame
        return self._from_string(raw)


_HEADER_TAG = _varint((TensorGroup.DESCRIPTOR.fields_by_name["tensors"].number << 3) | 2)
_DATA_TAG = _varint((TensorGroup.DESCRIPTOR.fields_by_name["data"].number << 3) | 2)


def _field(tag: bytes, pieces: list[Any]) -> list[Any]:
    """A length-delimited field: its tag, the pieces' total length as a varint, the pieces."""
    return [tag, _varint(sum(len(piece) for piece in pieces)), *pieces]


def _group_body(headers: list[TensorHeader], data: list[memoryview | bytes]) -> list[Any]:
    """A serialised ``TensorGroup`` as pieces: each header, then the data field."""
    pieces = [part for header in headers for part in _field(_HEADER_TAG, [header.SerializeToString()])]
    return pieces + _field(_DATA_TAG, data)


#: Called with (name, dtype, shape) after the codec's own checks and before allocation; raises to
#: refuse a tensor (e.g. a parameter whose shape does not fit the model).
HeaderCheck = Callable[[str, torch.dtype, tuple[int, ...]], None]


class TensorDecoder:
    """Reassembles a stream of frames (headers, groups and chunks) into named tensors.

    Args:
        limits: sizes refused with :class:`TensorLimitError` before any allocation.
        check_header: optional extra validation of each header, run before allocation (for a group,
            on every header of the group before its buffer is allocated).
        pin_memory: allocate the buffers in pinned host memory (when torch sees CUDA), from which
            copies to a GPU are asynchronous.

    Frames arrive through :meth:`add` (a header, a group or a chunk) or :meth:`add_message` (a
    proto message whose ``frame`` oneof is ``tensor``, ``group`` or ``chunk``); :meth:`finish`
    returns the tensors in arrival order. The tensors of a group are views of one flat buffer
    (:meth:`~psg_wire.flat.FlatTensors.pack` finds it again without a copy).
    """

    def __init__(self, limits: CodecLimits, *, check_header: HeaderCheck | None = None,
                 pin_memory: bool = False) -> None:
        self._limits = limits
        self._check_header = check_header
        self._pin_memory = pin_memory and torch.cuda.is_available()
        self._tensors: dict[str, torch.Tensor] = {}
        self._total_bytes = 0
        # The tensor or group being filled: its layout, its buffer and how much has arrived.
        self._layout = FlatLayout(entries=(), num_bytes=0)
        self._buffer = torch.empty(0, dtype=torch.uint8)  # (num_bytes,)
        self._view = memoryview(b"")  # writable bytes of _buffer
        self._filled = 0
        self._open = False

    @property
    def total_bytes(self) -> int:
        """Bytes declared by the headers seen so far."""
        return self._total_bytes

    def add_message(self, message: object) -> None:
        """Feeds a message whose ``frame`` oneof holds ``tensor``, ``group`` or ``chunk``."""
        kind = message.WhichOneof("frame")  # type: ignore[attr-defined]
        if kind == "tensor":
            self.add(message.tensor)  # type: ignore[attr-defined]
        elif kind == "chunk":
            self.add(message.chunk)  # type: ignore[attr-defined]
        elif kind == "group":
            group = message.group  # type: ignore[attr-defined]
            self._start(list(group.tensors), group.data)
        else:
            raise CodecError(f"TensorDecoder: expected a tensor header, group or chunk frame, got {kind!r}")

    def add(self, frame: Frame | TensorGroup) -> None:
        """Feeds one header, one group or one chunk."""
        if isinstance(frame, TensorHeader):
            self._start([frame], b"")
        elif isinstance(frame, (bytes, bytearray, memoryview)):
            self._fill(frame)
        elif isinstance(frame, (TensorGroup, GroupFrame)):
            self._start(list(frame.tensors), frame.data)
        else:
            raise CodecError(f"TensorDecoder: unexpected frame of type {type(frame).__name__}")

    def finish(self) -> dict[str, torch.Tensor]:
        """Completes the stream; raises :class:`CodecError` when the last tensor is truncated."""
        self._close_current()
        return self._tensors

    # ------------------------------------------------------------------------------- internals
    def _check(self, header: TensorHeader, earlier: list[tuple[str, torch.dtype, tuple[int, ...]]]
               ) -> tuple[str, torch.dtype, tuple[int, ...]]:
        """Every check of one header, before anything is allocated for it; counts its bytes."""
        name = header.name
        if not name or len(name) > _MAX_NAME_CHARS:
            raise CodecError(f"TensorDecoder: tensor name must have 1..{_MAX_NAME_CHARS} characters, "
                             f"got {len(name)}")
        if name in self._tensors or any(name == other for other, _, _ in earlier):
            raise CodecError(f"TensorDecoder: tensor {name!r} appears twice")
        dtype = DTYPES.get(header.dtype)
        if dtype is None:
            raise CodecError(f"TensorDecoder: tensor {name!r} has unknown dtype {header.dtype[:40]!r}; "
                             f"supported: {', '.join(DTYPES)}")
        shape = tuple(int(d) for d in header.shape)
        if len(shape) > _MAX_DIMS or any(d < 0 for d in shape):
            raise CodecError(f"TensorDecoder: tensor {name!r} has invalid shape "
                             f"{list(shape)[:_MAX_DIMS + 1]}")
        expected = math.prod(shape) * dtype.itemsize  # Python ints: no overflow however large the shape
        if header.num_bytes != expected:
            raise CodecError(f"TensorDecoder: tensor {name!r} declares {header.num_bytes} bytes but "
                             f"{header.dtype}{list(shape)} needs {expected}")
        limits = self._limits
        if expected > limits.max_tensor_bytes:
            raise TensorLimitError(f"TensorDecoder: tensor {name!r} has {expected} bytes, more than "
                                   f"the limit of {limits.max_tensor_bytes}")
        if self._total_bytes + expected > limits.max_total_bytes:
            raise TensorLimitError(f"TensorDecoder: the tensors add up to more than the limit of "
                                   f"{limits.max_total_bytes} bytes (at {name!r})")
        if len(self._tensors) + len(earlier) + 1 > limits.max_tensors:
            raise TensorLimitError(f"TensorDecoder: more than {limits.max_tensors} tensors")
        if self._check_header is not None:
            self._check_header(name, dtype, shape)
        self._total_bytes += expected
        return name, dtype, shape

    def _start(self, headers: list[TensorHeader], data: bytes | memoryview) -> None:
        self._close_current()
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for header in headers:
            specs.append(self._check(header, specs))
        self._layout = layout = FlatLayout.of(specs)
        # Uninitialised (no zero-filling pass): the chunks must write every byte before finish().
        self._buffer = torch.empty(layout.num_bytes, dtype=torch.uint8, pin_memory=self._pin_memory)  # (num_bytes,)
        self._view = self._buffer.numpy().data if layout.num_bytes else memoryview(bytearray())
        self._filled = 0
        self._open = True
        if len(data):
            self._fill(data)

    def _fill(self, chunk: bytes | bytearray | memoryview) -> None:
        if not self._open:
            raise CodecError("TensorDecoder: a chunk arrived before any tensor header")
        if not isinstance(chunk, bytes):
            chunk = memoryview(chunk).cast("B")  # sizes in bytes, whatever the view's item format
        size = len(chunk)
        if size > self._limits.max_chunk_bytes:
            raise TensorLimitError(f"TensorDecoder: chunk of {size} bytes exceeds the limit of "
                                   f"{self._limits.max_chunk_bytes}")
        end = self._filled + size
        declared = len(self._view)
        if end > declared:
            raise CodecError(f"TensorDecoder: tensor {self._what()} received {end} bytes, more than "
                             f"the {declared} declared")
        self._view[self._filled:end] = chunk  # the one copy of these bytes on this side
        self._filled = end

    def _what(self) -> str:
        names = self._layout.names
        return repr(names[0]) if len(names) == 1 else f"group {list(names)[:4]}"

    def _close_current(self) -> None:
        if not self._open:
            return
        declared = len(self._view)
        if self._filled != declared:
            raise CodecError(f"TensorDecoder: tensor {self._what()} is truncated: {self._filled} of "
                             f"{declared} bytes arrived")
        self._open = False
        flat = FlatTensors(self._layout, self._buffer)
        for entry, tensor in zip(self._layout.entries, flat.views().values()):
            if not _LITTLE_ENDIAN and entry.num_bytes:
                swapped = _swap_bytes(bytearray(tensor.view(torch.uint8).numpy().data), entry.dtype.itemsize)
                tensor = torch.frombuffer(swapped, dtype=torch.uint8).view(entry.dtype).reshape(entry.shape)
            self._tensors[entry.name] = tensor
        self._buffer = torch.empty(0, dtype=torch.uint8)  # (0,)
        self._view = memoryview(b"")
