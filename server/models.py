"""The model registry: architectures the server builds by name (models never come from clients).

An architecture is a *builder*, a function of keyword arguments with type annotations and
defaults, returning an ``nn.Module``. The registry derives the argument list from the builder's
signature (for ``ListModels`` and for validating a session's JSON kwargs), unless the entry brings
its own parser of the JSON object (the Hugging Face family, :mod:`psg_server.huggingface`, takes a
transformers config); and optionally holds a *signature* function describing what the model takes
per row, positionally or by keyword, which the frontend uses to reject batches that do not fit
before any worker sees them. Any model can get a LoRA adapter (:class:`psg_wire.adapters.LoraAdapter`)
on top, which freezes its own parameters.

Operators add architectures with ``--model-plugin my.module``: the module defines
``register_models(registry)`` and calls :meth:`ModelRegistry.register`. Builders must be
constructible under ``torch.device("meta")`` (the registry sizes models that way before building
them for real).

>>> registry = default_registry()
>>> kwargs = registry.parse_kwargs("mlp", '{"in_features": 4, "hidden": [8], "num_classes": 3}')
>>> registry.build("mlp", kwargs)(torch.zeros(2, 4)).shape
torch.Size([2, 3])
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from psg_core.errors import ConfigError
from psg_server.errors import InvalidRequestError, LimitExceededError, ModelNotFoundError
from psg_wire.adapters import LoraAdapter

__all__ = [
    "BUILTIN",
    "InputSpec",
    "ModelArgument",
    "ModelEntry",
    "ModelRegistry",
    "ModelSignature",
    "ParameterInfo",
    "default_registry",
]

logger = logging.getLogger(__name__)

#: Origin of the architectures that ship with psg.
BUILTIN = "builtin"
_MAX_INT = 1 << 31
_MAX_LIST = 64
_MAX_STR = 64
_MAX_KWARGS_JSON = 64 * 1024

#: A per-row dimension: an exact size, or inclusive bounds ``(low, high)``.
Dim = int | tuple[int, int]


@dataclass(frozen=True)
class InputSpec:
    """One model input, per row (the batch dimension excluded).

    ``kind`` is ``"float"`` (any floating dtype; cast to the parameters' dtype, must be finite),
    ``"index"`` (any integer dtype; cast to int64, values in ``[0, num_embeddings)``) or ``"mask"``
    (any dtype holding only 0 and 1, an attention mask; cast to int64).
    """

    kind: str
    sample_shape: tuple[Dim, ...]
    num_embeddings: int | None = None
    #: A keyword input the batch must send (False: the model has a default for it).
    required: bool = True
    #: The keyword input this one must have the shape of (an attention mask and its input ids).
    same_shape_as: str | None = None


@dataclass(frozen=True)
class ModelSignature:
    """What a model takes per row and how many outputs per row it produces.

    ``inputs`` are the positional arguments (``inputs/0``, ...) and ``keyword_inputs`` the keyword
    arguments the model accepts (``inputs/<name>``); a batch sends every positional one, the
    required keyword ones and any other keyword one.
    """

    inputs: tuple[InputSpec, ...]
    num_outputs: int
    keyword_inputs: Mapping[str, InputSpec] = field(default_factory=dict)
    #: The keyword input whose shape token-level targets must have (one label per token), if any.
    targets_like: str | None = None


@dataclass(frozen=True)
class ModelArgument:
    """One keyword argument of a builder, as ``ListModels`` reports it."""

    name: str
    type_name: str
    default: Any
    required: bool


@dataclass(frozen=True)
class ParameterInfo:
    """A parameter of a built model: what ``CreateSession`` reports and ``PushParameters`` checks."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def num_bytes(self) -> int:
        """Size of the tensor on the wire."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ModelEntry:
    """A registered architecture."""

    name: str
    builder: Callable[..., nn.Module]
    description: str
    arguments: tuple[ModelArgument, ...]
    origin: str
    signature: Callable[..., ModelSignature] | None
    #: The model takes its batch on dimension 0 only (DPConfig.batch_first must be True).
    batch_first_only: bool
    #: Validates the decoded JSON object of kwargs and returns the builder's kwargs (None: checked
    #: against ``arguments``, from the builder's signature).
    parse: Callable[[dict[str, Any]], dict[str, Any]] | None = None


_TYPE_NAMES: dict[Any, str] = {int: "int", float: "float", bool: "bool", str: "str",
                               tuple[int, ...]: "list[int]", list[int]: "list[int]"}


def _arguments(name: str, builder: Callable[..., nn.Module]) -> tuple[ModelArgument, ...]:
    try:
        hints = typing.get_type_hints(builder)
    except (NameError, TypeError) as err:
        raise ConfigError(f"ModelRegistry.register: cannot read the annotations of {name!r}: {err}") from None
    arguments = []
    for param in inspect.signature(builder).parameters.values():
        if param.kind not in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
            raise ConfigError(f"ModelRegistry.register: {name!r} builder argument {param.name!r} must be "
                              "a plain keyword argument")
        type_name = _TYPE_NAMES.get(hints.get(param.name))
        if type_name is None:
            raise ConfigError(f"ModelRegistry.register: {name!r} argument {param.name!r} has annotation "
                              f"{hints.get(param.name)!r}; supported: int, float, bool, str, tuple[int, ...]")
        required = param.default is inspect.Parameter.empty
        arguments.append(ModelArgument(param.name, type_name, None if required else param.default, required))
    return tuple(arguments)


def _coerce(model: str, argument: ModelArgument, value: Any) -> Any:
    where = f"model {model!r} argument {argument.name!r}"
    kind = argument.type_name
    if kind == "bool":
        if not isinstance(value, bool):
            raise InvalidRequestError(f"CreateSession: {where} must be a boolean, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= _MAX_INT:
            raise InvalidRequestError(f"CreateSession: {where} must be an integer below 2**31, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequestError(f"CreateSession: {where} must be a finite number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str) or len(value) > _MAX_STR:
            raise InvalidRequestError(f"CreateSession: {where} must be a string of at most {_MAX_STR} "
                                      f"characters, got {value!r:.80}")
        return value
    if (not isinstance(value, list) or len(value) > _MAX_LIST
            or any(isinstance(v, bool) or not isinstance(v, int) or abs(v) >= _MAX_INT for v in value)):
        raise InvalidRequestError(f"CreateSession: {where} must be a list of at most {_MAX_LIST} "
                                  f"integers, got {value!r:.80}")
    return tuple(value)


class ModelRegistry:
    """Architectures by name; see the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._origin = BUILTIN
        self.plugins: tuple[str, ...] = ()
        # name -> parameters at the default arguments (None: an argument is required)
        self._default_parameters: dict[str, list[ParameterInfo] | None] = {}

    def register(self, name: str, builder: Callable[..., nn.Module], *,
                 signature: Callable[..., ModelSignature] | None = None, description: str | None = None,
                 batch_first_only: bool = True, replace: bool = False,
                 arguments: Sequence[ModelArgument] | None = None,
                 parse_kwargs: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Adds an architecture.

        Args:
            name: what clients pass to ``CreateSession``.
            builder: keyword-only, annotated (int, float, bool, str, tuple[int, ...]) -> nn.Module.
            signature: same keyword arguments -> :class:`ModelSignature`; lets the server reject
                batches that do not fit (without it, only the row layout is checked).
            description: defaults to the first line of the builder's docstring.
            batch_first_only: sessions must use ``batch_first=True``.
            replace: allow replacing an existing name.
            arguments: what ``ListModels`` shows, for a builder whose signature cannot say
                (``**kwargs``); requires ``parse_kwargs``.
            parse_kwargs: the decoded JSON object -> the builder's kwargs, raising
                :class:`InvalidRequestError` (or :class:`ModelNotFoundError`) for what it refuses;
                replaces the checks against the builder's signature.
        """
        if (arguments is None) != (parse_kwargs is None):
            raise ConfigError(f"ModelRegistry.register: {name!r} needs both arguments and parse_kwargs, or "
                              "neither")
        if not name or not name.replace("_", "").isalnum():
            raise ConfigError(f"ModelRegistry.register: model names are letters, digits and '_', "
                              f"got {name!r}")
        if name in self._entries and not replace:
            raise ConfigError(f"ModelRegistry.register: model {name!r} is already registered "
                              f"(by {self._entries[name].origin}); pass replace=True")
        doc = description if description is not None else (inspect.getdoc(builder) or "").split("\n")[0]
        self._entries[name] = ModelEntry(name=name, builder=builder, description=doc,
                                         arguments=tuple(arguments) if arguments is not None
                                         else _arguments(name, builder),
                                         origin=self._origin, signature=signature,
                                         batch_first_only=batch_first_only, parse=parse_kwargs)
        self._default_parameters.pop(name, None)

    def load_plugin(self, module_name: str) -> None:
        """Imports ``module_name`` and calls its ``register_models(registry)``."""
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ConfigError(f"ModelRegistry.load_plugin: cannot import {module_name!r}: {err}") from None
        hook = getattr(module, "register_models", None)
        if not callable(hook):
            raise ConfigError(f"ModelRegistry.load_plugin: {module_name!r} has no register_models(registry)")
        self._origin = module_name
        try:
            hook(self)
        finally:
            self._origin = BUILTIN
        self.plugins = (*self.plugins, module_name)
        logger.info("models: plugin %s loaded", module_name)

    def entries(self) -> list[ModelEntry]:
        """Every architecture, sorted by name."""
        return [self._entries[name] for name in sorted(self._entries)]

    def entry(self, name: str) -> ModelEntry:
        """The architecture called ``name``, or :class:`ModelNotFoundError`."""
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFoundError(f"CreateSession: unknown model {name[:80]!r}; known: "
                                     f"{', '.join(sorted(self._entries))}")
        return entry

    def parse_kwargs(self, name: str, kwargs_json: str) -> dict[str, Any]:
        """Validates a JSON object of keyword arguments and fills in the defaults."""
        entry = self.entry(name)
        if len(kwargs_json) > _MAX_KWARGS_JSON:
            raise InvalidRequestError(f"CreateSession: model_kwargs_json has {len(kwargs_json)} characters, "
                                      f"more than {_MAX_KWARGS_JSON}")
        try:
            given = json.loads(kwargs_json) if kwargs_json.strip() else {}
        except RecursionError:  # json recurses once per nesting level
            raise InvalidRequestError("CreateSession: model_kwargs_json is nested too deeply") from None
        except ValueError as err:  # JSONDecodeError, and an integer of more digits than Python converts
            raise InvalidRequestError(f"CreateSession: model_kwargs_json is not valid JSON: {err}") from None
        if not isinstance(given, dict):
            raise InvalidRequestError("CreateSession: model_kwargs_json must be a JSON object")
        if entry.parse is not None:
            return entry.parse(given)
        known = {argument.name: argument for argument in entry.arguments}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise InvalidRequestError(f"CreateSession: model {name!r} has no argument(s) {unknown}; "
                                      f"arguments: {sorted(known)}")
        kwargs = {}
        for argument in entry.arguments:
            if argument.name in given:
                kwargs[argument.name] = _coerce(name, argument, given[argument.name])
            elif argument.required:
                raise InvalidRequestError(f"CreateSession: model {name!r} needs argument {argument.name!r}")
            else:
                kwargs[argument.name] = argument.default
        return kwargs

    def build(self, name: str, kwargs: Mapping[str, Any], *, device: torch.device | str | None = None,
              lora: LoraAdapter | None = None) -> nn.Module:
        """Builds the model, with the LoRA adapter ``lora`` when given (peft: the model's own
        parameters are then frozen). A builder that rejects its arguments, or an adapter that does
        not fit the model, gives :class:`InvalidRequestError`."""
        entry = self.entry(name)
        try:
            with torch.device(device) if device is not None else contextlib.nullcontext():
                module = entry.builder(**kwargs)
                if lora is None:
                    return module
                try:
                    return lora.apply(module)
                except ConfigError as err:
                    raise InvalidRequestError(f"CreateSession: the LoRA adapter does not fit model {name!r}: "
                                              f"{err}") from None
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as err:  # includes psg's ConfigError
            raise InvalidRequestError(f"CreateSession: model {name!r} rejected its arguments: "
                                      f"{err}") from None

    def describe(self, name: str, kwargs: Mapping[str, Any], *, max_bytes: int,
                 lora: LoraAdapter | None = None) -> list[ParameterInfo]:
        """Parameters of the model (built on the meta device, so nothing is allocated), with
        ``requires_grad`` telling the trainable ones from the frozen ones.

        Raises :class:`LimitExceededError` when they add up to more than ``max_bytes``.
        """
        module = self.build(name, kwargs, device="meta", lora=lora)
        params = [ParameterInfo(n, p.dtype, tuple(p.shape), p.requires_grad)
                  for n, p in module.named_parameters()]
        total = sum(p.num_bytes for p in params)
        if total > max_bytes:
            raise LimitExceededError(f"CreateSession: model {name!r} with these arguments has {total} "
                                     f"parameter bytes, more than the server's limit of {max_bytes}")
        return params

    def default_parameters(self, name: str, *, max_bytes: int) -> list[ParameterInfo]:
        """Parameters of the model at its default arguments (``ListModels`` shows them), or an
        empty list when an argument is required or the defaults exceed ``max_bytes``. Computed
        once per entry."""
        if name not in self._default_parameters:
            entry = self.entry(name)
            params = None
            if entry.parse is None and not any(a.required for a in entry.arguments):
                kwargs = {a.name: a.default for a in entry.arguments}
                try:
                    params = self.describe(name, kwargs, max_bytes=max_bytes)
                except (InvalidRequestError, LimitExceededError) as err:
                    logger.warning("models: %s at its defaults: %s", name, err)
            self._default_parameters[name] = params
        return list(self._default_parameters[name] or ())

    def default_signature(self, name: str) -> ModelSignature | None:
        """What the model takes per row at its default arguments (``ListModels`` shows it); None
        when its entry states no signature, an argument is required, or the entry parses its own
        arguments (a Hugging Face config: there is no default)."""
        entry = self.entry(name)
        if entry.signature is None or entry.parse is not None or any(a.required for a in entry.arguments):
            return None
        return entry.signature(**{a.name: a.default for a in entry.arguments})

    def signature(self, name: str, kwargs: Mapping[str, Any]) -> ModelSignature | None:
        """What the model takes per row, if its entry says."""
        entry = self.entry(name)
        return None if entry.signature is None else entry.signature(**kwargs)


def default_registry(plugins: Sequence[str] = ()) -> ModelRegistry:
    """The built-in architectures (:mod:`psg_server.architectures`, the Hugging Face family
    included) plus the given plugins."""
    from psg_server import architectures

    registry = ModelRegistry()
    architectures.register_builtins(registry)
    for plugin in plugins:
        registry.load_plugin(plugin)
    return registry
