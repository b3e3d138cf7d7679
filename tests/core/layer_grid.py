"""The layer grid: every layer family in many configurations, run through every mode.

A :class:`Case` is one layer configuration (a Conv2d with stride 2 and reflect padding, a
bidirectional DPLSTM on packed input, ...). A :class:`Cell` is a case under one K, loss reduction,
batch layout and mode. :func:`run_cell` runs a cell and says what happened
(:class:`Outcome`): the mode's result equals the microbatch oracle (``PASS``), or it raised a
:class:`psg_core.PsgError` whose message names the layer (``REFUSED``); anything else (a raw torch
error, a wrong value, a refusal that does not say which layer) is a ``FAILURE``.

Modes: ``hooks``, ``functorch`` and ``ew`` through :func:`psg_core.per_sample_gradients`;
``gsm``, the :class:`psg_core.GradSampleModule` wrapper with an ordinary ``loss.backward()``;
``ghost`` through :func:`psg_core.dp_gradient`, against :func:`psg_core.clip_and_sum` of the
oracle (the norms and the clipped sum).

The grid is deterministic: every case builds its layer and batch from fixed seeds.
"""

from __future__ import annotations

import enum
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import psg_core
from psg_core import DPConfig, PsgError
from psg_core.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from tests.oracle import assert_close_scaled, hooks_grad_samples, microbatch_oracle

MODES = ("hooks", "gsm", "functorch", "ew", "ghost")
SAMPLES = 3  # N; rows are N*K

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


def linear_cases() -> Iterator[Case]:
    for extra, bias in itertools.product([(), (5,), (2, 3), (ROWS,)], [True, False]):
        if extra == (ROWS,) and not bias:
            continue
        options = dict(extra=tuple("rows" if e == ROWS else e for e in extra), bias=bias)
        yield Case("Linear", options, _seeded(lambda bf, bias=bias: Probe(nn.Linear(4, 3, bias=bias))),
                   _sequence_batch((*extra, 4)), layouts=(True, False) if extra else (True,))


_SPATIAL = {1: (7,), 2: (5, 6), 3: (3, 5, 5)}
_KERNEL = {1: 3, 2: (3, 2), 3: (2, 3, 2)}
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
    instance = {1: (nn.InstanceNorm1d, (3, 5)), 2: (nn.InstanceNorm2d, (3, 4, 3)), 3: (nn.InstanceNorm3d, (3, 3, 3, 2))}
    for layer_type, shape in instance.values():
        for running in (False, True):
            specs.append((layer_type.__name__, dict(affine=True, track_running_stats=running),
                          lambda t=layer_type, r=running: t(3, affine=True, track_running_stats=r),
                          _channels_batch(shape), (True,)))
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
            out, _ = pad_packed_sequence(out, batch_first=self.rnn.batch_first, total_length=self.steps)
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


# ------------------------------------------------------------------------------ cells
@dataclass(frozen=True)
class Cell:
    case: Case
    K: int
    reduction: str
    batch_first: bool
    mode: str

    @property
    def id(self) -> str:
        layout = "bf" if self.batch_first else "tm"
        return f"{self.case.name}-K{self.K}-{self.reduction}-{layout}-{self.mode}"


def cells_of(case: Case, modes: Sequence[str] = MODES) -> list[Cell]:
    return [Cell(case, K, reduction, batch_first, mode)
            for K, reduction, batch_first, mode in itertools.product([1, 2], ["mean", "sum"], case.layouts, modes)]


def full_grid() -> list[Cell]:
    return [cell for case in all_cases() for cell in cells_of(case)]


def slice_grid(per_mode: int = 3) -> list[Cell]:
    """A fixed subset: each family, for every mode, ``per_mode`` of its cases, turning through
    its K / reduction / layout combinations so each family meets each of them."""
    families: dict[str, list[Case]] = {}
    for case in all_cases():
        families.setdefault(case.family, []).append(case)
    cells = []
    for cases in families.values():
        for m, mode in enumerate(MODES):
            for r in range(per_mode):
                case = cases[(m + len(MODES) * r) % len(cases)]
                combos = cells_of(case, [mode])
                cell = combos[(m + 3 * r) % len(combos)]
                if cell not in cells:
                    cells.append(cell)
    return cells


