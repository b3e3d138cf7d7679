"""What crosses the wire for a step: a push and a step in one call, tensor groups, one message each
way for a small step, reduced-precision (bf16) parameters and gradients, inputs refused at their
header before their bytes, a reply asked for in one message (a unary call both ways), and the
worker-side phases in the metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from psg_client import GradientClient, ServiceError, WireDtypes
from psg_core.config import DPConfig
from psg_server.background import BackgroundServer
from psg_wire.codec import FrameWire
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_wire.v1 import gradient_service_pb2_grpc as pb_grpc
from psg_wire.v1.tensor_pb2 import TensorGroup, TensorHeader
from tests.server.service_harness import MLP_KWARGS, build, client_for, local_dp, mlp_batch, serve

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with serve(max_batch_rows=256) as running:
        yield running


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[GradientClient]:
    with client_for(server) as connected:
        yield connected


def open_session(client: GradientClient, **options: Any) -> Any:
    return client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=8,
                                 config=DPConfig(max_grad_norm=0.5), **options)


def expected(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {n: g / 8 for n, g in local_dp(model, inputs, targets, DPConfig(max_grad_norm=0.5)).grads.items()}


def test_a_push_and_a_step_in_one_call_equal_the_two_calls(client: GradientClient) -> None:
    inputs, targets = mlp_batch(8, seed=3)
    with open_session(client) as session:
        for seed in (1, 2):
            model = build(seed=seed)
            result = session.compute_gradients(inputs, targets, parameters=model)
            assert result.param_version == session.param_version == seed
            for name, grad in expected(model, inputs, targets).items():
                torch.testing.assert_close(result.grads[name], grad, rtol=1e-5, atol=1e-7)
        assert session.info().param_version == 2
        # The pushed version stays the session's: a plain step computes at it.
        again = session.compute_gradients(inputs, targets)
        assert again.param_version == 2
        # A logical batch in parts pushes with its first part only.
        parts = session.compute_gradients(inputs, targets, parameters=build(seed=4), max_rows=3)
        assert parts.param_version == 3 and parts.samples == 8
        for name, grad in expected(build(seed=4), inputs, targets).items():
            torch.testing.assert_close(parts.grads[name], grad, rtol=1e-5, atol=1e-7)


def test_misplaced_or_stale_pushes_are_refused(server: BackgroundServer, client: GradientClient) -> None:
    inputs, targets = mlp_batch(4)
    wire = FrameWire(pb.ComputeGradientsRequest)
    with open_session(client) as session, grpc.insecure_channel(server.target) as channel:
        session.push_parameters(build())
        stub = pb_grpc.GradientServiceStub(channel)
        params = [(f"parameters/{n}", p.detach()) for n, p in build().named_parameters()]
        batch = [("inputs/0", inputs), ("targets", targets)]

        def call(header: pb.ComputeGradientsHeader, named: list[Any]) -> None:
            frames = wire.messages(named, group=True, lead=("header", header, "group"))
            list(stub.ComputeGradients((pb.ComputeGradientsRequest.FromString(f) for f in frames), timeout=30))

        cases = [
            (pb.ComputeGradientsHeader(session_id=session.id, param_version=1, push_version=1), params + batch,
             Code.FAILED_PRECONDITION, "not newer"),
            (pb.ComputeGradientsHeader(session_id=session.id, param_version=2, push_version=3), params + batch,
             Code.INVALID_ARGUMENT, "must compute at it"),
            (pb.ComputeGradientsHeader(session_id=session.id, param_version=1), params + batch,
             Code.INVALID_ARGUMENT, "sets no push_version"),
            (pb.ComputeGradientsHeader(session_id=session.id, param_version=2, push_version=2), params[:1] + batch,
             Code.INVALID_ARGUMENT, "lacks the trainable parameters"),
        ]
        for header, named, code, message in cases:
            with pytest.raises(grpc.RpcError) as err:
                call(header, named)
            assert err.value.code() == code and message in err.value.details(), err.value.details()
        assert session.info().param_version == 1  # nothing was stored


def test_a_small_step_is_one_message_each_way(server: BackgroundServer, client: GradientClient) -> None:
    inputs, targets = mlp_batch(4)
    with open_session(client) as session, grpc.insecure_channel(server.target) as channel:
        model = build()
        header = pb.ComputeGradientsHeader(session_id=session.id, param_version=1, push_version=1,
                                           grouped_reply=True)
        named = [(f"parameters/{n}", p.detach()) for n, p in model.named_parameters()]
        named += [("inputs/0", inputs), ("targets", targets)]
        messages = list(FrameWire(pb.ComputeGradientsRequest).messages(named, group=True,
                                                                       lead=("header", header, "group")))
        assert len(messages) == 1
        call = channel.unary_stream("/psg.v1.GradientService/ComputeGradients",
                                    request_serializer=lambda raw: raw,
                                    response_deserializer=pb.ComputeGradientsResponse.FromString)
        replies = list(call(messages[0], timeout=30))
        assert len(replies) == 1 and replies[0].WhichOneof("frame") == "result"
        result = replies[0].result
        assert result.stats.samples == 4 and [h.name for h in result.gradients.tensors] == [
            n for n, _ in model.named_parameters()]


@pytest.fixture(scope="module")
def small_messages() -> Iterator[BackgroundServer]:
    """A server that chunks its replies at 256 bytes and takes messages of 128 KiB at most."""
    with serve(max_batch_rows=256, chunk_bytes=256, max_message_bytes=128 * 1024) as running:
        yield running


def _step_call(channel: grpc.Channel, header: pb.ComputeGradientsHeader, named: list[Any], *,
               unary: bool) -> list[pb.ComputeGradientsResponse]:
    messages = list(FrameWire(pb.ComputeGradientsRequest).messages(named, group=True,
                                                                   lead=("header", header, "group")))
    assert len(messages) == 1
    method = "/psg.v1.GradientService/ComputeGradients"
    if unary:
        call = channel.unary_unary(method, request_serializer=lambda raw: raw,
                                   response_deserializer=pb.ComputeGradientsResponse.FromString)
        return [call(messages[0], timeout=30)]
    stream = channel.unary_stream(method, request_serializer=lambda raw: raw,
                                  response_deserializer=pb.ComputeGradientsResponse.FromString)
    return list(stream(messages[0], timeout=30))


def test_single_message_reply_holds_every_gradient_whatever_the_chunk_size(small_messages: BackgroundServer) -> None:
    inputs, targets = mlp_batch(4)
    model = build()
    named = [(f"parameters/{n}", p.detach()) for n, p in model.named_parameters()]
    named += [("inputs/0", inputs), ("targets", targets)]
    with client_for(small_messages) as client, open_session(client) as session, \
            grpc.insecure_channel(small_messages.target) as channel:
        header = pb.ComputeGradientsHeader(session_id=session.id, param_version=1, push_version=1,
                                           grouped_reply=True)
        streamed = _step_call(channel, header, named, unary=False)
        assert len(streamed) > 1  # the server's 256-byte chunks
        header = pb.ComputeGradientsHeader(session_id=session.id, param_version=2, push_version=2,
                                           grouped_reply=True, single_message_reply=True)
        (reply,) = _step_call(channel, header, named, unary=True)  # a unary call reads exactly one
        assert reply.WhichOneof("frame") == "result" and reply.result.stats.step == 2
        assert [h.name for h in reply.result.gradients.tensors] == [n for n, _ in model.named_parameters()]
        assert len(reply.result.gradients.data) >= sum(p.numel() * 4 for p in model.parameters())


def test_single_message_reply_is_refused_before_the_step_when_it_cannot_hold(small_messages: BackgroundServer) -> None:
    inputs, targets = mlp_batch(4)
    with client_for(small_messages) as client, open_session(client) as session, \
            grpc.insecure_channel(small_messages.target) as channel:
        session.push_parameters(build())
        header = pb.ComputeGradientsHeader(session_id=session.id, param_version=1, single_message_reply=True)
        with pytest.raises(grpc.RpcError) as refused:
            _step_call(channel, header, [("inputs/0", inputs), ("targets", targets)], unary=False)
        assert refused.value.code() == Code.INVALID_ARGUMENT and "grouped_reply" in refused.value.details()
        assert session.info().steps == 0
    wide = {"in_features": 64, "hidden": [300], "num_classes": 3}  # 77 KB of gradients > 64 KiB
    with client_for(small_messages, chunk_bytes=16 * 1024) as client, client.create_session(
            "mlp", model_kwargs=wide, loss="cross_entropy", expected_batch_size=4,
            config=DPConfig(max_grad_norm=0.5)) as session, grpc.insecure_channel(small_messages.target) as channel:
        torch.manual_seed(0)
        session.push_parameters(build(kwargs=wide))
        header = pb.ComputeGradientsHeader(session_id=session.id, param_version=1, grouped_reply=True,
                                           single_message_reply=True)
        batch = [("inputs/0", torch.randn(4, 64)), ("targets", torch.zeros(4, dtype=torch.long))]
        with pytest.raises(grpc.RpcError) as refused:
            _step_call(channel, header, batch, unary=False)
        assert refused.value.code() == Code.INVALID_ARGUMENT and "do not fit in one message" in refused.value.details()
        assert session.info().steps == 0
        # The client reads such a reply as a stream by itself, and small ones as one message.
        result = session.compute_gradients(batch[0][1], batch[1][1])
        assert result.step == 1 and set(result.grads) == {n for n, _ in build(kwargs=wide).named_parameters()}


def test_the_client_steps_in_one_unary_call_when_both_ways_fit(client: GradientClient) -> None:
    inputs, targets = mlp_batch(4)
    calls = {"single": 0}
    single = client._stub.ComputeGradientsSingle

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["single"] += 1
        return single(*args, **kwargs)

    client._stub.ComputeGradientsSingle = counted
    try:
        with open_session(client) as session:
            model = build(seed=5)
            result = session.compute_gradients(inputs, targets, parameters=model)  # push and step: one group
            assert calls["single"] == 1
            for name, grad in expected(model, inputs, targets).items():
                torch.testing.assert_close(result.grads[name], grad, rtol=1e-5, atol=1e-7)
            assert result.step == 1 and session.compute_gradients(inputs, targets).step == 2
            assert calls["single"] == 2
    finally:
        client._stub.ComputeGradientsSingle = single


def test_old_clients_get_one_tensor_per_parameter(server: BackgroundServer, client: GradientClient) -> None:
    inputs, targets = mlp_batch(4)
    with open_session(client) as session, grpc.insecure_channel(server.target) as channel:
        session.push_parameters(build())
        stub = pb_grpc.GradientServiceStub(channel)
        wire = FrameWire(pb.ComputeGradientsRequest)
        header = pb.ComputeGradientsRequest(header=pb.ComputeGradientsHeader(session_id=session.id, param_version=1))
        frames = [header] + [pb.ComputeGradientsRequest.FromString(wire.serialize(m)) for m in
                             wire.messages([("inputs/0", inputs), ("targets", targets)], chunk_bytes=16)]
        kinds = [reply.WhichOneof("frame") for reply in stub.ComputeGradients(iter(frames), timeout=30)]
        assert kinds[0] == "stats" and "group" not in kinds and kinds.count("tensor") == 4


def test_bf16_on_the_wire_halves_the_bytes_within_bf16_rounding(client: GradientClient) -> None:
    inputs, targets = mlp_batch(8, seed=5)
    model = build(seed=9)
    with open_session(client) as exact, \
            open_session(client, wire=WireDtypes(gradients=torch.bfloat16)) as gradients_only, \
            open_session(client, wire=WireDtypes(parameters=torch.bfloat16, gradients=torch.bfloat16)) as both:
        for session in (exact, gradients_only, both):
            session.push_parameters(model)
        assert both.last_push_bytes * 2 == exact.last_push_bytes == gradients_only.last_push_bytes
        reference = exact.compute_gradients(inputs, targets).grads
        rounded = gradients_only.compute_gradients(inputs, targets).grads
        reduced = both.compute_gradients(inputs, targets).grads
        assert both.info().wire.parameters_dtype == "bfloat16"
        for name, grad in reference.items():
            assert rounded[name].dtype == reduced[name].dtype == torch.float32  # cast back by the client
            # The gradient is computed exactly and rounded once to bf16 (8 significant bits).
            assert torch.equal(rounded[name], grad.to(torch.bfloat16).float())
            # Rounded parameters move the gradient a little more (README: about 1% here).
            error = float((reduced[name] - grad).norm() / grad.norm())
            assert error < 2e-2, (name, error)
        # A reattached session knows its wire dtypes.
        again = client.session(both.id)
        assert again.wire == both.wire
        assert again.compute_gradients(inputs, targets, parameters=model).grads.keys() == reference.keys()


def test_a_bf16_session_refuses_float32_parameters(server: BackgroundServer, client: GradientClient) -> None:
    with open_session(client, wire=WireDtypes(parameters=torch.bfloat16)) as session, \
            grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GradientServiceStub(channel)
        wire = FrameWire(pb.PushParametersRequest)
        header = pb.PushParametersHeader(session_id=session.id, version=1)
        frames = wire.messages(list(build().named_parameters()), group=True, lead=("header", header, "group"))
        with pytest.raises(grpc.RpcError) as err:
            stub.PushParameters((pb.PushParametersRequest.FromString(wire.serialize(f)) for f in frames), timeout=30)
        assert err.value.code() == Code.INVALID_ARGUMENT and "must be torch.bfloat16 [8, 6]" in err.value.details()
    with pytest.raises(ServiceError, match="gradients_dtype must be"):
        request = pb.CreateSessionRequest(model="mlp", loss="cross_entropy", expected_batch_size=1,
                                          dp=pb.DPSettings(max_grad_norm=1.0), wire=pb.WireSettings(gradients_dtype="int8"))
        client.call(lambda stub, kw: stub.CreateSession(request, **kw))


@pytest.mark.parametrize("grouped", [False, True])
def test_an_input_that_cannot_fit_is_refused_at_its_header(server: BackgroundServer, client: GradientClient,
                                                           grouped: bool) -> None:
    """A header declaring a 2 GB input for a 6-feature model is refused before any byte is sent."""
    with open_session(client) as session, grpc.insecure_channel(server.target) as channel:
        session.push_parameters(build())
        stub = pb_grpc.GradientServiceStub(channel)
        huge = TensorHeader(name="inputs/0", dtype="float32", shape=[64, 8_000_000], num_bytes=64 * 8_000_000 * 4)
        first = pb.ComputeGradientsRequest(header=pb.ComputeGradientsHeader(session_id=session.id, param_version=1))
        declared = (pb.ComputeGradientsRequest(group=TensorGroup(tensors=[huge])) if grouped
                    else pb.ComputeGradientsRequest(tensor=huge))
        with pytest.raises(grpc.RpcError) as err:  # the stream stays open: only the check can end the call
            list(stub.ComputeGradients(_then_wait([first, declared]), timeout=30))
        assert err.value.code() == Code.INVALID_ARGUMENT
        assert "does not fit the model: expected ['rows', 6]" in err.value.details()
        wrong = [("inputs/0", torch.zeros(4, 6, dtype=torch.int64)), ("inputs/1", torch.zeros(4, 6))]
        for name, tensor in wrong:
            header = TensorHeader(name=name, dtype=str(tensor.dtype).removeprefix("torch."),
                                  shape=list(tensor.shape), num_bytes=tensor.numel() * tensor.element_size())
            with pytest.raises(grpc.RpcError) as err:
                list(stub.ComputeGradients(_then_wait([first, pb.ComputeGradientsRequest(tensor=header)]),
                                           timeout=30))
            assert err.value.code() == Code.INVALID_ARGUMENT
            assert ("must be floating point" if name == "inputs/0" else "takes 1 input(s), got 'inputs/1'") in err.value.details()


def _then_wait(messages: list[Any]) -> Iterator[Any]:
    """The messages, then a stream that neither ends nor sends until the call is over (the test's
    timeout): only the server's header check can end the call early."""
    yield from messages
    _CALL_OVER.wait(30)


_CALL_OVER = threading.Event()


@pytest.fixture(autouse=True)
def _release_waiting_streams() -> Iterator[None]:
    _CALL_OVER.clear()
    yield
    _CALL_OVER.set()


def test_metrics_break_down_the_workers_phases(server: BackgroundServer, client: GradientClient) -> None:
    inputs, targets = mlp_batch(4)
    with open_session(client) as session:
        session.compute_gradients(inputs, targets, parameters=build())
    text = server.server.metrics.exposition().decode()  # type: ignore[union-attr]
    for phase in ("copy_in", "compute", "copy_out"):
        assert f'psg_worker_phase_seconds_count{{phase="{phase}"}}' in text
