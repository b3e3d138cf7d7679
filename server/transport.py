"""How values cross Ray's object store between the frontend and the worker actors.

Shards, parameter sets and results travel as :class:`TensorPayload`: their CPU tensors pickle as
raw out-of-band buffers, which Ray writes straight into the object store, instead of torch's own
pickling (a ``torch.save`` archive per storage, copied in band, and a view's whole storage with
it). That is one copy on each side of the wire, and a shard that is a view of the batch sends only
its own rows.

The rest is the frontend's side of the store: :func:`put` (blocking, so callers run it on a
thread), :func:`as_future` (an object reference awaited without a blocking ``ray.get``),
:func:`cancel`, and :class:`ParameterRefs`, which puts each (session, version) parameter set once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import numpy as np
import ray
import torch
from ray import exceptions as ray_errors

from psg_server.executor import ParameterSet, Shard

__all__ = ["ParameterRefs", "TensorPayload", "as_future", "cancel", "put"]

logger = logging.getLogger(__name__)


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


class ParameterRefs:
    """The object-store reference of each session's current parameter set: one ``ray.put`` per
    (session, version), however many shards and steps use it."""

    def __init__(self) -> None:
        # session id -> (version, reference of the ParameterSet in the object store)
        self._refs: dict[str, tuple[int, ray.ObjectRef]] = {}

    async def get(self, session_id: str, parameters: ParameterSet) -> ray.ObjectRef:
        """The reference of ``parameters``, put (on a thread) unless already there."""
        cached = self._refs.get(session_id)
        if cached is not None and cached[0] == parameters.version:
            return cached[1]
        ref = await asyncio.get_running_loop().run_in_executor(None, put, parameters)
        self._refs[session_id] = (parameters.version, ref)
        return ref

    def drop(self, session_id: str) -> None:
        """Forgets the session's reference (the object store frees the set once unreferenced)."""
        self._refs.pop(session_id, None)

    def clear(self) -> None:
        """Forgets every reference."""
        self._refs.clear()


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


def _pack(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _PackedTensor(value) if _packable(value) else value
    if type(value) in (tuple, list):
        return type(value)(_pack(item) for item in value)
    if type(value) is dict:
        return {key: _pack(item) for key, item in value.items()}
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
    flat = torch.from_numpy(np.array(raw, copy=True))  # (numel * itemsize,) uint8
    return flat.view(dtype).reshape(shape)


def _unpack_dataclass(cls: type, fields: dict[str, Any]) -> Any:
    return cls(**fields)
