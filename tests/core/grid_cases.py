"""The layer grid's cases: each layer family in many configurations (tests/core/layer_grid.py
runs them).

A :class:`Case` is one layer configuration (a Conv2d with stride 2 and reflect padding, a
bidirectional DPLSTM on packed input, an Embedding whose sequence is as long as the batch has
rows, ...): ``build(batch_first)`` gives the model, ``batch(rows, batch_first)`` its inputs and
each sample's own inputs. Everything is built from fixed seeds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from psg_core.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention

Args = tuple[Any, ...]


# ------------------------------------------------------------------------------ batches
@dataclass(frozen=True)
class Batch:
    """The model's positional arguments for the whole batch, and sample n's arguments.

    ``sample(n, K)`` is what sample n alone would have been called with (its K rows).
    """

    args: Args
    sample: Callable[[int, int], Args]


def dense(*tensors: torch.Tensor | None, batch_dim: int = 0) -> Batch:
    """Every tensor holds the batch on ``batch_dim`` (1-D ones on dimension 0); None stays None."""

    def sample(n: int, K: int) -> Args:
        return tuple(None if t is None else t.narrow(batch_dim if t.dim() > batch_dim else 0, n * K, K)
                     for t in tensors)

    return Batch(tensors, sample)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


ROWS = -1  # in a shape: as many as the batch has rows (a size that equals N*K, by coincidence)


def _shape(rows: int, shape: Sequence[int], batch_first: bool) -> tuple[int, ...]:
    sizes = [rows if size == ROWS else size for size in shape]
    return (rows, *sizes) if batch_first or not sizes else (sizes[0], rows, *sizes[1:])


def floats(rows: int, *shape: int, batch_first: bool = True, seed: int = 1) -> torch.Tensor:
    """``(rows, *shape)``, or ``(shape[0], rows, *shape[1:])`` time-major."""
    return torch.randn(*_shape(rows, shape, batch_first), generator=_generator(seed))


def tokens(rows: int, vocab: int, *shape: int, batch_first: bool = True, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, _shape(rows, shape, batch_first), generator=_generator(seed))


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One layer configuration.

    ``build(batch_first)`` returns the model (the layer behind a small probe module that returns
    one tensor); ``batch(rows, batch_first)`` its inputs. ``layouts`` lists the batch_first values
    that apply (time-major only where the layer has a sequence axis to put first). ``options``
    describe the configuration (predicates in the tests read them).
    """

    family: str
    options: dict[str, Any]
    build: Callable[[bool], nn.Module] = field(compare=False)
    batch: Callable[[int, bool], Batch] = field(compare=False)
    layouts: tuple[bool, ...] = (True,)

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.options.items())

    @property
    def name(self) -> str:
        return f"{self.family}[{self.label}]"


