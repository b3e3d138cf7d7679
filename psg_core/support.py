"""Layers that no backend takes as they are: the one list every backend checks against.

* **Sample-mixing layers**: a BatchNorm in training mode normalises with statistics of the whole
  batch, so one sample's gradient depends on the other samples and per-sample gradients are
  undefined (even when its own affine parameters are frozen). ``.eval()`` or GroupNorm fixes it.
* **Embeddings with** ``scale_grad_by_freq=True`` scale gradients by token counts over the whole
  batch, which a per-layer grad sampler (hooks, ghost) cannot undo; ``torch.func`` runs each
  sample alone, where the counts are the sample's own (the oracle's definition), so it computes them.
* **Fused layers** (``nn.RNN``/``nn.GRU``/``nn.LSTM``, ``nn.MultiheadAttention``): one kernel
  whose inside per-layer hooks cannot see; :func:`psg_core.fix_model` swaps them for psg's DP
  rewrites. ``torch.func`` runs attention per sample, but has no batching rule for the fused
  recurrent kernels.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

from psg_core.errors import UnsupportedModuleError

__all__ = ["exclusive", "FUSED", "NOT_VMAPPABLE", "SAMPLE_MIXING", "reject_batch_mixing", "reject_fused",
           "frequency_scaled", "reject_frequency_scaling", "reject_per_layer_unsupported", "own_parameters",
           "unit_module", "is_unit", "hooked_modules", "modules_of", "one_walk", "trainable_parameters",
           "built_on_experts_interface", "EXPERTS_INTERFACE", "GLOBAL_ATTENTION_NAMES", "known_rowwise",
           "CallState", "call_state", "state_of_call", "is_cache", "without_fresh_caches", "rng_snapshot",
           "rng_changed", "rng_replayed"]

#: Layers that mix the samples of a batch (in training mode).
SAMPLE_MIXING: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
#: Fused layers whose kernels per-layer hooks cannot see into.
FUSED: tuple[type[nn.Module], ...] = (nn.RNNBase, nn.MultiheadAttention)
#: Fused layers that ``torch.func.vmap`` cannot run per sample.
NOT_VMAPPABLE: tuple[type[nn.Module], ...] = (nn.RNNBase,)


# ------------------------------------------------------------------------------ the model's tree
_WALK = threading.local()

#: one lock per model that psg computes per-sample gradients of (see exclusive)
_MODEL_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def exclusive(module: nn.Module) -> Iterator[None]:
    """Holds ``module``'s lock for the block: psg's calls on one model from several threads run one
    after the other. Each backend changes the model while it runs (hooks registered on its layers
    catch every forward through them, torch.func swaps its parameters in and out by attribute):
    two threads computing on one model at once got each other's activations or parameters, and
    wrong gradients or errors. Calls on different models still run at once; a thread may enter
    again (a step calling into another psg function on the same model).

    >>> model = nn.Linear(2, 2)
    >>> with exclusive(model), exclusive(model):  # re-entrant in one thread
    ...     pass
    """
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(module)
        if lock is None:
            lock = _MODEL_LOCKS[module] = threading.RLock()
    with lock:
        yield


@contextlib.contextmanager
def one_walk(module: nn.Module) -> Iterator[None]:
    """Within the block, :func:`modules_of` ``(module)`` lists ``module.named_modules()`` once: a
    step's checks, hooks and parameter lists (each of which used to walk the tree itself) share
    one walk. The tree must not change inside the block (a step does not change it)."""
    previous = getattr(_WALK, "held", None)
    if previous is not None and previous.module is module:
        yield  # held already (dp_gradient's walk, in per_sample_gradients): the same tree
        return
    _WALK.held = _Walk(module, tuple(module.named_modules()))
    try:
        yield
    finally:
        _WALK.held = previous


class _Walk:
    """One walk of a module's tree, and what was read from it (its trainable parameters, each
    layer's own parameters), for the duration of :func:`one_walk`."""

    def __init__(self, module: nn.Module, modules: tuple[tuple[str, nn.Module], ...]) -> None:
        self.module = module
        self.modules = modules
        self.trainable: dict[str, nn.Parameter] | None = None
        self.own: dict[nn.Module, tuple[nn.Parameter, ...]] = {}  # by the layer (held: no id reuse)


