"""Recurrent layers rebuilt from Linear cells: DPRNN, DPGRU, DPLSTM and their cells.

torch's ``nn.RNN``/``nn.GRU``/``nn.LSTM`` run one fused kernel over the whole sequence, which
hooks cannot see into. Here every layer and direction owns a cell made of two
:class:`RNNLinear` layers, ``ih`` (input to hidden) and ``hh`` (hidden to hidden), so each
parameter gets per-sample gradients from the Linear grad sampler.

Per layer and direction, ``ih`` runs once on the whole batch-first sequence ``(B, T, F)``; the
time loop runs outside autograd with a hand-written backward (:mod:`psg_core.layers._recurrence`),
and ``hh`` is called once on the ``(B, T, H)`` states the loop read, returning the values the
loop computed. Variable-length (packed) batches keep every sample in every step, in the caller's
sample order, and mask the update: a sample's state stops changing after its last step and its
outputs there are zero, so the reverse direction starts at each sequence's own last step, as in
torch.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Union, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from psg_core._layout import ALWAYS_BATCH_FIRST, STATE_BATCH_AXIS
from psg_core.errors import ConfigError, UnsupportedModuleError
import psg_core.layers._recurrence as _recurrence
from psg_core.provenance import UNKNOWN, active_tracker, rowwise

__all__ = ["RNNLinear", "DPRNNCell", "DPGRUCell", "DPLSTMCell", "DPRNN", "DPGRU", "DPLSTM"]

logger = logging.getLogger(__name__)

#: A recurrent state: ``h`` for RNN and GRU, ``(h, c)`` for LSTM.
State = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

_TORCH_KEY = re.compile(r"^(weight|bias)_(ih|hh)(_l\d+(?:_reverse)?)?$")


class RNNLinear(nn.Linear):
    """An ``nn.Linear`` whose input is batch-first whatever the model's layout.

    The recurrent layers call it on ``(B, features)`` steps or ``(B, T, features)`` sequences even
    when the model is ``batch_first=False``; the class attribute named by
    :data:`psg_core._layout.ALWAYS_BATCH_FIRST` tells the hooks backend so.

    >>> RNNLinear(3, 2)(torch.zeros(4, 3)).shape
    torch.Size([4, 2])
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The recurrence computed hh(h_prev) step by step already: use it (_recurrence.known_output).
        known = _recurrence.known_linear(self, input)
        if known is None:  # oneDNN's product where psg.gemm picks it (the input projection)
            known = _recurrence.fast_linear(self, input)
        return super().forward(input) if known is None else known


setattr(RNNLinear, ALWAYS_BATCH_FIRST, True)


def _torch_keys_to_cell_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                             *args: Any) -> None:
    """Renames torch keys: ``weight_ih_l0_reverse`` -> ``l0_reverse.ih.weight``, and a torch
    cell's ``weight_ih`` -> ``ih.weight``."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _TORCH_KEY.match(key[len(prefix):])
        if match is None:
            continue
        kind, linear, cell = match.groups()
        cell_prefix = f"{cell[1:]}." if cell else ""
        state_dict[f"{prefix}{cell_prefix}{linear}.{kind}"] = state_dict.pop(key)


# ------------------------------------------------------------------------------------------ cells
class _DPCellBase(nn.Module):
    """Two RNNLinear layers of ``gates * hidden_size`` outputs; subclasses define the update."""

    gates: int = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if input_size < 1 or hidden_size < 1:
            raise ConfigError(f"{type(self).__name__}: input_size and hidden_size must be >= 1, "
                              f"got {input_size} and {hidden_size}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        factory = {"device": device, "dtype": dtype}
        self.ih = RNNLinear(input_size, self.gates * hidden_size, bias=bias, **factory)
        self.hh = RNNLinear(hidden_size, self.gates * hidden_size, bias=bias, **factory)
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(_torch_keys_to_cell_keys)

    def reset_parameters(self) -> None:
        """Uniform in ``[-1/sqrt(H), 1/sqrt(H)]``, as torch initialises recurrent layers."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for param in self.parameters():
            nn.init.uniform_(param, -bound, bound)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias}"

    def step(self, input_gates: torch.Tensor, state: State) -> State:
        """One update from precomputed ``ih(x_t)`` ``(B, gates*H)`` and the previous state."""
        raise NotImplementedError  # each concrete cell overrides it

    def _zero_state(self, input: torch.Tensor) -> State:
        return input.new_zeros(input.shape[0], self.hidden_size)  # (B, H)

    def _batched(self, input: torch.Tensor) -> tuple[torch.Tensor, bool]:
        if input.dim() not in (1, 2) or input.shape[-1] != self.input_size:
            raise ConfigError(f"{type(self).__name__}.forward: expected input (B, {self.input_size}) "
                              f"or ({self.input_size},), got shape {tuple(input.shape)}")
        return (input, True) if input.dim() == 2 else (input.unsqueeze(0), False)


