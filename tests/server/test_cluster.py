"""Joining Ray: where the token comes from, when token mode is turned on, and failures explained.

The same against real ``ray start`` clusters (token authentication on, a host without the token)
is tests/integration/test_ray_multinode.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from psg_server import cluster
from psg_server.errors import NoWorkersError


def test_the_token_comes_from_ray_s_sources_in_ray_s_order(tmp_path: Path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("a" * 32)
    assert cluster.token_source({}, home=tmp_path) == str(tmp_path / ".ray" / "auth_token")
    assert cluster.token_source({"RAY_AUTH_TOKEN_PATH": "/etc/ray/token"}, home=tmp_path) == \
        "RAY_AUTH_TOKEN_PATH=/etc/ray/token"
    assert cluster.token_source({"RAY_AUTH_TOKEN": "b" * 32, "RAY_AUTH_TOKEN_PATH": "/x"}, home=tmp_path) == \
        "RAY_AUTH_TOKEN"
    assert cluster.token_source({"RAY_AUTH_TOKEN": " "}, home=tmp_path / "nobody") is None


def test_token_mode_is_turned_on_only_when_unset_and_a_token_exists(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    monkeypatch.setattr(Path, "home", lambda: tmp_path)  # no ~/.ray/auth_token
    environ = {"RAY_AUTH_TOKEN": "c" * 32}
    assert cluster.prepare_token_auth(environ) == "RAY_AUTH_TOKEN" and environ["RAY_AUTH_MODE"] == "token"
    chosen = {"RAY_AUTH_TOKEN": "c" * 32, "RAY_AUTH_MODE": "disabled"}  # the operator's choice stands
    assert cluster.prepare_token_auth(chosen) is None and chosen["RAY_AUTH_MODE"] == "disabled"
    bare: dict[str, str] = {}
    assert cluster.prepare_token_auth(bare) is None and "RAY_AUTH_MODE" not in bare


class _AuthenticationError(Exception):
    """Stands for ray.exceptions.AuthenticationError (matched by name, as Ray wraps it variously)."""


_AuthenticationError.__name__ = "AuthenticationError"


def _refused() -> ConnectionError:
    try:
        try:
            raise _AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing or incorrect")
        except _AuthenticationError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from cause
    except ConnectionError as error:
        return error


def test_failures_name_the_cause_and_the_fix() -> None:
    missing = cluster.describe_failure(_refused(), address="10.0.0.1:6379", source=None, environ={})
    assert "requires token authentication and this host has no Ray token" in missing
    assert "RAY_AUTH_TOKEN" in missing and "~/.ray/auth_token" in missing and "ray get-auth-token" in missing
    wrong = cluster.describe_failure(_refused(), address="10.0.0.1:6379", source="RAY_AUTH_TOKEN",
                                     environ={"RAY_AUTH_MODE": "token"})
    assert "refused this host's Ray token (from RAY_AUTH_TOKEN)" in wrong
    absent = cluster.describe_failure(ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"),
                                      address="10.0.0.1:6379", source=None, environ={})
    assert "ray status --address 10.0.0.1:6379" in absent and "--ray-address" in absent
    for line in (missing, wrong, absent):
        assert "\n" not in line and line.startswith("cannot join the Ray cluster at 10.0.0.1:6379: ")


def test_an_embedded_ray_that_times_out_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def timed_out(**kwargs: object) -> None:  # what Ray raises when its processes start too slowly
        raise Exception("The current node timed out during startup. This could happen because some of "
                        "the Ray processes failed to startup.")

    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(NoWorkersError, match=r"^WorkerPool.start: cannot start the embedded Ray: The current "
                                             r"node timed out during startup.*Fix: ") as failure:
        cluster.connect(None, {})
    assert "\n" not in str(failure.value)