# ------------------------------------------------------------------------------ running a cell
class Outcome(enum.Enum):
    PASS = "pass"
    REFUSED = "refused"
    FAILURE = "failure"


@dataclass
class Result:
    outcome: Outcome
    detail: str = ""
    error: BaseException | None = None
    warnings: list[str] = field(default_factory=list)


def _loss(reduction: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda out, y: F.mse_loss(out, y, reduction=reduction)


def _unreduced(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y, reduction="none")


def _double(value: Any) -> Any:
    if isinstance(value, PackedSequence):
        return value.to(torch.float64)
    if isinstance(value, tuple):
        return tuple(_double(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float64)
    return value


def prepare(cell: Cell) -> tuple[nn.Module, Batch, torch.Tensor, dict[str, torch.Tensor]]:
    """The model, batch, targets and oracle of a cell."""
    case, K = cell.case, cell.K
    model = case.build(cell.batch_first)
    batch = case.batch(SAMPLES * K, cell.batch_first)
    with torch.no_grad():
        out = model(*batch.args)
    targets = torch.randn(out.shape, generator=_generator(14))
    dim = 0 if cell.batch_first else 1
    samples = [(_double(batch.sample(n, K)), targets.narrow(dim, n * K, K)) for n in range(SAMPLES)]
    expected = microbatch_oracle(model, samples, _loss(cell.reduction))
    return model, batch, targets, {n: g.to_dense() if g.is_sparse else g for n, g in expected.items()}


def names_layer(err: BaseException, model: nn.Module) -> bool:
    """A refusal must say which layer: a module type of the model (the root's too: the module
    that takes a PackedSequence is the model), or a module path, in its message."""
    text = str(err)
    types = {type(m).__name__ for m in model.modules()}
    paths = {f"'{name}'" for name, _ in model.named_modules() if name}
    return any(t in text for t in types) or any(p in text for p in paths)


def compute(cell: Cell, model: nn.Module, batch: Batch, targets: torch.Tensor,
            expected: dict[str, torch.Tensor]) -> None:
    """Runs the cell's mode and compares with the oracle (AssertionError on a mismatch)."""
    K, reduction, batch_first = cell.K, cell.reduction, cell.batch_first
    if cell.mode == "ghost":
        per_sample = {n: g.to(torch.float32) for n, g in expected.items()}
        norms = torch.cat([g.flatten(1) for g in per_sample.values()], 1).norm(dim=1)
        bound = max(float(norms.median()) * 0.7, 1e-3)  # some samples clipped, some not
        reference = psg_core.clip_and_sum(per_sample, max_grad_norm=bound)
        result = psg_core.dp_gradient(model, batch.args, targets, loss_fn=_unreduced,
                                      config=DPConfig(mode="ghost", augmentation_multiplicity=K,
                                                      loss_reduction=reduction, batch_first=batch_first,
                                                      max_grad_norm=bound))
        assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms")
        actual = result.grads
        expected = reference.grads
    elif cell.mode == "gsm":
        actual, _ = hooks_grad_samples(model, batch.args, targets, _loss(reduction), K=K,
                                       loss_reduction=reduction, batch_first=batch_first)
    else:
        actual = psg_core.per_sample_gradients(model, batch.args, targets, loss_fn=_unreduced, mode=cell.mode,
                                               augmentation_multiplicity=K, loss_reduction=reduction,
                                               batch_first=batch_first)
    assert_all_close(actual, expected)


def assert_all_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Each parameter against the oracle, scaled by its own largest entry; a gradient that is
    zero up to rounding (a key bias under softmax) is scaled by the model's largest entry."""
    assert set(actual) == set(expected), f"parameters {sorted(actual)} != {sorted(expected)}"
    overall = max((float(g.abs().max()) for g in expected.values() if g.numel()), default=0.0) or 1.0
    for name, ref in expected.items():
        got = actual[name]
        assert got is not None, f"{name}: missing"
        got = got.to_dense() if got.is_sparse else got
        own = float(ref.abs().max()) if ref.numel() else 0.0
        if own > 1e-6 * overall:
            assert_close_scaled(got, ref, name=name)
            continue
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        torch.testing.assert_close(got.double() / overall, ref.double() / overall, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name} (zero up to rounding): {m}")


def run_cell(cell: Cell) -> Result:
    """What one cell does: the oracle's result, a refusal naming the layer, or a failure.

    Warnings are recorded on the result, not raised (torch warns about ``padding="same"`` with
    even kernels in the oracle's forward too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, batch, targets, expected = prepare(cell)
        try:
            compute(cell, model, batch, targets, expected)
            result = Result(Outcome.PASS)
        except AssertionError as err:
            result = Result(Outcome.FAILURE, f"mismatch: {err}".splitlines()[0], err)
        except PsgError as err:
            named = names_layer(err, model)
            result = Result(Outcome.REFUSED if named else Outcome.FAILURE,
                            ("" if named else "refusal without the layer: ") + f"{type(err).__name__}: {err}", err)
        except Exception as err:  # noqa: BLE001  (the grid reports every raw error)
            result = Result(Outcome.FAILURE, f"raw {type(err).__name__}: {err}".splitlines()[0], err)
        finally:
            for p in model.parameters():  # GradSampleModule leaves its outputs on the model
                p.grad, p.grad_sample = None, None
    result.warnings = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return result


# ------------------------------------------------------------------------------ report
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.core.layer_grid [--slice]``: runs the grid and prints a tally by mode and
    outcome, then one line per failure. Exit status 1 when anything failed."""
    import argparse
    import collections
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--slice", action="store_true", help="only the slice that `make test` runs")
    parser.add_argument("--family", help="only this layer family (e.g. Conv2d)")
    parser.add_argument("--messages", action="store_true", help="print each distinct refusal message")
    options = parser.parse_args(argv)
    cells = slice_grid() if options.slice else full_grid()
    if options.family:
        cells = [c for c in cells if c.case.family == options.family]
    tally: collections.Counter[tuple[str, str]] = collections.Counter()
    failures: list[str] = []
    warned: collections.Counter[str] = collections.Counter()
    messages: dict[tuple[str, str, str], list[str]] = {}
    refusals: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for cell in cells:
        result = run_cell(cell)
        warned.update(result.warnings)
        tally[(cell.mode, result.outcome.value)] += 1
        if result.outcome is Outcome.FAILURE:
            failures.append(f"{cell.id}: {result.detail}")
        elif result.outcome is Outcome.REFUSED:
            refusals[(cell.mode, cell.case.family, type(result.error).__name__)] += 1
            messages.setdefault((cell.mode, cell.case.family, result.detail[:300]), []).append(cell.id)
    out = sys.stdout
    out.write(f"{len(cells)} cells\n")
    for mode in MODES:
        counts = ", ".join(f"{o.value} {tally[(mode, o.value)]}" for o in Outcome)
        out.write(f"  {mode:9s} {counts}\n")
    out.write("refusals by mode and family:\n")
    for (mode, family, kind), count in sorted(refusals.items()):
        out.write(f"  {mode:9s} {family:22s} {kind:24s} {count}\n")
    if options.messages:
        for (mode, family, text), ids in sorted(messages.items()):
            out.write(f"REFUSAL {mode} {family} x{len(ids)} (e.g. {ids[0]}): {text}\n")
    for line in failures:
        out.write(f"FAILURE {line[:400]}\n")
    for text, count in warned.most_common():
        out.write(f"WARNING x{count}: {text[:300]}\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
