"""Exception hierarchy of psg_core.

Every error psg raises derives from :class:`PsgError`, and also from the builtin exception a
caller would naturally catch (``ValueError``, ``NotImplementedError``), so both styles work::

    >>> try:
    ...     raise BatchLayoutError("per_sample_gradients: 7 input rows are not divisible by K=2")
    ... except ValueError as err:
    ...     print(type(err).__name__)
    BatchLayoutError

The server maps these classes to gRPC status codes in one table (``psg_server.errors``).
"""

from __future__ import annotations

__all__ = [
    "PsgError",
    "ConfigError",
    "BatchLayoutError",
    "NonFiniteInputError",
    "UnsupportedModuleError",
    "GradAccumulationError",
    "BudgetExhaustedError",
]


class PsgError(Exception):
    """Root of every error raised by psg."""


class ConfigError(PsgError, ValueError):
    """An argument or configuration value is invalid (bad mode, negative norm bound, ...)."""


class BatchLayoutError(PsgError, ValueError):
    """The batch does not have the documented layout (e.g. rows not divisible by K)."""


class NonFiniteInputError(PsgError, ValueError):
    """An input tensor contains NaN or infinity."""


class UnsupportedModuleError(PsgError, NotImplementedError):
    """A module cannot get per-sample gradients with the chosen backend."""


class GradAccumulationError(PsgError, ValueError):
    """A second backward pass ran while gradient accumulation is forbidden."""


class BudgetExhaustedError(PsgError):
    """A step would exceed the privacy budget."""
