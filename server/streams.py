"""Reading and writing the chunked streams of PushParameters and ComputeGradients.

Both request streams are a header message followed by tensor frames (see ``tensor.proto``); the
ComputeGradients reply is a stats message followed by tensor frames.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from psg_core.errors import NonFiniteInputError
from psg_server.errors import InvalidRequestError, ParametersMissingError
from psg_server.executor import ParameterSet
from psg_server.models import ParameterInfo
from psg_server.sessions import Session, SessionStore
from psg_wire.codec import CodecLimits, FrameWire, HeaderCheck, TensorDecoder
from psg_wire.flat import FlatLayout, FlatTensors

__all__ = ["all_finite", "check_push_version", "parameter_check", "parameter_set", "push_parameters", "pushed_bytes",
           "read_header", "read_tensors", "tensor_messages"]

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


async def read_tensors(requests: AsyncIterator[Any], decoder: TensorDecoder, header: Any = None
                       ) -> dict[str, torch.Tensor]:
    """Feeds the group the ``header`` carries (if any) and every remaining message to ``decoder``
    and returns the finished tensors."""
    if header is not None and header.HasField("group"):
        decoder.add(header.group)
    async for message in requests:
        decoder.add_message(message)
    return decoder.finish()


def check_push_version(session: Session, version: int, *, rpc: str) -> None:
    """A push's version, checked when its header arrives, before the upload: not above
    :data:`~psg_server.sessions.MAX_PARAMETER_VERSION` (:class:`InvalidRequestError`), newer than
    every version pushed before (:class:`~psg_server.errors.StaleParametersError`). Only a fast
    refusal: :meth:`SessionStore.store_parameters` checks again when it stores the set, since
    another push may have been stored during the upload."""
    session.check_new_version(version, rpc=rpc)


def parameter_check(session: Session, *, rpc: str) -> HeaderCheck:
    """Header check of a pushed parameter, before its bytes are allocated: a parameter of the model,
    in its dtype and shape; a floating one in the session's parameter wire dtype when it has one."""
    expected = {p.name: p for p in session.parameter_info}
    wire = session.wire.parameters

    def check(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        info = expected.get(name)
        if info is None:
            raise InvalidRequestError(f"{rpc}: model {session.spec.model!r} has no parameter "
                                      f"{name[:200]!r}")
        wanted = wire if wire is not None and info.dtype.is_floating_point else info.dtype
        if dtype != wanted or shape != info.shape:
            raise InvalidRequestError(f"{rpc}: parameter {name!r} must be {wanted} "
                                      f"{list(info.shape)}, got {dtype} {list(shape)}")
    return check


def parameter_set(session: Session, version: int, tensors: Mapping[str, torch.Tensor], *,
                  rpc: str) -> ParameterSet:
    """The session's :class:`ParameterSet` of version ``version`` from the decoded ``tensors``
    (checked by :func:`parameter_check`), cast back from the wire dtype if the session has one.

    Every trainable parameter must come; the frozen ones come all together (they replace the
    session's) or not at all (the session's are kept, without a copy), as ``PushParametersRequest``
    says. :class:`ParametersMissingError` when none came and the session holds none.
    """
    expected = {p.name: p for p in session.parameter_info}
    missing = [name for name, info in expected.items() if info.requires_grad and name not in tensors]
    if missing:
        raise InvalidRequestError(f"{rpc}: the parameter set lacks the trainable parameters {_some(missing)}")
    frozen = [name for name, info in expected.items() if not info.requires_grad]
    sent = [name for name in frozen if name in tensors]
    if sent and len(sent) != len(frozen):
        raise InvalidRequestError(f"{rpc}: the set holds {len(sent)} of the {len(frozen)} frozen "
                                  f"parameters; send all of them (they replace the session's) or none (the "
                                  f"session keeps its own); missing {_some([n for n in frozen if n not in tensors])}")
    bad = _non_finite(tensors)
    if bad:
        raise NonFiniteInputError(f"{rpc}: parameters {bad[:8]} contain NaN or infinity")
    if session.wire.parameters is not None:
        tensors = _widened(tensors, expected)
    if sent or not frozen:
        return ParameterSet(version=version, tensors=tensors, frozen_version=version, frozen=frozenset(frozen))
    held = session.parameters
    if held is None:
        raise ParametersMissingError(f"{rpc}: session {session.id!r} holds no frozen parameters (none "
                                     "pushed yet, or the server dropped them); push them with the trainable ones")
    everything = {name: tensors[name] if name in tensors else held.tensors[name] for name in expected}
    return ParameterSet(version=version, tensors=everything, frozen_version=held.frozen_from,
                        frozen=frozenset(frozen))


def _non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors holding NaN or infinity: one check over the whole buffer when they lie
    in one (a decoded group; its gaps are zeros), tensor by tensor otherwise or to name them."""
    flat = FlatTensors.find(tensors) if tensors else None
    typed = flat.typed() if flat is not None else None
    if typed is not None and all_finite(typed):
        return []
    return [name for name, t in tensors.items() if not all_finite(t)]


def _widened(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, ParameterInfo]) -> dict[str, torch.Tensor]:
    """The tensors in their parameters' dtypes, one flat buffer per group of the push (the trainable
    ones, the frozen ones), so they still travel on as one buffer each: one cast-copy per byte."""
    out: dict[str, torch.Tensor] = {}
    for trainable in (True, False):
        names = [name for name in tensors if expected[name].requires_grad == trainable]
        if not names:
            continue
        flat = FlatTensors.empty(FlatLayout.of((name, expected[name].dtype, expected[name].shape) for name in names))
        for name, view in flat.views().items():
            out[name] = view.copy_(tensors[name])
    return {name: out[name] for name in tensors}


async def push_parameters(requests: AsyncIterator[Any], store: SessionStore, session: Session, header: Any,
                          limits: CodecLimits, *, pin_memory: bool = False) -> ParameterSet:
    """PushParameters: decodes the parameter set a ``PushParametersHeader`` announces for
    ``session``, refusing any tensor that does not match the model's parameters before allocating
    it, then, under the session's lock, builds the set (:func:`parameter_set`: the frozen tensors it
    keeps are those held then) and stores it (:meth:`SessionStore.store_parameters`, which checks the
    version again). Returns the stored set."""
    check_push_version(session, header.version, rpc="PushParameters")  # before the upload
    decoder = TensorDecoder(limits, check_header=parameter_check(session, rpc="PushParameters"),
                            pin_memory=pin_memory)
    tensors = await read_tensors(requests, decoder, header)
    async with session.lock:
        parameters = parameter_set(session, header.version, tensors, rpc="PushParameters")
        store.store_parameters(session, parameters, rpc="PushParameters")
    return parameters


def pushed_bytes(session: Session, parameters: ParameterSet) -> int:
    """Bytes of the tensors the push of ``parameters`` carried: the trainable ones, and the
    frozen ones when that push sent them."""
    sent_frozen = parameters.frozen_from == parameters.version
    wire = session.wire.parameters
    return sum(math.prod(info.shape) * wire.itemsize if wire is not None and info.dtype.is_floating_point
               else info.num_bytes for info in session.parameter_info if info.requires_grad or sent_frozen)


def _some(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"


def tensor_messages(message_type: type[Message], named: Iterable[tuple[str, torch.Tensor]] | FlatTensors, *,
                    chunk_bytes: int, group: bool = False, lead: tuple[str, Any, str] | None = None
                    ) -> Iterator[Message | bytes]:
    """``message_type(tensor=...)`` for every tensor header of ``named`` and, for every chunk, the
    serialised ``message_type(chunk=...)`` as ``bytes`` (see :class:`~psg_wire.codec.FrameWire`;
    the method's response serialiser passes them through); with ``group`` (always for
    :class:`~psg_wire.flat.FlatTensors`), one serialised group frame and its chunks, the group
    inside ``lead``'s message when given (:meth:`~psg_wire.codec.FrameWire.lead`)."""
    return FrameWire(message_type).messages(named, chunk_bytes=chunk_bytes, group=group, lead=lead)
