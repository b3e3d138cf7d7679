"""The Python client of the psg gradient service::

    from torch import nn
    from psg_core.config import DPConfig
    with GradientClient("localhost:50051", token=None) as client:
        model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
        session = client.create_session("mlp", loss="cross_entropy", expected_batch_size=64,
                                        config=DPConfig(max_grad_norm=1.0, noise_multiplier=1.1),
                                        sample_rate=64 / 60_000, delta=1e-5)
        session.push_parameters(model)
        result = session.compute_gradients(inputs, targets)
        result.apply_to(model)
        optimizer.step()

Inputs go positionally (a tensor, or a sequence of tensors) or by keyword (a mapping such as
``{"input_ids": ..., "attention_mask": ...}``, for the Hugging Face family). A session may add a LoRA
adapter (``lora=LoraAdapter(...)``): its frozen base model is pushed once, every later version
carries only the adapter, and only the adapter's gradients come back. With
``adaptive_clipping=QuantileClipping(...)`` the server moves the session's flat bound after every
step towards a private quantile of the per-sample norms (:attr:`GradientResult.clip_bound`,
:attr:`Session.clip_bound`). With ``capture=True`` the server's workers record each shard shape's
step once and replay it (``psg_core.CapturedStep``: the same gradients, less work per step for
fixed batch shapes; :attr:`Session.capture`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import grpc
import torch
from torch import nn

from psg_client.batches import split_named_batch
from psg_client.torch import apply_gradients, batch_tensors, check_parameters, parameter_tensors
from psg_core.adaptive_clipping import QuantileClipping
from psg_core.config import DPConfig
from psg_core.errors import PsgError
from psg_wire.adapters import LoraAdapter
from psg_wire.codec import DEFAULT_CHUNK_BYTES, CodecLimits, FrameWire, TensorDecoder
from psg_wire.convert import (PrivacyRequest, WireDtypes, adaptive_clipping_from_proto, adaptive_clipping_to_proto,
                              dp_config_to_proto, lora_to_proto, parameter_spec_from_proto, privacy_to_proto,
                              step_stats_from_proto, wire_dtypes_from_proto, wire_dtypes_to_proto)
from psg_wire.convert import dp_config_from_proto
from psg_wire.flat import FlatTensors
from psg_wire.names import REASON_METADATA_KEY, SERVICE_NAME, Reason, parameter_name
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_wire.v1 import gradient_service_pb2_grpc as pb_grpc

__all__ = ["GradientClient", "GradientResult", "RetryPolicy", "ServiceError", "Session", "TLSConfig"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_PUSH_WIRE = FrameWire(pb.PushParametersRequest)
_COMPUTE_WIRE = FrameWire(pb.ComputeGradientsRequest)
_REPLY_WIRE = FrameWire(pb.ComputeGradientsResponse)


class ServiceError(PsgError, RuntimeError):
    """The server answered with an error status.

    Attributes:
        code: the gRPC status code (``grpc.StatusCode.INVALID_ARGUMENT``, ...).
        details: the server's message.
        reason: the server's machine-readable reason (``PARAMETERS_MISSING``, ``BUDGET_EXHAUSTED``,
            ...), empty when the error did not come from psg's error table.
    """

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ServiceError:
        """Wraps a grpc error (reading the ``psg-error-reason`` trailing metadata)."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        reason = next((str(v) for k, v in (trailers or ()) if k == REASON_METADATA_KEY), "")
        return cls(code, details or "", reason)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of calls that fail with UNAVAILABLE: exponential backoff with jitter."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts (``max_attempts - 1`` of them)."""
        backoff = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            yield backoff * random.uniform(0.5, 1.0)
            backoff = min(backoff * self.multiplier, self.max_backoff_s)


