"""Names both ends of the wire agree on and the ``.proto`` files cannot express.

The service's full name, the trailing-metadata key that carries an error's machine-readable
reason and the reasons themselves, and the tensor names of a ``ComputeGradients`` batch: positional
model arguments travel as ``inputs/0``, ``inputs/1``, ..., keyword arguments as ``inputs/<name>``,
the targets as ``targets``, and parameters pushed with the step as ``parameters/<name>``
(``proto/README.md``).

>>> input_name(0), input_name("attention_mask"), TARGETS
('inputs/0', 'inputs/attention_mask', 'targets')
>>> parse_input_name("inputs/attention_mask"), parse_input_name("targets")
('attention_mask', None)
"""

from __future__ import annotations

from psg_wire.v1 import gradient_service_pb2 as _pb

__all__ = [
    "INPUT_PREFIX",
    "MAX_INPUT_NAME",
    "PARAMETER_PREFIX",
    "REASON_METADATA_KEY",
    "SERVICE_NAME",
    "TARGETS",
    "Reason",
    "input_name",
    "parameter_name",
    "parse_input_name",
    "parse_parameter_name",
]

#: Full name of the gRPC service (``psg.v1.GradientService``), as health checks and reflection
#: know it and as method paths start.
SERVICE_NAME: str = _pb.DESCRIPTOR.services_by_name["GradientService"].full_name

#: Trailing metadata key of an error status carrying its :class:`Reason`.
REASON_METADATA_KEY = "psg-error-reason"

#: Prefix of the tensor names of a batch's model inputs.
INPUT_PREFIX = "inputs/"

#: Prefix of the parameters a ``ComputeGradients`` request pushes before its batch
#: (``ComputeGradientsHeader.push_version``).
PARAMETER_PREFIX = "parameters/"

#: Name of a batch's target tensor.
TARGETS = "targets"

#: Longest keyword of a named input (``inputs/<name>``).
MAX_INPUT_NAME = 64


def input_name(key: int | str) -> str:
    """Wire name of a model input: ``inputs/<i>`` for positional argument ``i``, ``inputs/<name>``
    for a keyword argument.

    >>> input_name(2)
    'inputs/2'
    """
    return f"{INPUT_PREFIX}{key}"


def parameter_name(name: str) -> str:
    """Wire name of a parameter pushed within a ``ComputeGradients`` request.

    >>> parameter_name("0.weight"), parse_parameter_name("parameters/0.weight"), parse_parameter_name("targets")
    ('parameters/0.weight', '0.weight', None)
    """
    return f"{PARAMETER_PREFIX}{name}"


def parse_parameter_name(name: str) -> str | None:
    """The parameter a ``parameters/<name>`` tensor carries, or None for any other name."""
    return name[len(PARAMETER_PREFIX):] if name.startswith(PARAMETER_PREFIX) else None


def parse_input_name(name: str) -> int | str | None:
    """What a batch tensor's name says about the model argument it is: the position ``i`` of
    ``inputs/<i>``, the keyword of ``inputs/<name>``, or None when ``name`` is neither (``targets``,
    or a malformed name).

    A position is written in decimal without leading zeros; a keyword is an ASCII Python
    identifier (as keyword arguments are) of at most :data:`MAX_INPUT_NAME` characters.

    >>> parse_input_name("inputs/1"), parse_input_name("inputs/input_ids")
    (1, 'input_ids')
    >>> parse_input_name("inputs/01"), parse_input_name("inputs/not-a-name"), parse_input_name("inputs/")
    (None, None, None)
    """
    if not name.startswith(INPUT_PREFIX):
        return None
    key = name[len(INPUT_PREFIX):]
    if not key.isascii():
        return None
    if key.isdigit():
        return int(key) if key == str(int(key)) else None
    return key if key.isidentifier() and len(key) <= MAX_INPUT_NAME else None


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
    #: A part of a logical batch came out of order (its earlier parts were never received, or were
    #: lost with a server restart): send the logical batch again from part 0.
    ACCUMULATION_LOST = "ACCUMULATION_LOST"
    #: A step's seed was used by an earlier step of the session (the same seed draws the same
    #: noise): give each step its own ``step_seed``, or leave it unset.
    STEP_SEED_REUSED = "STEP_SEED_REUSED"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    NO_WORKERS = "NO_WORKERS"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    #: A request stream sent nothing for the server's ``--stream-idle-seconds``: the call was ended.
    STREAM_IDLE = "STREAM_IDLE"
    BAD_TENSOR = "BAD_TENSOR"
    BAD_MESSAGE = "BAD_MESSAGE"
    NON_FINITE_INPUT = "NON_FINITE_INPUT"
    BATCH_LAYOUT = "BATCH_LAYOUT"
    UNSUPPORTED_MODULE = "UNSUPPORTED_MODULE"
    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_CONFIG = "INVALID_CONFIG"
    INTERNAL = "INTERNAL"
