"""A real ``psg-server`` killed with SIGKILL in the middle of a stream of steps and restarted on the
same ``--state-dir``: no step whose gradient a client received is missing from the ledger (epsilon
afterwards is at least the epsilon every received step reported, and no step index is handed out
twice), a session with 3 accounted steps is found with its ledger, and the client carries on by
itself (it retries while the server is down, then pushes its parameters again).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from psg_client import GradientClient, GradientResult, RetryPolicy, Session
from psg_core.accounting import PrivacyAccountant
from psg_core.config import DPConfig
from tests.ports import free_port
from tests.server.service_harness import MLP_KWARGS, build, mlp_batch
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
#: Long enough to ride out a restart (a few seconds of imports on a loaded machine).
PATIENT = RetryPolicy(max_attempts=200, initial_backoff_s=0.05, max_backoff_s=0.5)
DELTA = 1e-5


class ServerProcess:
    """``psg-server --executor inprocess`` on a fixed port and state directory, logging to a file."""

    def __init__(self, port: int, state_dir: Path, log: Path) -> None:
        self.port, self.state_dir, self.log = port, state_dir, log
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PSG_", "GRPC_", "RAY_"))}
        with self.log.open("a") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "psg_server", "--port", str(self.port), "--executor", "inprocess",
                 "--state-dir", str(self.state_dir)], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        wait_until(lambda: self.log.read_text().count("serving on port") >= self.starts or
                   self.process.poll() is not None, 180, "psg-server to serve")  # type: ignore[union-attr]
        assert self.process.poll() is None, self.log.read_text()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(free_port(), tmp_path / "state", tmp_path / "psg-server.log")
    process.start()
    try:
        yield process
    finally:
        process.stop()


def open_session(client: GradientClient) -> Session:
    session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=64,
                                    config=DPConfig(noise_multiplier=1.0), sample_rate=0.01, delta=DELTA,
                                    accountant="pld")
    session.push_parameters(build())
    return session


def test_sigkill_mid_stream_loses_no_received_step(server: ServerProcess) -> None:
    client = GradientClient(f"127.0.0.1:{server.port}", retry=PATIENT, timeout_s=60.0)
    inputs, targets = mlp_batch(512)

    # A session with 3 accounted steps, idle when the server dies.
    settled = open_session(client)
    settled_steps = [settled.compute_gradients(inputs, targets) for _ in range(3)]

    # A session stepping in a loop while the server is killed under it.
    busy = open_session(client)
    received: list[GradientResult] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    progress = threading.Condition()

    def train() -> None:
        try:
            while not stop.is_set():
                result = busy.compute_gradients(inputs, targets)
                with progress:
                    received.append(result)
                    progress.notify_all()
        except BaseException as error:  # reported by the main thread
            errors.append(error)
            with progress:
                progress.notify_all()

    def received_at_least(count: int) -> bool:
        with progress:
            return progress.wait_for(lambda: len(received) >= count or bool(errors), timeout=120) and not errors

    trainer = threading.Thread(target=train, name="trainer")
    trainer.start()
    try:
        assert received_at_least(3), errors
        server.kill()  # the trainer is inside a call: uploading, computing or reading a reply
        before_kill = len(received)
        server.start()
        assert received_at_least(before_kill + 3), errors  # it carried on by itself
    finally:
        stop.set()
        trainer.join(timeout=120)
    assert not errors, errors
    info = busy.info()

    # Every received gradient is in the ledger: step indices are never handed out twice (a step
    # received but not persisted would have its index reused after the restart) ...
    indices = [result.step for result in received]
    assert indices == sorted(set(indices)), indices
    assert info.steps >= indices[-1]
    # ... and epsilon now covers every received step's.
    assert info.epsilon_spent >= max(result.epsilon_spent for result in received)
    ledger = PrivacyAccountant("pld")
    ledger.step(1.0, 0.01, num_steps=info.steps)
    assert info.epsilon_spent == pytest.approx(ledger.epsilon(DELTA))

    # The settled session: found, its 3 steps and their epsilon, its parameters to push again.
    attached = client.session(settled.id)
    again = attached.info()
    assert (again.steps, again.epsilon_spent) == (3, settled_steps[-1].epsilon_spent)
    assert (again.param_version, again.latest_param_version) == (0, 1)
    attached.push_parameters(build())
    fourth = attached.compute_gradients(inputs, targets)
    assert fourth.step == 4 and fourth.epsilon_spent > again.epsilon_spent
    client.close()
