"""Sessions that survive a restart: the SQLite store under --state-dir, reopening sessions with their
ledger, step counter, parameter version, sigma and seed, and a client that carries on by itself.

A real psg-server process killed (SIGKILL) mid-stream and restarted is in
tests/integration/test_restart.py.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import grpc
import pytest

from psg_client import RetryPolicy, ServiceError
from psg_core.accounting import PrivacyAccountant
from psg_core.calibration import calibrate_noise_multiplier
from psg_core.config import DPConfig
from psg_core.errors import ConfigError
from psg_server.config import ServerConfig
from psg_server.errors import InvalidRequestError, SessionNotFoundError
from psg_server.models import default_registry
from psg_server.sessions import Session, SessionStore, open_session, restore_session
from psg_server.state import DATABASE_NAME, SessionDatabase, SessionRecord
from psg_wire.v1 import gradient_service_pb2 as pb
from tests.ports import free_port
from tests.server.service_harness import MLP_KWARGS, build, client_for, mlp_batch, serve

REGISTRY = default_registry()
CONFIG = ServerConfig()


def request(**privacy: object) -> pb.CreateSessionRequest:
    return pb.CreateSessionRequest(
        model="mlp", model_kwargs_json=json.dumps(MLP_KWARGS), loss="cross_entropy", expected_batch_size=4,
        dp=pb.DPSettings(max_grad_norm=1.0, noise_multiplier=1.2),
        privacy=pb.PrivacySettings(sample_rate=0.01, delta=1e-5, **privacy))  # type: ignore[arg-type]


def store(state_dir: Path, *, idle_seconds: float = 3600.0) -> SessionStore:
    return SessionStore(max_sessions=8, idle_seconds=idle_seconds, parameter_memory_bytes=1 << 20,
                        database=SessionDatabase(state_dir))


def reopen(state_dir: Path, **kwargs: float) -> SessionStore:
    reopened = store(state_dir, **kwargs)
    reopened.restore(lambda record: restore_session(record, registry=REGISTRY, config=CONFIG))
    return reopened


# ---------------------------------------------------------------------------------- the database
def test_one_server_per_state_directory(tmp_path: Path) -> None:
    database = SessionDatabase(tmp_path / "state")
    with pytest.raises(ConfigError, match="in use by another psg-server"):
        SessionDatabase(tmp_path / "state")
    database.close()
    SessionDatabase(tmp_path / "state").close()  # released by close (and by the process's death)


def test_a_database_of_another_schema_is_refused(tmp_path: Path) -> None:
    SessionDatabase(tmp_path).close()
    with sqlite3.connect(tmp_path / DATABASE_NAME) as connection:
        connection.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(ConfigError, match="schema version 99"):
        SessionDatabase(tmp_path)
    SessionDatabase(tmp_path / "elsewhere").close()  # (the refused one released its lock)
    with pytest.raises(ConfigError, match="schema version 99"):
        SessionDatabase(tmp_path)


def test_records_round_trip(tmp_path: Path) -> None:
    database = SessionDatabase(tmp_path)
    record = SessionRecord(session_id="s", owner="alice", request=b"\x00\x01", steps=0, ledger=None,
                           epsilon_spent=0.0, param_version=0, updated=time.time())
    database.insert(record)
    database.save_progress("s", steps=2, ledger="{}", epsilon_spent=0.25, param_version=7)
    [loaded] = database.load()
    assert (loaded.session_id, loaded.owner, loaded.request, loaded.steps, loaded.ledger, loaded.epsilon_spent,
            loaded.param_version) == ("s", "alice", b"\x00\x01", 2, "{}", 0.25, 7)
    database.delete("s")
    assert database.load() == []
    database.close()


# ------------------------------------------------------------------------ sessions across restarts
def accounted(session: Session, steps: int) -> None:
    for _ in range(steps):
        session.record_step()


def test_a_reopened_session_has_its_settings_ledger_steps_and_version(tmp_path: Path) -> None:
    sessions = store(tmp_path)
    session = open_session(request(target_epsilon=50.0), owner="alice", registry=REGISTRY, config=CONFIG)
    sessions.add(session)
    accounted(session, 3)
    session.latest_version = 4
    sessions.persist(session)
    sessions.close()

    reopened = reopen(tmp_path)
    again = reopened.get(session.id, "alice")
    assert (again.steps, again.latest_version, again.parameters) == (3, 4, None)
    assert again.epsilon_spent == session.epsilon_spent > 0 and again.budget_left == session.budget_left
    assert (again.seed, again.dp_config, again.privacy) == (session.seed, session.dp_config, session.privacy)
    assert again.noise_seed(None) == session.noise_seed(None)  # step 4's noise, as without the restart
    expected = PrivacyAccountant("rdp")
    expected.step(1.2, 0.01, num_steps=3)
    assert again.epsilon_spent == expected.epsilon(1e-5)
    with pytest.raises(SessionNotFoundError):
        reopened.get(session.id, "bob")
    again.record_step()  # the ledger goes on from 3
    assert again.steps == 4 and again.epsilon_spent > session.epsilon_spent
    reopened.close()


def test_closed_and_expired_sessions_are_forgotten(tmp_path: Path) -> None:
    sessions = store(tmp_path)
    closed, kept = (open_session(request(), owner="alice", registry=REGISTRY, config=CONFIG) for _ in range(2))
    sessions.add(closed)
    sessions.add(kept)
    sessions.remove(closed.id, "alice")
    sessions.close()
    reopened = reopen(tmp_path)
    assert len(reopened) == 1 and reopened.get(kept.id, "alice").steps == 0
    reopened.close()
    time.sleep(0.01)  # the idle time being tested is wall-clock time since the last write
    expired = reopen(tmp_path, idle_seconds=0.001)
    assert len(expired) == 0
    expired.close()
    assert not _rows(tmp_path)


def _rows(state_dir: Path) -> list[tuple[str]]:
    with sqlite3.connect(state_dir / DATABASE_NAME) as connection:
        return connection.execute("SELECT session_id FROM sessions").fetchall()


def test_a_session_that_cannot_be_rebuilt_stays_stored_and_the_others_open(tmp_path: Path) -> None:
    sessions = store(tmp_path)
    good = open_session(request(), owner="alice", registry=REGISTRY, config=CONFIG)
    sessions.add(good)
    bad = open_session(request(), owner="alice", registry=REGISTRY, config=CONFIG)
    bad.request.model = "no-such-model"
    sessions.add(bad)
    sessions.close()
    reopened = reopen(tmp_path)
    assert len(reopened) == 1 and reopened.get(good.id, "alice") is not None
    reopened.close()
    assert len(_rows(tmp_path)) == 2


# ---------------------------------------------------------------------------- noise calibration
def test_a_session_planned_in_steps_gets_the_calibrated_sigma() -> None:
    planned = request(target_epsilon=3.0, steps=200, accountant="rdp")
    planned.dp.noise_multiplier = 0.0
    session = open_session(planned, owner="alice", registry=REGISTRY, config=CONFIG)
    sigma = calibrate_noise_multiplier(3.0, delta=1e-5, sample_rate=0.01, steps=200, accountant="rdp")
    assert session.dp_config.noise_multiplier == sigma and session.privacy.target_epsilon == 3.0
    # The stored request reopens it with that sigma, without calibrating again.
    assert session.request.dp.noise_multiplier == sigma and not session.request.privacy.steps
    assert session.request.seed == session.seed


@pytest.mark.parametrize(("privacy", "sigma", "match"), [
    ({"target_epsilon": 3.0, "steps": 10}, 1.0, "not both"),
    ({"steps": 10}, 0.0, "needs privacy.target_epsilon"),
    ({"target_epsilon": 3.0, "steps": 10, "epochs": 1.0}, 0.0, "one of them"),
])
def test_calibration_requests_that_do_not_add_up_are_refused(privacy: dict[str, float], sigma: float,
                                                            match: str) -> None:
    planned = request(**privacy)
    planned.dp.noise_multiplier = sigma
    with pytest.raises((InvalidRequestError, ConfigError), match=match):
        open_session(planned, owner="alice", registry=REGISTRY, config=CONFIG)


def test_the_client_asks_for_a_plan_and_reads_the_sigma() -> None:
    with serve() as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                        expected_batch_size=4, config=DPConfig(max_grad_norm=1.0),
                                        sample_rate=0.1, delta=1e-5, target_epsilon=4.0, epochs=3)
        expected = calibrate_noise_multiplier(4.0, delta=1e-5, sample_rate=0.1, epochs=3,
                                              accountant=ServerConfig.default_accountant)
        assert session.noise_multiplier == expected
        assert client.session(session.id).noise_multiplier == expected  # what GetSession reports


# ----------------------------------------------------------------------- a server restarted in process
def test_a_restarted_server_resumes_sessions_and_the_client_carries_on(tmp_path: Path) -> None:
    port = free_port()
    model = build()
    inputs, targets = mlp_batch(4)
    patient = RetryPolicy(max_attempts=30, initial_backoff_s=0.05, max_backoff_s=0.5)
    with serve(port=port, state_dir=tmp_path) as server:
        client = client_for(server, retry=patient)
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy",
                                        expected_batch_size=4, config=DPConfig(noise_multiplier=1.0),
                                        sample_rate=0.05, delta=1e-5, seed=3)
        session.push_parameters(model)
        received = [session.compute_gradients(inputs, targets) for _ in range(3)]
    with serve(port=port, state_dir=tmp_path):
        info = session.info()
        assert (info.steps, info.epsilon_spent, info.param_version, info.latest_param_version) == \
            (3, received[-1].epsilon_spent, 0, 1)
        # The same Session object goes on: PARAMETERS_MISSING -> it pushes again (version 2).
        fourth = session.compute_gradients(inputs, targets)
        assert (fourth.step, fourth.param_version) == (4, 2) and fourth.epsilon_spent > received[-1].epsilon_spent
        # A new process reattaches by id and pushes above the stored version.
        attached = client.session(session.id)
        assert attached.param_version == 2 and attached.noise_multiplier == 1.0
        assert attached.push_parameters(model) == 3
        assert attached.compute_gradients(inputs, targets).step == 5
    client.close()


def test_a_version_the_database_cannot_keep_is_refused_at_push(tmp_path: Path) -> None:
    # SQLite keeps signed 64-bit integers: version 2**63 used to be accepted, then every step failed
    # INTERNAL after being charged in memory, and a restart forgot the charges.
    port = free_port()
    model = build()
    inputs, targets = mlp_batch(4)
    with serve(port=port, state_dir=tmp_path) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                        config=DPConfig(noise_multiplier=1.0), delta=1e-5)
        session.param_version = 2**63 - 1
        for push in (lambda: session.push_parameters(model),
                     lambda: session.compute_gradients(inputs, targets, parameters=model)):
            with pytest.raises(ServiceError) as err:
                push()
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "parameter version 9223372036854775808 is above 9223372036854775807 (2**63 - 1)" in err.value.details
        info = session.info()
        assert (info.steps, info.latest_param_version, info.epsilon_spent) == (0, 0, 0.0)
        session.param_version = 2**63 - 2
        assert session.push_parameters(model) == 2**63 - 1  # the largest that fits is kept
        spent = session.compute_gradients(inputs, targets).epsilon_spent
    with serve(port=port, state_dir=tmp_path) as server, client_for(server) as client:
        info = client.session(session.id).info()
        assert (info.steps, info.latest_param_version, info.epsilon_spent) == (1, 2**63 - 1, spent)


def test_a_step_whose_progress_cannot_be_written_is_neither_returned_nor_charged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing = {"on": False}
    save_progress = SessionDatabase.save_progress

    def flaky(self: SessionDatabase, *args: object, **kwargs: object) -> None:
        if failing["on"]:
            raise sqlite3.OperationalError("database or disk is full")
        save_progress(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SessionDatabase, "save_progress", flaky)
    port = free_port()
    inputs, targets = mlp_batch(4)
    with serve(port=port, state_dir=tmp_path) as server, client_for(server) as client:
        session = client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=4,
                                        config=DPConfig(noise_multiplier=1.0), delta=1e-5, sample_rate=0.1)
        session.push_parameters(build())
        first = session.compute_gradients(inputs, targets, step_seed=1)
        failing["on"] = True
        with pytest.raises(ServiceError) as err:
            session.compute_gradients(inputs, targets, step_seed=2)
        assert err.value.code == grpc.StatusCode.INTERNAL
        info = session.info()  # as the database has it: one step
        assert (info.steps, info.epsilon_spent) == (1, first.epsilon_spent)
        failing["on"] = False
        second = session.compute_gradients(inputs, targets, step_seed=2)  # its seed was never used
        assert second.step == 2
    with serve(port=port, state_dir=tmp_path) as server, client_for(server) as client:
        info = client.session(session.id).info()
        assert (info.steps, info.epsilon_spent) == (2, second.epsilon_spent)
