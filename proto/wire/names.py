"""Names both ends of the wire agree on and the ``.proto`` files cannot express.

The service's full name, the trailing-metadata key that carries an error's machine-readable
reason and the reasons themselves, and the tensor names of a ``ComputeGradients`` batch: positional
model arguments travel as ``inputs/0``, ``inputs/1``, ..., keyword arguments as ``inputs/<name>``,
and the targets as ``targets`` (``proto/README.md``).

>>> input_name(0), input_name("attention_mask"), TARGETS
('inputs/0', 'inputs/attention_mask', 'targets')
"""

from __future__ import annotations

from psg_wire.v1 import gradient_service_pb2 as _pb

__all__ = [
    "INPUT_PREFIX",
    "REASON_METADATA_KEY",
    "SERVICE_NAME",
    "TARGETS",
    "Reason",
    "input_name",
]

#: Full name of the gRPC service (``psg.v1.GradientService``), as health checks and reflection
#: know it and as method paths start.
SERVICE_NAME: str = _pb.DESCRIPTOR.services_by_name["GradientService"].full_name

#: Trailing metadata key of an error status carrying its :class:`Reason`.
REASON_METADATA_KEY = "psg-error-reason"

#: Prefix of the tensor names of a batch's model inputs.
INPUT_PREFIX = "inputs/"

#: Name of a batch's target tensor.
TARGETS = "targets"


def input_name(key: int | str) -> str:
    """Wire name of a model input: ``inputs/<i>`` for positional argument ``i``, ``inputs/<name>``
    for a keyword argument.

    >>> input_name(2)
    'inputs/2'
    """
    return f"{INPUT_PREFIX}{key}"


class Reason:
    """The machine-readable reasons an error status carries under :data:`REASON_METADATA_KEY`.

    Plain strings (not an enum) because they travel as metadata values; the server's status table
    (``psg_server.errors.STATUS_TABLE``) picks one per error, and clients branch on them (the
    Python client pushes its parameters again on :attr:`PARAMETERS_MISSING`).
    """

    UNAUTHENTICATED = "UNAUTHENTICATED"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    LOSS_NOT_FOUND = "LOSS_NOT_FOUND"
    STALE_PARAMETERS = "STALE_PARAMETERS"
    PARAMETERS_MISSING = "PARAMETERS_MISSING"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    NO_WORKERS = "NO_WORKERS"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    BAD_TENSOR = "BAD_TENSOR"
    BAD_MESSAGE = "BAD_MESSAGE"
    NON_FINITE_INPUT = "NON_FINITE_INPUT"
    BATCH_LAYOUT = "BATCH_LAYOUT"
    UNSUPPORTED_MODULE = "UNSUPPORTED_MODULE"
    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_CONFIG = "INVALID_CONFIG"
    INTERNAL = "INTERNAL"
