"""Sessions and their store: ownership, versions, budget, seeds, expiry and parameter memory."""

from __future__ import annotations

import json
import math
import re
import sqlite3
from pathlib import Path

import grpc
import pytest
import torch

from psg_core.config import DPGradient
from psg_core.errors import BudgetExhaustedError
from psg_core.noise import add_noise
from psg_core.privacy_step import PrivacyStep
from psg_server.config import ServerConfig
from psg_server.errors import (InvalidRequestError, LimitExceededError, ParametersMissingError, SessionNotFoundError,
                               StaleParametersError, translate)
from psg_server.executor import ParameterSet
from psg_server.models import default_registry
from psg_server.sessions import MAX_PARAMETER_VERSION, Session, SessionStore, open_session, restore_session
from psg_server.state import SessionDatabase
from psg_server.step import StepRunner
from psg_wire.v1 import gradient_service_pb2 as pb

REGISTRY = default_registry()


def make(owner: str = "alice", **dp: object) -> Session:
    kwargs = '{"in_features": 2, "hidden": [], "num_classes": 2}'
    settings = pb.DPSettings(**{"max_grad_norm": 1.0, **dp})  # type: ignore[arg-type]
    request = pb.CreateSessionRequest(model="mlp", model_kwargs_json=kwargs, loss="cross_entropy",
                                      expected_batch_size=4, dp=settings)
    return open_session(request, owner=owner, registry=REGISTRY, config=ServerConfig())


def params(version: int, size: int = 2) -> ParameterSet:
    return ParameterSet(version=version, tensors={"0.weight": torch.zeros(2, size), "0.bias": torch.zeros(2)})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sessions_belong_to_their_owner() -> None:
    store = SessionStore(max_sessions=4, idle_seconds=10, parameter_memory_bytes=1 << 20)
    session = make("alice")
    store.add(session)
    assert store.get(session.id, "alice") is session
    with pytest.raises(SessionNotFoundError):
        store.get(session.id, "bob")
    with pytest.raises(SessionNotFoundError):
        store.remove(session.id, "bob")
    assert store.remove(session.id, "alice") is session and len(store) == 0


def test_versions_stale_and_missing() -> None:
    store = SessionStore(max_sessions=4, idle_seconds=10, parameter_memory_bytes=1 << 20)
    session = make()
    store.add(session)
    with pytest.raises(ParametersMissingError):
        session.parameters_for(0)
    store.store_parameters(session, params(3))
    assert session.parameters_for(3).version == 3
    with pytest.raises(StaleParametersError, match="version 2 is stale; session .* is at version 3"):
        session.parameters_for(2)
    with pytest.raises(ParametersMissingError):
        session.parameters_for(4)


def test_parameter_memory_drops_least_recently_used_sets() -> None:
    clock = Clock()
    size = params(1).num_bytes
    store = SessionStore(max_sessions=4, idle_seconds=100, parameter_memory_bytes=2 * size, clock=clock)
    sessions = [make() for _ in range(3)]
    for index, session in enumerate(sessions):
        clock.now = index
        store.add(session)
    store.store_parameters(sessions[0], params(1))
    store.store_parameters(sessions[1], params(1))
    clock.now = 5
    store.get(sessions[0].id, "alice")  # touched: sessions[1] is now the least recently used
    store.store_parameters(sessions[2], params(1))
    assert [s.parameters is not None for s in sessions] == [True, False, True]
    assert sessions[1].latest_version == 1  # it knows what it lost
    with pytest.raises(LimitExceededError, match="exceed the server's parameter memory"):
        store.store_parameters(sessions[0], params(2, size=1000))


def test_idle_sessions_expire_and_the_store_has_a_limit() -> None:
    clock = Clock()
    store = SessionStore(max_sessions=2, idle_seconds=10, parameter_memory_bytes=1 << 20, clock=clock)
    old, new = make(), make()
    store.add(old)
    clock.now = 8
    store.add(new)
    with pytest.raises(LimitExceededError, match="already holds 2 sessions"):
        store.add(make())
    clock.now = 12
    assert store.expire_idle() == [old] and len(store) == 1


def test_one_owner_cannot_take_every_session() -> None:
    store = SessionStore(max_sessions=4, idle_seconds=10, parameter_memory_bytes=1 << 20, max_sessions_per_owner=2)
    store.add(make("alice"))
    store.add(make("alice"))
    with pytest.raises(LimitExceededError, match=r"already holds 2 open sessions.*max_sessions_per_token=2"):
        store.add(make("alice"))
    store.add(make("bob"))  # the others still get theirs
    assert len(store) == 3


