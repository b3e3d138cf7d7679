"""A registry of per-layer-type entries, shared by the grad samplers and the ghost norms.

Lookup walks the class MRO, and a subclass that overrides ``forward`` inherits nothing (it may
compute anything). A type may also be registered by its dotted name (``"package.module.Class"``)
so that psg_core need not import an optional library to support one of its layers: the name is
resolved at lookup time, once that module is in ``sys.modules`` (the model that uses the layer
has imported it by then).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from torch import nn

from psg_core.errors import ConfigError

__all__ = ["LayerTypeRegistry", "LayerKey"]

#: A layer type, or its dotted name ``"package.module.Class"`` resolved when that module is loaded.
LayerKey = type[nn.Module] | str


class _Entry(Protocol):
    @property
    def layer_type(self) -> type[nn.Module]: ...

    @property
    def fn(self) -> Callable[..., Any]: ...


_E = TypeVar("_E", bound=_Entry)


def _dotted_name(layer_type: type[nn.Module]) -> str:
    return f"{layer_type.__module__}.{layer_type.__qualname__}"


class LayerTypeRegistry(Generic[_E]):
    """Layer types (or their dotted names) -> entries.

    Args:
        what: what an entry is, for messages (``"grad sampler"``).
        decorator: the public registration function, for messages (``"register_grad_sampler"``).
    """

    def __init__(self, *, what: str, decorator: str) -> None:
        self._what = what
        self._decorator = decorator
        self._entries: dict[type[nn.Module], _E] = {}
        #: dotted names not resolved yet -> the entry to make for the type once it is.
        self._deferred: dict[str, Callable[[type[nn.Module]], _E]] = {}
        #: types resolved from a dotted name (left out of iteration, see __iter__).
        self._resolved: set[type[nn.Module]] = set()
        #: ``len(sys.modules)`` when the deferred names were last tried with none mid-import:
        #: a lookup tries them again only once more modules are loaded (-1: try at the next).
        self._tried_at = -1

    # --------------------------------------------------------------------------- registration
    def check_keys(self, layer_types: Sequence[Any]) -> None:
        """:class:`ConfigError` unless ``layer_types`` is a non-empty list of nn.Module subclasses
        or dotted names."""
        if not layer_types:
            raise ConfigError(f"{self._decorator}: give at least one layer type")
        for key in layer_types:
            if isinstance(key, str):
                parts = key.split(".")
                if len(parts) < 2 or not all(part.isidentifier() for part in parts):
                    raise ConfigError(f"{self._decorator}: a layer named by a string must be "
                                      f"'package.module.Class', got {key!r}")
            elif not (isinstance(key, type) and issubclass(key, nn.Module)):
                raise ConfigError(
                    f"{self._decorator}: expected nn.Module subclasses, got {key!r}")

    def add(self, layer_types: Sequence[LayerKey], make_entry: Callable[[type[nn.Module]], _E], *,
            replace: bool) -> None:
        """Registers ``make_entry(layer_type)`` for every key (checked with :meth:`check_keys`).

        A key that already has an entry (by type or by the same dotted name) raises
        :class:`ConfigError` unless ``replace``.
        """
        self.check_keys(layer_types)
        for key in layer_types:
            current = self._current(key)
            if current is not None and not replace:
                label = key if isinstance(key, str) else key.__qualname__
                raise ConfigError(f"{self._decorator}: {label} already has a {self._what} ({current}); "
                                  "pass replace=True to override it")
        for key in layer_types:
            if isinstance(key, str):
                for resolved in [t for t in self._resolved if _dotted_name(t) == key]:
                    self._resolved.discard(resolved)
                    del self._entries[resolved]
                self._deferred[key] = make_entry
                self._tried_at = -1  # its module may be loaded already
            else:
                self._deferred.pop(_dotted_name(key), None)
                self._resolved.discard(key)
                self._entries[key] = make_entry(key)

    def _current(self, key: LayerKey) -> str | None:
        """The qualified name of the function registered for ``key`` (type or name), if any."""
        name = key if isinstance(key, str) else _dotted_name(key)
        entry = None if isinstance(key, str) else self._entries.get(key)
        if entry is None:
            entry = next((e for t, e in self._entries.items() if _dotted_name(t) == name), None)
        if entry is not None:
            return entry.fn.__qualname__
        return "registered by name" if name in self._deferred else None

    def unregister(self, layer_type: LayerKey) -> None:
        """Removes the entry registered for exactly ``layer_type`` (a type or dotted name;
        KeyError if none)."""
        if isinstance(layer_type, str):
            resolved = [t for t in self._resolved if _dotted_name(t) == layer_type]
            if layer_type not in self._deferred and not resolved:
                raise KeyError(layer_type)
            self._deferred.pop(layer_type, None)
            for t in resolved:
                self._resolved.discard(t)
                del self._entries[t]
            return
        del self._entries[layer_type]
        self._resolved.discard(layer_type)

    # --------------------------------------------------------------------------- lookup
    def _resolve_deferred(self) -> None:
        """Turns the dotted names whose module is loaded into type entries."""
        loaded = len(sys.modules)
        mid_import = False
        for name, make_entry in list(self._deferred.items()):
            module_name, _, class_name = name.rpartition(".")
            module = sys.modules.get(module_name)
            layer_type = getattr(module, class_name, None) if module is not None else None
            if layer_type is None:
                mid_import = mid_import or module is not None
                continue  # not imported yet (or mid-import): try again at a later lookup
            if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
                raise ConfigError(f"{self._decorator}: {name!r} is a {type(layer_type).__name__}, not an "
                                  "nn.Module subclass")
            self._deferred.pop(name, None)
            if layer_type not in self._entries:
                self._entries[layer_type] = make_entry(layer_type)
                self._resolved.add(layer_type)
        self._tried_at = -1 if mid_import else loaded

    def lookup(self, layer: nn.Module | type[nn.Module]) -> _E | None:
        """The entry for ``layer`` (instance or type): its own type first, then its bases."""
        if self._deferred and len(sys.modules) != self._tried_at:
            self._resolve_deferred()
        layer_type = layer if isinstance(layer, type) else type(layer)
        for klass in layer_type.__mro__:
            entry = self._entries.get(klass)
            if entry is not None:
                # A subclass that computes something else than the registered layer must not
                # inherit its entry silently.
                return entry if layer_type.forward is entry.layer_type.forward else None
        return None

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, (nn.Module, type)) and self.lookup(layer) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[type[nn.Module]]:
        """The types registered as types, sorted by name. Those registered by dotted name are left
        out even once resolved, so that a listing does not depend on what the process imported
        (see :meth:`deferred_names`)."""
        return iter(sorted((t for t in self._entries if t not in self._resolved), key=lambda t: t.__qualname__))

    def __len__(self) -> int:
        return len(self._entries) - len(self._resolved)

    def deferred_names(self) -> list[str]:
        """The dotted names registered, resolved or not, sorted."""
        return sorted({*self._deferred, *(_dotted_name(t) for t in self._resolved)})
