"""Requests of one session that overlap, over a real socket: what a request's header was checked
against when it arrived may have changed by the time its upload ends, so the server checks again
when it acts (stores a pushed set, adds a part, releases a step) and refuses what no longer holds.

Each test holds some streams open after their headers (a thread per call, fed from a queue), lets
another request run to the end meanwhile, then finishes the held ones.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from torch import nn

from psg_client import GradientClient
from psg_core.config import DPConfig
from psg_server.background import BackgroundServer
from psg_wire.codec import encode_tensors
from psg_wire.names import Reason, input_name, parameter_name
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_wire.v1 import gradient_service_pb2_grpc as pb_grpc
from psg_wire.v1.tensor_pb2 import TensorHeader
from tests.server.service_harness import MLP_KWARGS, build, local_dp, mlp_batch

#: Time for the server to read and check a header the test has sent (it takes well under a millisecond).
HEADER_SECONDS = 0.5


@pytest.fixture()
def stub(server: BackgroundServer) -> Iterator[pb_grpc.GradientServiceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GradientServiceStub(channel)


def push_messages(session_id: str, version: int, model: nn.Module) -> list[pb.PushParametersRequest]:
    frames = encode_tensors((name, p.detach()) for name, p in model.named_parameters())
    return [pb.PushParametersRequest(header=pb.PushParametersHeader(session_id=session_id, version=version)),
            *(pb.PushParametersRequest(tensor=f) if isinstance(f, TensorHeader) else pb.PushParametersRequest(chunk=f)
              for f in frames)]


def compute_messages(session_id: str, version: int, inputs: torch.Tensor, targets: torch.Tensor, *,
                     push: nn.Module | None = None, part: int = 0, more_parts: bool = False,
                     step_seed: int | None = None) -> list[pb.ComputeGradientsRequest]:
    header = pb.ComputeGradientsHeader(session_id=session_id, param_version=version, part=part,
                                       more_parts=more_parts, push_version=version if push is not None else 0)
    if step_seed is not None:
        header.step_seed = step_seed
    named = [] if push is None else [(parameter_name(n), p.detach()) for n, p in push.named_parameters()]
    frames = encode_tensors([*named, (input_name(0), inputs), ("targets", targets)])
    return [pb.ComputeGradientsRequest(header=header),
            *(pb.ComputeGradientsRequest(tensor=f) if isinstance(f, TensorHeader)
              else pb.ComputeGradientsRequest(chunk=f) for f in frames)]


class HeldCall:
    """A client-streaming call on a thread whose messages the test sends when it chooses."""

    _END = object()

    def __init__(self, method: Callable[..., Any], messages: list[Any]) -> None:
        self._messages = list(messages)
        self._queue: queue.Queue[Any] = queue.Queue()
        self.result: Any = None
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, args=(method,), daemon=True)
        self._thread.start()

    def _requests(self) -> Iterator[Any]:
        while (message := self._queue.get()) is not self._END:
            yield message

    def _run(self, method: Callable[..., Any]) -> None:
        try:
            reply = method(self._requests(), timeout=60)
            self.result = reply if not isinstance(reply, Iterator) else list(reply)
        except grpc.RpcError as error:
            self.error = error

    def send_header(self) -> None:
        self._queue.put(self._messages.pop(0))

    def finish(self) -> HeldCall:
        for message in self._messages:
            self._queue.put(message)
        self._queue.put(self._END)
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        return self

    def refusal(self) -> tuple[grpc.StatusCode, str, str]:
        assert self.error is not None, f"the call succeeded: {self.result}"
        reason = next((v for k, v in (self.error.trailing_metadata() or ()) if k == "psg-error-reason"), "")
        return self.error.code(), reason, self.error.details()


def held(*calls: HeldCall) -> None:
    """Sends each call's header and gives the server the time to check them all."""
    for call in calls:
        call.send_header()
    time.sleep(HEADER_SECONDS)


def same_gradient(result_grads: dict[str, torch.Tensor], model: nn.Module, inputs: torch.Tensor,
                  targets: torch.Tensor, config: DPConfig, batch_size: int) -> bool:
    local = local_dp(model, inputs, targets, config)
    return all(torch.allclose(result_grads[name], local.grads[name] / batch_size, atol=1e-6)
               for name in local.grads)