@dataclass(frozen=True)
class TLSConfig:
    """TLS for the channel; PEM bytes. ``certificate_chain`` + ``private_key`` enable mutual TLS."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    #: Name to verify the server certificate against, when it differs from the target's host.
    server_name_override: str | None = None


@dataclass(frozen=True)
class GradientResult:
    """One step's answer: the DP gradient and its statistics."""

    #: ``{name: tensor}`` for every trainable parameter: clipped, summed, noised, and divided by the
    #: expected batch size under mean reduction.
    grads: dict[str, torch.Tensor]
    step: int
    param_version: int
    samples: int
    mean_loss: float
    #: Per-sample gradient norms before clipping, ``{quantile: norm}``.
    norm_quantiles: dict[float, float]
    fraction_clipped: float
    epsilon_spent: float
    budget_left: float
    server_seconds: float = field(default=0.0, compare=False)
    #: Samples whose gradient was not finite, which the server dropped from the sum.
    num_dropped: int = 0
    #: Adaptive clipping only (None otherwise): the flat bound this step's samples were clipped at.
    clip_bound: float | None = None
    #: Adaptive clipping only: the bound the session's next step clips at.
    next_clip_bound: float | None = None
    #: Adaptive clipping only: the released (noised) estimate of the fraction of samples
    #: ``clip_bound`` left unclipped, which moved the bound.
    unclipped_fraction: float | None = None

    def apply_to(self, model: nn.Module) -> None:
        """Fills ``p.grad`` of every trainable parameter, ready for ``optimizer.step()``."""
        apply_gradients(model, self.grads)