# The cells' gate math: row-wise, parameter-free (the parameters are in ih and hh, hooked Linear
# layers), so the batch tracker need not follow it op by op (psg_core.provenance.rowwise).
def _rnn_tanh_update(input_gates: torch.Tensor, hidden_gates: torch.Tensor) -> torch.Tensor:
    return torch.tanh(input_gates + hidden_gates)  # (B, H)


def _rnn_relu_update(input_gates: torch.Tensor, hidden_gates: torch.Tensor) -> torch.Tensor:
    return torch.relu(input_gates + hidden_gates)  # (B, H)


def _gru_update(input_gates: torch.Tensor, hidden_gates: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    x_r, x_z, x_n = input_gates.chunk(3, dim=1)  # (B, H) each
    h_r, h_z, h_n = hidden_gates.chunk(3, dim=1)  # (B, H) each
    reset = torch.sigmoid(x_r + h_r)
    update = torch.sigmoid(x_z + h_z)
    candidate = torch.tanh(x_n + reset * h_n)
    return (1.0 - update) * candidate + update * h  # (B, H)


def _lstm_update(input_gates: torch.Tensor, hidden_gates: torch.Tensor, c: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    i, f, g, o = (input_gates + hidden_gates).chunk(4, dim=1)  # (B, H) each
    c_next = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (B, H)
    h_next = torch.sigmoid(o) * torch.tanh(c_next)  # (B, H)
    return h_next, c_next


class DPRNNCell(_DPCellBase):
    """``nn.RNNCell`` from two Linear layers: ``h' = act(ih(x) + hh(h))``.

    >>> cell = DPRNNCell(3, 4)
    >>> cell(torch.zeros(2, 3)).shape
    torch.Size([2, 4])
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", device: Any = None, dtype: Any = None) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ConfigError(f"DPRNNCell: nonlinearity must be 'tanh' or 'relu', got "
                              f"{nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, bias, device, dtype)

    def step(self, input_gates: torch.Tensor, state: State) -> State:
        update = _rnn_tanh_update if self.nonlinearity == "tanh" else _rnn_relu_update
        return cast(torch.Tensor, rowwise(update, input_gates, self.hh(cast(torch.Tensor, state))))  # (B, H)

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        x, batched = self._batched(input)  # (B, F)
        h = self._zero_state(x) if hx is None else (hx if batched else hx.unsqueeze(0))  # (B, H)
        h_next = cast(torch.Tensor, self.step(self.ih(x), h))  # (B, H)
        return h_next if batched else h_next.squeeze(0)


class DPGRUCell(_DPCellBase):
    """``nn.GRUCell`` from two Linear layers (gate order r, z, n as in torch).

    >>> DPGRUCell(3, 4)(torch.zeros(2, 3)).shape
    torch.Size([2, 4])
    """

    gates = 3

    def step(self, input_gates: torch.Tensor, state: State) -> State:
        h = cast(torch.Tensor, state)  # (B, H)
        return cast(torch.Tensor, rowwise(_gru_update, input_gates, self.hh(h), h))  # (B, H)

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None) -> torch.Tensor:
        x, batched = self._batched(input)  # (B, F)
        h = self._zero_state(x) if hx is None else (hx if batched else hx.unsqueeze(0))  # (B, H)
        h_next = cast(torch.Tensor, self.step(self.ih(x), h))  # (B, H)
        return h_next if batched else h_next.squeeze(0)


class DPLSTMCell(_DPCellBase):
    """``nn.LSTMCell`` from two Linear layers (gate order i, f, g, o as in torch).

    >>> h, c = DPLSTMCell(3, 4)(torch.zeros(2, 3))
    >>> h.shape, c.shape
    (torch.Size([2, 4]), torch.Size([2, 4]))
    """

    gates = 4

    def _zero_state(self, input: torch.Tensor) -> State:
        zeros = input.new_zeros(input.shape[0], self.hidden_size)  # (B, H)
        return zeros, zeros

    def step(self, input_gates: torch.Tensor, state: State) -> State:
        h, c = cast(tuple[torch.Tensor, torch.Tensor], state)  # (B, H) each
        return cast(State, rowwise(_lstm_update, input_gates, self.hh(h), c))

    def forward(self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, batched = self._batched(input)  # (B, F)
        if hx is None:
            state = self._zero_state(x)
        else:
            state = hx if batched else (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
        h_next, c_next = cast(tuple[torch.Tensor, torch.Tensor], self.step(self.ih(x), state))
        return (h_next, c_next) if batched else (h_next.squeeze(0), c_next.squeeze(0))


# ----------------------------------------------------------------------------------- sequences
class _DPRNNBase(nn.Module):
    """The time loop shared by DPRNN, DPGRU and DPLSTM.

    Cells are attributes ``l{k}`` and ``l{k}_reverse`` (``ih``/``hh`` inside), so torch's
    ``weight_ih_l{k}[_reverse]`` and friends map one to one; ``load_state_dict`` accepts torch's
    keys directly.
    """

    mode: str = ""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device: Any = None, dtype: Any = None, *, nonlinearity: str = "tanh") -> None:
        super().__init__()
        name = type(self).__name__
        if num_layers < 1:
            raise ConfigError(f"{name}: num_layers must be >= 1, got {num_layers}")
        if isinstance(dropout, bool) or not 0.0 <= float(dropout) <= 1.0:
            raise ConfigError(f"{name}: dropout must be a number in [0, 1], got {dropout!r}")
        if dropout > 0 and num_layers == 1:
            logger.warning("%s: dropout=%s applies between layers only, so it has no effect with "
                           "num_layers=1", name, dropout)
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = 0
        self.nonlinearity = nonlinearity
        directions = 2 if bidirectional else 1
        self._cell_names: list[list[str]] = []
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else hidden_size * directions
            names = [f"l{layer}", f"l{layer}_reverse"][:directions]
            for cell_name in names:
                self.add_module(cell_name, self._make_cell(layer_input, hidden_size, bias, device,
                                                           dtype))
            self._cell_names.append(names)
        self.register_load_state_dict_pre_hook(_torch_keys_to_cell_keys)

    def _make_cell(self, input_size: int, hidden_size: int, bias: bool, device: Any,
                   dtype: Any) -> _DPCellBase:
        raise NotImplementedError  # each concrete layer overrides it

    @property
    def num_directions(self) -> int:
        """2 when bidirectional, else 1."""
        return 2 if self.bidirectional else 1

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            text += f", num_layers={self.num_layers}"
        if not self.bias:
            text += ", bias=False"
        if self.batch_first:
            text += ", batch_first=True"
        if self.dropout:
            text += f", dropout={self.dropout}"
        if self.bidirectional:
            text += ", bidirectional=True"
        return text

    # -------------------------------------------------------------------------- state plumbing
    def _initial_states(self, hx: Any, batch: int, reference: torch.Tensor,
                        batched: bool) -> list[State]:
        """One state per (layer, direction), in torch's order ``l0, l0_reverse, l1, ...``."""
        where = f"{type(self).__name__}.forward"
        expected = (self.num_layers * self.num_directions, batch, self.hidden_size)
        tensors: list[torch.Tensor]
        if hx is None:
            tensors = [reference.new_zeros(expected)] * self._state_parts
        else:
            tensors = list(hx) if isinstance(hx, (tuple, list)) else [hx]
            if len(tensors) != self._state_parts:
                raise ConfigError(f"{where}: hx must be {self._state_description}, got "
                                  f"{len(tensors)} tensor(s)")
            if not batched:
                tensors = [t.unsqueeze(1) for t in tensors]
            for tensor in tensors:
                if tuple(tensor.shape) != expected:
                    raise ConfigError(f"{where}: each hidden state must have shape {expected}, "
                                      f"got {tuple(tensor.shape)}")
        per_cell = [t.unbind(0) for t in tensors]  # parts x (layers*directions) x (B, H)
        if self._state_parts == 1:
            return list(per_cell[0])
        return list(zip(*per_cell))

    @property
    def _state_parts(self) -> int:
        return 1

    @property
    def _state_description(self) -> str:
        return "one tensor h_0"

    def _pack_states(self, finals: list[State], batched: bool) -> Any:
        # One tensor per cell, or (h, c) per cell for an LSTM (_state_parts == 2).
        parts: list[Sequence[torch.Tensor]] = (
            [cast(list[torch.Tensor], finals)] if self._state_parts == 1
            else list(zip(*cast(list[tuple[torch.Tensor, torch.Tensor]], finals))))
        stacked = [torch.stack(list(part), dim=0) for part in parts]  # (layers*dirs, B, H)
        if not batched:
            stacked = [t.squeeze(1) for t in stacked]
        return stacked[0] if self._state_parts == 1 else tuple(stacked)

    # ---------------------------------------------------------------------------- the loop
    @staticmethod
    def _run_direction(cell: _DPCellBase, sequence: torch.Tensor, state: State,
                       mask: torch.Tensor | None, reverse: bool) -> tuple[torch.Tensor, State]:
        """``sequence`` (B, T, F) -> outputs (B, T, H) and the final state (see
        :mod:`psg_core.layers._recurrence`: the loop runs outside autograd, ``ih`` and ``hh`` are
        each called once on the whole sequence)."""
        return cast(tuple[torch.Tensor, State], _recurrence.run(cell, sequence, state, mask, reverse))

    def forward(self, input: torch.Tensor | PackedSequence, hx: Any = None
                ) -> tuple[torch.Tensor | PackedSequence, Any]:
        """Runs the recurrence like torch's layer.

        Args:
            input: ``(T, B, F)`` (``(B, T, F)`` when ``batch_first``), unbatched ``(T, F)``, or a
                ``PackedSequence``.
            hx: initial state, ``(num_layers*D, B, H)`` (a pair for LSTM), in the caller's sample
                order; zeros when None.

        Returns:
            ``(output, h_n)`` (``(output, (h_n, c_n))`` for LSTM) with torch's shapes; output is a
            ``PackedSequence`` with the input's ``sorted_indices`` when the input is packed.
        """
        where = f"{type(self).__name__}.forward"
        lengths: torch.Tensor | None = None
        batched = True
        if isinstance(input, PackedSequence):
            sequence, lengths = _unpack(input)  # (B, T, F), (B,)
        else:
            if input.dim() not in (2, 3):
                raise ConfigError(f"{where}: expected a 3-D input (or 2-D unbatched), got shape "
                                  f"{tuple(input.shape)}")
            batched = input.dim() == 3
            if not batched:
                sequence = input.unsqueeze(0)  # (1, T, F)
            else:
                sequence = input if self.batch_first else input.transpose(0, 1)  # (B, T, F)
        if sequence.shape[-1] != self.input_size:
            raise ConfigError(f"{where}: input must have {self.input_size} features, got shape "
                              f"{tuple(sequence.shape)}")
        batch, steps = sequence.shape[0], sequence.shape[1]
        mask = None
        if lengths is not None:
            positions = torch.arange(steps, device=sequence.device)
            mask = positions.unsqueeze(0) < lengths.to(sequence.device).unsqueeze(1)  # (B, T)
        states = self._initial_states(hx, batch, sequence, batched)

        finals: list[State] = []
        layer_input = sequence  # (B, T, F)
        for layer, names in enumerate(self._cell_names):
            if layer > 0 and self.dropout > 0 and self.training:
                layer_input = F.dropout(layer_input, p=self.dropout, training=True)
            outputs = []
            for direction, name in enumerate(names):
                index = layer * self.num_directions + direction
                out, final = self._run_direction(getattr(self, name), layer_input, states[index],
                                                 mask, reverse=direction == 1)
                outputs.append(out)
                finals.append(final)
            layer_input = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]  # (B, T, D*H)

        output: torch.Tensor | PackedSequence = layer_input
        if isinstance(input, PackedSequence) and lengths is not None:
            output = _untracked(lambda: self._repack(layer_input, lengths, input))
            _mark(output.data, UNKNOWN)  # the packed order: not an axis of rows
        elif not batched:
            output = layer_input.squeeze(0)  # (T, D*H)
        elif not self.batch_first:
            output = layer_input.transpose(0, 1)  # (T, B, D*H)
        return output, self._pack_states(finals, batched)

    @staticmethod
    def _repack(padded: torch.Tensor, lengths: torch.Tensor, like: PackedSequence) -> PackedSequence:
        """Packs ``padded`` (B, T, H), in the caller's order, with ``like``'s batch sizes and
        sorted/unsorted indices."""
        if like.sorted_indices is not None:
            padded = padded.index_select(0, like.sorted_indices)  # (B, T, H), longest first
            lengths = lengths.index_select(0, like.sorted_indices.to(lengths.device))
        data = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=True).data
        return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


