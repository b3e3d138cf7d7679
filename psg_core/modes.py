"""Closed sets of choices, as enums parsed once at the entry point."""

from __future__ import annotations

import enum

from psg_core.errors import ConfigError

__all__ = ["GradSampleMode", "LossReduction", "Clipping", "parse_enum"]


class GradSampleMode(str, enum.Enum):
    """Backend that computes per-sample gradients."""

    HOOKS = "hooks"
    FUNCTORCH = "functorch"
    EW = "ew"
    GHOST = "ghost"


class LossReduction(str, enum.Enum):
    """How the batch loss reduces the per-row losses."""

    MEAN = "mean"
    SUM = "sum"


class Clipping(str, enum.Enum):
    """Per-sample clipping rule."""

    FLAT = "flat"
    PER_LAYER = "per_layer"
    AUTOMATIC = "automatic"


def parse_enum(enum_type: type[enum.Enum], value: object, *, what: str) -> enum.Enum:
    """Turns ``value`` (an enum member or its string value) into a member of ``enum_type``.

    Raises :class:`~psg_core.errors.ConfigError` naming ``what`` and the allowed values.

    >>> parse_enum(LossReduction, "sum", what="loss_reduction")
    <LossReduction.SUM: 'sum'>
    """
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_type)  # type: ignore[attr-defined]
        raise ConfigError(f"{what}: expected one of {allowed}, got {value!r}") from None
