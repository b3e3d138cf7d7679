"""The examples in psg_wire's docstrings run (``make test`` collects doctests from psg_core only)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["psg_wire", "psg_wire.adapters", "psg_wire.codec", "psg_wire.convert", "psg_wire.names"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
