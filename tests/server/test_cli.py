"""What an operator sees from ``psg-server`` and ``psg-demo``: help that gives every flag's default,
gRPC's environment prepared before gRPC loads, log levels that tell the server's failures from
refused requests, and log lines that print values, not reprs.

The same, run as commands in subprocesses (and with a Ray pool), is in
tests/integration/test_server_cli.py.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

from psg_core.config import DPConfig
from psg_server import cli
from psg_server.config import ServerConfig, build_parser
from psg_server.errors import (InvalidRequestError, LimitExceededError, NoWorkersError, StepTimeoutError,
                               translate)
from tests.server.service_harness import MLP_KWARGS, client_for, serve

def server_defaults() -> dict[str, object]:
    """What ``psg-server`` itself passes over the dataclass defaults (see cli.main), read when called:
    its state directory follows ``XDG_STATE_HOME``, which tests/conftest.py sets per test session."""
    return cli.command_defaults()


def help_entries(text: str) -> dict[str, str]:
    """``{"--flag": "its help on one line"}`` for every option of an argparse ``--help`` output.

    An entry starts at a line indented by two spaces and a dash; its help follows the flag column
    (on the same line or the next) and goes on over the lines indented deeper.
    """
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.split("options:", 1)[1].splitlines():
        if re.match(r"  -", line):
            # "  --workers N, --num-workers N   workers: ..."; the flag column ends at 2+ spaces.
            column, _, rest = line.strip().partition("  ")
            current = [rest]
            for flag in re.findall(r"--[a-z][a-z-]*", column):
                entries[flag] = current
        elif line.startswith("   ") and current is not None:
            current.append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(parts).split()) for flag, parts in entries.items()}


def shown_default(help_text: str) -> str:
    """``X`` of the ``(default: X)`` that ends an option's help."""
    match = re.search(r"\(default: (.+)\)$", help_text)
    assert match, f"no '(default: ...)' at the end of {help_text!r}"
    return match.group(1)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options, less ``--help``."""
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


# ------------------------------------------------------------------------------ psg-server --help
def check_server_help(text: str) -> None:
    """Every flag of psg-server is in ``text`` with help and a default, the dataclass's where it
    has a plain one."""
    entries = help_entries(text)
    field_defaults = {f.name: f.default for f in fields(ServerConfig)} | server_defaults()
    checked = 0
    for action in options(build_parser()):
        for flag in action.option_strings:
            if not flag.startswith("--"):
                continue
            text = entries.get(flag)
            assert text, f"psg-server --help does not describe {flag}"
            shown = shown_default(text)
            assert text.removesuffix(f"(default: {shown})").strip(), f"{flag} has a default but no help"
            default = field_defaults.get(action.dest)
            if isinstance(default, Path):
                default = str(default)
            if isinstance(default, (int, float, str)) and not isinstance(default, bool):
                # Byte sizes read "4194304 = 4 MiB": the exact number comes first.
                assert shown.split(" = ")[0] == str(default), (flag, shown, default)
            checked += 1
    assert checked >= 28


def test_server_help_gives_every_flag_help_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    # What cli.main does once gRPC's environment is set (left alone here: this is the test process).
    with pytest.raises(SystemExit) as exit_info:
        ServerConfig.from_args(["--help"], environ={}, defaults=server_defaults())
    assert exit_info.value.code == 0
    check_server_help(capsys.readouterr().out)


def test_every_server_setting_has_a_flag() -> None:
    dests = {action.dest for action in options(build_parser())}
    # Tokens never come from a flag (process listings); --tokens-file or PSG_TOKENS carry them.
    assert {f.name for f in fields(ServerConfig)} - dests == {"tokens"}


def test_help_defaults_follow_the_config() -> None:
    """The help reads its defaults from ServerConfig, with the command's overrides on top."""
    plain = help_entries(build_parser().format_help())
    command = help_entries(build_parser(server_defaults()).format_help())
    assert shown_default(plain["--executor"]) == ServerConfig.executor == "inprocess"
    assert shown_default(command["--executor"]) == "ray"
    assert shown_default(command["--max-message-bytes"]) == f"{ServerConfig.max_message_bytes} = 4 MiB"


