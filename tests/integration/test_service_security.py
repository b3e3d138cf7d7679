"""Auth, TLS and mutual TLS, health and reflection, metrics, bind refusal and the psg-server CLI."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from psg_client import GradientClient, ServiceError, TLSConfig
from psg_core.config import DPConfig
from psg_core.errors import ConfigError
from psg_server.cli import main as cli_main
from psg_server.config import ServerConfig
from psg_server.service import create_server
from tests.server.service_harness import (FAST_RETRY, MLP_KWARGS, TOKEN_ALICE, build, client_for, mlp_batch,
                                          serve)

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Pki:
    ca: bytes
    server_cert: Path
    server_key: Path
    ca_path: Path
    client_cert: bytes
    client_key: bytes


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
           *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "psg test CA")])
    ca = _issue("psg test CA", ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue("localhost", server_key, ca_name, ca_key, server=True)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue("trainer", client_key, ca_name, ca_key)
    paths = {"ca.pem": _pem(ca), "server.pem": _pem(server), "server.key": _key_pem(server_key)}
    for name, data in paths.items():
        (folder / name).write_bytes(data)
    return Pki(ca=_pem(ca), server_cert=folder / "server.pem", server_key=folder / "server.key",
               ca_path=folder / "ca.pem", client_cert=_pem(client), client_key=_key_pem(client_key))


def _step(client: GradientClient) -> int:
    with client.create_session("mlp", model_kwargs=MLP_KWARGS, loss="cross_entropy", expected_batch_size=2,
                               config=DPConfig()) as session:
        session.push_parameters(build())
        return session.compute_gradients(*mlp_batch(2)).samples


def test_tls_serves_verified_clients_and_refuses_plaintext(pki: Pki) -> None:
    with serve(tls_cert=pki.server_cert, tls_key=pki.server_key) as server:
        with GradientClient(server.target, tls=TLSConfig(root_certificates=pki.ca), retry=FAST_RETRY) as client:
            assert _step(client) == 2
        with client_for(server) as plaintext, pytest.raises(ServiceError) as err:
            plaintext.server_info()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with GradientClient(server.target, tls=True, retry=FAST_RETRY) as untrusted, pytest.raises(ServiceError):
            untrusted.server_info()  # the test CA is not among the system roots


def test_mutual_tls_requires_a_client_certificate(pki: Pki) -> None:
    with serve(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca_path) as server:
        mutual = TLSConfig(root_certificates=pki.ca, certificate_chain=pki.client_cert, private_key=pki.client_key)
        with GradientClient(server.target, tls=mutual, retry=FAST_RETRY) as client:
            assert _step(client) == 2
        with GradientClient(server.target, tls=TLSConfig(root_certificates=pki.ca), retry=FAST_RETRY) as anonymous, \
                pytest.raises(ServiceError) as err:
            anonymous.server_info()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_health_is_open_and_reflection_needs_a_token() -> None:
    with serve(tokens={TOKEN_ALICE: "alice"}) as server, grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "psg.v1.GradientService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(reflection.ServerReflectionInfo(iter([request]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(reflection.ServerReflectionInfo(iter([request]), timeout=10,
                                                       metadata=(("authorization", f"Bearer {TOKEN_ALICE}"),)))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"psg.v1.GradientService", "grpc.health.v1.Health"} <= names


def test_health_goes_not_serving_on_shutdown() -> None:
    async def scenario() -> int:
        server, port = await create_server(ServerConfig(port=0))
        await server.health.enter_graceful_shutdown()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        await server.stop(grace=None)
        return reply.status

    assert asyncio.run(scenario()) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_prometheus_metrics_count_requests_failures_and_phases() -> None:
    with serve(metrics_port=0) as server, client_for(server) as client:
        assert server.server is not None and server.server.metrics_port
        _step(client)
        with pytest.raises(ServiceError):
            client.session("missing")
        url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    assert 'psg_requests_total{method="ComputeGradients"} 1.0' in text
    assert 'psg_request_failures_total{code="NOT_FOUND",method="GetSession"} 1.0' in text
    for phase in ("receive", "validate", "compute", "noise", "account", "send"):
        assert f'psg_step_phase_seconds_count{{phase="{phase}"}}' in text
    assert "psg_samples_total 2.0" in text and "psg_open_sessions 0.0" in text


def test_non_loopback_bind_without_auth_or_tls_is_refused() -> None:
    with pytest.raises(ConfigError, match="refusing to listen on 0.0.0.0"):
        asyncio.run(create_server(ServerConfig(host="0.0.0.0", port=0)))
    assert cli_main(["--host", "0.0.0.0", "--port", "0"]) == 2


def test_psg_server_cli_serves_until_sigterm(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {TOKEN_ALICE}\n")
    env = {**os.environ, "PSG_MAX_BATCH_ROWS": "128", "PYTHONPATH": str(REPO)}
    # The in-process executor: what this test checks (the tokens file, a limit from the environment,
    # a clean exit on SIGTERM) does not depend on the executor, and the command's default, an
    # embedded Ray, starts and stops in test_server_cli.py::test_a_ray_backed_server_logs_no_grpc_fork_notices.
    process = subprocess.Popen([sys.executable, "-m", "psg_server", "--port", "0", "--executor", "inprocess",
                                "--tokens-file", str(tokens)],
                               stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert process.stderr is not None
        port = None
        for line in process.stderr:
            match = re.search(r"serving on port (\d+)", line)
            if match:
                port = int(match.group(1))
                break
        assert port is not None, "psg-server never reported its port"
        with GradientClient(f"127.0.0.1:{port}", token=TOKEN_ALICE, retry=FAST_RETRY) as client:
            assert client.server_info().limits.max_batch_rows == 128
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
