"""How values cross Ray's object store between the frontend and the worker actors.

Shards, parameter sets and results travel as :class:`TensorPayload`: their CPU tensors pickle as
raw out-of-band buffers, which Ray writes straight into the object store, instead of torch's own
pickling (a ``torch.save`` archive per storage, copied in band, and a view's whole storage with
it). That is one copy on each side of the wire, and a shard that is a view of the batch sends only
its own rows.

The rest is the frontend's side of the store: :func:`put` (blocking, so callers run it on a
thread), :func:`as_future` (an object reference awaited without a blocking ``ray.get``),
:func:`cancel`, :func:`shard_argument` and :class:`ParameterRefs`. A parameter version travels as
:class:`ParameterArgs`: the flat buffer of the parameters every version carries, and the object
reference of the frozen ones (a LoRA run's base model), put once per frozen version. Values up to
:data:`INLINE_BYTES` ride inside the actor call itself (no ``ray.put``, no fetch by the worker);
larger ones are put once and passed by reference.

A worker on a GPU calls :func:`pin_unpacked_tensors`: the tensors it unpickles then land in pinned
host memory, from which its copies to the GPU are asynchronous.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray import exceptions as ray_errors

from psg_server.executor import ParameterSet, SessionSpec, Shard, ShardTimings
from psg_wire.flat import FlatLayout

__all__ = ["INLINE_BYTES", "ParameterArgs", "ParameterRefs", "TensorPayload", "as_future", "cancel", "pack_call",
           "pin_unpacked_tensors", "put", "shard_argument", "unpack"]

logger = logging.getLogger(__name__)

#: Values of at most this many tensor bytes travel inside the actor call (Ray inlines call arguments
#: below 100 KiB, pickled; a larger argument would be put by ``.remote()`` itself, on the event loop).
INLINE_BYTES = 64 * 1024

# Whether _unpack_tensor allocates pinned host memory (a GPU worker's process sets it).
_pinned = False


def pin_unpacked_tensors(enabled: bool) -> None:
    """Makes the tensors this process unpickles from :class:`TensorPayload` land in pinned (page
    locked) host memory, so that copying them to a GPU is asynchronous; a GPU worker turns it on."""
    global _pinned
    _pinned = enabled


class TensorPayload:
    """Wraps a value for the object store so that its CPU tensors travel as raw out-of-band bytes.

    Pickling with protocol 5 hands each tensor's bytes (only the bytes of the tensor itself, even
    for a view) to the pickler's buffer callback, which Ray uses to write them straight into the
    object store. Unpickling gives back the value itself, not the wrapper, with every tensor in
    fresh, writable memory. Tensors are found inside tuples, lists, dicts and dataclasses
    (:class:`~psg_server.executor.Shard`, :class:`~psg_server.executor.ParameterSet`,
    :class:`~psg_core.config.DPGradient`); other tensors (on a GPU, needing grad, sparse,
    quantized, subclasses) and other values pickle as usual.

    >>> import pickle
    >>> rows = torch.arange(8.0).view(4, 2)  # (4, 2)
    >>> shard = Shard(index=0, inputs=(rows[1:3],), targets=torch.tensor([1, 2]))
    >>> copy = pickle.loads(pickle.dumps(TensorPayload(shard), protocol=5))
    >>> type(copy).__name__, copy.inputs[0].tolist(), copy.targets.dtype
    ('Shard', [[2.0, 3.0], [4.0, 5.0]], torch.int64)
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _identity, (_pack(self.value),)


def put(value: Shard | ParameterSet) -> ray.ObjectRef:
    """Blocking: ``value`` into the object store, its tensors as raw out-of-band bytes."""
    return ray.put(TensorPayload(value))


def as_future(ref: ray.ObjectRef) -> asyncio.Future[Any]:
    """An asyncio future of an object reference (no blocking ``ray.get``)."""
    return asyncio.wrap_future(ref.future())


def cancel(ref: ray.ObjectRef) -> None:
    """Cancels the task behind ``ref``; quiet when it finished or its worker is gone."""
    try:
        ray.cancel(ref)
    except (ray_errors.RayError, ValueError) as error:
        logger.debug("transport: cancel: %s", error)


@dataclass(frozen=True)
class ParameterArgs:
    """A parameter version as an actor call carries it (see the module docstring).

    ``varying`` is the flat buffer of the parameters every version carries (a
    :class:`TensorPayload`), or a 1-tuple holding its object reference when it is larger than
    :data:`INLINE_BYTES`; ``fixed`` a 1-tuple holding the reference of the frozen parameters, or
    None when the session has none. References travel inside tuples, which Ray does not resolve: a
    worker fetches them only when its resident model lacks that version (or frozen version).
    """

    version: int
    frozen_from: int
    varying: TensorPayload | tuple[ray.ObjectRef]
    fixed: tuple[ray.ObjectRef] | None = None

    def fetch(self, *, frozen: bool) -> ParameterSet:
        """Blocking (in a worker): the parameter set, with the frozen parameters when ``frozen``."""
        varying = _resolve(self.varying)
        fixed = _resolve(self.fixed) if frozen and self.fixed is not None else None
        tensors = {**varying.views(), **(fixed.views() if fixed is not None else {})}
        return ParameterSet(version=self.version, tensors=tensors, frozen_version=self.frozen_from,
                            frozen=frozenset(fixed.layout.names) if fixed is not None else frozenset())


def _resolve(value: Any) -> Any:
    value = value[0] if isinstance(value, tuple) else value
    if isinstance(value, ray.ObjectRef):
        return ray.get(value)
    return value.value if isinstance(value, TensorPayload) else value


