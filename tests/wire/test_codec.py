"""The tensor wire codec: exact round trips, and refusal of malformed or oversized data before
anything is allocated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from google.protobuf.message import DecodeError

from psg_wire.codec import (DTYPES, ChunkFrame, CodecError, CodecLimits, FrameWire, GroupFrame, TensorDecoder,
                            TensorLimitError, _swap_bytes, dtype_name, encode_group, encode_tensor, encode_tensors)
from psg_wire.flat import FlatTensors
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_wire.v1.tensor_pb2 import TensorGroup, TensorHeader


def roundtrip(named: list[tuple[str, torch.Tensor]], *, chunk_bytes: int = 7,
              limits: CodecLimits = CodecLimits()) -> dict[str, torch.Tensor]:
    decoder = TensorDecoder(limits)
    for frame in encode_tensors(named, chunk_bytes=chunk_bytes):
        decoder.add(frame)
    return decoder.finish()


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_whitelisted_dtype_round_trips_bit_exactly(dtype: torch.dtype) -> None:
    tensor = sample(dtype, (3, 5))
    out = roundtrip([("t", tensor)])["t"]
    assert out.dtype == dtype and out.shape == tensor.shape
    assert torch.equal(out.view(torch.uint8) if dtype != torch.bool else out,
                       tensor.view(torch.uint8) if dtype != torch.bool else tensor)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=4), chunk=st.integers(1, 64),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]))
def test_round_trip_for_any_shape_and_chunk_size(shape: list[int], chunk: int, dtype: torch.dtype) -> None:
    tensor = sample(dtype, tuple(shape))
    out = roundtrip([("a", tensor), ("b", tensor + 1 if dtype != torch.bool else tensor)], chunk_bytes=chunk)
    assert list(out) == ["a", "b"]
    assert out["a"].shape == tensor.shape and torch.equal(out["a"], tensor)


def test_non_contiguous_and_grad_tensors_are_sent_as_their_values() -> None:
    base = torch.randn(4, 6, requires_grad=True)
    view = base.t()[1:, ::2]  # non-contiguous view of a tensor that requires grad
    out = roundtrip([("v", view)])["v"]
    assert torch.equal(out, view.detach()) and not out.requires_grad


def test_chunks_respect_the_size_and_carry_exactly_num_bytes() -> None:
    frames = list(encode_tensor("w", torch.zeros(10, dtype=torch.float64), chunk_bytes=16))
    header, chunks = frames[0], frames[1:]
    assert isinstance(header, TensorHeader) and header.num_bytes == 80
    assert [len(c) for c in chunks] == [16] * 5
    assert list(encode_tensor("e", torch.zeros(0, 3))) == [TensorHeader(name="e", dtype="float32", shape=[0, 3])]


def test_unsupported_dtypes_are_refused_on_both_sides() -> None:
    with pytest.raises(CodecError, match="cannot be sent"):
        list(encode_tensor("c", torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(CodecError, match="unknown dtype 'complex64'"):
        TensorDecoder(CodecLimits()).add(TensorHeader(name="c", dtype="complex64", shape=[2], num_bytes=16))
    assert dtype_name(torch.int16) == "int16"


@pytest.mark.parametrize("header, message", [
    (TensorHeader(name="x", dtype="float32", shape=[3], num_bytes=11),
     "declares 11 bytes but float32\\[3\\] needs 12"),
    (TensorHeader(name="x", dtype="float32", shape=[-1, 4], num_bytes=0), "invalid shape"),
    (TensorHeader(name="", dtype="float32", shape=[1], num_bytes=4), "name must have"),
    (TensorHeader(name="x", dtype="float32", shape=[1] * 17, num_bytes=4), "invalid shape"),
])
def test_malformed_headers_are_refused(header: TensorHeader, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        TensorDecoder(CodecLimits()).add(header)


def test_truncated_excess_and_orphan_bytes_are_refused() -> None:
    header = TensorHeader(name="x", dtype="int32", shape=[2], num_bytes=8)
    truncated = TensorDecoder(CodecLimits())
    truncated.add(header)
    truncated.add(b"\x00" * 5)
    with pytest.raises(CodecError, match="truncated: 5 of 8 bytes"):
        truncated.finish()
    interrupted = TensorDecoder(CodecLimits())
    interrupted.add(header)
    with pytest.raises(CodecError, match="truncated"):
        interrupted.add(TensorHeader(name="y", dtype="int32", shape=[0], num_bytes=0))
    excess = TensorDecoder(CodecLimits())
    excess.add(header)
    with pytest.raises(CodecError, match="received 9 bytes, more than the 8 declared"):
        excess.add(b"\x00" * 9)
    with pytest.raises(CodecError, match="before any tensor header"):
        TensorDecoder(CodecLimits()).add(b"\x00")


def test_duplicate_names_are_refused() -> None:
    decoder = TensorDecoder(CodecLimits())
    decoder.add(TensorHeader(name="x", dtype="bool", shape=[0], num_bytes=0))
    with pytest.raises(CodecError, match="appears twice"):
        decoder.add(TensorHeader(name="x", dtype="bool", shape=[0], num_bytes=0))


def test_limits_are_checked_before_allocating() -> None:
    # 2**62 bytes could never be allocated: refusing it proves the check runs first.
    huge = TensorHeader(name="h", dtype="float32", shape=[1 << 60], num_bytes=1 << 62)
    with pytest.raises(TensorLimitError, match="more than the limit of 1024"):
        TensorDecoder(CodecLimits(max_tensor_bytes=1024)).add(huge)
    decoder = TensorDecoder(CodecLimits(max_total_bytes=100))
    decoder.add(TensorHeader(name="a", dtype="uint8", shape=[60], num_bytes=60))
    decoder.add(b"\x01" * 60)
    with pytest.raises(TensorLimitError, match="add up to more than the limit of 100"):
        decoder.add(TensorHeader(name="b", dtype="uint8", shape=[60], num_bytes=60))
    few = TensorDecoder(CodecLimits(max_tensors=1))
    few.add(TensorHeader(name="a", dtype="uint8", shape=[0], num_bytes=0))
    with pytest.raises(TensorLimitError, match="more than 1 tensors"):
        few.add(TensorHeader(name="b", dtype="uint8", shape=[0], num_bytes=0))
    big_chunk = TensorDecoder(CodecLimits(max_chunk_bytes=4))
    big_chunk.add(TensorHeader(name="a", dtype="uint8", shape=[8], num_bytes=8))
    with pytest.raises(TensorLimitError, match="chunk of 8 bytes"):
        big_chunk.add(b"\x00" * 8)


def test_header_check_runs_before_allocation_and_can_refuse() -> None:
    seen = []

    def check(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        seen.append((name, dtype, shape))
        raise CodecError(f"no {name}")

    decoder = TensorDecoder(CodecLimits(max_tensor_bytes=1 << 50, max_total_bytes=1 << 50), check_header=check)
    with pytest.raises(CodecError, match="no w"):
        decoder.add(TensorHeader(name="w", dtype="float16", shape=[1 << 40], num_bytes=1 << 41))
    assert seen == [("w", torch.float16, (1 << 40,))]


def test_decoded_tensors_own_writable_memory() -> None:
    out = roundtrip([("w", torch.arange(4.0))])["w"]
    out += 1  # the decoder's own uninitialised buffer, filled by the chunks: writable, no warning
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_swap_bytes_reverses_each_element_and_is_its_own_inverse() -> None:
    data = bytearray(range(8))
    assert _swap_bytes(data, 4) == bytearray([3, 2, 1, 0, 7, 6, 5, 4])
    assert _swap_bytes(_swap_bytes(data, 2), 2) == data
    assert _swap_bytes(data, 1) is data


def test_message_frames_must_be_tensor_or_chunk() -> None:
    decoder = TensorDecoder(CodecLimits())
    decoder.add_message(pb.PushParametersRequest(tensor=TensorHeader(name="z", dtype="int8", shape=[1], num_bytes=1)))
    decoder.add_message(pb.PushParametersRequest(chunk=b"\x05"))
    with pytest.raises(CodecError, match="got 'header'"):
        decoder.add_message(pb.PushParametersRequest(header=pb.PushParametersHeader(session_id="s")))
    assert decoder.finish()["z"].tolist() == [5]


def test_chunks_given_as_views_of_any_item_format_count_in_bytes() -> None:
    values = torch.arange(6, dtype=torch.float32)
    decoder = TensorDecoder(CodecLimits())
    decoder.add(TensorHeader(name="f", dtype="float32", shape=[6], num_bytes=24))
    decoder.add(memoryview(values[:4].numpy()))  # 4 float items, 16 bytes
    decoder.add(bytearray(values[4:].numpy().tobytes()))
    assert torch.equal(decoder.finish()["f"], values)


MESSAGE_TYPES = [pb.PushParametersRequest, pb.ComputeGradientsRequest, pb.ComputeGradientsResponse]


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 1 << 20])
def test_fast_chunk_frames_are_exactly_protobufs_encoding(message_type: type, size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    wire = FrameWire(message_type)
    raw = wire.chunk(memoryview(payload))
    assert raw == message_type(chunk=payload).SerializeToString()
    parsed = wire.parse(raw)
    assert isinstance(parsed, ChunkFrame) and parsed.WhichOneof("frame") == "chunk" and parsed.chunk == payload
    assert message_type.FromString(raw).chunk == payload


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_every_other_message_is_parsed_by_protobuf(message_type: type) -> None:
    wire = FrameWire(message_type)
    tensor = message_type(tensor=TensorHeader(name="w", dtype="float32", shape=[2], num_bytes=8))
    assert wire.serialize(tensor) == tensor.SerializeToString() and wire.parse(tensor.SerializeToString()) == tensor
    # A chunk field followed by more fields is not a lone chunk: protobuf decides (the last oneof member wins).
    two = wire.chunk(b"ab") + tensor.SerializeToString()
    assert wire.parse(two) == message_type.FromString(two) and wire.parse(two).WhichOneof("frame") == "tensor"
    for bad in (wire.chunk(b"abc")[:-1], b"\x1a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\xff\xff\xff\x0f\x12"):
        with pytest.raises(DecodeError):
            wire.parse(bad)
    with pytest.raises(TypeError, match="no 'bytes chunk' field"):
        FrameWire(pb.PushParametersHeader)


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), chunk=st.integers(1, 40))
def test_fast_frames_round_trip_through_the_decoder(shape: list[int], chunk: int) -> None:
    named = [("a", torch.randn(shape)), ("b", torch.arange(7, dtype=torch.int16))]
    wire = FrameWire(pb.ComputeGradientsResponse)
    decoder = TensorDecoder(CodecLimits())
    for message in wire.messages(named, chunk_bytes=chunk):
        decoder.add_message(wire.parse(wire.serialize(message)))
    out = decoder.finish()
    assert list(out) == ["a", "b"] and all(torch.equal(out[name], tensor) for name, tensor in named)


# ------------------------------------------------------------------------------------ groups
def group_named(shape: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.randn(shape)), ("flags", torch.tensor([True, False, True])),
            ("empty", torch.zeros(0, 3, dtype=torch.float16)), ("b", torch.arange(7, dtype=torch.int64))]


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), chunk=st.integers(1, 200))
def test_groups_round_trip_through_fast_frames(message_type: type, shape: list[int], chunk: int) -> None:
    named = group_named(shape)
    wire = FrameWire(message_type)
    decoder = TensorDecoder(CodecLimits())
    messages = list(wire.messages(named, chunk_bytes=chunk, group=True))
    for message in messages:
        decoder.add_message(wire.parse(wire.serialize(message)))
    out = decoder.finish()
    assert list(out) == [name for name, _ in named]
    assert all(out[name].dtype == tensor.dtype and torch.equal(out[name], tensor) for name, tensor in named)
    # One buffer for the whole group, laid out as FlatLayout says: packing it again copies nothing.
    flat = FlatTensors.pack(out)
    assert flat.buffer.data_ptr() == out["flags"].data_ptr() - flat.layout.entries[1].offset
    # The serialised group is protobuf's own encoding of it, and the bytes add up to the layout's.
    group = message_type.FromString(wire.serialize(messages[0])).group
    assert [h.name for h in group.tensors] == list(out)
    assert len(group.data) + sum(len(wire.parse(m).chunk) for m in messages[1:]) == flat.layout.num_bytes
    assert all(len(wire.parse(m).chunk) <= chunk for m in messages[1:]) and len(group.data) <= chunk


def test_group_frames_match_encode_group_and_protobuf() -> None:
    named = group_named([2, 3])
    frames = list(encode_group(named, chunk_bytes=40))
    wire = FrameWire(pb.ComputeGradientsRequest)
    messages = list(wire.messages(named, chunk_bytes=40, group=True))
    assert messages[0] == pb.ComputeGradientsRequest(group=frames[0]).SerializeToString()
    assert messages[1:] == [wire.chunk(frame) for frame in frames[1:]]
    parsed = wire.parse(messages[0])
    assert isinstance(parsed, GroupFrame) and parsed.WhichOneof("frame") == "group"
    assert list(parsed.tensors) == list(frames[0].tensors) and bytes(parsed.data) == frames[0].data
    # The gaps between tensors are zero bytes.
    decoder = TensorDecoder(CodecLimits())
    for frame in frames:
        decoder.add(frame)
    out = decoder.finish()
    flat = FlatTensors.pack(out)
    entries = flat.layout.entries
    gap = flat.buffer[entries[0].offset + entries[0].num_bytes:entries[1].offset]
    assert gap.numel() > 0 and not gap.any()


def test_flat_tensors_encode_as_one_group_without_copying_per_tensor() -> None:
    flat = FlatTensors.pack([("w", torch.randn(5, 3)), ("b", torch.randn(3))])
    wire = FrameWire(pb.ComputeGradientsResponse)
    decoder = TensorDecoder(CodecLimits())
    for message in wire.messages(flat, chunk_bytes=1 << 20):
        decoder.add_message(wire.parse(wire.serialize(message)))
    out = decoder.finish()
    assert all(torch.equal(out[name], tensor) for name, tensor in flat.views().items())


def test_a_group_is_checked_header_by_header_before_its_buffer_is_allocated() -> None:
    seen: list[str] = []

    def check(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        seen.append(name)
        if name == "second":
            raise CodecError(f"no {name}")

    huge = TensorHeader(name="first", dtype="float32", shape=[1 << 20, 1 << 10], num_bytes=4 << 30)
    group = TensorGroup(tensors=[huge, TensorHeader(name="second", dtype="int8", shape=[1], num_bytes=1)])
    decoder = TensorDecoder(CodecLimits(max_tensor_bytes=8 << 30, max_total_bytes=8 << 30), check_header=check)
    with pytest.raises(CodecError, match="no second"):
        decoder.add(group)  # 4 GiB declared first: refused before anything is allocated
    assert seen == ["first", "second"]
    limited = TensorDecoder(CodecLimits(max_total_bytes=100))
    with pytest.raises(TensorLimitError, match="add up"):
        limited.add(TensorGroup(tensors=[TensorHeader(name=f"t{i}", dtype="float32", shape=[10], num_bytes=40)
                                         for i in range(3)]))
    duplicate = TensorDecoder(CodecLimits())
    with pytest.raises(CodecError, match="appears twice"):
        duplicate.add(TensorGroup(tensors=[TensorHeader(name="x", dtype="int8", shape=[1], num_bytes=1)] * 2))


def test_truncated_and_excess_group_bytes_are_refused() -> None:
    headers = [TensorHeader(name="a", dtype="float32", shape=[2], num_bytes=8),
               TensorHeader(name="b", dtype="float32", shape=[2], num_bytes=8)]  # b at offset 64: 72 bytes
    short = TensorDecoder(CodecLimits())
    short.add(TensorGroup(tensors=headers, data=bytes(70)))
    with pytest.raises(CodecError, match="truncated"):
        short.finish()
    long = TensorDecoder(CodecLimits())
    long.add(TensorGroup(tensors=headers, data=bytes(70)))
    with pytest.raises(CodecError, match="more than"):
        long.add(bytes(3))


def test_group_messages_with_other_fields_go_through_protobuf() -> None:
    wire = FrameWire(pb.PushParametersRequest)
    group = pb.PushParametersRequest(group=TensorGroup(tensors=[TensorHeader(name="a", dtype="int8", shape=[1],
                                                                               num_bytes=1)], data=b"\x07"))
    raw = group.SerializeToString()
    assert isinstance(wire.parse(raw), GroupFrame)
    # A varint field inside the group (an unknown field of another wire type) is left to protobuf.
    odd = raw[:1] + bytes([raw[1] + 2]) + raw[2:] + b"\x18\x01"
    parsed = wire.parse(odd)
    assert not isinstance(parsed, GroupFrame) and parsed.group.data == b"\x07"
