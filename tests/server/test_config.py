"""ServerConfig from flags and environment, tokens files, and the bind refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from psg_core.errors import ConfigError
from psg_server.config import ServerConfig, load_tokens
from psg_server.security import check_bind_allowed

TOKEN_A = "token-a-0123456789"
TOKEN_B = "token-b-0123456789"


def test_flags_win_over_environment_which_wins_over_defaults() -> None:
    config = ServerConfig.from_args(["--port", "7000"], environ={"PSG_PORT": "6000", "PSG_MAX_BATCH_ROWS": "32",
                                                                 "PSG_SESSION_IDLE_SECONDS": "1.5",
                                                                 "PSG_MODEL_PLUGINS": "a.b, c"})
    assert config.port == 7000 and config.max_batch_rows == 32 and config.session_idle_seconds == 1.5
    assert config.model_plugins == ("a.b", "c")
    assert config.chunk_bytes == ServerConfig().chunk_bytes


def test_direct_channels_are_opt_in_by_flag_or_environment() -> None:
    assert ServerConfig.from_args([], {}).direct_channels is False
    assert ServerConfig.from_args([], {"PSG_DIRECT_CHANNELS": "1"}).direct_channels is True
    assert ServerConfig.from_args(["--direct-channels"], {}).direct_channels is True
    assert ServerConfig.from_args(["--no-direct-channels"], {"PSG_DIRECT_CHANNELS": "yes"}).direct_channels is False


def test_config_is_frozen_and_never_shows_tokens() -> None:
    config = ServerConfig(tokens={TOKEN_A: "alice"})
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
    assert TOKEN_A not in repr(config)


def test_tokens_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# operators\nalice {TOKEN_A}\n\n{TOKEN_B}  # ci\n")
    config = ServerConfig.from_args(["--tokens-file", str(path)], environ={"PSG_TOKENS": "x" * 20})
    assert config.tokens[TOKEN_A] == "alice" and set(config.tokens) == {TOKEN_A, TOKEN_B, "x" * 20}
    # unlabeled tokens get distinct principals, whichever source they come from
    assert config.tokens[TOKEN_B] != config.tokens["x" * 20]
    assert config.tokens[TOKEN_B].startswith("token-")
    from_env = ServerConfig.from_args([], environ={"PSG_TOKENS_FILE": str(path)})
    assert set(from_env.tokens) == {TOKEN_A, TOKEN_B}


@pytest.mark.parametrize("text, message", [
    ("short", "at least 16 characters"),
    ("a b c", "has 3 fields"),
    (f"{TOKEN_A}\n{TOKEN_A}", "repeats a token"),
])
def test_bad_tokens_files_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_tokens(text, source="t")


def test_unreadable_tokens_file_and_bad_environment_numbers() -> None:
    with pytest.raises(ConfigError, match="cannot read tokens file"):
        ServerConfig.from_args(["--tokens-file", "/nonexistent/tokens"], environ={})
    with pytest.raises(ConfigError, match="PSG_PORT='eighty' is not a number"):
        ServerConfig.from_args([], environ={"PSG_PORT": "eighty"})


@pytest.mark.parametrize("kwargs, message", [
    ({"port": 70000}, "port must be in"),
    ({"chunk_bytes": 4 << 20}, "chunk_bytes must be in"),
    ({"max_message_bytes": 1000}, "max_message_bytes must be"),
    ({"max_batch_rows": 0}, "max_batch_rows must be an int >= 1"),
    ({"step_timeout_seconds": 0}, "step_timeout_seconds must be > 0"),
    ({"default_accountant": "gdp"}, "default_accountant"),
    ({"tls_cert": Path("c.pem")}, "tls_cert and tls_key go together"),
    ({"tls_client_ca": Path("ca.pem")}, "needs tls_cert"),
])
def test_invalid_configurations_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


def test_non_loopback_bind_needs_tokens_or_tls_or_insecure() -> None:
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_bind_allowed(ServerConfig(host=host))
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(ConfigError, match="refusing to listen"):
            check_bind_allowed(ServerConfig(host=host))
    check_bind_allowed(ServerConfig(host="0.0.0.0", tokens={TOKEN_A: "a"}))
    check_bind_allowed(ServerConfig(host="0.0.0.0", tls_cert=Path("c"), tls_key=Path("k")))
    check_bind_allowed(ServerConfig(host="0.0.0.0", insecure=True))


def test_ipv6_address_is_bracketed() -> None:
    assert ServerConfig(host="::1", port=5).address == "[::1]:5"
    assert ServerConfig(host="127.0.0.1", port=5).address == "127.0.0.1:5"
