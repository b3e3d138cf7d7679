"""The one status table and its translator."""

from __future__ import annotations

import logging

import grpc
import pytest
from google.protobuf.message import DecodeError

from psg_core.errors import (BatchLayoutError, BudgetExhaustedError, ConfigError, NonFiniteInputError,
                             UnsupportedModuleError)
from psg_server.errors import (STATUS_TABLE, AuthenticationError, InvalidRequestError, LimitExceededError,
                               LossNotFoundError, ModelNotFoundError, NoWorkersError, ParametersMissingError,
                               SessionNotFoundError, StaleParametersError, StepSeedReusedError, StepTimeoutError,
                               translate)
from psg_wire.codec import CodecError, TensorLimitError

Code = grpc.StatusCode


@pytest.mark.parametrize("error, code, reason", [
    (CodecError("truncated"), Code.INVALID_ARGUMENT, "BAD_TENSOR"),
    (InvalidRequestError("shape"), Code.INVALID_ARGUMENT, "INVALID_REQUEST"),
    (ConfigError("dtype"), Code.INVALID_ARGUMENT, "INVALID_CONFIG"),
    (BatchLayoutError("K"), Code.INVALID_ARGUMENT, "BATCH_LAYOUT"),
    (NonFiniteInputError("nan"), Code.INVALID_ARGUMENT, "NON_FINITE_INPUT"),
    (UnsupportedModuleError("ew"), Code.INVALID_ARGUMENT, "UNSUPPORTED_MODULE"),
    (SessionNotFoundError("s"), Code.NOT_FOUND, "SESSION_NOT_FOUND"),
    (ModelNotFoundError("m"), Code.NOT_FOUND, "MODEL_NOT_FOUND"),
    (LossNotFoundError("l"), Code.NOT_FOUND, "LOSS_NOT_FOUND"),
    (StaleParametersError("v"), Code.FAILED_PRECONDITION, "STALE_PARAMETERS"),
    (ParametersMissingError("v"), Code.FAILED_PRECONDITION, "PARAMETERS_MISSING"),
    (BudgetExhaustedError("eps"), Code.FAILED_PRECONDITION, "BUDGET_EXHAUSTED"),
    (StepSeedReusedError("seed"), Code.FAILED_PRECONDITION, "STEP_SEED_REUSED"),
    (TensorLimitError("big"), Code.RESOURCE_EXHAUSTED, "LIMIT_EXCEEDED"),
    (LimitExceededError("big"), Code.RESOURCE_EXHAUSTED, "LIMIT_EXCEEDED"),
    (NoWorkersError("none"), Code.UNAVAILABLE, "NO_WORKERS"),
    (StepTimeoutError("slow"), Code.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    (TimeoutError(), Code.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    (AuthenticationError("who"), Code.UNAUTHENTICATED, "UNAUTHENTICATED"),
])
def test_domain_errors_map_to_their_status(error: Exception, code: grpc.StatusCode, reason: str) -> None:
    status = translate(error)
    assert (status.code, status.reason) == (code, reason)
    assert status.message == (str(error) or type(error).__name__)


def test_protobuf_decode_errors_get_a_public_message() -> None:
    status = translate(DecodeError("Error parsing message with type 'x': wire format was corrupt"))
    assert status.code == Code.INVALID_ARGUMENT
    assert status.message == "the request is not a valid psg.v1 protobuf message"


def test_unexpected_errors_are_internal_with_a_reference_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="psg_server.errors"):
        status = translate(KeyError("secret detail"), method="ComputeGradients")
    assert status.code == Code.INTERNAL and "secret detail" not in status.message
    reference = status.message.split("reference ")[1].split(")")[0]
    assert any(reference in r.getMessage() and r.exc_info for r in caplog.records)


def test_subclasses_come_before_their_bases_in_the_table() -> None:
    for i, (earlier, _, _) in enumerate(STATUS_TABLE):
        for later, _, _ in STATUS_TABLE[i + 1:]:
            assert not issubclass(later, earlier) or later is earlier, (later, earlier)
