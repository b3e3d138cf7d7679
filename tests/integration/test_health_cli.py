"""psg-health: exit 0 against a SERVING server, 1 against anything else, always within --timeout."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psg_server.background import BackgroundServer
from psg_server.health import check_health, main
from psg_server.service import SERVICE_NAME
from tests.server.service_harness import TOKEN_ALICE, serve

PSG_HEALTH = Path(sys.executable).parent / "psg-health"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer_key: ec.EllipticCurvePrivateKey,
                 issuer: str, *, ca: bool = False, dns_name: str | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if dns_name is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate for the name psg.test only (not 127.0.0.1), a client certificate."""
    folder = tmp_path_factory.mktemp("health-pki")
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    files = {
        "ca.pem": _certificate("health CA", ca_key, ca_key, "health CA", ca=True),
        "server.pem": _certificate("psg.test", server_key, ca_key, "health CA", dns_name="psg.test"),
        "client.pem": _certificate("probe", client_key, ca_key, "health CA"),
    }
    for name, certificate in files.items():
        (folder / name).write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    for name, key in (("server.key", server_key), ("client.key", client_key)):
        (folder / name).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return Pki(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "client.pem",
               folder / "client.key")


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    """A SERVING server (in-process executor) with tokens: health stays open without one."""
    with serve(tokens={TOKEN_ALICE: "alice"}) as running:
        yield running


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_serving_server_exits_0(server: BackgroundServer) -> None:
    assert main(["--target", server.target, "--timeout", "10"], environ={}) == 0
    assert main(["--target", server.target, "--service", SERVICE_NAME], environ={}) == 0
    report = check_health(server.target, timeout_s=10)
    assert report.serving and report.status == "SERVING" and report.detail == ""


def test_unknown_service_exits_1(server: BackgroundServer) -> None:
    assert main(["--target", server.target, "--service", "no.such.Service"], environ={}) == 1
    assert check_health(server.target, service="no.such.Service").status == "NOT_FOUND"


def test_not_serving_exits_1() -> None:
    with serve() as running:
        assert main(["--target", running.target], environ={}) == 0
        assert running.server is not None
        running.call(running.server.health.enter_graceful_shutdown())
        assert main(["--target", running.target], environ={}) == 1
        assert check_health(running.target).status == "NOT_SERVING"


def test_nothing_listening_exits_1() -> None:
    target = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    assert main(["--target", target, "--timeout", "5"], environ={}) == 1
    assert check_health(target, timeout_s=5).status == "UNAVAILABLE"
    assert time.monotonic() - started < 10


def test_a_server_that_never_answers_exits_1_within_the_timeout() -> None:
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        assert main(["--target", target, "--timeout", "1"], environ={}) == 1
        elapsed = time.monotonic() - started
    assert 0.5 < elapsed < 5, elapsed
    assert check_health(target, timeout_s=0.5).status in ("DEADLINE_EXCEEDED", "UNAVAILABLE")


def test_tls_and_server_name(pki: Pki) -> None:
    with serve(tls_cert=pki.server_cert, tls_key=pki.server_key) as running:
        tls = ["--target", running.target, "--tls-ca", str(pki.ca), "--timeout", "10"]
        assert main([*tls, "--tls-server-name", "psg.test"], environ={}) == 0
        assert main(tls, environ={}) == 1  # the certificate does not name 127.0.0.1
        assert main(["--target", running.target, "--tls", "--tls-server-name", "psg.test"], environ={}) == 1
        assert main(["--target", running.target], environ={}) == 1  # plaintext against TLS
        environ = {"PSG_HEALTH_TARGET": running.target, "PSG_HEALTH_TLS_CA": str(pki.ca),
                   "PSG_HEALTH_TLS_SERVER_NAME": "psg.test"}
        assert main([], environ=environ) == 0


