"""Fixtures of the core suites.

``device``: the oracle tests run once per device of :data:`tests.devices.DEVICES`: on the CPU
always, on CUDA where torch sees a GPU (skipped otherwise, with the reason; ``PSG_REQUIRE_CUDA=1``
makes that a failure). Running ``pytest`` on a GPU host is all it takes to run the CUDA cases, and
``pytest -m cuda`` runs only them; nothing in CI needs a GPU. On CUDA the fixture holds TF32 off
while the test runs (:func:`tests.devices.oracle_precision`), so float32 results are compared at
float32 precision.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.devices import CUDA_AVAILABLE, DEVICES, oracle_precision


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device the test computes on (see the module docstring)."""
    chosen = torch.device(request.param)
    if chosen.type == "cuda" and not CUDA_AVAILABLE:  # only reached with PSG_REQUIRE_CUDA=1
        pytest.fail("PSG_REQUIRE_CUDA=1, but torch sees no CUDA device", pytrace=False)
    with oracle_precision(chosen):
        yield chosen