@pytest.mark.parametrize("dp, message", [
    ({"noise_multiplier": 1e300}, "noise_multiplier 1e+300 is above 10000"),
    ({"noise_multiplier": 1.0, "max_grad_norm": 1e308}, "max_grad_norm 1e+308 is above 1e+30"),
    ({"noise_multiplier": 1e4, "max_grad_norm": 1e28}, "noise_multiplier * max_grad_norm = 10000 * 1e+28 = 1e+32"),
])
def test_sigma_and_bounds_that_would_overflow_are_refused(dp: dict[str, float], message: str) -> None:
    # sigma = 1e300 used to fail every step in the accountants; C = 1e308 returned an all-inf gradient
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        make(**dp)


def test_noise_seeds_depend_on_session_seed_and_step() -> None:
    a, b = make(), make()
    a.seed = b.seed = 42
    assert a.noise_seed(None) == b.noise_seed(None) == a.noise_seed(1)
    assert a.noise_seed(1) != a.noise_seed(2)
    b.seed = 43
    assert a.noise_seed(5) != b.noise_seed(5)
    assert 0 <= a.noise_seed(2**64 - 1) < 2**63


def test_budget_is_checked_before_and_recorded_after_a_step() -> None:
    request = pb.CreateSessionRequest(model="mlp", loss="cross_entropy", expected_batch_size=4,
                                      dp=pb.DPSettings(max_grad_norm=1.0, noise_multiplier=3.0),
                                      privacy=pb.PrivacySettings(accountant="rdp", sample_rate=0.5, delta=1e-5,
                                                                 target_epsilon=2.0))
    session = open_session(request, owner="a", registry=REGISTRY, config=ServerConfig())
    spent = []
    with pytest.raises(BudgetExhaustedError):
        for _ in range(10):
            session.check_budget()
            session.record_step()
            spent.append(session.epsilon_spent)
    assert session.accounted and not make().accounted
    assert len(spent) == 5 and spent == sorted(spent) and spent[-1] <= 2.0
    assert session.budget_left == pytest.approx(2.0 - spent[-1])
    free = make()
    free.check_budget()
    assert free.record_step() == 1 and math.isinf(free.epsilon_spent) and math.isinf(free.budget_left)


def test_mean_reduction_normalises_by_the_expected_batch_size() -> None:
    assert make().normaliser == 4.0
    assert make(loss_reduction="sum").normaliser == 1.0