class GradientClient:
    """Connection to a psg server.

    Args:
        target: ``host:port``.
        token: bearer token (sent as ``authorization: Bearer <token>``), if the server wants one.
        tls: False (plaintext), True (TLS with the system's roots) or a :class:`TLSConfig`.
        retry: how UNAVAILABLE is retried.
        timeout_s: deadline of each call (a step included).
        chunk_bytes: chunk size of uploaded tensors.
        max_message_bytes: gRPC max message size of the channel.
        limits: what the client accepts from the server's replies.
    """

    def __init__(self, target: str, *, token: str | None = None, tls: bool | TLSConfig = False,
                 retry: RetryPolicy = RetryPolicy(), timeout_s: float | None = 600.0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_message_bytes: int = 4 << 20,
                 limits: CodecLimits = CodecLimits()) -> None:
        options: list[tuple[str, Any]] = [("grpc.max_send_message_length", max_message_bytes),
                                          ("grpc.max_receive_message_length", max_message_bytes)]
        if tls is False:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            config = tls if isinstance(tls, TLSConfig) else TLSConfig()
            if config.server_name_override:
                options.append(("grpc.ssl_target_name_override", config.server_name_override))
            credentials = grpc.ssl_channel_credentials(config.root_certificates, config.private_key,
                                                       config.certificate_chain)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._stub = _stub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.retry = retry
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.limits = limits
        self._one_message_bytes: int | None = None

    # ------------------------------------------------------------------------------ plumbing
    def call(self, invoke: Callable[[Any, dict[str, Any]], _T]) -> _T:
        """Runs ``invoke(stub, call_kwargs)``, retrying UNAVAILABLE; raises :class:`ServiceError`."""
        delays = self.retry.delays()
        while True:
            try:
                return invoke(self._stub, {"metadata": self._metadata, "timeout": self.timeout_s})
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    delay = next(delays, None)
                    if delay is not None:
                        logger.info("psg client: server unavailable, retrying in %.2f s", delay)
                        time.sleep(delay)
                        continue
                raise ServiceError.from_rpc_error(error) from None

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> GradientClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------------------ RPCs
    def server_info(self) -> pb.ServerInfo:
        """Version, backends, workers and limits of the server."""
        return self.call(lambda stub, kw: stub.GetServerInfo(pb.GetServerInfoRequest(), **kw))

    def one_message_bytes(self) -> int:
        """The largest payload the server takes or sends in one message (its ``max_chunk_bytes``,
        asked once per client; 0 when it does not say): a step whose gradients fit well below it
        is read as a single reply."""
        if self._one_message_bytes is None:
            self._one_message_bytes = int(self.server_info().limits.max_chunk_bytes)
        return self._one_message_bytes

    def list_models(self) -> list[pb.ModelInfo]:
        """Architectures the server can build."""
        return list(self.call(lambda stub, kw: stub.ListModels(pb.ListModelsRequest(), **kw)).models)

    def create_session(self, model: str, *, loss: str, expected_batch_size: int,
                       config: DPConfig = DPConfig(), model_kwargs: Mapping[str, Any] | None = None,
                       sample_rate: float | None = None, delta: float | None = None,
                       target_epsilon: float | None = None, accountant: str | None = None,
                       seed: int | None = None, secure_rng: bool = False, steps: int | None = None,
                       epochs: float | None = None, lora: LoraAdapter | None = None,
                       wire: WireDtypes | None = None,
                       adaptive_clipping: QuantileClipping | None = None, capture: bool = False) -> Session:
        """Opens a session; see ``CreateSessionRequest`` in ``gradient_service.proto``.

        Args:
            model: a name from :meth:`list_models`.
            loss: cross_entropy, nll, mse, bce_with_logits, token_cross_entropy or causal_lm.
            expected_batch_size: samples (not rows) per step, the normaliser of the gradient.
            config: the DP configuration of every step.
            model_kwargs: the architecture's keyword arguments; for the Hugging Face family
                (``hf_causal_lm``, ...) the transformers config, e.g. ``GPT2Config(...).to_dict()``.
            sample_rate: Poisson sampling rate q (default 1: full batch).
            delta: delta of the reported epsilon; needed when ``config.noise_multiplier > 0``.
            target_epsilon: refuse steps beyond this epsilon.
            accountant: "rdp" or "pld" (default: the server's).
            seed: seeds the per-step noise (default: a secret random seed chosen by the server).
            secure_rng: draw noise from a cryptographically secure source instead.
            lora: a LoRA adapter the server adds to the model; give the trainer's copy the same
                adapter (``lora.apply(model)``), so that names and trainable parameters agree.
            steps, epochs: the planned run (one of the two), to have the server choose sigma in
                place of ``config.noise_multiplier`` (left at 0): the smallest that keeps epsilon at
                ``delta`` within ``target_epsilon`` after the plan. :attr:`Session.noise_multiplier`
                tells which.
            wire: send parameters and/or receive gradients in bf16 (``WireDtypes(parameters=
                torch.bfloat16, gradients=torch.bfloat16)``): half the bytes of float32, each value
                rounded to 8 significant bits (README, "Reduced precision on the wire"); the session
                casts both ways, so tensors keep their dtypes here.
            adaptive_clipping: a :class:`~psg_core.adaptive_clipping.QuantileClipping`: the
                server starts the (flat) bound at ``config.max_grad_norm`` and moves it after every
                step towards the target quantile of the per-sample norms, as
                :class:`psg_core.DPStep` does in process; each step is still accounted at
                ``config.noise_multiplier``, the gradient's noise being raised to pay for the
                count. :attr:`GradientResult.clip_bound` and :attr:`Session.clip_bound` tell the
                bound.
            capture: have the server's workers run the steps through
                :class:`psg_core.CapturedStep`: each shard shape's step is recorded once and
                replayed after (the same gradients as an eager step, with less of psg's per-step
                work). Worth it for batches of fixed shapes (fixed-size or padded batches, the same
                ``max_rows``); each new shard shape costs each worker an eager step, a recording and
                a checked step before it replays. Not with ``adaptive_clipping`` (the server refuses
                the pair: INVALID_ARGUMENT).
        """
        privacy = PrivacyRequest(accountant=accountant, sample_rate=sample_rate, delta=delta,
                                 target_epsilon=target_epsilon, steps=steps, epochs=epochs)
        request = pb.CreateSessionRequest(model=model, model_kwargs_json=json.dumps(dict(model_kwargs or {})),
                                          loss=loss, dp=dp_config_to_proto(config),
                                          expected_batch_size=expected_batch_size,
                                          privacy=privacy_to_proto(privacy), secure_rng=secure_rng,
                                          capture=capture)
        if seed is not None:
            request.seed = seed
        if lora is not None:
            request.lora.CopyFrom(lora_to_proto(lora))
        if wire is not None:
            request.wire.CopyFrom(wire_dtypes_to_proto(wire))
        if adaptive_clipping is not None:
            request.adaptive_clipping.CopyFrom(adaptive_clipping_to_proto(adaptive_clipping))
        reply = self.call(lambda stub, kw: stub.CreateSession(request, **kw))
        return Session(self, reply.session_id, reply.parameters,
                       config=dataclasses.replace(config, noise_multiplier=reply.noise_multiplier),
                       wire=wire or WireDtypes(), adaptive_clipping=adaptive_clipping,
                       clip_bound=config.max_grad_norm if adaptive_clipping is not None else None, capture=capture)

    def session(self, session_id: str) -> Session:
        """Attaches to an existing session of this token (after a client or a server restart); push
        the parameters before the next step."""
        info = self.call(lambda stub, kw: stub.GetSession(pb.GetSessionRequest(session_id=session_id), **kw))
        config = dp_config_from_proto(info.dp) if info.HasField("dp") else None
        adaptive = adaptive_clipping_from_proto(info.adaptive_clipping) if info.HasField("adaptive_clipping") \
            else None
        return Session(self, session_id, info.parameters, config=config,
                       param_version=max(info.param_version, info.latest_param_version),
                       frozen_held=info.frozen_version > 0, wire=wire_dtypes_from_proto(info.wire),
                       adaptive_clipping=adaptive, clip_bound=info.clip_bound if adaptive is not None else None,
                       capture=info.capture)