def _held(module: nn.Module) -> _Walk | None:
    held: _Walk | None = getattr(_WALK, "held", None)
    return held if held is not None and held.module is module else None


def modules_of(module: nn.Module) -> Sequence[tuple[str, nn.Module]]:
    """``module.named_modules()`` as a sequence: the walk :func:`one_walk` holds for ``module``, or
    a new one.

    >>> [path for path, _ in modules_of(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))]
    ['', '0', '1']
    """
    held = _held(module)
    return held.modules if held is not None else tuple(module.named_modules())


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """``named_parameters()`` restricted to parameters with ``requires_grad`` (same names, same
    order), from :func:`modules_of`.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> model[0].bias.requires_grad_(False)  # doctest: +ELLIPSIS
    Parameter containing:...
    >>> list(trainable_parameters(model))
    ['0.weight', '1.weight', '1.bias']
    """
    held = _held(module)
    if held is not None and held.trainable is not None:
        return dict(held.trainable)
    seen: set[int] = set()
    out: dict[str, nn.Parameter] = {}
    for path, layer in modules_of(module):
        for name, p in layer._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                out[f"{path}.{name}" if path else name] = p
    if held is not None:
        held.trainable = dict(out)
    return out


def _label(path: str, layer: nn.Module) -> str:
    return f"'{path or '<root>'}' ({type(layer).__qualname__})"


def _batch_mixing(path: str, layer: nn.Module, where: str) -> UnsupportedModuleError | None:
    if isinstance(layer, SAMPLE_MIXING) and layer.training:
        return UnsupportedModuleError(
            f"{where}: module {_label(path, layer)} is a BatchNorm in "
            "training mode, which mixes the samples of a batch, so per-sample gradients are "
            "undefined; call .eval() on it or replace it with GroupNorm (psg_core.fix_model does)")
    return None


def _fused(path: str, layer: nn.Module, where: str, layer_types: tuple[type[nn.Module], ...] = FUSED,
           why: str = "a fused layer whose kernel hooks cannot see into") -> UnsupportedModuleError | None:
    if isinstance(layer, layer_types) and any(p.requires_grad for p in layer.parameters(recurse=False)):
        return UnsupportedModuleError(
            f"{where}: module {_label(path, layer)} is {why}; swap it for its DP rewrite with "
            "psg_core.fix_model")
    return None


def _frequency_scaling(path: str, layer: nn.Module, where: str) -> UnsupportedModuleError | None:
    if frequency_scaled(layer):
        return UnsupportedModuleError(
            f"{where}: module {_label(path, layer)} has scale_grad_by_freq=True, which scales gradients "
            "by token frequencies over the whole batch, so a per-layer grad sampler cannot give each "
            "sample its own; use mode='functorch' (each sample alone) or scale_grad_by_freq=False")
    return None


_Check = Callable[[str, nn.Module], UnsupportedModuleError | None]


def _reject(module: nn.Module, checks: Sequence[_Check], *, where: str) -> None:
    """One walk of ``module``: raises the first error of the first check that finds one (each
    check's first offending layer in walk order; the checks in the order given). A TorchScript
    module is refused first, whatever the checks: no backend can hook it or run it under torch.func."""
    first: list[UnsupportedModuleError | None] = [None] * len(checks)
    for path, layer in modules_of(module):
        if isinstance(layer, torch.jit.ScriptModule):
            raise UnsupportedModuleError(
                f"{where}: module {_label(path, layer)} is a TorchScript module (torch.jit.script), whose "
                "calls no forward hook, autograd hook or torch.func transform can follow; pass the eager "
                "module (script the model after training, or trace it)")
        for i, check in enumerate(checks):
            if first[i] is None:
                first[i] = check(path, layer)
    for error in first:
        if error is not None:
            raise error


# ------------------------------------------------------------------------------ routed experts
#: The module of transformers' experts interface (Mixtral, Qwen-MoE, OLMoE, DeepSeek experts, ...).
EXPERTS_INTERFACE = "transformers.integrations.moe"