def test_overlapping_pushes_never_move_the_version_back_nor_reuse_one(client: GradientClient,
                                                                     stub: pb_grpc.GradientServiceStub) -> None:
    config = DPConfig(max_grad_norm=100.0)
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=3,
                                    config=config)
    first, older, other = build(seed=5), build(seed=3), build(seed=55)
    five = HeldCall(stub.PushParameters, push_messages(session.id, 5, first))
    three = HeldCall(stub.PushParameters, push_messages(session.id, 3, older))
    held(five, three)  # both headers pass: the session is at version 0
    assert five.finish().result.version == 5
    code, reason, details = three.finish().refusal()  # checked again when it is stored: 3 < 5
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.STALE_PARAMETERS)
    assert "version 3 is not newer than the session's version 5" in details
    info = session.info()
    assert (info.latest_param_version, info.param_version) == (5, 5)
    # Version 5 names the first set for good: another set under 5 is refused ...
    with pytest.raises(grpc.RpcError) as again:
        stub.PushParameters(iter(push_messages(session.id, 5, other)), timeout=30)
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # ... and a step at 5 computes on it.
    inputs, targets = mlp_batch(3, seed=1)
    session.param_version = 5
    result = session.compute_gradients(inputs, targets)
    assert result.param_version == 5 and same_gradient(result.grads, first, inputs, targets, config, 3)


def test_a_push_with_a_step_is_checked_again_against_a_push_that_overtook_it(
        client: GradientClient, stub: pb_grpc.GradientServiceStub) -> None:
    config = DPConfig(max_grad_norm=100.0)
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=3,
                                    config=config)
    inputs, targets = mlp_batch(3, seed=2)
    late, early = build(seed=4), build(seed=6)
    step = HeldCall(stub.ComputeGradients, compute_messages(session.id, 4, inputs, targets, push=late))
    push = HeldCall(stub.PushParameters, push_messages(session.id, 6, early))
    held(step, push)
    assert push.finish().result.version == 6
    code, reason, details = step.finish().refusal()
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.STALE_PARAMETERS)
    assert details.startswith("ComputeGradients: version 4 is not newer than the session's version 6")
    info = session.info()
    assert (info.latest_param_version, info.param_version, info.steps) == (6, 6, 0)
    session.param_version = 6
    result = session.compute_gradients(inputs, targets)
    assert result.param_version == 6 and same_gradient(result.grads, early, inputs, targets, config, 3)


def test_two_last_parts_of_one_logical_batch_release_it_once(client: GradientClient,
                                                             stub: pb_grpc.GradientServiceStub) -> None:
    config = DPConfig(max_grad_norm=100.0)
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=6,
                                    config=config)
    model = build(seed=7)
    session.push_parameters(model)
    inputs, targets = mlp_batch(6, seed=3)
    [pending] = stub.ComputeGradients(iter(compute_messages(session.id, 1, inputs[:3], targets[:3], more_parts=True)),
                                      timeout=30)
    assert pending.stats.pending and pending.stats.samples == 3
    # Both continue the pending batch when their headers arrive; only the first to run may.
    rest = [HeldCall(stub.ComputeGradients, compute_messages(session.id, 1, inputs[3:], targets[3:], part=1))
            for _ in range(2)]
    done, refused = _one_done_one_refused(rest)
    code, reason, _ = refused.refusal()
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.ACCUMULATION_LOST)
    stats = done.result[0].stats
    assert (stats.step, stats.samples, stats.pending) == (1, 6, False)
    assert session.info().steps == 1


def test_two_steps_with_one_step_seed_at_once_release_one_noise_draw(client: GradientClient,
                                                                     stub: pb_grpc.GradientServiceStub) -> None:
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=2.0)
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=3,
                                    config=config, delta=1e-5)
    session.push_parameters(build())
    calls = [HeldCall(stub.ComputeGradients, compute_messages(session.id, 1, *mlp_batch(3, seed=seed), step_seed=7))
             for seed in (1, 2)]
    done, refused = _one_done_one_refused(calls)  # both headers pass: no step has used seed 7 yet
    code, reason, details = refused.refusal()
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.STEP_SEED_REUSED)
    assert "step_seed 7" in details
    assert done.result[0].stats.step == 1 and session.info().steps == 1


def _one_done_one_refused(calls: list[HeldCall]) -> tuple[HeldCall, HeldCall]:
    """Holds ``calls`` after their headers, finishes them, and returns the one that succeeded and
    the one that was refused (exactly one each)."""
    held(*calls)
    for call in calls:
        call.finish()
    [done] = [call for call in calls if call.error is None]
    [refused] = [call for call in calls if call.error is not None]
    return done, refused
