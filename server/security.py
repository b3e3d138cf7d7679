"""Authentication and transport security: bearer tokens, TLS / mutual TLS, bind refusal.

* Tokens arrive as ``authorization: Bearer <token>`` metadata. :class:`AuthInterceptor` denies
  every method by default (UNAUTHENTICATED) unless the token is known; only the standard health
  service is open, so load balancers and ``psg-health`` can probe without a secret. Each token
  maps to a *principal* (its label), and sessions belong to the principal that created them.
* With no tokens configured every caller is the principal ``anonymous``.
* :func:`check_bind_allowed` refuses a non-loopback address without tokens or TLS unless the
  operator passed ``--insecure``.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from grpc import aio

from psg_core.errors import ConfigError
from psg_server.config import ServerConfig
from psg_server.errors import AuthenticationError
from psg_wire.names import REASON_METADATA_KEY, Reason

__all__ = ["ANONYMOUS", "AuthInterceptor", "TokenAuthenticator", "check_bind_allowed",
           "server_credentials"]

logger = logging.getLogger(__name__)

#: Principal of every caller when the server has no tokens.
ANONYMOUS = "anonymous"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_SCHEME = "bearer "


class TokenAuthenticator:
    """Checks bearer tokens in constant time and names the caller.

    >>> auth = TokenAuthenticator({"a-token-of-16-chars": "alice"})
    >>> auth.principal((("authorization", "Bearer a-token-of-16-chars"),))
    'alice'
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = [(token.encode(), label) for token, label in tokens.items()]

    @property
    def enabled(self) -> bool:
        """Whether any token is configured (otherwise every caller is :data:`ANONYMOUS`)."""
        return bool(self._tokens)

    def principal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        """The label of the caller's token; :class:`AuthenticationError` when it is missing or unknown."""
        if not self._tokens:
            return ANONYMOUS
        values = [value for key, value in (metadata or ()) if key == "authorization"]
        if not values:
            raise AuthenticationError("missing 'authorization: Bearer <token>' metadata")
        value = values[0].decode() if isinstance(values[0], bytes) else values[0]
        if len(values) > 1 or not value.lower().startswith(_SCHEME):
            raise AuthenticationError("the authorization metadata must be one 'Bearer <token>'")
        presented = value[len(_SCHEME):].strip().encode()
        found = None
        for token, label in self._tokens:  # no early exit: time does not depend on which matched
            if hmac.compare_digest(presented, token):
                found = label
        if found is None:
            raise AuthenticationError("unknown bearer token")
        return found

    def principal_of(self, context: aio.ServicerContext) -> str:
        """:meth:`principal` of an RPC's invocation metadata."""
        return self.principal(context.invocation_metadata())


#: The trailer every refusal carries, as every other psg error status does its reason.
_UNAUTHENTICATED_TRAILER = ((REASON_METADATA_KEY, Reason.UNAUTHENTICATED),)


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts with UNAUTHENTICATED (reason
    trailer included)."""
    async def deny(_request: Any, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, trailing_metadata=_UNAUTHENTICATED_TRAILER)

    async def deny_stream(_request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, trailing_metadata=_UNAUTHENTICATED_TRAILER)
        yield  # makes this an async generator, as response-streaming handlers are

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


class AuthInterceptor(aio.ServerInterceptor):
    """Denies every RPC without a known bearer token, except the health service."""

    def __init__(self, authenticator: TokenAuthenticator) -> None:
        self._authenticator = authenticator

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if not self._authenticator.enabled or method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        try:
            self._authenticator.principal(handler_call_details.invocation_metadata)
        except AuthenticationError as err:
            logger.info("auth: %s refused: %s", method, err)
            handler = await continuation(handler_call_details)
            if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
                return handler
            return _denying_handler(handler, str(err))
        return await continuation(handler_call_details)


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config's PEM files (mutual TLS with ``tls_client_ca``), or None."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    try:
        cert = config.tls_cert.read_bytes()
        key = config.tls_key.read_bytes()
        client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    except OSError as err:
        raise ConfigError(f"server_credentials: cannot read a TLS file: {err}") from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or wildcard: it may resolve to a public interface


def check_bind_allowed(config: ServerConfig) -> None:
    """Raises :class:`ConfigError` for a non-loopback bind with neither tokens nor TLS.

    >>> check_bind_allowed(ServerConfig(host="127.0.0.1"))
    >>> check_bind_allowed(ServerConfig(host="0.0.0.0"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    psg_core.errors.ConfigError: psg-server: refusing to listen on 0.0.0.0 without ...
    """
    if _is_loopback(config.host) or config.tokens or config.tls:
        return
    if config.insecure:
        logger.warning("psg-server: listening on %s without authentication or TLS (--insecure)",
                       config.host)
        return
    raise ConfigError(f"psg-server: refusing to listen on {config.host} without --tokens-file/PSG_TOKENS "
                      "or TLS; pass --insecure to do it anyway")