class Session:
    """A session on the server; not thread-safe (one trainer loop per session).

    Keeps a reference (no copy) to the last pushed tensors, so that it can push them again under
    a new version when the server reports PARAMETERS_MISSING: after the server restarted (its
    sessions live on in its ``--state-dir``) this object goes on where it was, and a new process
    reattaches with :meth:`GradientClient.session` and pushes its parameters.
    """

    def __init__(self, client: GradientClient, session_id: str, parameters: Iterable[pb.ParameterSpec], *,
                 param_version: int = 0, config: DPConfig | None = None, frozen_held: bool = False,
                 wire: WireDtypes = WireDtypes(), adaptive_clipping: QuantileClipping | None = None,
                 clip_bound: float | None = None, capture: bool = False) -> None:
        self._client = client
        self.id = session_id
        specs = list(parameters)
        #: ``{name: (dtype, shape)}`` of every model parameter.
        self.parameter_specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            p.name: parameter_spec_from_proto(p) for p in specs}
        #: ``{name: requires_grad}`` in the session's model: the frozen parameters travel once.
        self.trainable: dict[str, bool] = {p.name: p.requires_grad for p in specs}
        #: Bytes of the tensors the last push sent.
        self.last_push_bytes = 0
        self._frozen_held = frozen_held
        self.param_version = param_version
        #: The session's DP configuration, ``noise_multiplier`` the sigma of its steps (chosen by the
        #: server when the session was opened with a plan); None from a server that does not say.
        self.config = config
        #: The dtypes parameters and gradients travel in (CreateSession's ``wire``).
        self.wire = wire
        #: How the server adapts the session's flat bound; None = it stays ``config.max_grad_norm``.
        self.adaptive_clipping = adaptive_clipping
        #: With adaptive clipping, the bound the session's next step clips at, as the server last
        #: said (at creation, attaching, or in a step's result); None without.
        self.clip_bound = clip_bound
        #: Whether the server runs the session's steps through ``psg_core.CapturedStep``
        #: (CreateSession's ``capture``).
        self.capture = capture
        self._pushed: list[tuple[str, torch.Tensor]] | None = None

    @property
    def noise_multiplier(self) -> float | None:
        """sigma of every step (None when the server did not say)."""
        return None if self.config is None else self.config.noise_multiplier

    def push_parameters(self, model: nn.Module | Sequence[tuple[str, torch.Tensor]], *,
                        frozen: bool | None = None) -> int:
        """Uploads the parameters of ``model`` under a new version and returns that version.

        Every trainable parameter goes; the frozen ones (``requires_grad=False`` in the session's
        model, a LoRA run's base model) go with the session's first push, and then only with
        ``frozen=True`` (their values changed) or when the server lost them. A trainer that pushes
        before every step saves a round trip with ``compute_gradients(..., parameters=model)``.

        Args:
            model: the trainer's model (its ``requires_grad`` flags must be the session's) or
                ``(name, tensor)`` pairs of every parameter.
            frozen: send the frozen parameters (True), keep the server's (False), or send them
                when the server holds none (None).
        """
        named = self._checked_parameters(model)
        send_frozen = not self._frozen_held if frozen is None else frozen
        try:
            self._push(named, send_frozen=send_frozen)
        except ServiceError as error:
            if frozen is not None or send_frozen or error.reason != Reason.PARAMETERS_MISSING:
                raise
            logger.warning("psg client: the server holds no frozen parameters of session %s; sending them",
                           self.id)
            self._push(named, send_frozen=True)
        self._pushed = named
        return self.param_version

    def _checked_parameters(self, model: nn.Module | Sequence[tuple[str, torch.Tensor]]
                            ) -> list[tuple[str, torch.Tensor]]:
        named = parameter_tensors(model) if isinstance(model, nn.Module) else list(model)
        flags = ({name: p.requires_grad for name, p in model.named_parameters()} if isinstance(model, nn.Module)
                 else None)
        check_parameters(named, self.parameter_specs, requires_grad=flags, trainable=self.trainable)
        return named

    def _parameter_groups(self, named: list[tuple[str, torch.Tensor]], *, send_frozen: bool,
                          rename: Callable[[str], str] = str) -> list[Any]:
        """The parameters as two groups, the trainable ones and the frozen ones (when sent): few
        messages, and the server keeps the trainable ones, which travel on to its workers every
        version, as the one flat buffer they arrived in. In the session's wire dtype, if it has one."""
        dtype = self.wire.parameters
        groups: list[Any] = []
        for trainable in (True, False):
            group = [(rename(name), tensor) for name, tensor in named
                     if self.trainable[name] == trainable and (trainable or send_frozen)]
            if group:
                groups.append(group if dtype is None else FlatTensors.pack(group, dtype=dtype))
        return groups

    def _single_reply(self, client: GradientClient) -> bool:
        """Whether to ask for the step's reply in one message: the gradients (every trainable
        parameter, in the session's wire dtype for gradients if it has one) within the client's
        chunk size and, with room for their headers, within the server's message limit."""
        wire = self.wire.gradients
        sizes = [math.prod(shape) * (wire or dtype).itemsize
                 for name, (dtype, shape) in self.parameter_specs.items() if self.trainable[name]]
        payload = sum(sizes)
        return payload <= client.chunk_bytes and payload + 512 * (len(sizes) + 1) <= client.one_message_bytes()

    def _push(self, named: list[tuple[str, torch.Tensor]], *, send_frozen: bool) -> None:
        version = self.param_version + 1
        header = pb.PushParametersHeader(session_id=self.id, version=version)

        def invoke(stub: Any, kw: dict[str, Any]) -> pb.PushParametersResponse:
            groups = self._parameter_groups(named, send_frozen=send_frozen)
            return stub.PushParameters(_frames(_PUSH_WIRE, header, groups, self._client.chunk_bytes), **kw)

        reply = self._client.call(invoke)
        self.param_version = version
        self.last_push_bytes = reply.num_bytes
        self._frozen_held = True

    def compute_gradients(self, inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                          targets: torch.Tensor, *,
                          step_seed: int | None = None, max_rows: int | None = None,
                          max_bytes: int | None = None,
                          parameters: nn.Module | Sequence[tuple[str, torch.Tensor]] | None = None) -> GradientResult:
        """One DP step on the batch (``N * K`` rows, sample-major); see :class:`GradientResult`.

        ``inputs`` is a tensor, a sequence of tensors (the model's positional arguments) or a
        mapping of keyword arguments (``{"input_ids": ..., "attention_mask": ...}``).

        With ``parameters`` (the model, or ``(name, tensor)`` pairs), the call first pushes them
        under a new version, as :meth:`push_parameters` would, and computes at that version: a push
        and a step in one round trip.

        With ``max_rows`` or ``max_bytes``, a batch larger than that goes as several requests of
        whole samples (gradient accumulation: the server adds noise and accounts once, after the
        last), and the result is that of the whole batch: use it for logical batches beyond the
        server's ``max_batch_rows`` or ``max_request_bytes`` (:meth:`GradientClient.server_info`).
        """
        push = None if parameters is None else self._checked_parameters(parameters)
        options: dict[str, Any] = {"max_rows": max_rows, "max_bytes": max_bytes}
        try:
            return self._compute(inputs, targets, step_seed, push=push, **options)
        except ServiceError as error:
            lost = error.reason == Reason.PARAMETERS_MISSING and (push is not None or self._pushed is not None)
            if not lost and error.reason != Reason.ACCUMULATION_LOST:
                raise
        if lost and push is not None:
            logger.warning("psg client: the server holds no frozen parameters of session %s; sending them",
                           self.id)
            return self._compute(inputs, targets, step_seed, push=push, send_frozen=True, **options)
        if lost:
            logger.warning("psg client: the server lost the parameters of session %s; pushing them again",
                           self.id)
            self.push_parameters(self._pushed, frozen=True)  # type: ignore[arg-type]
        else:
            logger.warning("psg client: the server lost the first parts of this logical batch; sending it again")
        return self._compute(inputs, targets, step_seed, push=push, **options)

    def info(self) -> pb.SessionInfo:
        """Steps, epsilon spent and budget left."""
        request = pb.GetSessionRequest(session_id=self.id)
        return self._client.call(lambda stub, kw: stub.GetSession(request, **kw))

    def close(self) -> None:
        """Releases the session on the server."""
        request = pb.CloseSessionRequest(session_id=self.id)
        self._client.call(lambda stub, kw: stub.CloseSession(request, **kw))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _compute(self, inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                 targets: torch.Tensor, step_seed: int | None, *, max_rows: int | None = None,
                 max_bytes: int | None = None, push: list[tuple[str, torch.Tensor]] | None = None,
                 send_frozen: bool | None = None) -> GradientResult:
        named = batch_tensors(inputs, targets)
        config = self.config or DPConfig()
        parts = split_named_batch(named, max_rows=max_rows, max_bytes=max_bytes,
                                  augmentation_multiplicity=config.augmentation_multiplicity,
                                  batch_first=config.batch_first)
        client = self._client
        frozen = not self._frozen_held if send_frozen is None else send_frozen
        dtypes = ({name: dtype for name, (dtype, _) in self.parameter_specs.items()}
                  if self.wire.gradients is not None else None)
        for index, part in enumerate(parts):
            pushing = push is not None and index == 0
            version = self.param_version + 1 if pushing else self.param_version
            header = pb.ComputeGradientsHeader(session_id=self.id, param_version=version, part=index,
                                               more_parts=index < len(parts) - 1, grouped_reply=True,
                                               push_version=version if pushing else 0)
            if step_seed is not None:
                header.step_seed = step_seed

            header.single_message_reply = self._single_reply(client)

            def invoke(stub: Any, kw: dict[str, Any], header: pb.ComputeGradientsHeader = header,
                       part: list[tuple[str, torch.Tensor]] = part, pushing: bool = pushing) -> GradientResult:
                groups = self._parameter_groups(push, send_frozen=frozen, rename=parameter_name) \
                    if pushing and push is not None else []
                requests = _frames(_COMPUTE_WIRE, header, _one_group_if_small([*groups, part], client.chunk_bytes),
                                   client.chunk_bytes)
                if header.single_message_reply:  # one message each way: a unary call, no stream
                    first = list(itertools.islice(requests, 2))
                    if len(first) == 1:
                        return _read_result([stub.ComputeGradientsSingle(first[0], **kw)], client.limits, dtypes)
                    requests = itertools.chain(first, requests)
                return _read_result(stub.ComputeGradients(requests, **kw), client.limits, dtypes)

            result = client.call(invoke)
            if pushing:
                self.param_version, self._frozen_held, self._pushed = version, True, push
        if result.next_clip_bound is not None:
            self.clip_bound = result.next_clip_bound
        return result


