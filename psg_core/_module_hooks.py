"""Forward hooks put on many modules at once and taken off together, without a handle per hook.

Every psg step hooks the model's modules (the batch tracker two hooks per module, a backend one per
layer with parameters) and unhooks them at its end. ``Module.register_forward_hook`` builds a
:class:`torch.utils.hooks.RemovableHandle` per hook (three weak references, a lookup of its
dictionaries at removal): on a 20-module model that was ~80 us of a step's host time on a CPU,
more on a GPU host. :class:`ModuleHooks` writes the same entries into the same dictionaries
(``_forward_pre_hooks``, ``_forward_hooks`` and their ``with_kwargs`` / ``always_call`` flags), with
keys drawn from the handles' own counter, so torch runs them exactly as registered hooks (same
order, ``prepend`` included) and a handle torch or the user creates later never collides with one.

>>> import torch
>>> from torch import nn
>>> layer, seen = nn.Linear(2, 2), []
>>> hooks = ModuleHooks()
>>> hooks.forward(layer, lambda m, args, out: seen.append("after"))
>>> hooks.forward(layer, lambda m, args, out: seen.append("first"), prepend=True)
>>> hooks.pre(layer, lambda m, args: seen.append("before"))
>>> _ = layer(torch.zeros(1, 2)); hooks.remove(); _ = layer(torch.zeros(1, 2))
>>> seen, len(layer._forward_hooks), len(layer._forward_pre_hooks)
(['before', 'first', 'after'], 0, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ModuleHooks"]


def _next_key() -> int:
    """A hook key no handle holds: taken from :class:`RemovableHandle`'s counter, as a handle's is."""
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    return key


class ModuleHooks:
    """A set of forward (pre-)hooks on modules, removed together by :meth:`remove`."""

    __slots__ = ("_added",)

    def __init__(self) -> None:
        # (hook dictionary, its flag dictionaries, key) per hook added
        self._added: list[tuple[dict[int, Any], tuple[dict[int, Any], ...], int]] = []

    def pre(self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        """``module.register_forward_pre_hook(hook, with_kwargs=...)``."""
        key = _next_key()
        hooks, flags = module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs
        hooks[key] = hook
        if with_kwargs:
            flags[key] = True
        self._added.append((hooks, (flags,), key))

    def forward(self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False,
                always_call: bool = False, prepend: bool = False) -> None:
        """``module.register_forward_hook(hook, with_kwargs=..., always_call=..., prepend=...)``."""
        key = _next_key()
        hooks = module._forward_hooks
        hooks[key] = hook
        if with_kwargs:
            module._forward_hooks_with_kwargs[key] = True
        if always_call:
            module._forward_hooks_always_called[key] = True
        if prepend:
            hooks.move_to_end(key, last=False)  # type: ignore[attr-defined]
        self._added.append((hooks, (module._forward_hooks_with_kwargs, module._forward_hooks_always_called), key))

    def remove(self) -> None:
        """Takes every hook off (idempotent)."""
        for hooks, flags, key in self._added:
            hooks.pop(key, None)
            for table in flags:
                table.pop(key, None)
        self._added.clear()

    def __len__(self) -> int:
        return len(self._added)

    def __bool__(self) -> bool:
        return bool(self._added)

