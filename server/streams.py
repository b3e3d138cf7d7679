"""Reading and writing the chunked streams of PushParameters and ComputeGradients.

Both request streams are a header message followed by tensor frames (see ``tensor.proto``); the
ComputeGradients reply is a stats message followed by tensor frames.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, TypeVar

import torch

from psg_core.errors import NonFiniteInputError
from psg_server.errors import InvalidRequestError, ParametersMissingError, StaleParametersError
from psg_server.executor import ParameterSet
from psg_server.sessions import Session
from psg_wire.codec import CodecLimits, FrameWire, TensorDecoder
from psg_wire.flat import FlatTensors

__all__ = ["all_finite", "pushed_bytes", "read_header", "read_tensors", "receive_parameters", "tensor_messages"]

Message = TypeVar("Message")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (always True for non-floating dtypes).

    A NaN or infinite element makes the sum NaN or infinite, so a finite sum proves the tensor
    finite in one cheap reduction; only a non-finite sum (which finite elements can also give, by
    overflow) needs the elementwise test.

    >>> all_finite(torch.tensor([1.0, 3e38, 3e38])), all_finite(torch.tensor([1.0, float("nan")]))
    (True, False)
    """
    if not tensor.is_floating_point():
        return True
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


async def read_header(requests: AsyncIterator[Any], *, rpc: str) -> Any:
    """The first message's ``header``; :class:`InvalidRequestError` when the stream starts otherwise."""
    async for message in requests:
        if message.WhichOneof("frame") != "header":
            raise InvalidRequestError(f"{rpc}: the first message must be the header, got "
                                      f"{message.WhichOneof('frame')!r}")
        return message.header
    raise InvalidRequestError(f"{rpc}: the request stream is empty")


async def read_tensors(requests: AsyncIterator[Any], decoder: TensorDecoder) -> dict[str, torch.Tensor]:
    """Feeds every remaining message to ``decoder`` and returns the finished tensors."""
    async for message in requests:
        decoder.add_message(message)
    return decoder.finish()


async def receive_parameters(requests: AsyncIterator[Any], session: Session, version: int,
                             limits: CodecLimits) -> ParameterSet:
    """Decodes a parameter set for ``session``, refusing any tensor that does not match the
    model's parameters before allocating it.

    Every trainable parameter must come; the frozen ones come all together (they replace the
    session's) or not at all (the session's are kept, without a copy), as ``PushParametersRequest``
    says. :class:`ParametersMissingError` when none came and the session holds none.
    """
    if version <= session.latest_version:
        raise StaleParametersError(f"PushParameters: version {version} is not newer than the session's "
                                   f"version {session.latest_version}")
    expected = {p.name: p for p in session.parameter_info}

    def check(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        info = expected.get(name)
        if info is None:
            raise InvalidRequestError(f"PushParameters: model {session.spec.model!r} has no parameter "
                                      f"{name!r}")
        if dtype != info.dtype or shape != info.shape:
            raise InvalidRequestError(f"PushParameters: parameter {name!r} must be {info.dtype} "
                                      f"{list(info.shape)}, got {dtype} {list(shape)}")

    tensors = await read_tensors(requests, TensorDecoder(limits, check_header=check))
    missing = [name for name, info in expected.items() if info.requires_grad and name not in tensors]
    if missing:
        raise InvalidRequestError(f"PushParameters: the parameter set lacks the trainable parameters "
                                  f"{_some(missing)}")
    frozen = [name for name, info in expected.items() if not info.requires_grad]
    sent = [name for name in frozen if name in tensors]
    if sent and len(sent) != len(frozen):
        raise InvalidRequestError(f"PushParameters: the set holds {len(sent)} of the {len(frozen)} frozen "
                                  f"parameters; send all of them (they replace the session's) or none (the "
                                  f"session keeps its own); missing {_some([n for n in frozen if n not in tensors])}")
    bad = [name for name, t in tensors.items() if not all_finite(t)]
    if bad:
        raise NonFiniteInputError(f"PushParameters: parameters {bad[:8]} contain NaN or infinity")
    if sent or not frozen:
        return ParameterSet(version=version, tensors=tensors, frozen_version=version)
    held = session.parameters
    if held is None:
        raise ParametersMissingError(f"PushParameters: session {session.id!r} holds no frozen parameters (none "
                                     "pushed yet, or the server dropped them); push them with the trainable ones")
    everything = {name: tensors[name] if name in tensors else held.tensors[name] for name in expected}
    return ParameterSet(version=version, tensors=everything, frozen_version=held.frozen_from)


def pushed_bytes(session: Session, parameters: ParameterSet) -> int:
    """Bytes of the tensors the push of ``parameters`` carried: the trainable ones, and the
    frozen ones when that push sent them."""
    sent_frozen = parameters.frozen_from == parameters.version
    return sum(info.num_bytes for info in session.parameter_info if info.requires_grad or sent_frozen)


def _some(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"


def tensor_messages(message_type: type[Message], named: Iterable[tuple[str, torch.Tensor]] | FlatTensors, *,
                    chunk_bytes: int, group: bool = False) -> Iterator[Message | bytes]:
    """``message_type(tensor=...)`` for every tensor header of ``named`` and, for every chunk, the
    serialised ``message_type(chunk=...)`` as ``bytes`` (see :class:`~psg_wire.codec.FrameWire`;
    the method's response serialiser passes them through); with ``group`` (always for
    :class:`~psg_wire.flat.FlatTensors`), one serialised group frame and its chunks."""
    return FrameWire(message_type).messages(named, chunk_bytes=chunk_bytes, group=group)