class Probe(nn.Module):
    """Calls ``layer(*args)``; the layer returns one tensor with the batch where the inputs have it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any) -> torch.Tensor:
        return self.layer(*args)


def _seeded(factory: Callable[[bool], nn.Module]) -> Callable[[bool], nn.Module]:
    def build(batch_first: bool) -> nn.Module:
        torch.manual_seed(0)
        return factory(batch_first)

    return build


def _sequence_batch(shape: Sequence[int]) -> Callable[[int, bool], Batch]:
    """Floats whose first non-batch axis is a sequence: batch-first or time-major."""
    def batch(rows: int, batch_first: bool) -> Batch:
        return dense(floats(rows, *shape, batch_first=batch_first), batch_dim=0 if batch_first else 1)
    return batch


def _channels_batch(shape: Sequence[int]) -> Callable[[int, bool], Batch]:
    return lambda rows, batch_first: dense(floats(rows, *shape))


def _linear(bias: bool) -> Callable[[bool], nn.Module]:
    return lambda batch_first: Probe(nn.Linear(4, 3, bias=bias))


def linear_cases() -> Iterator[Case]:
    extras: list[tuple[int, ...]] = [(), (5,), (2, 3), (ROWS,)]
    for extra, bias in itertools.product(extras, [True, False]):
        if extra == (ROWS,) and not bias:
            continue
        options = dict(extra=tuple("rows" if e == ROWS else e for e in extra), bias=bias)
        yield Case("Linear", options, _seeded(_linear(bias)), _sequence_batch((*extra, 4)),
                   layouts=(True, False) if extra else (True,))


_SPATIAL = {1: (7,), 2: (5, 6), 3: (3, 5, 5)}
_KERNEL: dict[int, Any] = {1: 3, 2: (3, 2), 3: (2, 3, 2)}
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _dilation(dims: int, dilation: int) -> int | tuple[int, ...]:
    return dilation if dims < 3 or dilation == 1 else (1, dilation, dilation)


def conv_cases(dims: int) -> Iterator[Case]:
    layer_type = _CONV[dims]
    for stride, padding, dilation, groups in itertools.product([1, 2], [0, 1, "same"], [1, 2], [1, 2]):
        if padding == "same" and stride != 1:
            continue  # torch refuses it
        modes = ["zeros"] if padding == 0 else ["zeros", "reflect", "replicate", "circular"]
        for padding_mode in modes:
            bias = (stride + dilation + groups) % 2 == 0 or padding_mode != "zeros"
            options = dict(stride=stride, padding=padding, dilation=_dilation(dims, dilation), groups=groups,
                           padding_mode=padding_mode, bias=bias)

            def factory(bf: bool, options: dict[str, Any] = options) -> nn.Module:
                return Probe(layer_type(4, 6, _KERNEL[dims], **options))

            yield Case(layer_type.__name__, options, _seeded(factory), _channels_batch((4, *_SPATIAL[dims])))


def conv_transpose_cases(dims: int) -> Iterator[Case]:
    layer_type = _CONV_T[dims]
    grid = itertools.product([1, 2], [0, 1], [0, 1], [1, 2], [1, 2])
    for stride, padding, output_padding, groups, dilation in grid:
        if output_padding >= max(stride, dilation):
            continue  # torch refuses it
        if dims == 3 and (padding, groups) != (0, 1) and (stride, dilation) != (2, 1):
            continue  # a few 3-D configurations are enough (and the slowest)
        options = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                       dilation=dilation, bias=(stride + groups) % 2 == 1)

        def factory(bf: bool, options: dict[str, Any] = options) -> nn.Module:
            return Probe(layer_type(4, 6, _KERNEL[dims], **options))

        yield Case(layer_type.__name__, options, _seeded(factory), _channels_batch((4, *_SPATIAL[dims])))


def embedding_cases() -> Iterator[Case]:
    configs: list[dict[str, Any]] = [
        dict(shape=(5,)),
        dict(shape=(5,), padding_idx=0),
        dict(shape=()),
        dict(shape=(2, 3), padding_idx=3),
        dict(shape=(ROWS,), padding_idx=0),
        dict(shape=(5,), max_norm=1.0),
        dict(shape=(5,), sparse=True),
        dict(shape=(5,), scale_grad_by_freq=True),
    ]
    for config in configs:
        shape = config.pop("shape")

        def factory(bf: bool, config: dict[str, Any] = config) -> nn.Module:
            return Probe(nn.Embedding(8, 4, **config))

        def batch(rows: int, batch_first: bool, shape: tuple[int, ...] = shape) -> Batch:
            ids = tokens(rows, 8, *shape, batch_first=batch_first)  # padding ids 0 and 3 occur
            return dense(ids, batch_dim=0 if batch_first else 1)

        options = dict(shape=tuple("rows" if e == ROWS else e for e in shape), **config)
        yield Case("Embedding", options, _seeded(factory), batch, layouts=(True, False) if shape else (True,))


def _offsets_batch(rows: int, *, empty: bool, weights: bool, last_offset: bool, single: bool) -> Batch:
    """1-D tokens cut into ``rows`` bags by offsets: sample n owns bags n*K .. n*K+K-1. ``single``:
    one token per bag, so that the tokens are as many as the rows."""
    lengths = [1] * rows if single else \
        [int(v) for v in torch.randint(0 if empty else 1, 5, (rows,), generator=_generator(3))]
    total = sum(lengths)
    ids = torch.randint(0, 10, (total,), generator=_generator(4))
    starts = [0, *itertools.accumulate(lengths)]  # rows + 1 boundaries
    per_token = torch.rand(total, generator=_generator(5)) + 0.5

    def bags(first: int, count: int) -> Args:
        lo, hi = starts[first], starts[first + count]
        offsets = torch.tensor(starts[first:first + count + (1 if last_offset else 0)]) - lo
        return (ids[lo:hi], offsets) + ((per_token[lo:hi],) if weights else ())

    return Batch(bags(0, rows), lambda n, K: bags(n * K, K))


class Bag(nn.Module):
    """An EmbeddingBag called as ``bag(input, offsets, per_sample_weights)``."""

    def __init__(self, bag: nn.EmbeddingBag) -> None:
        super().__init__()
        self.bag = bag

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.bag(ids, offsets, per_sample_weights=per_sample_weights)


def embedding_bag_cases() -> Iterator[Case]:
    extras = ["-", "weights", "padding_idx", "empty", "last_offset", "one_token"]
    for bag_mode, layout, extra in itertools.product(["sum", "mean", "max"], ["2d", "offsets"], extras):
        if extra == "weights" and bag_mode != "sum":
            continue  # torch: per_sample_weights only with mode='sum'
        if extra in ("empty", "last_offset", "one_token") and layout == "2d":
            continue
        if bag_mode == "max" and extra != "-" or extra == "one_token" and bag_mode != "mean":
            continue
        config: dict[str, Any] = dict(mode=bag_mode)
        if extra == "padding_idx":
            config["padding_idx"] = 0
        if extra == "last_offset":
            config["include_last_offset"] = True

        def factory(bf: bool, config: dict[str, Any] = config) -> nn.Module:
            return Probe(Bag(nn.EmbeddingBag(10, 4, **config)))

        def batch(rows: int, batch_first: bool, layout: str = layout, extra: str = extra) -> Batch:
            if layout == "offsets":
                return _offsets_batch(rows, empty=extra == "empty", weights=extra == "weights",
                                      last_offset=extra == "last_offset", single=extra == "one_token")
            ids = tokens(rows, 10, 4)
            if extra != "weights":
                return dense(ids)
            return dense(ids, None, torch.rand(rows, 4, generator=_generator(5)) + 0.5)

        yield Case("EmbeddingBag", dict(mode=bag_mode, input=layout, extra=extra), _seeded(factory), batch)


def _instance_norm(layer_type: type[nn.Module], running: bool) -> Callable[[], nn.Module]:
    return lambda: layer_type(3, affine=True, track_running_stats=running)


def norm_cases() -> Iterator[Case]:
    both = (True, False)
    specs: list[tuple[str, dict[str, Any], Callable[[], nn.Module], Callable[[int, bool], Batch], tuple[bool, ...]]] = [
        ("LayerNorm", dict(shape=(4,)), lambda: nn.LayerNorm(4), _sequence_batch((5, 4)), both),
        ("LayerNorm", dict(shape=(5, 4)), lambda: nn.LayerNorm((5, 4)), _channels_batch((5, 4)), (True,)),
        ("LayerNorm", dict(shape=(4,), bias=False), lambda: nn.LayerNorm(4, bias=False),
         _sequence_batch((3, 4)), both),
        ("LayerNorm", dict(shape=(4,), steps="rows"), lambda: nn.LayerNorm(4), _sequence_batch((ROWS, 4)), both),
        ("LayerNorm", dict(shape=(4,), affine=False, after="Linear"),
         lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, elementwise_affine=False)),
         _sequence_batch((3, 4)), both),
        ("GroupNorm", dict(groups=2, spatial=1), lambda: nn.GroupNorm(2, 4), _channels_batch((4, 5)), (True,)),
        ("GroupNorm", dict(groups=1, spatial=2), lambda: nn.GroupNorm(1, 4), _channels_batch((4, 3, 3)), (True,)),
        ("GroupNorm", dict(groups=2, spatial=0), lambda: nn.GroupNorm(2, 4), _channels_batch((4,)), (True,)),
        ("GroupNorm", dict(groups=4, spatial=1), lambda: nn.GroupNorm(4, 4), _channels_batch((4, 3)), (True,)),
        ("RMSNorm", dict(shape=(4,)), lambda: nn.RMSNorm(4), _sequence_batch((3, 4)), both),
        ("RMSNorm", dict(shape=(3, 4), eps=1e-5), lambda: nn.RMSNorm((3, 4), eps=1e-5), _channels_batch((3, 4)),
         (True,)),
    ]
    instance: list[tuple[type[nn.Module], tuple[int, ...]]] = [
        (nn.InstanceNorm1d, (3, 5)), (nn.InstanceNorm2d, (3, 4, 3)), (nn.InstanceNorm3d, (3, 3, 3, 2))]
    for layer_type, shape in instance:
        for running in (False, True):
            specs.append((layer_type.__name__, dict(affine=True, track_running_stats=running),
                          _instance_norm(layer_type, running), _channels_batch(shape), (True,)))
    for family, options, make, batch, layouts in specs:
        def factory(bf: bool, make: Callable[[], nn.Module] = make) -> nn.Module:
            layer = make()
            with torch.no_grad():  # affine parameters away from their 1/0 start
                for p in layer.parameters():
                    p.add_(0.3 * torch.randn_like(p))
            return Probe(layer)

        yield Case(family, options, _seeded(factory), batch, layouts)


class Attend(nn.Module):
    """Attention with separate query, key and value inputs and an optional key padding mask."""

    def __init__(self, attention: DPMultiheadAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attention(query, key, value, key_padding_mask=key_padding_mask)[0]


def attention_cases() -> Iterator[Case]:
    grid = itertools.product([True, False], [False, True], [False, True], [None, (3, 5)], [False, True], [5, ROWS])
    for bias, add_bias_kv, add_zero_attn, kv_dims, masked, steps in grid:
        if masked and (kv_dims is not None or not bias):
            continue
        if steps == ROWS and (kv_dims is not None or add_zero_attn):
            continue
        kdim, vdim = kv_dims or (None, None)

        def factory(bf: bool, bias: bool = bias, add_bias_kv: bool = add_bias_kv, add_zero_attn: bool = add_zero_attn,
                    kdim: int | None = kdim, vdim: int | None = vdim) -> nn.Module:
            return Attend(DPMultiheadAttention(4, 2, bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                               kdim=kdim, vdim=vdim, batch_first=bf))

        def batch(rows: int, batch_first: bool, kdim: int | None = kdim, vdim: int | None = vdim,
                  masked: bool = masked, steps: int = steps) -> Batch:
            dim = 0 if batch_first else 1
            query = floats(rows, steps if steps == ROWS else 3, 4, batch_first=batch_first, seed=6)
            key = floats(rows, steps, kdim or 4, batch_first=batch_first, seed=7)
            value = floats(rows, steps, vdim or 4, batch_first=batch_first, seed=8)
            if not masked:
                return dense(query, key, value, batch_dim=dim)
            keys = key.shape[1 - dim]
            lengths = torch.randint(2, keys + 1, (rows,), generator=_generator(9))
            mask = torch.arange(keys)[None, :] >= lengths[:, None]  # (rows, S): batch-first in either layout

            def sample(n: int, K: int) -> Args:
                return (*(t.narrow(dim, n * K, K) for t in (query, key, value)), mask[n * K:(n + 1) * K])

            return Batch((query, key, value, mask), sample)

        options = dict(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim_vdim=kv_dims,
                       key_padding_mask=masked, steps="rows" if steps == ROWS else steps)
        yield Case("DPMultiheadAttention", options, _seeded(factory), batch, layouts=(True, False))


class Recur(nn.Module):
    """A recurrent layer; returns its output, padded to ``steps`` when the input is packed."""

    def __init__(self, rnn: nn.Module, steps: int) -> None:
        super().__init__()
        self.rnn = rnn
        self.steps = steps

    def forward(self, x: Any, state: Any = None) -> torch.Tensor:
        out, _ = self.rnn(x, state) if state is not None else self.rnn(x)
        if isinstance(out, PackedSequence):
            out, _ = pad_packed_sequence(out, batch_first=bool(self.rnn.batch_first), total_length=self.steps)
        return out


_STEPS = 4


def _recurrent_batch(rows: int, batch_first: bool, *, packed: bool, states: int | None, lstm: bool) -> Batch:
    """``(rows, T, 3)`` (time-major: ``(T, rows, 3)``), packed or not, with an optional initial
    state ``(states, rows, 4)`` (an LSTM's ``(h0, c0)``), whose batch is on axis 1 in both layouts."""
    dim = 0 if batch_first else 1
    x = floats(rows, _STEPS, 3, batch_first=batch_first, seed=10)
    lengths = torch.randint(1, _STEPS + 1, (rows,), generator=_generator(11))
    hidden = [torch.randn(states, rows, 4, generator=_generator(12 + i)) for i in range(2 if lstm else 1)] \
        if states is not None else []

    def make(first: int, count: int) -> Args:
        part = x.narrow(dim, first, count)
        lead: Any = pack_padded_sequence(part, lengths[first:first + count], batch_first=batch_first,
                                         enforce_sorted=False) if packed else part
        if not hidden:
            return (lead,)
        state = [h.narrow(1, first, count) for h in hidden]
        return (lead, tuple(state) if lstm else state[0])

    return Batch(make(0, rows), lambda n, K: make(n * K, K))


def recurrent_cases() -> Iterator[Case]:
    grid = itertools.product([DPRNN, DPGRU, DPLSTM], [1, 2, 3], [False, True], [False, True], [False, True])
    for rnn_type, layers, bidirectional, packed, with_state in grid:
        if with_state and (layers, bidirectional) == (1, False) and rnn_type is not DPLSTM:
            continue
        if layers == 3 and (rnn_type is not DPGRU or not with_state):
            continue  # 3 or 6 initial states: as many as the batch has rows (K = 1 or 2)
        directions = 2 if bidirectional else 1
        extra = {"nonlinearity": "relu"} if rnn_type is DPRNN and layers == 2 else {}

        def factory(bf: bool, rnn_type: type[nn.Module] = rnn_type, layers: int = layers,
                    bidirectional: bool = bidirectional, extra: dict[str, Any] = extra) -> nn.Module:
            rnn = rnn_type(3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=bf, **extra)
            if extra:  # relu: biases up, so that units are alive and gradients are not all zero
                with torch.no_grad():
                    for name, p in rnn.named_parameters():
                        if name.endswith("bias"):
                            p.add_(0.5)
            return Recur(rnn, _STEPS)

        def batch(rows: int, batch_first: bool, packed: bool = packed,
                  states: int | None = layers * directions if with_state else None,
                  lstm: bool = rnn_type is DPLSTM) -> Batch:
            return _recurrent_batch(rows, batch_first, packed=packed, states=states, lstm=lstm)

        options = dict(layers=layers, bidirectional=bidirectional, packed=packed, initial_state=with_state, **extra)
        yield Case(rnn_type.__name__, options, _seeded(factory), batch, layouts=(True, False))


def all_cases() -> list[Case]:
    """Every case, in a fixed order."""
    return [*linear_cases(), *conv_cases(1), *conv_cases(2), *conv_cases(3),
            *conv_transpose_cases(1), *conv_transpose_cases(2), *conv_transpose_cases(3),
            *embedding_cases(), *embedding_bag_cases(), *norm_cases(), *attention_cases(),
            *recurrent_cases()]