def _stub(channel: grpc.Channel) -> pb_grpc.GradientServiceStub:
    """The generated stub, with the two tensor-streaming methods going through :class:`FrameWire`
    (chunk and group frames are serialised and read without protobuf's extra copies of their
    payload) and :class:`_OneOrMore` (a request of one message goes without a streaming call)."""
    stub = pb_grpc.GradientServiceStub(channel)
    push, compute = f"/{SERVICE_NAME}/PushParameters", f"/{SERVICE_NAME}/ComputeGradients"
    push_reply, compute_reply = pb.PushParametersResponse.FromString, _REPLY_WIRE.parse
    stub.PushParameters = _OneOrMore(  # type: ignore[method-assign]
        channel.stream_unary(push, request_serializer=_PUSH_WIRE.serialize, response_deserializer=push_reply,
                             _registered_method=True),
        channel.unary_unary(push, request_serializer=_PUSH_WIRE.serialize, response_deserializer=push_reply,
                            _registered_method=True))
    # A step whose request is one message and whose reply the server sends as one
    # (single_message_reply): a unary call on the same method, the same bytes on the wire.
    stub.ComputeGradientsSingle = channel.unary_unary(  # type: ignore[attr-defined]
        compute, request_serializer=_COMPUTE_WIRE.serialize, response_deserializer=compute_reply,
        _registered_method=True)
    stub.ComputeGradients = _OneOrMore(  # type: ignore[method-assign]
        channel.stream_stream(compute, request_serializer=_COMPUTE_WIRE.serialize,
                              response_deserializer=compute_reply, _registered_method=True),
        channel.unary_stream(compute, request_serializer=_COMPUTE_WIRE.serialize,
                             response_deserializer=compute_reply, _registered_method=True))
    return stub


