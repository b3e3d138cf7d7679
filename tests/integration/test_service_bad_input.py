"""Every kind of bad input gets its exact status code, and the server keeps answering."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from psg_client import GradientClient, ServiceError
from psg_core.config import DPConfig
from psg_server.background import BackgroundServer
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_wire.v1 import gradient_service_pb2_grpc as pb_grpc
from psg_wire.v1.tensor_pb2 import TensorHeader
from tests.server.service_harness import (MLP_KWARGS, TOKEN_ALICE, TOKEN_BOB, build, client_for, local_dp, mlp_batch,
                                          serve)

Code = grpc.StatusCode
ALICE = (("authorization", f"Bearer {TOKEN_ALICE}"),)
MAX_TENSOR_BYTES = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with serve(tokens={TOKEN_ALICE: "alice", TOKEN_BOB: "bob"}, max_tensor_bytes=MAX_TENSOR_BYTES,
               max_batch_rows=64) as running:
        yield running


@pytest.fixture()
def alice(server: BackgroundServer) -> Iterator[GradientClient]:
    with client_for(server, TOKEN_ALICE) as client:
        yield client


@pytest.fixture()
def stub(server: BackgroundServer) -> Iterator[pb_grpc.GradientServiceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GradientServiceStub(channel)


@pytest.fixture()
def session(alice: GradientClient) -> Any:
    created = alice.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                   config=DPConfig(augmentation_multiplicity=2))
    created.push_parameters(build())
    return created


def status_of(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, str]:
    """Runs a call that must fail; returns (code, details, reason), checking the server still answers."""
    with pytest.raises((ServiceError, grpc.RpcError)) as err:
        call()
    error = err.value
    if isinstance(error, ServiceError):
        return error.code, error.details, error.reason
    reason = next((v for k, v in (error.trailing_metadata() or ()) if k == "psg-error-reason"), "")
    return error.code(), error.details(), reason


@pytest.fixture(autouse=True)
def server_still_answers(alice: GradientClient) -> Iterator[None]:
    yield
    assert alice.server_info().version  # after every bad request the server is alive and well


def compute_stream(session_id: str, version: int, frames: list[Any]) -> Iterator[pb.ComputeGradientsRequest]:
    yield pb.ComputeGradientsRequest(header=pb.ComputeGradientsHeader(session_id=session_id, param_version=version))
    for frame in frames:
        yield (pb.ComputeGradientsRequest(tensor=frame) if isinstance(frame, TensorHeader)
               else pb.ComputeGradientsRequest(chunk=frame))


def run_compute(stub: pb_grpc.GradientServiceStub, session_id: str, version: int, frames: list[Any]) -> None:
    list(stub.ComputeGradients(compute_stream(session_id, version, frames), metadata=ALICE, timeout=30))


def test_truncated_tensor_bytes(stub: pb_grpc.GradientServiceStub, session: Any) -> None:
    frames = [TensorHeader(name="inputs/0", dtype="float32", shape=[2, 6], num_bytes=48), b"\x00" * 20]
    code, details, reason = status_of(lambda: run_compute(stub, session.id, 1, frames))
    assert (code, reason) == (Code.INVALID_ARGUMENT, "BAD_TENSOR") and "truncated: 20 of 48" in details
    header = pb.PushParametersRequest(header=pb.PushParametersHeader(session_id=session.id, version=2))
    short = [header, pb.PushParametersRequest(tensor=TensorHeader(name="0.bias", dtype="float32", shape=[8],
                                                                   num_bytes=32)),
             pb.PushParametersRequest(chunk=b"\x00" * 31)]
    code, details, _ = status_of(lambda: stub.PushParameters(iter(short), metadata=ALICE, timeout=30))
    assert code == Code.INVALID_ARGUMENT and "truncated" in details


def test_byte_count_that_does_not_match_the_shape(stub: pb_grpc.GradientServiceStub, session: Any) -> None:
    frames = [TensorHeader(name="inputs/0", dtype="float32", shape=[2, 6], num_bytes=40), b"\x00" * 40]
    code, details, _ = status_of(lambda: run_compute(stub, session.id, 1, frames))
    assert code == Code.INVALID_ARGUMENT and "declares 40 bytes but float32[2, 6] needs 48" in details


def test_unknown_dtype(stub: pb_grpc.GradientServiceStub, session: Any) -> None:
    frames = [TensorHeader(name="inputs/0", dtype="complex64", shape=[2, 6], num_bytes=96), b"\x00" * 96]
    code, details, _ = status_of(lambda: run_compute(stub, session.id, 1, frames))
    assert code == Code.INVALID_ARGUMENT and "unknown dtype 'complex64'" in details


def test_shape_that_does_not_fit_the_model(alice: GradientClient, session: Any) -> None:
    targets = torch.zeros(4, dtype=torch.long)
    code, details, _ = status_of(lambda: session.compute_gradients(torch.randn(4, 5), targets))
    assert code == Code.INVALID_ARGUMENT and "does not fit the model: expected ['rows', 6]" in details
    wrong = [(name, torch.zeros(3) if name == "0.bias" else tensor) for name, tensor in
             ((n, p.detach()) for n, p in build().named_parameters())]
    session.parameter_specs["0.bias"] = (torch.float32, (3,))  # bypass the client's own check
    code, details, _ = status_of(lambda: session.push_parameters(wrong))
    assert code == Code.INVALID_ARGUMENT and "parameter '0.bias' must be torch.float32 [8]" in details


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs(session: Any, bad: float) -> None:
    inputs, targets = mlp_batch(4)
    inputs[1, 2] = bad
    code, details, reason = status_of(lambda: session.compute_gradients(inputs, targets))
    assert (code, reason) == (Code.INVALID_ARGUMENT, "NON_FINITE_INPUT") and "NaN or infinity" in details


def test_one_overflowing_record_is_dropped_not_summed(alice: GradientClient) -> None:
    # 3e38 is a finite float32, so the batch passes the input check; its gradient is not finite
    with alice.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                              config=DPConfig(max_grad_norm=1.0)) as session:
        model = build()
        session.push_parameters(model)
        inputs, targets = mlp_batch(4)
        inputs[1] = 3e38
        result = session.compute_gradients(inputs, targets)
        assert result.num_dropped == 1 and result.samples == 4
        assert all(bool(torch.isfinite(grad).all()) for grad in result.grads.values())
        assert math.isfinite(result.mean_loss) and all(map(math.isfinite, result.norm_quantiles.values()))
        kept = [0, 2, 3]  # the step is the other three samples' (over the expected batch size)
        expected = local_dp(model, inputs[kept], targets[kept], DPConfig(max_grad_norm=1.0))
        for name, grad in result.grads.items():
            torch.testing.assert_close(grad, expected.grads[name] / 4, rtol=1e-5, atol=1e-6)
        assert result.mean_loss == pytest.approx(expected.loss_sum / 3, rel=1e-5)


def test_batch_rows_not_divisible_by_K(session: Any) -> None:
    inputs, targets = mlp_batch(5)
    code, details, reason = status_of(lambda: session.compute_gradients(inputs, targets))
    assert (code, reason) == (Code.INVALID_ARGUMENT, "BATCH_LAYOUT")
    assert "5 rows, which is not divisible by augmentation_multiplicity K=2" in details


def test_unknown_session(alice: GradientClient) -> None:
    code, _, reason = status_of(lambda: alice.session("no-such-session"))
    assert (code, reason) == (Code.NOT_FOUND, "SESSION_NOT_FOUND")


def test_another_tokens_session_is_not_found(server: BackgroundServer, session: Any) -> None:
    with client_for(server, TOKEN_BOB) as bob:
        code, details, _ = status_of(lambda: bob.session(session.id))
        assert code == Code.NOT_FOUND and session.id in details
        inputs, targets = mlp_batch(4)
        hijack = bob.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4)
        hijack.id = session.id
        assert status_of(lambda: hijack.compute_gradients(inputs, targets))[0] == Code.NOT_FOUND
        assert status_of(lambda: hijack.close())[0] == Code.NOT_FOUND
    assert session.info().steps == 0  # untouched


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcd"])
def test_missing_or_unknown_token(server: BackgroundServer, token: str | None) -> None:
    with client_for(server, token) as anonymous:
        code, _, reason = status_of(anonymous.server_info)
        assert (code, reason) == (Code.UNAUTHENTICATED, "UNAUTHENTICATED")  # the trailer, as on every error
        assert status_of(lambda: anonymous.create_session("mlp", loss="mse", expected_batch_size=1))[::2] == \
            (Code.UNAUTHENTICATED, "UNAUTHENTICATED")


def test_missing_token_on_streaming_rpcs(stub: pb_grpc.GradientServiceStub, session: Any) -> None:
    assert status_of(lambda: list(stub.ComputeGradients(compute_stream(session.id, 1, []), timeout=30)))[::2] == \
        (Code.UNAUTHENTICATED, "UNAUTHENTICATED")
    push = iter([pb.PushParametersRequest(header=pb.PushParametersHeader(session_id=session.id, version=9))])
    assert status_of(lambda: stub.PushParameters(push, timeout=30))[::2] == (Code.UNAUTHENTICATED, "UNAUTHENTICATED")


def test_stale_parameter_version(session: Any) -> None:
    session.push_parameters(build())  # version 2
    session.param_version = 1
    inputs, targets = mlp_batch(4)
    code, details, reason = status_of(lambda: session.compute_gradients(inputs, targets))
    assert (code, reason) == (Code.FAILED_PRECONDITION, "STALE_PARAMETERS") and "version 1 is stale" in details
    code, _, reason = status_of(lambda: session.push_parameters(build()))  # version 2 again
    assert (code, reason) == (Code.FAILED_PRECONDITION, "STALE_PARAMETERS")


def test_declared_tensor_larger_than_the_limit(stub: pb_grpc.GradientServiceStub, session: Any) -> None:
    rows = MAX_TENSOR_BYTES // 24 + 1  # just over the limit, and nothing but the header is sent
    frames = [TensorHeader(name="inputs/0", dtype="float32", shape=[rows, 6], num_bytes=rows * 24)]
    code, details, reason = status_of(lambda: run_compute(stub, session.id, 1, frames))
    assert (code, reason) == (Code.RESOURCE_EXHAUSTED, "LIMIT_EXCEEDED")
    assert f"more than the limit of {MAX_TENSOR_BYTES}" in details


def test_more_rows_than_the_server_allows(session: Any) -> None:
    inputs, targets = mlp_batch(66)
    code, details, _ = status_of(lambda: session.compute_gradients(inputs, targets))
    assert code == Code.RESOURCE_EXHAUSTED and "max_batch_rows=64" in details


def test_exhausted_privacy_budget(alice: GradientClient) -> None:
    with alice.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                              config=DPConfig(noise_multiplier=3.0), sample_rate=0.5, delta=1e-5,
                              target_epsilon=2.0) as session:
        session.push_parameters(build())
        inputs, targets = mlp_batch(4)
        steps = 0
        with pytest.raises(ServiceError) as err:
            while steps < 50:
                result = session.compute_gradients(inputs, targets)
                steps += 1
                assert result.epsilon_spent <= 2.0
        assert (err.value.code, err.value.reason) == (Code.FAILED_PRECONDITION, "BUDGET_EXHAUSTED")
        assert steps == 5 and session.info().steps == steps  # 5 steps fit (RDP); the refused one is not accounted


@pytest.mark.parametrize("model, loss, code, reason", [
    ("gpt5", "cross_entropy", Code.NOT_FOUND, "MODEL_NOT_FOUND"),
    ("mlp", "hinge", Code.NOT_FOUND, "LOSS_NOT_FOUND"),
])
def test_unknown_model_or_loss(alice: GradientClient, model: str, loss: str, code: grpc.StatusCode,
                               reason: str) -> None:
    assert status_of(lambda: alice.create_session(model, loss=loss, expected_batch_size=1))[::2] == (code, reason)


@pytest.mark.parametrize("method", ["CreateSession", "GetSession", "PushParameters", "ComputeGradients"])
def test_garbage_bytes_on_the_wire(server: BackgroundServer, method: str) -> None:
    garbage = b"\xff\xff\xff\xff\x0f\x12\x07garbage"
    with grpc.insecure_channel(server.target) as channel:
        path = f"/psg.v1.GradientService/{method}"
        if method in ("CreateSession", "GetSession"):
            call: Callable[[], Any] = lambda: channel.unary_unary(path)(garbage, metadata=ALICE, timeout=30)
        elif method == "PushParameters":
            call = lambda: channel.stream_unary(path)(iter([garbage]), metadata=ALICE, timeout=30)
        else:
            call = lambda: list(channel.stream_stream(path)(iter([garbage]), metadata=ALICE, timeout=30))
        code, details, reason = status_of(call)
    assert (code, reason) == (Code.INVALID_ARGUMENT, "BAD_MESSAGE")
    assert details == "the request is not a valid psg.v1 protobuf message"


@pytest.mark.parametrize("frames, message", [
    ([TensorHeader(name="weights", dtype="float32", shape=[1], num_bytes=4), b"\x00" * 4],
     "unexpected tensor 'weights'"),
    ([TensorHeader(name="inputs/0", dtype="float32", shape=[2, 6], num_bytes=48), b"\x00" * 48],
     "the batch has no 'targets' tensor"),
    ([TensorHeader(name="targets", dtype="int64", shape=[2], num_bytes=16), b"\x00" * 16],
     "inputs must be named ['inputs/0']"),
])
def test_malformed_batches(stub: pb_grpc.GradientServiceStub, session: Any, frames: list[Any], message: str) -> None:
    code, details, _ = status_of(lambda: run_compute(stub, session.id, 1, frames))
    assert code == Code.INVALID_ARGUMENT and message in details


def test_targets_that_do_not_fit_the_loss(session: Any) -> None:
    inputs, _ = mlp_batch(4)
    code, details, _ = status_of(lambda: session.compute_gradients(inputs, torch.tensor([0, 1, 2, 3])))
    assert code == Code.INVALID_ARGUMENT and "class indices in [0, 3), got values in [0, 3]" in details
    code, details, _ = status_of(lambda: session.compute_gradients(inputs, torch.zeros(4, 3)))
    assert code == Code.INVALID_ARGUMENT and "integer tensor of class indices (1-D for this model)" in details


def test_stream_that_does_not_start_with_a_header(stub: pb_grpc.GradientServiceStub) -> None:
    requests = iter([pb.ComputeGradientsRequest(chunk=b"\x00")])
    code, details, _ = status_of(lambda: list(stub.ComputeGradients(requests, metadata=ALICE, timeout=30)))
    assert code == Code.INVALID_ARGUMENT and "the first message must be the header" in details


@pytest.mark.parametrize("overrides, message", [
    ({"expected_batch_size": 0}, "expected_batch_size must be >= 1"),
    ({"config": DPConfig(noise_multiplier=1.0)}, "delta must be in (0, 1)"),
    ({"target_epsilon": 1.0, "delta": 1e-5}, "needs noise_multiplier > 0"),
    ({"sample_rate": 1.5}, "sample_rate must be in (0, 1]"),
    ({"accountant": "gdp"}, "accountant must be 'rdp' or 'pld'"),
    ({"config": DPConfig(batch_first=False)}, "set batch_first=True"),
    ({"model_kwargs": {"hidden": [0]}}, "rejected its arguments"),
])
def test_invalid_session_settings(alice: GradientClient, overrides: dict[str, Any], message: str) -> None:
    options: dict[str, Any] = {"loss": "cross_entropy", "expected_batch_size": 2, **overrides}
    code, details, _ = status_of(lambda: alice.create_session("mlp", **options))
    assert code == Code.INVALID_ARGUMENT and message in details


def test_invalid_dp_settings_on_the_wire(stub: pb_grpc.GradientServiceStub) -> None:
    request = pb.CreateSessionRequest(model="mlp", loss="mse", expected_batch_size=1,
                                      dp=pb.DPSettings(mode="magic", max_grad_norm=1.0))
    code, details, reason = status_of(lambda: stub.CreateSession(request, metadata=ALICE, timeout=30))
    assert (code, reason) == (Code.INVALID_ARGUMENT, "INVALID_CONFIG") and "'magic'" in details
    request.dp.mode, request.dp.max_grad_norm = "hooks", 0.0
    assert status_of(lambda: stub.CreateSession(request, metadata=ALICE, timeout=30))[0] == Code.INVALID_ARGUMENT


@pytest.mark.parametrize("kwargs_json, message", [
    ("[" * 20_000 + "]" * 20_000, "nested too deeply"),  # json recurses once per level
    ('{"in_features": ' + "9" * 5000 + "}", "not valid JSON"),  # more digits than int() converts
])
def test_malformed_model_kwargs_json(stub: pb_grpc.GradientServiceStub, kwargs_json: str, message: str) -> None:
    request = pb.CreateSessionRequest(model="mlp", model_kwargs_json=kwargs_json, loss="mse", expected_batch_size=1,
                                      dp=pb.DPSettings(max_grad_norm=1.0))
    code, details, reason = status_of(lambda: stub.CreateSession(request, metadata=ALICE, timeout=30))
    assert (code, reason) == (Code.INVALID_ARGUMENT, "INVALID_REQUEST") and message in details


@pytest.mark.parametrize("config, message", [
    (DPConfig(noise_multiplier=1e300), "noise_multiplier 1e+300 is above"),
    (DPConfig(noise_multiplier=1.0, max_grad_norm=1e308), "max_grad_norm 1e+308 is above"),
])
def test_noise_that_would_overflow_is_refused_at_create_session(alice: GradientClient, config: DPConfig,
                                                                message: str) -> None:
    code, details, reason = status_of(lambda: alice.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                                                   expected_batch_size=4, config=config, delta=1e-5))
    assert (code, reason) == (Code.INVALID_ARGUMENT, "INVALID_REQUEST") and message in details


def test_an_idle_request_stream_is_ended() -> None:
    release = threading.Event()

    def stalled(session_id: str) -> Iterator[pb.ComputeGradientsRequest]:
        yield pb.ComputeGradientsRequest(header=pb.ComputeGradientsHeader(session_id=session_id, param_version=1))
        release.wait(30)  # never half-closes: the server must not wait for ever

    with serve(stream_idle_seconds=0.5) as idle_server, client_for(idle_server) as client, \
            grpc.insecure_channel(idle_server.target) as channel:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4)
        session.push_parameters(build())
        stub = pb_grpc.GradientServiceStub(channel)
        try:
            code, details, reason = status_of(lambda: list(stub.ComputeGradients(stalled(session.id), timeout=30)))
        finally:
            release.set()
        assert (code, reason) == (Code.DEADLINE_EXCEEDED, "STREAM_IDLE") and "sent nothing for 0.5 s" in details
        session.compute_gradients(*mlp_batch(4))  # streams that keep sending are served as before


def test_the_first_failing_check_gives_the_reason(stub: pb_grpc.GradientServiceStub, alice: GradientClient,
                                                  session: Any) -> None:
    # proto/README.md, "Which reason wins": a request wrong in several ways always gets the same one
    both = pb.CreateSessionRequest(model="gpt5", model_kwargs_json="[" * 20_000, loss="hinge", expected_batch_size=0,
                                   dp=pb.DPSettings(mode="magic"))
    assert status_of(lambda: stub.CreateSession(both, timeout=30))[::2] == (Code.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert status_of(lambda: stub.CreateSession(both, metadata=ALICE, timeout=30))[::2] == \
        (Code.NOT_FOUND, "MODEL_NOT_FOUND")
    garbage = [TensorHeader(name="inputs/0", dtype="float8", shape=[2, 6], num_bytes=1)]
    assert status_of(lambda: run_compute(stub, session.id, 7, garbage))[::2] == \
        (Code.FAILED_PRECONDITION, "PARAMETERS_MISSING")  # decided at the header, before any tensor
    assert status_of(lambda: run_compute(stub, "no-such-session", 1, garbage))[::2] == \
        (Code.NOT_FOUND, "SESSION_NOT_FOUND")


def test_a_session_without_noise_and_a_second_close(alice: GradientClient) -> None:
    created = alice.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4)
    info = created.info()
    assert info.delta == 0 and math.isinf(info.epsilon_spent) and math.isinf(info.budget_left)
    created.close()
    assert status_of(created.close)[::2] == (Code.NOT_FOUND, "SESSION_NOT_FOUND")
