"""Errors of the service and the one table that maps every error to a gRPC status.

Servicer methods never catch anything: the method wrapper in :mod:`psg_server.service` hands every
exception to :func:`translate`, which walks :data:`STATUS_TABLE` (first match by ``isinstance``)
and returns the status code, the public message and a short machine-readable reason
(:class:`psg_wire.names.Reason`) that travels as trailing metadata ``psg-error-reason``. Anything
not in the table is INTERNAL with a generic message and a reference id; the detail goes to the log
under that id.

>>> translate(SessionNotFoundError("GetSession: no session 'abc'")).code
<StatusCode.NOT_FOUND: (5, 'not found')>
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from psg_core.errors import (BatchLayoutError, BudgetExhaustedError, ConfigError, NonFiniteInputError,
                             PsgError, UnsupportedModuleError)
from psg_wire.codec import CodecError, TensorLimitError
from psg_wire.names import REASON_METADATA_KEY, Reason

__all__ = [
    "REASON_METADATA_KEY",
    "STATUS_TABLE",
    "AccumulationLostError",
    "AuthenticationError",
    "InvalidRequestError",
    "LimitExceededError",
    "LossNotFoundError",
    "ModelNotFoundError",
    "NoWorkersError",
    "ParametersMissingError",
    "SessionNotFoundError",
    "StaleParametersError",
    "Status",
    "StepSeedReusedError",
    "StepTimeoutError",
    "StreamIdleError",
    "translate",
]

logger = logging.getLogger(__name__)


class InvalidRequestError(PsgError, ValueError):
    """A request is malformed: missing header, a tensor that does not fit the model, bad kwargs."""


class SessionNotFoundError(PsgError, LookupError):
    """No such session for this caller (also what another token's session looks like)."""


class ModelNotFoundError(PsgError, LookupError):
    """The model registry has no architecture of that name."""


class LossNotFoundError(PsgError, LookupError):
    """The server knows no loss of that name."""


class StaleParametersError(PsgError):
    """The step names a parameter version older than the session's latest."""


class StepSeedReusedError(PsgError):
    """A step names a step seed an earlier step of the session used: the same seed would draw the
    same noise (:mod:`psg_server.step_seeds`)."""


class ParametersMissingError(PsgError):
    """The session holds no parameters for the requested version (never pushed, or dropped by the
    server under memory pressure); the client should push them again."""


class AccumulationLostError(PsgError):
    """A part of a logical batch arrived without its earlier parts (never sent, out of order, or
    lost with a restart of the server); the client sends the logical batch again from part 0."""


class LimitExceededError(PsgError):
    """A request exceeds a server limit (batch rows, model size, sessions, parameter memory)."""


class NoWorkersError(PsgError):
    """No live worker can run shards right now."""


class StepTimeoutError(PsgError):
    """A step ran past its deadline; its shards were cancelled."""


class StreamIdleError(PsgError):
    """A request stream sent no message for the server's ``stream_idle_seconds``."""


class AuthenticationError(PsgError):
    """Missing, malformed or unknown bearer token."""


#: (error type, status code, reason). First isinstance match wins, so subclasses come first.
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, str], ...] = (
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED),
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND, Reason.SESSION_NOT_FOUND),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND, Reason.MODEL_NOT_FOUND),
    (LossNotFoundError, grpc.StatusCode.NOT_FOUND, Reason.LOSS_NOT_FOUND),
    (StaleParametersError, grpc.StatusCode.FAILED_PRECONDITION, Reason.STALE_PARAMETERS),
    (ParametersMissingError, grpc.StatusCode.FAILED_PRECONDITION, Reason.PARAMETERS_MISSING),
    (BudgetExhaustedError, grpc.StatusCode.FAILED_PRECONDITION, Reason.BUDGET_EXHAUSTED),
    (AccumulationLostError, grpc.StatusCode.FAILED_PRECONDITION, Reason.ACCUMULATION_LOST),
    (StepSeedReusedError, grpc.StatusCode.FAILED_PRECONDITION, Reason.STEP_SEED_REUSED),
    (TensorLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.LIMIT_EXCEEDED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.LIMIT_EXCEEDED),
    (NoWorkersError, grpc.StatusCode.UNAVAILABLE, Reason.NO_WORKERS),
    (StepTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED, Reason.DEADLINE_EXCEEDED),
    (StreamIdleError, grpc.StatusCode.DEADLINE_EXCEEDED, Reason.STREAM_IDLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED, Reason.DEADLINE_EXCEEDED),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_TENSOR),
    (DecodeError, grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_MESSAGE),
    (NonFiniteInputError, grpc.StatusCode.INVALID_ARGUMENT, Reason.NON_FINITE_INPUT),
    (BatchLayoutError, grpc.StatusCode.INVALID_ARGUMENT, Reason.BATCH_LAYOUT),
    (UnsupportedModuleError, grpc.StatusCode.INVALID_ARGUMENT, Reason.UNSUPPORTED_MODULE),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_REQUEST),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_CONFIG),
)

#: Reasons by which the service fails a request it should have served: logged at ERROR, as are
#: unexpected errors. Every other reason refuses what the caller got wrong or a limit it hit (an idle
#: request stream too): logged at WARNING, so the operator sees those too but never mistakes them
#: for the server's own faults.
_SERVER_FAILURES = frozenset({Reason.NO_WORKERS, Reason.DEADLINE_EXCEEDED})

# Messages of known errors are written for the caller; protobuf's own are not, so they get this.
_PUBLIC_MESSAGES: dict[type[BaseException], str] = {
    DecodeError: "the request is not a valid psg.v1 protobuf message",
}


@dataclass(frozen=True)
class Status:
    """What the caller sees for one error."""

    code: grpc.StatusCode
    message: str
    reason: str


def translate(error: BaseException, *, method: str = "") -> Status:
    """Maps ``error`` to its :class:`Status` through :data:`STATUS_TABLE` and logs it.

    Args:
        error: what the servicer raised.
        method: the RPC's name, for the log.
    """
    for error_type, code, reason in STATUS_TABLE:
        if isinstance(error, error_type):
            message = _PUBLIC_MESSAGES.get(error_type) or str(error) or error_type.__name__
            level = logging.ERROR if reason in _SERVER_FAILURES else logging.WARNING
            logger.log(level, "%s: %s (%s): %s", method or "rpc", code.name, reason, error)
            return Status(code=code, message=message, reason=reason)
    reference = secrets.token_hex(6)
    logger.error("%s: unexpected error, reference %s", method or "rpc", reference, exc_info=error)
    return Status(code=grpc.StatusCode.INTERNAL,
                  message=f"internal server error (reference {reference}); see the server log",
                  reason=Reason.INTERNAL)