def _untracked(fn: Callable[[], Any]) -> Any:
    """``fn()`` with the batch tracker (psg_core.provenance) not following its ops: torch's pack and
    pad functions reorder the rows into a PackedSequence's order and back, which the layer, not
    the tracker, knows to be the batch's order again."""
    with torch._C.DisableTorchFunction():
        return fn()


def _mark(tensor: torch.Tensor, axis: int) -> None:
    tracker = active_tracker()
    if tracker is not None:
        tracker.mark(tensor, axis)


def _unpack(packed: PackedSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad_packed_sequence(packed, batch_first=True)``: padded rows in the batch's order; with a
    tracker, both are marked batched and the sequence's orders trusted (a caller unpacking the
    layer's PackedSequence output applies them)."""
    tracker = active_tracker()
    if tracker is None:
        return cast(tuple[torch.Tensor, torch.Tensor], pad_packed_sequence(packed, batch_first=True))
    tracker.trust_order(packed.unsorted_indices)
    sequence, lengths = _untracked(lambda: pad_packed_sequence(packed, batch_first=True))
    tracker.mark(sequence, 0)
    tracker.mark(lengths, 0)
    return sequence, lengths


# hx is (num_layers * D, B, H): its batch is on axis 1 (psg_core.provenance reads this).
setattr(_DPRNNBase, STATE_BATCH_AXIS, 1)


class DPRNN(_DPRNNBase):
    """``nn.RNN`` (tanh or relu) built from :class:`DPRNNCell` per layer and direction.

    Same constructor, ``forward`` and outputs as :class:`torch.nn.RNN`; ``load_state_dict``
    accepts an ``nn.RNN`` state dict.

    >>> rnn = DPRNN(3, 4, num_layers=2, bidirectional=True)
    >>> output, h_n = rnn(torch.zeros(5, 2, 3))
    >>> output.shape, h_n.shape
    (torch.Size([5, 2, 8]), torch.Size([4, 2, 4]))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ConfigError(f"DPRNN: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.mode = "RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU"
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device, dtype, nonlinearity=nonlinearity)

    def _make_cell(self, input_size: int, hidden_size: int, bias: bool, device: Any,
                   dtype: Any) -> _DPCellBase:
        return DPRNNCell(input_size, hidden_size, bias, self.nonlinearity, device, dtype)


class DPGRU(_DPRNNBase):
    """``nn.GRU`` built from :class:`DPGRUCell` per layer and direction.

    >>> output, h_n = DPGRU(3, 4, batch_first=True)(torch.zeros(2, 5, 3))
    >>> output.shape, h_n.shape
    (torch.Size([2, 5, 4]), torch.Size([1, 2, 4]))
    """

    mode = "GRU"

    def _make_cell(self, input_size: int, hidden_size: int, bias: bool, device: Any,
                   dtype: Any) -> _DPCellBase:
        return DPGRUCell(input_size, hidden_size, bias, device, dtype)


class DPLSTM(_DPRNNBase):
    """``nn.LSTM`` built from :class:`DPLSTMCell` per layer and direction.

    ``proj_size > 0`` (projected LSTM) is not supported and raises
    :class:`~psg_core.errors.UnsupportedModuleError`.

    >>> output, (h_n, c_n) = DPLSTM(3, 4)(torch.zeros(5, 2, 3))
    >>> output.shape, h_n.shape, c_n.shape
    (torch.Size([5, 2, 4]), torch.Size([1, 2, 4]), torch.Size([1, 2, 4]))
    """

    mode = "LSTM"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, device: Any = None, dtype: Any = None) -> None:
        if proj_size:
            raise UnsupportedModuleError(
                f"DPLSTM: proj_size={proj_size} (projected LSTM) is not supported; use "
                "proj_size=0, or a DPLSTM followed by an nn.Linear")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device, dtype)

    def _make_cell(self, input_size: int, hidden_size: int, bias: bool, device: Any,
                   dtype: Any) -> _DPCellBase:
        return DPLSTMCell(input_size, hidden_size, bias, device, dtype)

    @property
    def _state_parts(self) -> int:
        return 2

    @property
    def _state_description(self) -> str:
        return "a pair (h_0, c_0)"
