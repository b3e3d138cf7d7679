"""A process-wide choice among an enum's values: the convolution strategy, the matrix-product kernel.

Set in code (for the process, or for a block), else read from an environment variable, else a
default that the caller computes (it may depend on the device). The setting is process-wide, like
``torch.backends.cudnn.benchmark``: every thread sees it.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator
from typing import Generic, TypeVar

from psg_core.errors import ConfigError

__all__ = ["ProcessSetting"]

E = TypeVar("E", bound=enum.Enum)


class ProcessSetting(Generic[E]):
    """One setting: ``kind``'s values, the ``variable`` that sets the default, ``what`` for messages.

    >>> class Colour(str, enum.Enum):
    ...     RED = "red"
    ...     BLUE = "blue"
    >>> colour = ProcessSetting(Colour, "PSG_TEST_COLOUR", "colour")
    >>> with colour.scoped("blue", where="example"):
    ...     colour.current(Colour.RED)
    <Colour.BLUE: 'blue'>
    >>> colour.current(Colour.RED)
    <Colour.RED: 'red'>
    """

    def __init__(self, kind: type[E], variable: str, what: str) -> None:
        self.kind = kind
        self.variable = variable
        self.what = what
        self.forced: E | None = None

    def parse(self, value: E | str, *, where: str) -> E:
        """``value`` as one of the enum's members; a ConfigError naming them otherwise."""
        try:
            return self.kind(value)
        except ValueError:
            raise ConfigError(f"{where}: unknown {self.what} {value!r}; expected one of "
                              f"{[member.value for member in self.kind]}") from None

    def set(self, value: E | str | None, *, where: str) -> None:
        """Sets the value for the process (None: back to the environment variable or the default)."""
        self.forced = None if value is None else self.parse(value, where=where)

    @contextlib.contextmanager
    def scoped(self, value: E | str | None, *, where: str) -> Iterator[None]:
        """:meth:`set` for the duration of a block, then the previous setting."""
        previous = self.forced
        self.set(value, where=where)
        try:
            yield
        finally:
            self.forced = previous

    def current(self, default: E) -> E:
        """The value set, else the environment variable's, else ``default``."""
        if self.forced is not None:
            return self.forced
        from_env = os.environ.get(self.variable, "").strip()
        if from_env:
            return self.parse(from_env, where=f"environment variable {self.variable}")
        return default
