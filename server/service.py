"""The gRPC frontend: a thin servicer, its method wiring, and :func:`create_server`.

Servicer methods only name the caller, delegate and build replies. The wiring
(:func:`_method_handlers`) is generated from the service descriptor: each handler receives raw
bytes and parses them itself, so undecodable input is INVALID_ARGUMENT like any other bad input;
it counts the request and, on any exception, answers with the status :func:`psg_server.errors.translate`
picks (the one table), logging unexpected errors.

>>> import asyncio
>>> async def demo():
...     server, port = await create_server(ServerConfig(port=0))
...     await server.stop(grace=None)
...     return port > 0
>>> asyncio.run(demo())
True
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

import psg_core
from psg_core.modes import GradSampleMode
from psg_server.config import ServerConfig
from psg_server.errors import StreamIdleError, translate
from psg_server.executor import InProcessExecutor, ShardExecutor
from psg_server.losses import LOSSES
from psg_server.metrics import Metrics
from psg_server.models import ModelEntry, ModelRegistry, ModelSignature, ParameterInfo, default_registry
from psg_server.security import AuthInterceptor, TokenAuthenticator, check_bind_allowed, server_credentials
from psg_server.sessions import SessionStore, open_session, parameter_specs, restore_session, signature_info
from psg_server.state import SessionDatabase
from psg_server.step import StepRunner
from psg_server.streams import push_parameters, pushed_bytes, read_header
from psg_wire.codec import CodecLimits, FrameWire
from psg_wire.names import REASON_METADATA_KEY, SERVICE_NAME
from psg_wire.v1 import gradient_service_pb2 as pb

__all__ = ["SERVICE_NAME", "GradientServicer", "PsgServer", "create_server"]

logger = logging.getLogger(__name__)

_SERVICE = pb.DESCRIPTOR.services_by_name["GradientService"]


class GradientServicer:
    """Implements ``psg.v1.GradientService``; every method is a few lines of delegation."""

    def __init__(self, *, config: ServerConfig, registry: ModelRegistry, executor: ShardExecutor,
                 authenticator: TokenAuthenticator, metrics: Metrics) -> None:
        self._config = config
        self._registry = registry
        self._executor = executor
        self._auth = authenticator
        self._metrics = metrics
        database = SessionDatabase(config.state_dir) if config.state_dir is not None else None
        self._store = SessionStore(max_sessions=config.max_sessions, idle_seconds=config.session_idle_seconds,
                                   parameter_memory_bytes=config.parameter_memory_bytes, database=database,
                                   max_sessions_per_owner=config.max_sessions_per_token)
        if database is not None:
            restored = self._store.restore(functools.partial(restore_session, registry=registry, config=config))
            logger.info("psg-server: sessions kept in %s (%d reopened)", database.path, restored)
            metrics.sessions.set(restored)
        self._steps = StepRunner(config=config, store=self._store, executor=executor, metrics=metrics)
        self._parameter_limits = CodecLimits(max_tensor_bytes=config.max_tensor_bytes,
                                             max_total_bytes=config.max_request_bytes, max_tensors=1 << 16,
                                             max_chunk_bytes=config.max_chunk_bytes)

    @property
    def sessions(self) -> SessionStore:
        """The open sessions (the server closes their database when it stops)."""
        return self._store

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: aio.ServicerContext) -> pb.ServerInfo:
        self._auth.principal_of(context)
        config = self._config
        limits = pb.Limits(max_batch_rows=config.max_batch_rows, max_message_bytes=config.max_message_bytes,
                           max_tensor_bytes=config.max_tensor_bytes,
                           max_request_bytes=config.max_request_bytes, chunk_bytes=config.chunk_bytes,
                           max_model_bytes=config.max_model_bytes, max_chunk_bytes=config.max_chunk_bytes)
        workers = [pb.WorkerInfo(id=w.id, device=w.device, node=w.node or "")
                   for w in self._executor.workers()]
        return pb.ServerInfo(version=psg_core.__version__, backends=[m.value for m in GradSampleMode],
                             workers=workers, limits=limits, losses=sorted(LOSSES),
                             default_accountant=config.default_accountant)

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: aio.ServicerContext) -> pb.ListModelsResponse:
        self._auth.principal_of(context)
        registry, max_bytes = self._registry, self._config.max_model_bytes
        return pb.ListModelsResponse(models=[
            _model_info(entry, registry.default_parameters(entry.name, max_bytes=max_bytes),
                        registry.default_signature(entry.name))
            for entry in registry.entries()])

    async def CreateSession(self, request: pb.CreateSessionRequest,
                            context: aio.ServicerContext) -> pb.CreateSessionResponse:
        owner = self._auth.principal_of(context)
        await self._expire_idle()
        # Off the event loop: building the model and calibrating sigma can take seconds.
        session = await asyncio.get_running_loop().run_in_executor(None, functools.partial(
            open_session, request, owner=owner, registry=self._registry, config=self._config))
        self._store.add(session)
        self._metrics.sessions.set(len(self._store))
        dp = session.dp_config  # enums by value: their reprs would read <Clipping.FLAT: 'flat'>
        adaptive = session.adaptive_clipping
        logger.info("session %s opened by %s: model %s, loss %s (%s), backend %s%s, K=%d, %s clipping at "
                    "C=%g%s, noise multiplier %g", session.id, owner, request.model, session.loss.name,
                    dp.loss_reduction.value, dp.mode.value, " (captured steps)" if session.spec.capture else "",
                    dp.augmentation_multiplicity, dp.clipping.value,
                    dp.max_grad_norm, "" if adaptive is None else
                    f" adapting to quantile {adaptive.target_quantile:g} (learning rate {adaptive.learning_rate:g}, "
                    f"count noise {adaptive.count_noise_multiplier:g})", dp.noise_multiplier)
        return pb.CreateSessionResponse(session_id=session.id, parameters=parameter_specs(session.parameter_info),
                                        noise_multiplier=dp.noise_multiplier,
                                        signature=signature_info(session.signature))

    async def PushParameters(self, requests: AsyncIterator[pb.PushParametersRequest],
                             context: aio.ServicerContext) -> pb.PushParametersResponse:
        owner = self._auth.principal_of(context)
        header = await read_header(requests, rpc="PushParameters")
        session = self._store.get(header.session_id, owner)
        parameters = await push_parameters(requests, self._store, session, header, self._parameter_limits,
                                           pin_memory=self._executor.pinned_inputs)
        return pb.PushParametersResponse(version=parameters.version, num_bytes=pushed_bytes(session, parameters),
                                         frozen_version=parameters.frozen_from)

    async def ComputeGradients(self, requests: AsyncIterator[pb.ComputeGradientsRequest],
                               context: aio.ServicerContext) -> AsyncIterator[pb.ComputeGradientsResponse]:
        owner = self._auth.principal_of(context)
        async for message in self._steps.compute(requests, owner=owner,
                                                 time_remaining=context.time_remaining):
            yield message

    async def GetSession(self, request: pb.GetSessionRequest, context: aio.ServicerContext) -> pb.SessionInfo:
        return self._store.get(request.session_id, self._auth.principal_of(context)).info()

    async def CloseSession(self, request: pb.CloseSessionRequest,
                           context: aio.ServicerContext) -> pb.CloseSessionResponse:
        session = self._store.remove(request.session_id, self._auth.principal_of(context))
        await self._executor.release(session.id)
        self._metrics.sessions.set(len(self._store))
        return pb.CloseSessionResponse()

    async def _expire_idle(self) -> None:
        for session in self._store.expire_idle():
            await self._executor.release(session.id)


def _model_info(entry: ModelEntry, parameters: list[ParameterInfo], signature: ModelSignature | None) -> pb.ModelInfo:
    arguments = [pb.ModelArgument(name=a.name, type=a.type_name, required=a.required,
                                  default_json="" if a.required else json.dumps(a.default))
                 for a in entry.arguments]
    return pb.ModelInfo(name=entry.name, description=entry.description, arguments=arguments,
                        origin=entry.origin, parameters=parameter_specs(parameters),
                        signature=signature_info(signature))


# --------------------------------------------------------------------------------------- wiring
async def _abort(context: aio.ServicerContext, error: Exception, method: str, metrics: Metrics) -> None:
    status = translate(error, method=method)
    metrics.failures.labels(method=method, code=status.code.name).inc()
    await context.abort(status.code, status.message,
                        trailing_metadata=((REASON_METADATA_KEY, status.reason),))


async def _parsed(raw_requests: AsyncIterator[bytes], parse: Callable[[bytes], Any], *, rpc: str,
                  idle_seconds: float) -> AsyncIterator[Any]:
    """The parsed messages of a request stream; :class:`StreamIdleError` when the client sends
    nothing (no message, no half-close) for ``idle_seconds``, so an abandoned upload does not hold
    its buffers, session lock or slot for ever."""
    iterator = raw_requests.__aiter__()
    while True:
        try:
            # asyncio.timeout, not wait_for: no task per message (a step's few messages each paid one).
            async with asyncio.timeout(idle_seconds):
                raw = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise StreamIdleError(f"{rpc}: the request stream sent nothing for {idle_seconds:g} s "
                                  "(the server's stream_idle_seconds); send the next message sooner, or "
                                  "half-close the stream when it is complete") from None
        yield parse(raw)


def _method_handlers(servicer: GradientServicer, metrics: Metrics, *,
                     stream_idle_seconds: float = 60.0) -> dict[str, grpc.RpcMethodHandler]:
    handlers = {}
    for method in _SERVICE.methods:
        name = method.name
        implementation = getattr(servicer, name)
        parse, serialize = _codecs(method)
        messages = functools.partial(_parsed, parse=parse, rpc=name, idle_seconds=stream_idle_seconds)
        if method.client_streaming and method.server_streaming:
            handlers[name] = grpc.stream_stream_rpc_method_handler(
                _stream_stream(name, implementation, messages, metrics), response_serializer=serialize)
        elif method.client_streaming:
            handlers[name] = grpc.stream_unary_rpc_method_handler(
                _stream_unary(name, implementation, messages, metrics), response_serializer=serialize)
        elif not method.server_streaming:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unary_unary(name, implementation, parse, metrics), response_serializer=serialize)
        else:  # no unary-stream methods in psg.v1; refuse to start rather than serve it wrong
            raise TypeError(f"_method_handlers: unary-stream method {name} is not wired")
    return handlers


def _codecs(method: Any) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    """The request parser and the response serialiser of a method: protobuf's, except for the
    tensor streams, whose chunk frames go through :class:`FrameWire` (read in place; sent as the
    ``bytes`` :func:`psg_server.streams.tensor_messages` serialised)."""
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    parse = (FrameWire(request_type).parse if method.client_streaming and FrameWire.handles(request_type)
             else request_type.FromString)
    serialize = (FrameWire.serialize if method.server_streaming and FrameWire.handles(response_type)
                 else response_type.SerializeToString)
    return parse, serialize


def _unary_unary(name: str, implementation: Callable[..., Any], parse: Callable[[bytes], Any],
                 metrics: Metrics) -> Callable[..., Any]:
    async def handle(raw: bytes, context: aio.ServicerContext) -> Any:
        metrics.requests.labels(method=name).inc()
        try:
            return await implementation(parse(raw), context)
        except Exception as error:  # the one place errors become statuses
            await _abort(context, error, name, metrics)
    return handle


def _stream_unary(name: str, implementation: Callable[..., Any],
                  messages: Callable[[AsyncIterator[bytes]], AsyncIterator[Any]],
                  metrics: Metrics) -> Callable[..., Any]:
    async def handle(raw_requests: AsyncIterator[bytes], context: aio.ServicerContext) -> Any:
        metrics.requests.labels(method=name).inc()
        try:
            return await implementation(messages(raw_requests), context)
        except Exception as error:
            await _abort(context, error, name, metrics)
    return handle


def _stream_stream(name: str, implementation: Callable[..., Any],
                   messages: Callable[[AsyncIterator[bytes]], AsyncIterator[Any]],
                   metrics: Metrics) -> Callable[..., Any]:
    async def handle(raw_requests: AsyncIterator[bytes], context: aio.ServicerContext) -> AsyncIterator[Any]:
        metrics.requests.labels(method=name).inc()
        try:
            async for response in implementation(messages(raw_requests), context):
                yield response
        except Exception as error:
            await _abort(context, error, name, metrics)
    return handle


#: Seconds between two looks at the executor's readiness (health follows it).
_HEALTH_POLL_S = 0.5


async def _set_health(health: health_aio.HealthServicer, serving: bool) -> None:
    response = health_pb2.HealthCheckResponse
    status = response.SERVING if serving else response.NOT_SERVING
    for service in ("", SERVICE_NAME):
        await health.set(service, status)


async def _follow_readiness(health: health_aio.HealthServicer, executor: ShardExecutor,
                            serving: bool) -> None:
    """Keeps the health status at SERVING while the executor has workers, NOT_SERVING otherwise
    (``serving``: the status already set)."""
    while True:
        await asyncio.sleep(_HEALTH_POLL_S)
        ready = executor.ready
        if ready != serving:
            await _set_health(health, ready)
            logger.warning("psg-server: %s", "workers are back: SERVING" if ready else
                           "no live worker: NOT_SERVING")
            serving = ready


class PsgServer:
    """A running server: the gRPC server plus what it owns (executor, metrics endpoint, health)."""

    def __init__(self, server: aio.Server, executor: ShardExecutor, metrics: Metrics,
                 health: health_aio.HealthServicer, metrics_port: int | None,
                 health_task: asyncio.Task[None] | None = None, sessions: SessionStore | None = None) -> None:
        self.grpc_server = server
        self.executor = executor
        self.metrics = metrics
        self.health = health
        #: The bound Prometheus port, when the endpoint is on.
        self.metrics_port = metrics_port
        self._health_task = health_task
        self._sessions = sessions

    async def wait_for_termination(self) -> None:
        """Blocks until the server stops."""
        await self.grpc_server.wait_for_termination()

    async def stop(self, grace: float | None = 5.0) -> None:
        """Marks the service NOT_SERVING, stops accepting RPCs (in-flight ones get ``grace`` seconds),
        then closes the executor, the session database and the metrics endpoint."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        await self.executor.close()
        if self._sessions is not None:
            self._sessions.close()
        self.metrics.close()


