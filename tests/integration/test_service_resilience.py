"""Retries on UNAVAILABLE, re-pushing parameters the server dropped, deadlines, idle expiry.

Threads and the server's event loop meet through events, never through sleeps that guess how long
the other side takes.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from psg_client import GradientClient, RetryPolicy, ServiceError
from psg_core.config import DPConfig, DPGradient
from psg_server.background import BackgroundServer
from psg_server.config import ServerConfig
from psg_server.errors import NoWorkersError
from psg_server.executor import InProcessExecutor, ParameterSet, SessionSpec, Shard
from psg_server.models import default_registry
from tests.server.service_harness import MLP_KWARGS, build, client_for, local_dp, mlp_batch, serve

MLP_BYTES = sum(p.numel() * 4 for p in build().parameters())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class _SignallingRetry(RetryPolicy):
    """A retry policy that sets ``refused`` when the client first asks it for a delay, i.e. once a
    call has failed with UNAVAILABLE."""

    refused: threading.Event = field(default_factory=threading.Event, compare=False)

    def delays(self) -> Iterator[float]:
        for delay in super().delays():
            self.refused.set()
            yield delay


def test_client_retries_unavailable_until_the_server_comes_up() -> None:
    port = _free_port()
    # Up to 100 attempts at most 0.3 s apart: room for a server that starts slowly on a busy host.
    retry = _SignallingRetry(max_attempts=100, initial_backoff_s=0.05, max_backoff_s=0.3)
    holder: list[BackgroundServer] = []

    def start_once_refused() -> None:
        # The server starts only after the client has been refused, so the call must retry.
        if retry.refused.wait(timeout=30):
            holder.append(BackgroundServer(ServerConfig(port=port)).start())

    thread = threading.Thread(target=start_once_refused)
    thread.start()
    try:
        with GradientClient(f"127.0.0.1:{port}", retry=retry, timeout_s=10) as client:
            assert client.server_info().version
        assert retry.refused.is_set() and holder
    finally:
        retry.refused.set()  # releases the thread if the client failed before its first retry
        thread.join()
        for server in holder:
            server.stop()


def test_client_gives_up_after_its_attempts() -> None:
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01)
    with GradientClient(f"127.0.0.1:{_free_port()}", retry=retry, timeout_s=5) as client:
        with pytest.raises(ServiceError) as err:
            client.list_models()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    delays = list(RetryPolicy(max_attempts=4, initial_backoff_s=1.0, multiplier=3.0, max_backoff_s=5.0).delays())
    # backoffs 1, 3, min(9, 5), each jittered into [backoff / 2, backoff]
    assert len(delays) == 3 and all(b / 2 <= d <= b for d, b in zip(delays, (1.0, 3.0, 5.0)))


def test_parameters_dropped_under_memory_pressure_are_pushed_again() -> None:
    config = DPConfig(max_grad_norm=0.5)
    # room for one parameter set: pushing the second session's drops the first's
    with serve(parameter_memory_bytes=MLP_BYTES + MLP_BYTES // 2) as server, client_for(server) as client:
        first = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                      config=config)
        second = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                       config=config)
        model = build(seed=1)
        first.push_parameters(model)
        second.push_parameters(build(seed=2))
        assert first.info().param_version == 0  # dropped
        inputs, targets = mlp_batch(4)
        result = first.compute_gradients(inputs, targets)
        assert first.param_version == 2 and result.param_version == 2
        local = local_dp(model, inputs, targets, config)
        for name, grad in result.grads.items():
            torch.testing.assert_close(grad, local.grads[name] / 4, rtol=1e-5, atol=1e-6)
        fresh = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4)
        with pytest.raises(ServiceError) as err:  # never pushed: nothing to push again
            fresh.compute_gradients(inputs, targets)
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PARAMETERS_MISSING")
        with pytest.raises(ServiceError) as too_big:
            client.create_session("mlp", model_kwargs={**MLP_KWARGS, "hidden": [64]}, loss="cross_entropy",
                                  expected_batch_size=1).push_parameters(build(kwargs={**MLP_KWARGS, "hidden": [64]}))
        assert too_big.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


class _HangingExecutor(InProcessExecutor):
    """While ``hang`` is true, every step waits until it is cancelled; ``cancelled`` is set (from
    the server's event loop) at the first cancellation, and ``cancellations`` counts them."""

    def __init__(self) -> None:
        super().__init__(default_registry())
        self.hang = True
        self.cancelled = threading.Event()
        self.cancellations = 0

    async def run(self, spec: SessionSpec, parameters: ParameterSet, shards: Sequence[Shard]) -> list[DPGradient]:
        if self.hang:
            try:
                # Never resolves: only a cancellation ends it (at worst the server's shutdown, after
                # the test has already failed on `cancelled`).
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                self.cancellations += 1
                self.cancelled.set()
                raise
        return await super().run(spec, parameters, shards)


def test_steps_past_the_deadline_are_cancelled() -> None:
    executor = _HangingExecutor()
    with serve(executor=executor, step_timeout_seconds=1.0) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
        session.push_parameters(build())
        with pytest.raises(ServiceError) as err:
            session.compute_gradients(*mlp_batch(2))
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")
        assert executor.cancelled.wait(timeout=10), "the step was never cancelled"
        assert executor.cancellations == 1 and session.info().steps == 0
        executor.hang = False
        assert session.compute_gradients(*mlp_batch(2)).step == 1


def test_client_deadline_cancels_the_step_on_the_server() -> None:
    executor = _HangingExecutor()
    with serve(executor=executor) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
        session.push_parameters(build())
        client.timeout_s = 0.5
        with pytest.raises(ServiceError) as err:
            session.compute_gradients(*mlp_batch(2))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # The client gave up; the server notices the cancelled RPC in its own time.
        assert executor.cancelled.wait(timeout=10), "the server never cancelled the step"
        assert executor.cancellations == 1


class _NoWorkers(InProcessExecutor):
    async def run(self, spec: SessionSpec, parameters: ParameterSet, shards: Sequence[Shard]) -> list[DPGradient]:
        raise NoWorkersError("ComputeGradients: every worker is down")


def test_no_live_workers_is_unavailable_and_retried() -> None:
    executor = _NoWorkers(default_registry())
    with serve(executor=executor) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
        session.push_parameters(build())
        with pytest.raises(ServiceError) as err:
            session.compute_gradients(*mlp_batch(2))
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_WORKERS")
        assert client.server_info().version


def test_idle_sessions_expire() -> None:
    with serve(session_idle_seconds=0.2) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
        # Not synchronisation: the idle time itself is what is tested, and sleep() guarantees at
        # least this much of it (twice the limit) whatever the load.
        time.sleep(0.4)
        client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
        with pytest.raises(ServiceError) as err:
            session.info()
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_session_limit_is_resource_exhausted() -> None:
    with serve(max_sessions=2) as server, client_for(server) as client:
        for _ in range(2):
            client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="mse", expected_batch_size=1)
        with pytest.raises(ServiceError) as err:
            client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="mse", expected_batch_size=1)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
