"""``psg-server`` and ``psg-demo`` run as commands: their help, the one-line refusals, gRPC loaded
only after its environment is set, and a Ray-backed server whose log carries no gRPC fork notices.

Each starts a Python process (a few seconds of imports each), hence here, not with the unit tests in
tests/server/test_cli.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.server.test_cli import check_demo_help, check_server_help

REPO = Path(__file__).resolve().parents[2]


def _environment() -> dict[str, str]:
    """This environment less the PSG_, gRPC and Ray settings a developer may have exported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSG_", "GRPC_", "RAY_"))}
    env["COLUMNS"] = "100"
    return env


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_environment(), capture_output=True,
                          text=True, timeout=120, check=False)


def test_server_help() -> None:
    result = _run("-m", "psg_server", "--help")
    assert result.returncode == 0, result.stderr
    check_server_help(result.stdout)


def test_demo_help() -> None:
    result = _run("-m", "psg_client.demo", "--help")
    assert result.returncode == 0, result.stderr
    check_demo_help(result.stdout)


def test_refusing_a_public_address_is_one_error_line_with_one_prefix() -> None:
    result = _run("-m", "psg_server", "--host", "0.0.0.0", "--port", "0", "--executor", "inprocess")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "refusing" in line]
    assert len(lines) == 1, result.stderr
    assert " ERROR " in lines[0], lines[0]
    assert lines[0].count("psg-server:") == 1, lines[0]
    assert "refusing to listen on 0.0.0.0" in lines[0] and "--insecure" in lines[0], lines[0]


def test_a_bad_flag_value_is_one_error_line() -> None:
    result = _run("-m", "psg_server", "--port", "70000")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert " ERROR " in lines[0] and "port must be in 0..65535, got 70000" in lines[0], lines[0]


def test_the_command_loads_grpc_only_after_preparing_its_environment() -> None:
    # GRPC_ENABLE_FORK_SUPPORT is read when gRPC loads: importing the command must not load it.
    result = _run("-c", "import sys, psg_server.cli; print('grpc' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_ray_backed_server_logs_no_grpc_fork_notices(tmp_path: Path) -> None:
    """Without the command's gRPC settings, every process Ray forks while the frontend's threads
    are in gRPC printed ``fork_posix.cc ... skipping fork() handlers``."""
    log = tmp_path / "psg-server.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "psg_server", "--port", "0", "--workers", "1"],
                                   cwd=REPO, env=_environment(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "serving on port" not in log.read_text() and process.poll() is None:
            assert time.monotonic() < deadline, f"psg-server did not start:\n{log.read_text()}"
            time.sleep(0.2)  # polling the log file for a predicate, under the deadline above
        assert process.poll() is None, f"psg-server exited with {process.returncode}:\n{log.read_text()}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            status = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            status = process.wait(timeout=30)
    text = log.read_text()
    assert status == 0, text
    assert "fork_posix" not in text and "fork() handlers" not in text, text
