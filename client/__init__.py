"""psg_client: Python client for the psg gradient service.

>>> from psg_client import GradientClient, ServiceError
>>> GradientClient.__name__
'GradientClient'
"""

from __future__ import annotations

from psg_client.client import (GradientClient, GradientResult, RetryPolicy, ServiceError, Session,
                               TLSConfig)
from psg_core.adaptive_clipping import QuantileClipping
from psg_wire.adapters import LoraAdapter
from psg_wire.codec import CodecError, CodecLimits, TensorLimitError
from psg_wire.convert import WireDtypes

__all__ = [
    "CodecError",
    "CodecLimits",
    "GradientClient",
    "GradientResult",
    "LoraAdapter",
    "QuantileClipping",
    "RetryPolicy",
    "ServiceError",
    "Session",
    "TLSConfig",
    "TensorLimitError",
    "WireDtypes",
]