async def create_server(config: ServerConfig, *, executor: ShardExecutor | None = None,
                        registry: ModelRegistry | None = None) -> tuple[PsgServer, int]:
    """Builds, binds and starts a server; returns it and the bound port (``config.port=0`` picks one).

    Args:
        config: the server's configuration.
        executor: where shards run; default from ``config.executor``: a
            :class:`~psg_server.pool.WorkerPool` ("ray") or an :class:`InProcessExecutor` with
            ``config.num_workers`` threads. It is started here and closed by :meth:`PsgServer.stop`;
            health stays NOT_SERVING until it is ready, and whenever it has no live worker.
        registry: the model registry; default the built-ins plus ``config.model_plugins``.
    """
    check_bind_allowed(config)
    registry = registry if registry is not None else default_registry(config.model_plugins)
    if executor is None:
        executor = _default_executor(config, registry)
    metrics = Metrics()
    authenticator = TokenAuthenticator(config.tokens)
    options = [("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0)]
    server = aio.server(interceptors=[AuthInterceptor(authenticator)], options=options)
    servicer = GradientServicer(config=config, registry=registry, executor=executor,
                                authenticator=authenticator, metrics=metrics)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE_NAME, _method_handlers(servicer, metrics, stream_idle_seconds=config.stream_idle_seconds)),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    credentials = server_credentials(config)
    try:
        port = (server.add_secure_port(config.address, credentials) if credentials is not None
                else server.add_insecure_port(config.address))
    except BaseException:
        servicer.sessions.close()
        raise
    await _set_health(health, False)
    await server.start()
    try:
        await executor.start()
    except BaseException:
        await server.stop(None)
        servicer.sessions.close()
        raise
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = metrics.serve_http(config.metrics_host, config.metrics_port)
    serving = executor.ready
    await _set_health(health, serving)
    health_task = asyncio.create_task(_follow_readiness(health, executor, serving), name="psg-health")
    logger.info("psg-server listening on %s:%d (%s, %s)", config.host, port,
                "TLS" if credentials else "plaintext", "tokens" if authenticator.enabled else "no auth")
    return PsgServer(server, executor, metrics, health, metrics_port, health_task, servicer.sessions), port


def _default_executor(config: ServerConfig, registry: ModelRegistry) -> ShardExecutor:
    if config.executor == "ray":
        from psg_server.pool import WorkerPool  # Ray is imported only when the pool is used

        # "cuda:<i>" names a GPU of this process; Ray gives each worker a GPU of its own, or a share
        # of one when --workers exceeds the cluster's GPUs (psg_server.placement).
        use_gpus = {"auto": None, "cpu": False}.get(config.device, True)
        return WorkerPool(plugins=registry.plugins, num_workers=config.num_workers,
                          cpus_per_worker=config.cpus_per_worker, ray_address=config.ray_address, use_gpus=use_gpus,
                          direct_channels=config.direct_channels)
    return InProcessExecutor(registry, num_workers=config.num_workers or 1, device=config.device)