class _OneOrMore:
    """A client-streaming method called with a request iterator: a request of one message goes as
    a unary request (the same bytes on the wire: gRPC does not send a method's cardinality), which
    spares the thread a streaming call starts to read the iterator, and most of a small step's
    client-side cost; longer requests stream as usual."""

    def __init__(self, streaming: Any, single: Any) -> None:
        self._streaming = streaming
        self._single = single

    def __call__(self, requests: Iterator[Any], **kwargs: Any) -> Any:
        first = list(itertools.islice(requests, 2))
        if len(first) == 1:
            return self._single(first[0], **kwargs)
        return self._streaming(itertools.chain(first, requests), **kwargs)


def _one_group_if_small(groups: list[Any], chunk_bytes: int) -> list[Any]:
    """The request's groups (pushed parameters, then the batch) as one group when together they fit
    in a chunk, so that a small push-and-step is one message; groups in a wire dtype
    (:class:`FlatTensors`) stay as they are. Order is kept: the trainable parameters still lie
    first, in one run of the buffer, as the server keeps them."""
    if len(groups) < 2 or any(not isinstance(group, list) for group in groups):
        return groups
    merged = [pair for group in groups for pair in group]
    total = sum(tensor.numel() * tensor.element_size() for _, tensor in merged)
    return [merged] if total <= chunk_bytes else groups


