"""``psg-health``: one ``grpc.health.v1.Health/Check`` against a psg server; exit 0 when SERVING.

Made for Docker ``HEALTHCHECK``, compose ``healthcheck`` and Kubernetes exec probes, so it imports
only grpc (no torch, no Ray) and always finishes within ``--timeout``. Exit status: 0 when the
server answers SERVING; 1 for anything else (NOT_SERVING, unknown service, nothing listening,
TLS failure, timeout, bad flags). Docker reserves 2 for health checks, so bad flags exit 1 too.

    psg-health --target 127.0.0.1:50051 --timeout 3
    psg-health --target psg.example.org:443 --tls-ca ca.pem           # TLS, private CA
    psg-health --target 127.0.0.1:50051 --tls-ca ca.pem --tls-server-name psg.example.org \\
               --tls-cert probe.pem --tls-key probe.key              # mutual TLS

Every flag also reads ``PSG_HEALTH_<FLAG>`` (``--tls-ca`` <-> ``PSG_HEALTH_TLS_CA``); a flag on the
command line wins. Without ``--target`` the port is ``PSG_PORT`` (the server's own variable) or
50051 on 127.0.0.1. The health service is open without a token on psg servers; for a proxy that
wants one, ``--token-file`` (the token, or a psg tokens file whose first entry is used) or
``PSG_HEALTH_TOKEN`` adds ``authorization: Bearer <token>``.

>>> check_health("127.0.0.1:1", timeout_s=2.0).serving   # nothing listens on port 1
False
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["HealthReport", "build_parser", "check_health", "main"]

logger = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVING)
_DEFAULT_PORT = 50051


@dataclass(frozen=True)
class HealthReport:
    """The outcome of one check.

    Attributes:
        target: the address probed.
        status: the health status name (``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``, ...) when
            the server answered, else the gRPC status code name of the failed call
            (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``NOT_FOUND`` for an unknown service, ...).
        detail: the transport's message when the call failed, else empty.
    """

    target: str
    status: str
    detail: str = ""

    @property
    def serving(self) -> bool:
        """Whether the server answered SERVING."""
        return self.status == _SERVING


def check_health(target: str, *, service: str = "", timeout_s: float = 5.0,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
                 token: str | None = None) -> HealthReport:
    """Calls ``grpc.health.v1.Health/Check`` once, bounded by ``timeout_s`` (connecting included).

    Args:
        target: ``host:port`` of the server.
        service: the service to ask about; ``""`` (the default) is the server as a whole, which a
            psg server marks SERVING once its worker pool is up.
        timeout_s: deadline of the call, connection included.
        credentials: TLS channel credentials (``grpc.ssl_channel_credentials``); None = plaintext.
        server_name: name to verify the server certificate against, when it differs from the
            target's host (probing ``127.0.0.1`` inside a container, for instance).
        token: bearer token sent as ``authorization`` metadata, if any.

    Returns:
        A :class:`HealthReport`; transport failures are reported, never raised.

    >>> check_health("127.0.0.1:1", timeout_s=2.0).status
    'UNAVAILABLE'
    """
    if not timeout_s > 0:
        raise ValueError(f"check_health: timeout_s must be > 0, got {timeout_s!r}")
    options: list[tuple[str, str | int]] = [("grpc.enable_retries", 0)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    channel = (grpc.secure_channel(target, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(target, options=options))
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=metadata,
            wait_for_ready=False)
    except grpc.RpcError as error:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return HealthReport(target, code.name, details or "")
    finally:
        channel.close()
    return HealthReport(target, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors exit 1 (Docker reserves 2 for health checks)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage()
        self.exit(1, f"{self.prog}: error: {message}\n")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``psg-health`` argument parser; defaults come from ``PSG_HEALTH_*`` in ``environ``."""
    environ = os.environ if environ is None else environ

    def env(flag: str, fallback: str | None = None) -> str | None:
        return environ.get("PSG_HEALTH_" + flag.upper().replace("-", "_"), fallback)

    default_target = f"127.0.0.1:{environ.get('PSG_PORT') or _DEFAULT_PORT}"
    parser = _Parser(prog="psg-health",
                     description="Exit 0 when a psg server's grpc.health.v1 Check answers SERVING, 1 "
                                 "otherwise. Every flag also reads PSG_HEALTH_<FLAG>.")
    add = parser.add_argument
    add("--target", default=env("target", default_target),
        help=f"host:port of the server (default 127.0.0.1:$PSG_PORT or {_DEFAULT_PORT})")
    add("--service", default=env("service", ""),
        help="service name to check; empty (the default) = the whole server")
    add("--timeout", type=float, default=env("timeout", "5"),
        help="seconds for the whole check, connection included (default 5)")
    add("--tls", action="store_true", default=(env("tls", "") or "").lower() in ("1", "true", "yes", "on"),
        help="use TLS with the system's root certificates (implied by --tls-ca)")
    add("--tls-ca", type=Path, default=env("tls-ca"), help="PEM CA bundle that signed the server certificate")
    add("--tls-cert", type=Path, default=env("tls-cert"), help="PEM client certificate (mutual TLS)")
    add("--tls-key", type=Path, default=env("tls-key"), help="PEM client private key (mutual TLS)")
    add("--tls-server-name", default=env("tls-server-name"),
        help="name to verify the server certificate against (default: the target's host)")
    add("--token-file", type=Path, default=env("token-file"),
        help="file holding a bearer token (or a psg tokens file: its first entry is used); "
             "or PSG_HEALTH_TOKEN")
    add("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default=env("log-level", "INFO"))
    return parser


class _UsageError(Exception):
    """A flag's file cannot be used; main() reports it and exits 1."""


def _read(path: Path | str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise _UsageError(f"cannot read {what} {str(path)!r}: {err.strerror}") from None


def _token(path: Path | str | None, environ: Mapping[str, str]) -> str | None:
    text = _read(path, "--token-file")
    if text is None:
        return environ.get("PSG_HEALTH_TOKEN") or None
    for raw in text.decode().splitlines():
        line = raw.split("#", 1)[0].split()
        if line:
            return line[-1]  # 'token' or 'label token', as in the server's tokens file
    raise _UsageError(f"--token-file {str(path)!r} holds no token")


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise _UsageError("--tls-cert and --tls-key go together")
    root = _read(args.tls_ca, "--tls-ca")
    chain = _read(args.tls_cert, "--tls-cert")
    key = _read(args.tls_key, "--tls-key")
    if not (args.tls or root is not None or chain is not None):
        return None
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of the ``psg-health`` console script; returns the exit status (0 = SERVING)."""
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="psg-health: %(message)s")
    if not args.timeout > 0:
        logger.error("--timeout must be > 0, got %s", args.timeout)
        return 1
    try:
        credentials = _credentials(args)
        token = _token(args.token_file, environ)
    except _UsageError as err:
        logger.error("%s", err)
        return 1
    report = check_health(args.target, service=args.service, timeout_s=args.timeout, credentials=credentials,
                          server_name=args.tls_server_name, token=token)
    what = f"{report.target} service {args.service!r}" if args.service else report.target
    if report.serving:
        logger.info("%s %s", what, report.status)
        return 0
    logger.error("%s %s%s", what, report.status, f": {report.detail}" if report.detail else "")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