def built_on_experts_interface(cls: type) -> bool:
    """Whether ``cls`` is a routed-experts class built on transformers' experts interface: its
    ``forward`` is the interface's dispatcher (transformers is never imported here)."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and code.co_name == "forward" and code.co_filename.replace("\\", "/").endswith(
        EXPERTS_INTERFACE.replace(".", "/") + ".py")


#: Longformer's sliding-window self-attention with global tokens and LED's encoder copy of it, by
#: name: the global tokens of all rows are gathered by ``nonzero`` into (batch row, slot) places
#: padded to the batch's largest count (``num_global.max()``), and the padded slots' scores are set
#: to the dtype's lowest value, so softmax gives them exactly 0: each row's output is its own rows'
#: alone (row-wise, below); its ``is_global_attn`` flag is the batch's (see
#: :mod:`psg_core.grad_sample.functorch_fallback`).
GLOBAL_ATTENTION_NAMES = ("transformers.models.longformer.modeling_longformer.LongformerSelfAttention",
                          "transformers.models.led.modeling_led.LEDEncoderSelfAttention")

#: Hugging Face classes known to compute each batch row from the same row of their inputs alone,
#: whose ops the batch tracker would take for mixing (see :func:`known_rowwise`): the global
#: attentions above, and Llama 4's experts block, which tiles every token once per expert
#: (``repeat`` along the rows), scales each copy by its routing score and sums the copies back:
#: each token's output is its own row's alone (a unit too: its router, experts and shared expert
#: are computed from its whole call); and DBRX's experts, a loop over the experts hit that gathers
#: each expert's tokens from ``(B*T, d)`` states, runs its child's GLU on slices of the child's
#: weights and scatters the rows back (a unit: the weights are its child's); and LongCat-Flash's
#: experts, the same loop with zero-compute (identity) experts beside the routed ones; and JetMoE's
#: experts block and attention, whose router sorts the batch's tokens by expert (the attention's
#: query and output projections are such experts, reached by its own ``map`` and ``reduce``): each
#: row's output is its own tokens' alone (units: their routers and experts are their children);
#: and Qwen4's sparse-attention indexer, a loop over the batch's rows that picks each row's token
#: indices from its own keys (integers: its parameters get no gradient).
_ROWWISE_NAMES = frozenset(GLOBAL_ATTENTION_NAMES) | {"transformers.models.llama4.modeling_llama4.Llama4TextMoe",
                                                       "transformers.models.dbrx.modeling_dbrx.DbrxExperts",
                                                       "transformers.models.longcat_flash.modeling_longcat_flash."
                                                       "LongcatFlashExperts",
                                                       "transformers.models.jetmoe.modeling_jetmoe.JetMoeMoE",
                                                       "transformers.models.jetmoe.modeling_jetmoe.JetMoeAttention",
                                                       "transformers.models.qwen4_exp.modeling_qwen4_exp."
                                                       "Qwen4ExpTextQSAIndexer"}


def known_rowwise(cls: type) -> bool:
    """Whether ``cls`` is row-wise by psg's knowledge of it (transformers is never imported here):
    Hugging Face's routed experts (:func:`built_on_experts_interface`) and the attention classes of
    ``_ROWWISE_NAMES``; these are units too (:func:`is_unit`), their parameters' per-sample
    gradients computed from their whole call."""
    return built_on_experts_interface(cls) or f"{cls.__module__}.{cls.__qualname__}" in _ROWWISE_NAMES


# ------------------------------------------------------------------------------ units
#: Classes whose call is one unit for per-sample gradients (see :func:`unit_module`), by class;
#: Hugging Face's are known by name (transformers is never imported here).
_UNITS: dict[type, bool] = {}
_UNIT_NAMES = frozenset({
    # F.multi_head_attention_forward on its q/k/v/out projections' weights
    "transformers.models.wavlm.modeling_wavlm.WavLMAttention",
    # its slow path reads conv1d.weight in a functional convolution and scans in place
    "transformers.models.mamba.modeling_mamba.MambaMixer",
}) | _ROWWISE_NAMES


def unit_module(cls: type[nn.Module]) -> type[nn.Module]:
    """Declares that modules of class ``cls`` are one unit for per-sample gradients: their forward
    reads their submodules' parameters itself (``F.multi_head_attention_forward(...,
    self.q_proj.weight, ...)``, a functional convolution with ``self.conv.weight``), which
    per-layer hooks cannot attribute to the submodules. psg then takes every parameter of the
    module's subtree as the module's own: the hooks and ghost backends compute their per-sample
    gradients from ``torch.func`` on the module's whole call (the per-layer fallback), and hook
    none of its submodules. The module must not mix samples. Returns ``cls`` (a decorator).

    Hugging Face's WavLM attention, Mamba mixer and Longformer's (and LED's) self-attention are units
    already.

    >>> class Fused(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.proj = nn.Linear(3, 3)
    ...     def forward(self, x):
    ...         return torch.nn.functional.linear(x, self.proj.weight * 2, self.proj.bias)
    >>> unit_module(Fused) is Fused, [tuple(p.shape) for p in own_parameters(Fused())]
    (True, [(3, 3), (3,)])
    """
    _UNITS[cls] = True
    return cls


def is_unit(layer: nn.Module) -> bool:
    """Whether ``layer``'s class is a unit (:func:`unit_module`, or one of Hugging Face's known)."""
    cls = type(layer)
    known = _UNITS.get(cls)
    if known is None:
        known = _UNITS[cls] = f"{cls.__module__}.{cls.__qualname__}" in _UNIT_NAMES
    return known


def hooked_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()`` without the submodules of units (whose parameters the unit owns)."""
    inside: str | None = None
    for path, layer in modules_of(module):
        if inside is not None and (inside == "" or path.startswith(inside + ".")):
            continue
        inside = None
        yield path, layer
        if is_unit(layer) and layer._modules:
            inside = path


def own_parameters(layer: nn.Module) -> tuple[nn.Parameter, ...]:
    """``tuple(layer.parameters(recurse=False))`` read from ``_parameters`` directly (asked once
    per module and step: ``parameters()`` goes through the module-tree machinery).

    A layer with parametrized tensors (``torch.nn.utils.parametrizations.weight_norm``,
    ``spectral_norm``, ``orthogonal``: its ``weight`` is computed from ``original`` tensors before
    each call) owns those originals too; the parametrization lists that hold them own nothing.

    >>> len(own_parameters(nn.Linear(2, 3))), own_parameters(nn.Linear(2, 3, bias=False))[0].shape
    (2, torch.Size([3, 2]))
    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> layer = weight_norm(nn.Linear(2, 3))
    >>> [tuple(p.shape) for p in own_parameters(layer)], own_parameters(layer.parametrizations.weight)
    ([(3,), (3, 1), (3, 2)], ())
    """
    held: _Walk | None = getattr(_WALK, "held", None)
    if held is not None:
        known = held.own.get(layer)
        if known is None:
            known = held.own[layer] = _own_parameters(layer)
        return known
    return _own_parameters(layer)


def _own_parameters(layer: nn.Module) -> tuple[nn.Parameter, ...]:
    if isinstance(layer, _PARAMETRIZATION_LIST):
        return ()
    if is_unit(layer):  # its whole subtree (see unit_module)
        return tuple(layer.parameters())
    seen: set[int] = set()
    own = []
    for p in layer._parameters.values():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            own.append(p)
    lists = layer._modules.get("parametrizations")
    if lists is not None and _PARAMETRIZED in type(layer).__name__:
        for p in lists.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                own.append(p)
    return tuple(own)


# ------------------------------------------------------------------------------ a call's state
class CallState(NamedTuple):
    """What a layer's call began with, for a per-sample run of the call later (see
    :func:`call_state`)."""

    #: the plain tensor attributes (and None-valued ones) of the call's modules: ``((module,
    #: {name: value}), ...)``.
    attributes: tuple[tuple[nn.Module, dict[str, Any]], ...] = ()
    #: the ids of the caches among the call's arguments that held nothing for the layer yet.
    fresh_caches: frozenset[int] = frozenset()
    #: the random number generators' states when the call began (:func:`rng_snapshot`); kept on a
    #: captured call only where the call drew random numbers (dropout in training mode).
    rng: Any = None
    #: such a call's hooked outputs as it returned them (its replay must return the same).
    returned: tuple[torch.Tensor, ...] = ()


def call_state(layer: nn.Module, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> CallState:
    """The state a call of ``layer`` with ``args`` and ``kwargs`` begins with, for a per-sample run
    of the call later (the torch.func fallback, a unit's whole call).

    * The attributes of ``layer`` (of each module of a unit's subtree) that hold a plain tensor or
      None, not parameters or buffers. A module may keep state there that its call reads and
      replaces: RecurrentGemma's RG-LRU reads ``self.recurrent_states`` (None, set by its block) and
      stores the batch's last state there. Run again per sample after the batch's call, it would
      read the batch's state, not what the call read: another shape (an error), or the same shape
      (a wrong gradient, silently).
    * Which of transformers' caches among the arguments held nothing yet for the layer's
      ``layer_idx`` (a training forward with ``use_cache=True`` makes an empty one): the call
      only stores the batch's keys and values (or Mamba's states) there, so a sample's run
      computes the same without it (:func:`without_fresh_caches`), where the filled cache would
      hold every sample's.

    >>> cell = nn.Linear(2, 2)
    >>> cell.memory = None
    >>> [(type(m).__name__, sorted(state)) for m, state in call_state(cell).attributes]
    [('Linear', ['memory'])]
    """
    modules = layer.modules() if is_unit(layer) else (layer,)
    # (every module's entry, an empty one too: an attribute the call adds is taken away for a run)
    attributes = tuple((module, {name: value for name, value in vars(module).items() if _is_state(name, value)})
                       for module in modules)
    rng = rng_snapshot()
    index = getattr(layer, "layer_idx", None)
    if type(index) is not int or not (args or kwargs):
        return CallState(attributes, rng=rng)
    fresh = frozenset(id(value) for value in (*args, *(kwargs or {}).values())
                      if is_cache(value) and _holds_nothing(value, index))
    return CallState(attributes, fresh, rng)


def _holds_nothing(cache: Any, index: int) -> bool:
    """Whether ``cache`` holds nothing yet for layer ``index``: no keys (an attention layer's), or
    neither a convolution state nor a recurrent one (Mamba's and the linear-attention layers', which
    track no length). Anything else, or a cache that answers neither, is taken as filled."""
    try:
        return bool(cache.get_seq_length(index) == 0)
    except Exception:  # noqa: BLE001  (a layer that tracks no length, or another cache class)
        pass
    try:
        return cache.get_conv_state(index, state_idx=0) is None and cache.get_recurrent_state(index, state_idx=0) is None
    except Exception:  # noqa: BLE001  (a cache class without them: held as a filled one)
        return False


def rng_snapshot() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The states of torch's default random number generators: the CPU's, and each CUDA device's
    where CUDA is initialised (a copy: about a microsecond on the CPU)."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return torch.get_rng_state(), cuda


def rng_changed(snapshot: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> bool:
    """Whether a random number was drawn since ``snapshot`` (:func:`rng_snapshot`)."""
    cpu, cuda = snapshot
    if not torch.equal(torch.get_rng_state(), cpu):
        return True
    now = tuple(torch.cuda.get_rng_state_all()) if cuda else ()
    return any(not torch.equal(a, b) for a, b in zip(now, cuda))


@contextlib.contextmanager
def rng_replayed(snapshot: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> Iterator[None]:
    """Runs the block with the generators as ``snapshot`` held them (the block draws the same random
    numbers as the code that ran from there), then puts back their current states."""
    cpu, cuda = snapshot
    saved = torch.get_rng_state(), (tuple(torch.cuda.get_rng_state_all()) if cuda else ())
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(list(cuda))
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if cuda:
            torch.cuda.set_rng_state_all(list(saved[1]))


def is_cache(value: Any) -> bool:
    """Whether ``value`` is one of transformers' caches (a class of the ``...Cache`` family, known by
    name: transformers is never imported here)."""
    return not isinstance(value, torch.Tensor) and any(c.__name__.endswith("Cache") for c in type(value).__mro__)


def without_fresh_caches(value: Any, state: CallState) -> Any:
    """``value`` (a call's arguments) with the caches that were empty when the call began
    (:attr:`CallState.fresh_caches`) replaced by None."""
    if not state.fresh_caches:
        return value
    return tree_map(lambda v: None if id(v) in state.fresh_caches and is_cache(v) else v, value)


#: What every module's ``__dict__`` holds (its hooks, flags and dicts), never state of the model's.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _is_state(name: str, value: Any) -> bool:
    return (value is None or (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter))) \
        and name not in _MODULE_INTERNALS


@contextlib.contextmanager
def state_of_call(state: CallState) -> Iterator[None]:
    """Runs the block with each module's attributes as :func:`call_state` found them (an attribute
    of that kind the call added removed), then puts back what the modules held before the block
    (what the block stored there is dropped: a per-sample run's tensors, which may be
    torch.func's)."""
    saved = []
    for module, values in state.attributes:
        attributes = vars(module)
        before = dict(attributes)
        saved.append((module, before))
        for name, value in before.items():
            if name not in values and _is_state(name, value):
                del attributes[name]
        attributes.update(values)
    try:
        yield
    finally:
        for module, before in saved:
            attributes = vars(module)
            attributes.clear()
            attributes.update(before)


def parametrized(layer: nn.Module) -> bool:
    """Whether ``layer`` has parametrized tensors (``torch.nn.utils.parametrize``)."""
    return "parametrizations" in layer._modules and _PARAMETRIZED in type(layer).__name__


_PARAMETRIZED = "Parametrized"  # torch.nn.utils.parametrize names the class it injects Parametrized<Layer>
_PARAMETRIZATION_LIST = torch.nn.utils.parametrize.ParametrizationList


def reject_batch_mixing(module: nn.Module, *, where: str) -> None:
    """Raises :class:`UnsupportedModuleError` naming the first BatchNorm in training mode.

    >>> reject_batch_mixing(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), where="demo")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    psg_core.errors.UnsupportedModuleError: demo: module '1' (BatchNorm1d) is a BatchNorm in training mode, ...
    """
    _reject(module, [functools.partial(_batch_mixing, where=where)], where=where)


def reject_fused(module: nn.Module, *, where: str, layer_types: tuple[type[nn.Module], ...] = FUSED,
                 why: str = "a fused layer whose kernel hooks cannot see into") -> None:
    """Raises :class:`UnsupportedModuleError` naming the first layer of ``layer_types`` with
    trainable parameters of its own (``why`` says what is wrong with it).

    >>> reject_fused(nn.Sequential(nn.LSTM(2, 2)), where="demo")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    psg_core.errors.UnsupportedModuleError: demo: module '0' (LSTM) is a fused layer whose kernel hooks cannot see into; ...
    """
    _reject(module, [functools.partial(_fused, where=where, layer_types=layer_types, why=why)], where=where)


def frequency_scaled(layer: nn.Module) -> bool:
    """A trainable embedding with ``scale_grad_by_freq=True`` (see the module docstring)."""
    return (isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.scale_grad_by_freq
            and layer.weight.requires_grad)


def reject_frequency_scaling(module: nn.Module, *, where: str) -> None:
    """Raises :class:`UnsupportedModuleError` naming the first :func:`frequency_scaled` layer.

    >>> reject_frequency_scaling(nn.Sequential(nn.Embedding(5, 2, scale_grad_by_freq=True)), where="demo")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    psg_core.errors.UnsupportedModuleError: demo: module '0' (Embedding) has scale_grad_by_freq=True, ...
    """
    _reject(module, [functools.partial(_frequency_scaling, where=where)], where=where)


def reject_per_layer_unsupported(module: nn.Module, *, where: str) -> None:
    """:func:`reject_batch_mixing`, :func:`reject_frequency_scaling` and :func:`reject_fused`
    (in that order of precedence) in one walk of the model: what a per-layer backend (hooks,
    ghost) checks before every step.

    >>> reject_per_layer_unsupported(nn.Sequential(nn.LSTM(2, 2), nn.BatchNorm1d(2)), where="demo")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    psg_core.errors.UnsupportedModuleError: demo: module '1' (BatchNorm1d) is a BatchNorm in training mode, ...
    """
    _reject(module, [functools.partial(check, where=where)
                     for check in (_batch_mixing, _frequency_scaling, _fused)], where=where)