def _frames(wire: FrameWire, header: Any, groups: list[Any], chunk_bytes: int) -> Iterator[Any]:
    """A request stream: the header carrying the first group inline (a request whose tensors fit
    in one chunk is one message), then the other groups."""
    for index, group in enumerate(groups):
        lead = ("header", header, "group") if index == 0 else None
        yield from wire.messages(group, chunk_bytes=chunk_bytes, group=True, lead=lead)
    if not groups:
        yield wire.message_type(header=header)


def _read_result(responses: Iterator[pb.ComputeGradientsResponse], limits: CodecLimits,
                 dtypes: Mapping[str, torch.dtype] | None = None) -> GradientResult:
    stats: pb.StepStats | None = None
    decoder = TensorDecoder(limits)
    for message in responses:
        if stats is None:
            kind = message.WhichOneof("frame")
            if kind == "result":  # the stats and the first group of gradients in one message
                stats = message.result.stats
                if message.result.HasField("gradients"):
                    decoder.add(message.result.gradients)
            elif kind == "stats":
                stats = message.stats
            else:
                raise PsgError("compute_gradients: the server's reply did not start with the step stats")
        else:
            decoder.add_message(message)
    if stats is None:
        raise PsgError("compute_gradients: the server's reply was empty")
    stats_report = step_stats_from_proto(stats)
    # The last part's report is the step's (pending only marks the others).
    report = {f.name: getattr(stats_report, f.name) for f in dataclasses.fields(stats_report) if f.name != "pending"}
    grads = decoder.finish()
    if dtypes is not None:  # sent in the session's wire dtype: back to each parameter's own
        grads = {name: grad.to(dtypes.get(name, grad.dtype)) for name, grad in grads.items()}
    return GradientResult(grads=grads, **report)