class ParameterRefs:
    """The frontend's :class:`ParameterArgs` of each session: the varying parameters put (when
    large) once per (session, version), the frozen ones once per (session, frozen version), however
    many shards and steps use them."""

    def __init__(self) -> None:
        # session id -> (version, what carries the varying parameters of that version)
        self._varying: dict[str, tuple[int, TensorPayload | tuple[ray.ObjectRef]]] = {}
        # session id -> (frozen version, the frozen parameters' reference)
        self._fixed: dict[str, tuple[int, tuple[ray.ObjectRef]]] = {}

    async def arguments(self, session_id: str, parameters: ParameterSet) -> ParameterArgs:
        """The call arguments of ``parameters``; what is not in the store yet is put (on a thread)."""
        loop = asyncio.get_running_loop()
        held = self._varying.get(session_id)
        if held is None or held[0] != parameters.version:
            varying = parameters.varying
            payload = TensorPayload(varying)
            carried = payload if varying.layout.num_bytes <= INLINE_BYTES else \
                (await loop.run_in_executor(None, ray.put, payload),)
            held = self._varying[session_id] = (parameters.version, carried)
        fixed = None
        if parameters.fixed is not None:
            frozen = self._fixed.get(session_id)
            if frozen is None or frozen[0] != parameters.frozen_from:
                ref = await loop.run_in_executor(None, ray.put, TensorPayload(parameters.fixed))
                frozen = self._fixed[session_id] = (parameters.frozen_from, (ref,))
            fixed = frozen[1]
        return ParameterArgs(version=parameters.version, frozen_from=parameters.frozen_from, varying=held[1],
                             fixed=fixed)

    def drop(self, session_id: str) -> None:
        """Forgets the session's references (the object store frees them once unreferenced)."""
        self._varying.pop(session_id, None)
        self._fixed.pop(session_id, None)

    def clear(self) -> None:
        """Forgets every reference."""
        self._varying.clear()
        self._fixed.clear()


def pack_call(spec: Any, parameters: ParameterArgs, shard: TensorPayload | ray.ObjectRef) -> bytes | None:
    """A whole shard call as one pickled blob when everything rides inside it (small parameters,
    small shard, no frozen parameters by reference), else None. One argument pickled once by the
    standard pickler costs Ray's serializer a fraction of four arguments through cloudpickle: on a
    small step, a large part of the pool's fixed cost."""
    if not isinstance(shard, TensorPayload) or not isinstance(parameters.varying, TensorPayload) \
            or parameters.fixed is not None:
        return None
    return pickle.dumps(TensorPayload((spec, parameters, shard.value)), protocol=5)


def unpack(blob: bytes) -> Any:
    """The value :func:`pack_call` (or a worker's packed reply) pickled."""
    return pickle.loads(blob)


async def shard_argument(shard: Shard) -> TensorPayload | ray.ObjectRef:
    """What an actor call carries for ``shard``: the shard itself when small (inside the call), else
    its object reference (put on a thread), which Ray resolves before the call runs."""
    size = sum(t.numel() * t.element_size() for t in (*shard.inputs, shard.targets))
    if size <= INLINE_BYTES:
        return TensorPayload(shard)
    return await asyncio.get_running_loop().run_in_executor(None, put, shard)


class _PackedTensor:
    """A tensor pickled as (raw bytes as a flat uint8 array, dtype, shape)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray, torch.dtype, tuple[int, ...]]]:
        dense = self.tensor.detach().resolve_conj().resolve_neg().contiguous()
        raw = dense.reshape(-1).view(torch.uint8).numpy()  # (numel * itemsize,), shares dense's memory
        return _unpack_tensor, (raw, dense.dtype, tuple(dense.shape))


class _PackedDataclass:
    """A dataclass instance pickled as its class and its (packed) init fields."""

    __slots__ = ("cls", "fields")

    def __init__(self, cls: type, fields: dict[str, Any]) -> None:
        self.cls = cls
        self.fields = fields

    def __reduce__(self) -> tuple[Any, tuple[type, dict[str, Any]]]:
        return _unpack_dataclass, (self.cls, self.fields)


def _packable(tensor: torch.Tensor) -> bool:
    return (type(tensor) is torch.Tensor and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and not tensor.requires_grad and not tensor.is_quantized)


#: Dataclasses that never hold tensors: pickled as they are (the standard pickler restores them
#: without calling __init__), not field by field through _PackedDataclass.
_TENSOR_FREE: tuple[type, ...] = (SessionSpec, ShardTimings, FlatLayout)


def _pack(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _PackedTensor(value) if _packable(value) else value
    if type(value) in (tuple, list):
        return type(value)(_pack(item) for item in value)
    if type(value) is dict:
        return {key: _pack(item) for key, item in value.items()}
    if isinstance(value, _TENSOR_FREE):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        if all(f.init for f in fields):
            return _PackedDataclass(type(value), {f.name: _pack(getattr(value, f.name)) for f in fields})
    return value


def _identity(value: Any) -> Any:
    return value


def _unpack_tensor(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # ``raw`` may be a read-only view of the object store: copy it out (which also lets the store
    # free the object) into memory torch owns.
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    if _pinned:
        flat = torch.empty(raw.size, dtype=torch.uint8, pin_memory=True)  # (numel * itemsize,)
        flat.numpy()[:] = raw
    else:
        flat = torch.from_numpy(np.array(raw, copy=True))  # (numel * itemsize,) uint8
    return flat.view(dtype).reshape(shape)


def _unpack_dataclass(cls: type, fields: dict[str, Any]) -> Any:
    return cls(**fields)