def test_the_command_keeps_sessions_on_disk_unless_told_otherwise(tmp_path: Path) -> None:
    """The library's servers keep sessions in memory; the command's, under XDG's state home."""
    assert ServerConfig().state_dir is None
    environ = {"XDG_STATE_HOME": str(tmp_path)}
    assert config_state_dir([], environ) == tmp_path / "psg"
    assert config_state_dir(["--state-dir", str(tmp_path / "here")], environ) == tmp_path / "here"
    assert config_state_dir(["--state-dir", "none"], environ) is None
    assert config_state_dir([], {**environ, "PSG_STATE_DIR": "none"}) is None
    assert config_state_dir([], {**environ, "PSG_STATE_DIR": str(tmp_path / "env")}) == tmp_path / "env"
    plain = help_entries(build_parser().format_help())
    assert shown_default(plain["--state-dir"]) == "none, sessions in memory only"


def config_state_dir(argv: list[str], environ: dict[str, str]) -> Path | None:
    from psg_server.config import default_state_dir

    defaults = {"executor": "ray", "state_dir": default_state_dir(environ)}
    return ServerConfig.from_args(argv, environ=environ, defaults=defaults).state_dir


def test_flags_left_out_keep_the_environment_and_the_defaults() -> None:
    """The parser's own defaults stay None, so a flag left out never hides PSG_<FLAG>."""
    assert all(getattr(build_parser().parse_args([]), a.dest) is None for a in options(build_parser()))
    config = ServerConfig.from_args([], environ={"PSG_INSECURE": "1", "PSG_MAX_SESSIONS": "3"})
    assert config.insecure and config.max_sessions == 3 and config.port == ServerConfig.port


# ------------------------------------------------------------------------------- psg-demo --help
def check_demo_help(text: str) -> None:
    """Every flag of psg-demo is in ``text`` with its default, and no reST markup is."""
    from psg_client.demo import _parser

    assert "``" not in text and "psg-demo --epochs" in text
    entries = help_entries(text)
    for action in options(_parser()):
        flag = next(f for f in action.option_strings if f.startswith("--"))
        text = entries.get(flag)
        assert text, f"psg-demo --help does not describe {flag}"
        shown = shown_default(text)
        if action.default is not None and not isinstance(action.default, bool):
            assert shown == str(action.default), (flag, shown, action.default)


def test_demo_help_gives_defaults_and_no_markup(capsys: pytest.CaptureFixture[str]) -> None:
    from psg_client.demo import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    check_demo_help(capsys.readouterr().out)


# ------------------------------------------------------------------------------------ gRPC env
def test_grpc_fork_handlers_are_off_unless_the_operator_says_otherwise() -> None:
    environ: dict[str, str] = {}
    cli._prepare_grpc_environment(environ)
    assert environ == {"GRPC_ENABLE_FORK_SUPPORT": "false"}
    chosen = {"GRPC_ENABLE_FORK_SUPPORT": "true"}
    cli._prepare_grpc_environment(chosen)
    assert chosen == {"GRPC_ENABLE_FORK_SUPPORT": "true"}


# ------------------------------------------------------------------------------------ log lines
def test_the_session_open_line_prints_values_not_enum_reprs(caplog: pytest.LogCaptureFixture) -> None:
    config = DPConfig(mode="ghost", clipping="automatic", loss_reduction="sum", augmentation_multiplicity=2)
    with caplog.at_level(logging.INFO, logger="psg_server"), serve() as server, client_for(server) as client:
        client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2,
                              config=config)
    [line] = [r.getMessage() for r in caplog.records if "opened by" in r.getMessage()]
    assert "<" not in line and "GradSampleMode" not in line and "Clipping" not in line, line
    assert all(word in line for word in ("mlp", "ghost", "automatic", "sum")), line


@pytest.mark.parametrize(("error", "level"), [
    (NoWorkersError("ComputeGradients: every worker is down"), logging.ERROR),
    (StepTimeoutError("ComputeGradients: past the deadline"), logging.ERROR),
    (RuntimeError("a bug"), logging.ERROR),
    (LimitExceededError("CreateSession: 3 sessions open"), logging.WARNING),
    (InvalidRequestError("ComputeGradients: no header"), logging.WARNING),
], ids=["no-workers", "deadline", "unexpected", "limit", "bad-request"])
def test_errors_are_logged_at_error_and_refusals_at_warning(error: Exception, level: int,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="psg_server.errors"):
        translate(error, method="ComputeGradients")
    assert [r.levelno for r in caplog.records if r.name == "psg_server.errors"] == [level]
