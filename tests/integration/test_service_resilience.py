"""Retries on UNAVAILABLE, re-pushing parameters the server dropped, deadlines, idle expiry."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Sequence

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


def test_client_retries_unavailable_until_the_server_comes_up() -> None:
    port = _free_port()
    started = threading.Event()
    holder: list[BackgroundServer] = []

    def start_later() -> None:
        time.sleep(0.5)
        holder.append(BackgroundServer(ServerConfig(port=port)).start())
        started.set()

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        retry = RetryPolicy(max_attempts=30, initial_backoff_s=0.05, max_backoff_s=0.3)
        with GradientClient(f"127.0.0.1:{port}", retry=retry, timeout_s=10) as client:
            assert client.server_info().version
        assert started.is_set()
    finally:
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


class _SlowExecutor(InProcessExecutor):
    """Sleeps before every step; records whether a step was cancelled."""

    def __init__(self, delay: float) -> None:
        super().__init__(default_registry())
        self.delay = delay
        self.cancelled = 0

    async def run(self, spec: SessionSpec, parameters: ParameterSet, shards: Sequence[Shard]) -> list[DPGradient]:
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().run(spec, parameters, shards)


def test_steps_past_the_deadline_are_cancelled() -> None:
    executor = _SlowExecutor(delay=5.0)
    with serve(executor=executor, step_timeout_seconds=1.0) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
        session.push_parameters(build())
        with pytest.raises(ServiceError) as err:
            session.compute_gradients(*mlp_batch(2))
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")
        assert executor.cancelled == 1 and session.info().steps == 0
        executor.delay = 0.0
        assert session.compute_gradients(*mlp_batch(2)).step == 1


def test_client_deadline_cancels_the_step_on_the_server() -> None:
    executor = _SlowExecutor(delay=5.0)
    with serve(executor=executor) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2)
        session.push_parameters(build())
        client.timeout_s = 0.5
        with pytest.raises(ServiceError) as err:
            session.compute_gradients(*mlp_batch(2))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while executor.cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert executor.cancelled == 1


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
