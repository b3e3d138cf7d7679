"""A session's model kept on its worker's device across steps, its parameters views of flat buffers.

A worker builds a session's model once and keeps it where it computes (``cuda:0``, or the CPU).
Its parameters are re-homed into flat device buffers laid out as the parameter sets arrive
(:class:`~psg_wire.flat.FlatLayout`): one buffer for the parameters every version carries, one for
the frozen ones (a LoRA run's base model), which change only with their frozen version. Loading a
new version is then one copy of one host buffer into one device buffer (asynchronous from pinned
host memory), not a copy per parameter.

>>> import torch
>>> from psg_wire.flat import FlatTensors
>>> resident = ResidentModel(torch.nn.Linear(3, 2), torch.nn.MSELoss(), torch.device("cpu"))
>>> resident.load(FlatTensors.pack({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}), slot="varying")
>>> resident.model.weight.sum().item()
6.0
>>> resolve_device("cpu"), resolve_device("auto").type in ("cpu", "cuda")
(device(type='cpu'), True)
"""

from __future__ import annotations

import re

import torch
from torch import nn

from psg_core.errors import ConfigError
from psg_wire.flat import FlatTensors

__all__ = ["DEVICE_CHOICES", "ResidentModel", "check_device_name", "resolve_device"]

#: What ``--device`` accepts (besides ``cuda:<i>``).
DEVICE_CHOICES = ("auto", "cpu", "cuda")
_CUDA_INDEX = re.compile(r"cuda:(\d+)")


def check_device_name(name: str) -> str:
    """``name`` when it is ``auto``, ``cpu``, ``cuda`` or ``cuda:<i>``; :class:`ConfigError` otherwise
    (a syntax check: whether the device exists is :func:`resolve_device`'s to say)."""
    if name in DEVICE_CHOICES or _CUDA_INDEX.fullmatch(name):
        return name
    raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:<i>', got {name!r:.40}")


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means here: ``auto`` is the current CUDA device when torch sees one, else
    the CPU; ``cuda`` and ``cuda:<i>`` must exist (:class:`ConfigError` otherwise)."""
    check_device_name(name)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: torch sees no CUDA device")
    index = torch.cuda.current_device() if name in ("auto", "cuda") else int(name.split(":")[1])
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


class ResidentModel:
    """A model and its loss on ``device``, with the parameter versions it holds.

    Args:
        model: the session's model, already on ``device``.
        loss: its loss module.
        device: where it computes.
    """

    def __init__(self, model: nn.Module, loss: nn.Module, device: torch.device) -> None:
        self.model = model
        self.loss = loss
        self.device = device
        #: Version of the loaded parameters; -1 = none yet.
        self.version = -1
        #: Version whose push carried the loaded frozen parameters; -1 = none yet.
        self.frozen_from = -1
        #: How many times parameters were moved into a new device buffer (a slot's first load, or a
        #: changed layout): loads between two moves update the parameters in place, a move swaps
        #: their ``.data`` (a new signature for a recorded step, :class:`psg_core.CapturedStep`, whose
        #: CUDA graphs read the parameters by address; the runner makes its captured step anew).
        self.rehomes = 0
        self._buffers: dict[str, FlatTensors] = {}
        # Host buffers of copies that may still be in flight (CUDA copies from pinned memory are
        # asynchronous): kept alive until the slot's next load.
        self._sources: dict[str, FlatTensors] = {}

    def load(self, flat: FlatTensors, *, slot: str) -> None:
        """Copies ``flat`` (host or device) into the slot's device buffer: one copy, asynchronous
        from pinned memory. A slot whose layout changes (its first load) re-homes the parameters it
        names into a new device buffer, so that they are views of it from then on."""
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.layout != flat.layout:
            buffer = self._rehome(flat, slot)
        buffer.buffer.copy_(flat.buffer, non_blocking=True)  # (num_bytes,)
        self._sources[slot] = flat

    def _rehome(self, flat: FlatTensors, slot: str) -> FlatTensors:
        parameters = dict(self.model.named_parameters())
        unknown = [entry.name for entry in flat.layout.entries if entry.name not in parameters]
        if unknown:
            raise RuntimeError(f"ResidentModel.load: the model has no parameters {unknown[:8]}")
        for entry in flat.layout.entries:
            param = parameters[entry.name]
            if param.dtype != entry.dtype or tuple(param.shape) != entry.shape:
                raise RuntimeError(f"ResidentModel.load: parameter {entry.name!r} is {param.dtype} "
                                   f"{list(param.shape)}, the set holds {entry.dtype} {list(entry.shape)}")
        buffer = FlatTensors.empty(flat.layout, device=self.device)
        with torch.no_grad():
            for entry in flat.layout.entries:
                parameters[entry.name].data = buffer.view(entry)  # the parameter lives in the buffer now
        self._buffers[slot] = buffer
        self.rehomes += 1
        return buffer