def test_mutual_tls_needs_the_probe_certificate(pki: Pki) -> None:
    with serve(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca) as running:
        tls = ["--target", running.target, "--tls-ca", str(pki.ca), "--tls-server-name", "psg.test"]
        assert main([*tls, "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)], environ={}) == 0
        assert main(tls, environ={}) == 1


def test_default_target_follows_psg_port(server: BackgroundServer) -> None:
    assert server.config.host == "127.0.0.1"
    assert main([], environ={"PSG_PORT": str(server.port)}) == 0
    assert main([], environ={"PSG_PORT": str(_closed_port())}) == 1


class _RequireToken(grpc.ServerInterceptor):
    """Denies every call without ``authorization: Bearer <token>`` (a proxy that guards health)."""

    def __init__(self, token: str) -> None:
        self._expected = ("authorization", f"Bearer {token}")

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        if self._expected in tuple(details.invocation_metadata or ()):
            return continuation(details)

        def deny(_request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "token required")

        return grpc.unary_unary_rpc_method_handler(deny)


@contextlib.contextmanager
def _guarded_health_server(token: str) -> Iterator[str]:
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    guarded = grpc.server(executor, interceptors=[_RequireToken(token)])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, guarded)
    port = guarded.add_insecure_port("127.0.0.1:0")
    guarded.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        guarded.stop(grace=None).wait(10)
        executor.shutdown(wait=True)


def test_token_from_a_file_or_the_environment(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"# psg tokens file\nalice {TOKEN_ALICE}\nbob another-token-0123456789\n")
    bare = tmp_path / "token"
    bare.write_text(f"{TOKEN_ALICE}\n")
    with _guarded_health_server(TOKEN_ALICE) as target:
        assert main(["--target", target], environ={}) == 1
        assert check_health(target).status == "UNAUTHENTICATED"
        assert main(["--target", target, "--token-file", str(tokens)], environ={}) == 0
        assert main(["--target", target, "--token-file", str(bare)], environ={}) == 0
        assert main(["--target", target], environ={"PSG_HEALTH_TOKEN": TOKEN_ALICE}) == 0
        assert main(["--target", target], environ={"PSG_HEALTH_TOKEN": "wrong-token-0123456789"}) == 1


@pytest.mark.parametrize("argv", [
    ["--bogus"],
    ["--timeout", "0"],
    ["--timeout", "soon"],
    ["--tls-cert", "client.pem"],
    ["--tls-ca", "/nonexistent/ca.pem"],
    ["--token-file", "/nonexistent/token"],
], ids=["unknown-flag", "zero-timeout", "bad-timeout", "cert-without-key", "missing-ca", "missing-token"])
def test_usage_errors_exit_1_not_2(argv: list[str], capsys: pytest.CaptureFixture[str],
                                   caplog: pytest.LogCaptureFixture) -> None:
    # Docker reserves exit status 2 of a health check; argparse would use it for bad flags.
    try:
        status = main(["--target", f"127.0.0.1:{_closed_port()}", *argv], environ={})
    except SystemExit as exit_info:
        status = exit_info.code
    assert status == 1
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "error" in capsys.readouterr().err or logged  # argparse prints; main() logs


def test_help_exits_0() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"], environ={})
    assert exit_info.value.code == 0


def test_empty_token_file_exits_1(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n\n")
    assert main(["--target", f"127.0.0.1:{_closed_port()}", "--token-file", str(empty)], environ={}) == 1


def test_console_script(server: BackgroundServer) -> None:
    assert PSG_HEALTH.exists(), "psg-health is not installed; reinstall the package (pip install -e .)"
    serving = subprocess.run([str(PSG_HEALTH), "--target", server.target, "--timeout", "10"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert serving.returncode == 0 and "SERVING" in serving.stderr
    refused = subprocess.run([str(PSG_HEALTH), "--target", f"127.0.0.1:{_closed_port()}", "--timeout", "3"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    usage = subprocess.run([str(PSG_HEALTH), "--bogus"], capture_output=True, text=True, timeout=60, check=False)
    assert usage.returncode == 1