def test_the_session_runs_psg_core_privacy_step_with_the_l2_sensitivity() -> None:
    dp = pb.DPSettings(max_grad_norm=1.0, clipping="per_layer", per_layer_max_grad_norms=[3.0, 4.0],
                       noise_multiplier=1.0)
    kwargs = '{"in_features": 2, "hidden": [], "num_classes": 2}'
    privacy = pb.PrivacySettings(accountant="rdp", sample_rate=0.5, delta=1e-5)
    request = pb.CreateSessionRequest(model="mlp", model_kwargs_json=kwargs, loss="cross_entropy",
                                      expected_batch_size=4, dp=dp, privacy=privacy)
    session = open_session(request, owner="a", registry=REGISTRY, config=ServerConfig())
    assert session.privacy_step == PrivacyStep.for_config(session.dp_config, sample_rate=0.5, expected_batch_size=4)
    assert session.privacy_step.sensitivity == 5.0 and session.normaliser == 4.0
    # What a step releases: the merged clipped sum, noised once with the step's seed, normalised.
    merged = DPGradient(grads={"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2)},
                        per_sample_norms=torch.ones(3), loss_sum=1.0, num_samples=3, num_clipped=0)
    released = StepRunner._noise_and_normalise(session, merged, step_seed=9)
    expected = add_noise(merged.grads, noise_multiplier=1.0, sensitivity=5.0,
                         generator=torch.Generator().manual_seed(session.noise_seed(9)))
    for name, grad in expected.items():
        assert torch.equal(released[name], grad / 4.0)
    assert torch.equal(merged.grads["0.bias"], torch.ones(2))


def test_the_store_checks_the_version_again_when_it_stores() -> None:
    # PushParameters checks the version when the header comes, then uploads: another push may have
    # been stored meanwhile, so storing checks again, and a lower or equal version is refused.
    store = SessionStore(max_sessions=4, idle_seconds=10, parameter_memory_bytes=1 << 20)
    session = make()
    store.add(session)
    newer = params(5)
    store.store_parameters(session, newer)
    for version in (3, 5):
        with pytest.raises(StaleParametersError, match=f"ComputeGradients: version {version} is not newer than "
                                                       "the session's version 5"):
            store.store_parameters(session, params(version), rpc="ComputeGradients")
        assert session.parameters is newer and session.latest_version == 5


def test_versions_the_database_cannot_keep_are_invalid() -> None:
    session = make()
    with pytest.raises(InvalidRequestError, match=re.escape("PushParameters: parameter version 9223372036854775808 is "
                                                            "above 9223372036854775807 (2**63 - 1)")):
        session.check_new_version(2**63, rpc="PushParameters")
    with pytest.raises(InvalidRequestError, match="above 9223372036854775807"):
        session.check_new_version(2**64 - 1, rpc="PushParameters")
    session.check_new_version(MAX_PARAMETER_VERSION, rpc="PushParameters")  # the largest SQLite keeps


def test_augmentation_multiplicity_must_fit_the_servers_batch_rows() -> None:
    def request(K: int) -> pb.CreateSessionRequest:
        return pb.CreateSessionRequest(model="mlp", model_kwargs_json='{"in_features": 2, "num_classes": 2}',
                                       loss="cross_entropy", expected_batch_size=4,
                                       dp=pb.DPSettings(max_grad_norm=1.0, augmentation_multiplicity=K))
    config = ServerConfig(max_batch_rows=8)
    widest = open_session(request(8), owner="a", registry=REGISTRY, config=config)
    assert widest.dp_config.augmentation_multiplicity == 8
    with pytest.raises(InvalidRequestError, match=re.escape("CreateSession: augmentation_multiplicity 9 is above the "
                                                            "server's max_batch_rows=8")) as err:
        open_session(request(9), owner="a", registry=REGISTRY, config=config)
    assert translate(err.value).code == grpc.StatusCode.INVALID_ARGUMENT


class FailingDatabase(SessionDatabase):
    """A database whose progress writes fail while ``failing`` is set (a full disk, say)."""

    failing = False

    def save_progress(self, *args: object, **kwargs: object) -> None:
        if self.failing:
            raise sqlite3.OperationalError("database or disk is full")
        super().save_progress(*args, **kwargs)  # type: ignore[arg-type]


def test_a_step_whose_progress_cannot_be_written_is_not_counted(tmp_path: Path) -> None:
    database = FailingDatabase(tmp_path)
    store = SessionStore(max_sessions=4, idle_seconds=10, parameter_memory_bytes=1 << 20, database=database)
    request = pb.CreateSessionRequest(model="mlp", model_kwargs_json='{"in_features": 2, "num_classes": 2}',
                                      loss="cross_entropy", expected_batch_size=4,
                                      dp=pb.DPSettings(max_grad_norm=1.0, noise_multiplier=1.0),
                                      privacy=pb.PrivacySettings(accountant="rdp", sample_rate=0.1, delta=1e-5))
    session = open_session(request, owner="a", registry=REGISTRY, config=ServerConfig())
    store.add(session)
    assert store.record_step(session, step_seed=4) == 1
    one = (session.steps, session.epsilon_spent, session.record().ledger, session.used_step_seeds.runs())
    database.failing = True
    with pytest.raises(sqlite3.OperationalError):
        store.record_step(session, step_seed=5)
    # Memory is put back as the database has it: the step was never released, nor charged.
    assert (session.steps, session.epsilon_spent, session.record().ledger, session.used_step_seeds.runs()) == one
    [stored] = database.load()
    assert (stored.steps, stored.epsilon_spent, stored.ledger, stored.step_seeds) == (1, one[1], one[2], ((4, 4),))
    database.failing = False
    assert store.record_step(session, step_seed=5) == 2
    assert session.used_step_seeds.runs() == [(4, 5)]
    store.close()
    reopened = SessionStore(max_sessions=4, idle_seconds=10, parameter_memory_bytes=1 << 20,
                            database=SessionDatabase(tmp_path))
    reopened.restore(lambda record: restore_session(record, registry=REGISTRY, config=ServerConfig()))
    again = reopened.get(session.id, "a")
    assert (again.steps, again.epsilon_spent, again.used_step_seeds.runs()) == (2, session.epsilon_spent, [(4, 5)])
    assert json.loads(again.record().ledger or "null") == json.loads(session.record().ledger or "null")
    reopened.close()
