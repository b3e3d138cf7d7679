"""Sessions: one model, DP configuration, parameter versions, step counter and accountant each,
owned by the principal (token) that created them.

A caller only ever sees its own sessions: another principal's session id gives the same
NOT_FOUND as an unknown one. Idle sessions are closed after ``session_idle_seconds``; parameter
sets beyond ``parameter_memory_bytes`` are dropped least-recently-used first (the session stays,
and its client pushes again when told PARAMETERS_MISSING).

With a :class:`~psg_server.state.SessionDatabase` (``--state-dir``), the store writes every session
it opens, closes or expires, and the step runner has it write each step's progress before the
step's result goes out; :meth:`SessionStore.restore` reopens them after a restart (without their
parameters, which clients push again).

A session opened with adaptive clipping (``CreateSessionRequest.adaptive_clipping``) keeps its current
flat bound (:attr:`Session.clip_bound`): every step clips at it and moves it as
:class:`psg_core.DPStep` does in process (:mod:`psg_core.adaptive_clipping`); the bound is part of
the progress written with each step.

Parameter versions only go up: a push is refused (STALE_PARAMETERS) unless its version is above
every version the session was pushed before, checked when the push's header arrives and again,
atomically, when the set is stored (:meth:`SessionStore.store_parameters`), so a version never names
two parameter sets (workers keep a model loaded at a version and reload only on another one).

No two steps of a session draw the same noise: a step seed an earlier step used is refused
(:mod:`psg_server.step_seeds`, :meth:`Session.check_step_seed`); the seeds used are kept with the
session's progress. A step is accounted in memory and in the database together or not at all
(:meth:`SessionStore.record_step`).

A session opened with ``capture`` (``CreateSessionRequest.capture``, :attr:`SessionSpec.capture`)
has its workers run its steps through :class:`psg_core.capture.CapturedStep`; that holds the bound
fixed, so it is refused together with adaptive clipping. The flag is part of the request the
database keeps, so a restarted server reopens the session with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from psg_core.accounting import PrivacyAccountant
from psg_core.adaptive_clipping import (QuantileClipping, gradient_noise_multiplier, private_unclipped_fraction,
                                        updated_bound)
from psg_core.calibration import calibrate_noise_multiplier
from psg_core.config import DPConfig
from psg_core.errors import ConfigError
from psg_core.modes import Clipping
from psg_core.privacy_step import PrivacyStep
from psg_server.config import ServerConfig
from psg_server.errors import (InvalidRequestError, LimitExceededError, ParametersMissingError,
                               SessionNotFoundError, StaleParametersError, StepSeedReusedError)
from psg_server.accumulation import PendingBatch
from psg_server.executor import ParameterSet, SessionSpec
from psg_server.losses import LossEntry, get_loss
from psg_server.models import ModelRegistry, ModelSignature, ParameterInfo
from psg_wire.convert import dp_config_from_proto, lora_from_proto, parameter_spec_to_proto, privacy_from_proto
from psg_server.state import SessionDatabase, SessionRecord
from psg_server.step_seeds import UsedSeeds
from psg_wire.convert import WireDtypes, dp_config_to_proto, wire_dtypes_from_proto, wire_dtypes_to_proto
from psg_wire.convert import adaptive_clipping_from_proto, adaptive_clipping_to_proto
from psg_wire.names import input_name
from psg_wire.v1 import gradient_service_pb2 as pb

__all__ = ["MAX_NOISE_MULTIPLIER", "MAX_NOISE_SCALE", "MAX_PARAMETER_VERSION", "BoundUpdate", "PrivacyPlan", "Session",
           "SessionStore", "open_session", "parameter_specs", "restore_session", "signature_info"]

logger = logging.getLogger(__name__)


#: Largest parameter version a push may name: the session database keeps versions as SQLite
#: integers (signed 64-bit), so 2**63 and above could not be stored.
MAX_PARAMETER_VERSION = 2**63 - 1


@dataclass(frozen=True)
class _Progress:
    """What accounting a step changes in a :class:`Session` (:meth:`Session.record_step`), to put
    back when the step cannot be stored."""

    steps: int
    ledger: dict | None
    epsilon_spent: float
    clip_bound: float


@dataclass(frozen=True)
class PrivacyPlan:
    """How a session's steps are accounted."""

    accountant: str
    #: Poisson sampling rate q of each step.
    sample_rate: float
    #: delta of the reported epsilon (0 when there is no noise, hence nothing to report).
    delta: float
    #: None = no budget.
    target_epsilon: float | None


@dataclass(frozen=True)
class BoundUpdate:
    """What adaptive clipping released and decided in one step (:meth:`Session.adapt_bound`)."""

    #: The flat bound the step's samples were clipped at.
    bound: float
    #: The private estimate of the fraction of samples ``bound`` left unclipped.
    unclipped_fraction: float
    #: The bound the next step clips at.
    next_bound: float


class Session:
    """One client's training run on the server (see the module docstring)."""

    def __init__(self, *, session_id: str, owner: str, spec: SessionSpec, parameters: list[ParameterInfo],
                 signature: ModelSignature | None, loss: LossEntry, expected_batch_size: int,
                 privacy: PrivacyPlan, seed: int | None, secure_rng: bool,
                 adaptive_clipping: QuantileClipping | None = None) -> None:
        self.id = session_id
        self.owner = owner
        self.spec = spec
        self.parameter_info = parameters
        self.signature = signature
        self.loss = loss
        self.expected_batch_size = expected_batch_size
        self.privacy = privacy
        #: Budget check, noise, normalisation and accounting of every step (psg_core's, as DPStep's).
        self.privacy_step = PrivacyStep.for_config(spec.dp_config, sample_rate=privacy.sample_rate,
                                                   expected_batch_size=expected_batch_size)
        self.seed = seed if seed is not None else secrets.randbits(64)
        self.secure_rng = secure_rng
        #: How the flat bound adapts (CreateSessionRequest.adaptive_clipping); None = it stays fixed.
        self.adaptive_clipping = adaptive_clipping
        #: With adaptive clipping, the flat bound the next step clips at (it starts at
        #: ``dp_config.max_grad_norm``); otherwise always ``dp_config.max_grad_norm``.
        self.clip_bound = spec.dp_config.max_grad_norm
        #: Steps of one session run one at a time, so accounting follows step order.
        self.lock = asyncio.Lock()
        self.steps = 0
        self.parameters: ParameterSet | None = None
        self.latest_version = 0
        #: The step seeds its steps drew noise from (psg_server.step_seeds): none may be used again.
        self.used_step_seeds = UsedSeeds()
        #: The parts received of a logical batch sent in several requests (psg_server.accumulation).
        self.pending: PendingBatch | None = None
        #: The CreateSessionRequest as opened (sigma chosen, seed drawn): what rebuilds the session.
        self.request = pb.CreateSessionRequest()
        #: Reduced-precision wire dtypes of its parameters and gradients (CreateSessionRequest.wire).
        self.wire = WireDtypes()
        self.last_used = time.monotonic()
        self._accountant: PrivacyAccountant | None = None
        if spec.dp_config.noise_multiplier > 0:
            budget = {} if privacy.target_epsilon is None else {"target_epsilon": privacy.target_epsilon,
                                                                "target_delta": privacy.delta}
            self._accountant = PrivacyAccountant(method=privacy.accountant, **budget)
        self.epsilon_spent = 0.0 if self._accountant is not None else math.inf

    @property
    def dp_config(self) -> DPConfig:
        """The session's DP configuration."""
        return self.spec.dp_config

    @property
    def normaliser(self) -> float:
        """What the noised sum is divided by: the expected batch size under mean reduction."""
        return self.privacy_step.normaliser

    @property
    def accounted(self) -> bool:
        """Whether steps are accounted (the session adds noise); without, accounting is a no-op."""
        return self._accountant is not None

    @property
    def budget_left(self) -> float:
        """target_epsilon - epsilon_spent, or +inf without a budget."""
        target = self.privacy.target_epsilon
        return math.inf if target is None else target - self.epsilon_spent

    def check_new_version(self, version: int, *, rpc: str) -> None:
        """Refuses a pushed ``version`` the session cannot take: :class:`InvalidRequestError` above
        :data:`MAX_PARAMETER_VERSION`, :class:`StaleParametersError` unless it is above every version
        pushed before."""
        if version > MAX_PARAMETER_VERSION:
            raise InvalidRequestError(f"{rpc}: parameter version {version} is above {MAX_PARAMETER_VERSION} "
                                      "(2**63 - 1), the largest the server can keep (its session database stores "
                                      "signed 64-bit integers); number versions from 1 up")
        if version <= self.latest_version:
            raise StaleParametersError(f"{rpc}: version {version} is not newer than the session's "
                                       f"version {self.latest_version}; a push must name a version above every "
                                       "version pushed before")

    def parameters_for(self, version: int) -> ParameterSet:
        """The parameter set a step asks for, or why it cannot have it."""
        if version < self.latest_version:
            raise StaleParametersError(f"ComputeGradients: parameter version {version} is stale; session "
                                       f"{self.id!r} is at version {self.latest_version}")
        if self.parameters is None or self.parameters.version != version:
            raise ParametersMissingError(f"ComputeGradients: session {self.id!r} holds no parameters for "
                                         f"version {version}; push them (PushParameters) first")
        return self.parameters

    def check_budget(self) -> None:
        """:class:`BudgetExhaustedError` when one more step would exceed the budget; records nothing."""
        self.privacy_step.check_budget(self._accountant)

    @property
    def noise_step(self) -> PrivacyStep:
        """The privacy step that noises and normalises the next step's clipped sum: the session's
        :attr:`privacy_step`, or with adaptive clipping the same at the current bound and with the
        gradient's share of the noise multiplier (:func:`~psg_core.adaptive_clipping.gradient_noise_multiplier`;
        the step is still accounted at :attr:`privacy_step`'s)."""
        adaptive = self.adaptive_clipping
        if adaptive is None:
            return self.privacy_step
        sigma = gradient_noise_multiplier(self.privacy_step.noise_multiplier, adaptive.count_noise_multiplier)
        return replace(self.privacy_step, noise_multiplier=sigma, sensitivity=self.clip_bound)

    @property
    def draws_noise(self) -> bool:
        """Whether a step draws random values: gradient noise (sigma > 0), or adaptive clipping's
        count noise."""
        return self.dp_config.noise_multiplier > 0 or self.adaptive_clipping is not None

    def adapt_bound(self, per_sample_norms: torch.Tensor, *, generator: torch.Generator | None) -> BoundUpdate:
        """Adaptive clipping's release for a step whose samples (``per_sample_norms``, every
        sample of the logical batch) were clipped at :attr:`clip_bound`: the noised unclipped
        fraction (its noise drawn from ``generator`` after the gradient's, or from the CSPRNG with
        ``secure_rng``) and the next bound. Changes nothing: :meth:`record_step` applies it."""
        adaptive = self.adaptive_clipping
        if adaptive is None:
            raise ConfigError(f"Session.adapt_bound: session {self.id!r} has no adaptive clipping")
        fraction = private_unclipped_fraction(per_sample_norms, self.clip_bound,
                                              count_noise_multiplier=adaptive.count_noise_multiplier,
                                              expected_batch_size=self.expected_batch_size, generator=generator,
                                              secure_rng=self.secure_rng)
        return BoundUpdate(bound=self.clip_bound, unclipped_fraction=fraction,
                           next_bound=updated_bound(self.clip_bound, unclipped_fraction=fraction, clipping=adaptive))

    def record_step(self, update: BoundUpdate | None = None) -> int:
        """Accounts a completed step (gradient and, with adaptive clipping, count together: one
        mechanism at the session's sigma), moves the bound to ``update.next_bound`` when given and
        returns the step's 1-based index."""
        if self._accountant is not None:
            self.privacy_step.account(self._accountant)
            self.epsilon_spent = self._accountant.epsilon(self.privacy.delta)
        if update is not None:
            self.clip_bound = update.next_bound
        self.steps += 1
        return self.steps

    @property
    def seeds_noise(self) -> bool:
        """Whether a step draws noise from a generator seeded by its step seed (it draws noise,
        and not from the CSPRNG): then no two steps may have the same step seed."""
        return self.draws_noise and not self.secure_rng

    def step_seed_of(self, step_seed: int | None) -> int:
        """The step seed the next step's noise follows: ``step_seed``, or its 1-based index."""
        return self.steps + 1 if step_seed is None else step_seed

    def check_step_seed(self, step_seed: int | None, *, rpc: str = "ComputeGradients") -> None:
        """:class:`StepSeedReusedError` when the next step, with ``step_seed`` (None: its index),
        would draw the noise of an earlier step (see :mod:`psg_server.step_seeds`)."""
        if not self.seeds_noise:
            return
        seed = self.step_seed_of(step_seed)
        if seed not in self.used_step_seeds:
            return
        given = (f"step_seed {seed}" if step_seed is not None else
                 f"its default step seed {seed} (its step index; the request gives no step_seed)")
        raise StepSeedReusedError(f"{rpc}: this step of session {self.id!r} would use {given}, which an earlier step "
                                  "of the session used: it would draw the same noise, and the difference of the two "
                                  "gradients would show the difference of their clipped sums without noise. Give "
                                  "each step of a session its own step_seed (or leave it unset when no step sets one)")

    def _progress(self) -> _Progress:
        return _Progress(steps=self.steps,
                         ledger=None if self._accountant is None else self._accountant.state_dict(),
                         epsilon_spent=self.epsilon_spent, clip_bound=self.clip_bound)

    def _put_back(self, progress: _Progress) -> None:
        self.steps, self.epsilon_spent, self.clip_bound = progress.steps, progress.epsilon_spent, progress.clip_bound
        if self._accountant is not None and progress.ledger is not None:
            self._accountant.load_state_dict(progress.ledger)

    def noise_seed(self, step_seed: int | None) -> int:
        """Seed of this step's noise generator: a hash of the session seed and the step seed
        (the step index when the client gives none)."""
        step = self.steps + 1 if step_seed is None else step_seed
        digest = hashlib.blake2b(f"{self.seed}:{step}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1  # torch seeds are < 2**63

    def info(self) -> pb.SessionInfo:
        """``GetSession``'s answer."""
        return pb.SessionInfo(session_id=self.id, model=self.spec.model, steps=self.steps,
                              param_version=self.parameters.version if self.parameters else 0,
                              epsilon_spent=self.epsilon_spent, budget_left=self.budget_left,
                              delta=self.privacy.delta, parameters=parameter_specs(self.parameter_info),
                              dp=dp_config_to_proto(self.dp_config), latest_param_version=self.latest_version,
                              frozen_version=self.parameters.frozen_from if self.parameters else 0,
                              wire=wire_dtypes_to_proto(self.wire),
                              adaptive_clipping=None if self.adaptive_clipping is None else
                              adaptive_clipping_to_proto(self.adaptive_clipping),
                              clip_bound=self.clip_bound if self.adaptive_clipping is not None else 0.0,
                              capture=self.spec.capture)

    def record(self) -> SessionRecord:
        """The session as the database keeps it."""
        ledger = None if self._accountant is None else json.dumps(self._accountant.state_dict())
        return SessionRecord(session_id=self.id, owner=self.owner, request=self.request.SerializeToString(),
                             steps=self.steps, ledger=ledger, epsilon_spent=self.epsilon_spent,
                             param_version=self.latest_version, updated=time.time(),
                             clip_bound=self.clip_bound if self.adaptive_clipping is not None else None)

    def resume(self, record: SessionRecord) -> None:
        """Takes the progress of a stored session: steps, ledger, epsilon, parameter version and,
        with adaptive clipping, the bound."""
        self.steps, self.latest_version = record.steps, record.param_version
        self.used_step_seeds = UsedSeeds(record.step_seeds)
        if self._accountant is not None and record.ledger is not None:
            self._accountant.load_state_dict(json.loads(record.ledger))
            self.epsilon_spent = record.epsilon_spent
        if self.adaptive_clipping is not None and record.clip_bound is not None:
            self.clip_bound = record.clip_bound


def parameter_specs(parameters: list[ParameterInfo]) -> list[pb.ParameterSpec]:
    """Wire form of a model's parameters."""
    return [parameter_spec_to_proto(p.name, p.dtype, p.shape, requires_grad=p.requires_grad) for p in parameters]


def signature_info(signature: ModelSignature | None) -> pb.ModelSignatureInfo | None:
    """Wire form of a model's signature (None stays None: the field is left unset)."""
    if signature is None:
        return None
    keys: list[int | str] = [*range(len(signature.inputs)), *sorted(signature.keyword_inputs)]
    specs = [*signature.inputs, *(signature.keyword_inputs[k] for k in sorted(signature.keyword_inputs))]
    inputs = [pb.InputSignature(
        name=input_name(key), kind=spec.kind,
        row_shape=[pb.DimRange(min=d, max=d) if isinstance(d, int) else pb.DimRange(min=d[0], max=d[1])
                   for d in spec.sample_shape],
        num_embeddings=spec.num_embeddings or 0, required=spec.required,
        same_shape_as=input_name(spec.same_shape_as) if spec.same_shape_as else "")
        for key, spec in zip(keys, specs)]
    return pb.ModelSignatureInfo(inputs=inputs, num_outputs=signature.num_outputs,
                                 targets_like=input_name(signature.targets_like) if signature.targets_like else "")


def _privacy(request: pb.CreateSessionRequest, dp_config: DPConfig, default_accountant: str) -> PrivacyPlan:
    settings = privacy_from_proto(request.privacy)
    accountant = settings.accountant or default_accountant
    if accountant not in ("rdp", "pld"):
        raise InvalidRequestError(f"CreateSession: accountant must be 'rdp' or 'pld', got {accountant!r:.40}")
    sample_rate = settings.sample_rate or 1.0
    if not 0 < sample_rate <= 1:
        raise InvalidRequestError(f"CreateSession: sample_rate must be in (0, 1], got {sample_rate!r}")
    target = settings.target_epsilon
    delta = settings.delta or 0.0
    if target is not None and not (math.isfinite(target) and target > 0):
        raise InvalidRequestError(f"CreateSession: target_epsilon must be a finite number > 0, got "
                                  f"{target!r}")
    noisy = dp_config.noise_multiplier > 0
    if target is not None and not noisy:
        raise InvalidRequestError("CreateSession: a privacy budget (target_epsilon) needs "
                                  "noise_multiplier > 0")
    if noisy and not 0 < delta < 1:
        raise InvalidRequestError(f"CreateSession: delta must be in (0, 1) when noise_multiplier > 0, got "
                                  f"{delta!r}")
    return PrivacyPlan(accountant=accountant, sample_rate=sample_rate, delta=delta if noisy else 0.0,
                       target_epsilon=target)


def _calibrated(request: pb.CreateSessionRequest, dp_config: DPConfig, default_accountant: str) -> DPConfig:
    """``dp_config`` with the sigma chosen from the budget when the request plans steps or epochs."""
    settings = privacy_from_proto(request.privacy)
    if settings.steps is None and settings.epochs is None:
        return dp_config
    if dp_config.noise_multiplier != 0:
        raise InvalidRequestError(f"CreateSession: give dp.noise_multiplier ({dp_config.noise_multiplier}) or "
                                  "privacy.steps/epochs (calibration), not both")
    if settings.target_epsilon is None or settings.delta is None:
        raise InvalidRequestError("CreateSession: calibrating the noise (privacy.steps/epochs) needs "
                                  "privacy.target_epsilon and privacy.delta")
    sigma = calibrate_noise_multiplier(settings.target_epsilon, delta=settings.delta,
                                       sample_rate=settings.sample_rate or 1.0, steps=settings.steps,
                                       epochs=settings.epochs, accountant=settings.accountant or default_accountant)
    logger.info("sessions: noise multiplier %.4g for epsilon %g at delta %g after %s", sigma,
                settings.target_epsilon, settings.delta,
                f"{settings.steps} steps" if settings.steps else f"{settings.epochs} epochs")
    return replace(dp_config, noise_multiplier=sigma)


#: Largest noise multiplier a session may use: beyond it epsilon is 0 under both accountants for
#: any sample rate, and far beyond it (sigma = 1e300) their arithmetic overflows.
MAX_NOISE_MULTIPLIER = 1e4
#: Largest clipping bound, and largest noise std sigma * C: gradients and noise are float32 (largest
#: value 3.4e38), and a sum of 65 536 clipped gradients plus noise tens of stds out must stay finite.
MAX_NOISE_SCALE = 1e30


def _check_scales(dp_config: DPConfig) -> None:
    """Refuses sigma, C and sigma * C the step could not compute with finite numbers."""
    sigma, bound = dp_config.noise_multiplier, dp_config.max_grad_norm
    if sigma > MAX_NOISE_MULTIPLIER:
        raise InvalidRequestError(f"CreateSession: noise_multiplier {sigma:g} is above {MAX_NOISE_MULTIPLIER:g}, "
                                  "the largest the privacy accountants handle (epsilon is 0 well before it)")
    bounds = (bound, *(dp_config.per_layer_max_grad_norms or ()))
    if max(bounds) > MAX_NOISE_SCALE:
        raise InvalidRequestError(f"CreateSession: max_grad_norm {max(bounds):g} is above {MAX_NOISE_SCALE:g}; "
                                  "clipped float32 gradients would overflow")
    if sigma * max(bounds) > MAX_NOISE_SCALE:
        raise InvalidRequestError(f"CreateSession: the noise std noise_multiplier * max_grad_norm = {sigma:g} * "
                                  f"{max(bounds):g} = {sigma * max(bounds):g} is above {MAX_NOISE_SCALE:g}; "
                                  "float32 noise would overflow")


def _adaptive_clipping(request: pb.CreateSessionRequest, dp_config: DPConfig) -> QuantileClipping | None:
    """The session's adaptive clipping, checked against its (calibrated) DP configuration as
    :class:`psg_core.DPStep` checks it: flat clipping only, the count's noise above sigma / 2."""
    if not request.HasField("adaptive_clipping"):
        return None
    if request.capture:
        raise InvalidRequestError("CreateSession: capture and adaptive_clipping cannot go together: adaptive "
                                  "clipping moves the clipping bound every step, which a captured (recorded and "
                                  "replayed) step would hold fixed; use one or the other")
    try:
        adaptive = adaptive_clipping_from_proto(request.adaptive_clipping)
    except ConfigError as err:
        raise InvalidRequestError(f"CreateSession: adaptive_clipping: {err}") from None
    if dp_config.clipping is not Clipping.FLAT:
        raise InvalidRequestError(f"CreateSession: adaptive clipping moves one flat bound; got clipping="
                                  f"{dp_config.clipping.value!r} (use clipping='flat')")
    try:
        gradient_noise_multiplier(dp_config.noise_multiplier, adaptive.count_noise_multiplier)
    except ConfigError as err:
        raise InvalidRequestError(f"CreateSession: adaptive_clipping: {err}") from None
    return adaptive


def _opened_request(request: pb.CreateSessionRequest, sigma: float, seed: int,
                    adaptive: QuantileClipping | None) -> pb.CreateSessionRequest:
    """The request that reopens a session as it is: its sigma and seed fixed, nothing to calibrate,
    adaptive clipping's unset fields filled in."""
    opened = pb.CreateSessionRequest()
    opened.CopyFrom(request)
    opened.dp.noise_multiplier = sigma
    opened.privacy.ClearField("steps")
    opened.privacy.ClearField("epochs")
    opened.seed = seed
    if adaptive is not None:
        opened.adaptive_clipping.CopyFrom(adaptive_clipping_to_proto(adaptive))
    return opened


def restore_session(record: SessionRecord, *, registry: ModelRegistry, config: ServerConfig) -> Session:
    """Reopens a stored session (no parameters: its client pushes them again)."""
    request = pb.CreateSessionRequest.FromString(record.request)
    session = open_session(request, owner=record.owner, registry=registry, config=config,
                           session_id=record.session_id)
    session.resume(record)
    return session


def open_session(request: pb.CreateSessionRequest, *, owner: str, registry: ModelRegistry,
                 config: ServerConfig, session_id: str | None = None) -> Session:
    """Validates a ``CreateSession`` request and builds its (not yet stored) :class:`Session`
    (under a new id, or ``session_id`` when a stored session is reopened)."""
    entry = registry.entry(request.model)
    loss = get_loss(request.loss)
    kwargs = registry.parse_kwargs(request.model, request.model_kwargs_json)
    dp_config = dp_config_from_proto(request.dp)
    wire = wire_dtypes_from_proto(request.wire)
    lora = lora_from_proto(request.lora) if request.HasField("lora") else None
    if not dp_config.batch_first and (entry.batch_first_only or loss.batch_first_only):
        what = f"model {request.model!r}" if entry.batch_first_only else f"loss {loss.name!r}"
        raise InvalidRequestError(f"CreateSession: {what} takes its batch on dimension 0; set batch_first=True")
    if request.expected_batch_size < 1:
        raise InvalidRequestError("CreateSession: expected_batch_size must be >= 1 (samples per step)")
    K = dp_config.augmentation_multiplicity
    if session_id is None and K > config.max_batch_rows:  # (a reopened session keeps what it was opened with)
        raise InvalidRequestError(f"CreateSession: augmentation_multiplicity {K} is above the server's "
                                  f"max_batch_rows={config.max_batch_rows}: a sample's {K} rows travel in one "
                                  "request, so no request could carry a sample")
    dp_config = _calibrated(request, dp_config, config.default_accountant)
    _check_scales(dp_config)
    adaptive = _adaptive_clipping(request, dp_config)
    privacy = _privacy(request, dp_config, config.default_accountant)
    parameters = registry.describe(request.model, kwargs, max_bytes=config.max_model_bytes, lora=lora)
    if not any(p.requires_grad for p in parameters):
        raise InvalidRequestError(f"CreateSession: model {request.model!r} has no trainable parameters")
    trainable = sum(p.requires_grad for p in parameters)
    bounds = dp_config.per_layer_max_grad_norms
    if bounds is not None and len(bounds) != trainable:
        raise InvalidRequestError(f"CreateSession: per_layer_max_grad_norms has {len(bounds)} bounds for "
                                  f"{trainable} trainable parameters")
    session_id = session_id if session_id is not None else secrets.token_urlsafe(16)
    spec = SessionSpec(session_id=session_id, model=request.model,
                       model_kwargs_json=json.dumps(kwargs, sort_keys=True), loss=request.loss,
                       dp_config=dp_config, plugins=registry.plugins, lora=lora, capture=request.capture)
    session = Session(session_id=session_id, owner=owner, spec=spec, parameters=parameters,
                      signature=registry.signature(request.model, kwargs), loss=loss,
                      expected_batch_size=request.expected_batch_size, privacy=privacy,
                      seed=request.seed if request.HasField("seed") else None, secure_rng=request.secure_rng,
                      adaptive_clipping=adaptive)
    session.request = _opened_request(request, dp_config.noise_multiplier, session.seed, adaptive)
    session.wire = wire
    return session


class SessionStore:
    """Open sessions by id, with ownership, idle expiry and a memory cap on parameter sets.

    Args:
        max_sessions: open sessions at most.
        max_sessions_per_owner: open sessions of one owner (principal) at most; None = no quota
            but ``max_sessions``.
        idle_seconds: sessions unused this long are expired by :meth:`expire_idle`.
        parameter_memory_bytes: total bytes of parameter sets kept.
        clock: monotonic seconds (tests substitute their own).
        database: where sessions are kept across restarts; None = in memory only.
    """

    def __init__(self, *, max_sessions: int, idle_seconds: float, parameter_memory_bytes: int,
                 clock: Callable[[], float] = time.monotonic, database: SessionDatabase | None = None,
                 max_sessions_per_owner: int | None = None) -> None:
        self._sessions: dict[str, Session] = {}
        self._max_sessions = max_sessions
        self._max_per_owner = max_sessions_per_owner
        self._idle_seconds = idle_seconds
        self._memory = parameter_memory_bytes
        self._clock = clock
        self._database = database

    @property
    def persistent(self) -> bool:
        """Whether sessions are written to a database (:meth:`persist` does something)."""
        return self._database is not None

    def persist(self, session: Session, *, step_seeds: tuple[int, int] | None = None) -> None:
        """Writes ``session``'s progress (steps, ledger, parameter version, adaptive clipping's
        bound and, given ``step_seeds``, that run of used step seeds) to the database, durably.
        Blocking (an fsync): call it off the event loop."""
        if self._database is not None:
            record = session.record()
            self._database.save_progress(session.id, steps=record.steps, ledger=record.ledger,
                                         epsilon_spent=record.epsilon_spent, param_version=record.param_version,
                                         clip_bound=record.clip_bound, step_seeds=step_seeds)

    def record_step(self, session: Session, update: BoundUpdate | None = None, *,
                    step_seed: int | None = None) -> int:
        """Accounts a step whose result is about to be released: :meth:`Session.record_step`, its
        step seed (``step_seed``, None: its index) marked used when the step drew seeded noise and,
        with a database, all of it written durably before this returns. All or nothing: when the
        write fails, the session is put back as it was and the error raised, so no result goes out
        that the database does not account, and memory never counts a step the database lacks.
        Returns the step's 1-based index. Blocking (the accountant, an fsync): call it off the event
        loop, under the session's lock."""
        seed = session.step_seed_of(step_seed) if session.seeds_noise else None
        before = session._progress() if self._database is not None else None
        step = session.record_step(update)
        if before is not None:
            try:
                self.persist(session, step_seeds=None if seed is None else session.used_step_seeds.run_with(seed))
            except BaseException:
                session._put_back(before)
                raise
        if seed is not None:
            session.used_step_seeds.add(seed)
        return step

    def restore(self, build: Callable[[SessionRecord], Session]) -> int:
        """Reopens the database's sessions with ``build`` (:func:`restore_session`); those idle
        longer than ``idle_seconds`` since their last write are expired instead. Returns how many
        were reopened."""
        if self._database is None:
            return 0
        now, wall = self._clock(), time.time()
        for record in self._database.load():
            idle = max(0.0, wall - record.updated)
            if idle > self._idle_seconds:
                self._database.delete(record.session_id)
                logger.info("sessions: %s expired after %.0f s idle (across a restart)", record.session_id, idle)
                continue
            # One session that cannot be rebuilt (a plugin gone, a model renamed) must not keep the
            # server from starting with the others: it is logged and left in the database.
            try:
                session = build(record)
            except Exception:
                logger.exception("sessions: cannot reopen stored session %s; left in the state directory",
                                 record.session_id)
                continue
            session.last_used = now - idle
            self._sessions[session.id] = session
            logger.info("sessions: reopened %s (%d steps, epsilon %.4g, parameter version %d)", session.id,
                        session.steps, session.epsilon_spent, session.latest_version)
        return len(self._sessions)

    def close(self) -> None:
        """Closes the database (the sessions in memory stay readable)."""
        if self._database is not None:
            self._database.close()
            self._database = None

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: Session) -> None:
        """Stores a new session; :class:`LimitExceededError` when the server is full, or its owner
        holds its quota of sessions already."""
        if len(self._sessions) >= self._max_sessions:
            raise LimitExceededError(f"CreateSession: the server already holds {len(self._sessions)} "
                                     "sessions, its maximum; close one or wait for idle ones to expire")
        if self._max_per_owner is not None:
            held = sum(1 for other in self._sessions.values() if other.owner == session.owner)
            if held >= self._max_per_owner:
                raise LimitExceededError(f"CreateSession: this caller already holds {held} open sessions, "
                                         f"the server's maximum per token (max_sessions_per_token="
                                         f"{self._max_per_owner}); close one or wait for idle ones to expire")
        session.last_used = self._clock()
        if self._database is not None:
            self._database.insert(session.record())
        self._sessions[session.id] = session

    def get(self, session_id: str, owner: str) -> Session:
        """The caller's session; :class:`SessionNotFoundError` for unknown ids and others' sessions."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise SessionNotFoundError(f"no session {session_id[:64]!r} for this caller")
        session.last_used = self._clock()
        return session

    def remove(self, session_id: str, owner: str) -> Session:
        """Closes the caller's session and returns it."""
        session = self.get(session_id, owner)
        if self._database is not None:
            self._database.delete(session_id)
        del self._sessions[session_id]
        return session

    def expire_idle(self) -> list[Session]:
        """Removes and returns the sessions idle longer than ``idle_seconds`` (none mid-step)."""
        cutoff = self._clock() - self._idle_seconds
        expired = [s for s in self._sessions.values() if s.last_used < cutoff and not s.lock.locked()]
        for session in expired:
            if self._database is not None:
                self._database.delete(session.id)
            del self._sessions[session.id]
            logger.info("sessions: %s expired after %.0f s idle", session.id, self._idle_seconds)
        return expired

    def store_parameters(self, session: Session, parameters: ParameterSet, *, rpc: str = "PushParameters") -> None:
        """Makes ``parameters`` the session's current set, dropping other sessions' sets (least
        recently used first) while the total exceeds the memory cap.

        The version is checked here again (:meth:`Session.check_new_version`: above every version
        stored before), with nothing awaited between the check and the store, so two pushes that
        overlap can never move the session's version back nor store two sets under one version.
        Callers hold the session's lock (a push-and-step stores and computes under it).
        """
        session.check_new_version(parameters.version, rpc=rpc)
        size = parameters.num_bytes
        if size > self._memory:
            raise LimitExceededError(f"{rpc}: {size} parameter bytes exceed the server's "
                                     f"parameter memory of {self._memory}")
        session.parameters = None
        held = sum(s.parameters.num_bytes for s in self._sessions.values() if s.parameters is not None)
        victims = sorted((s for s in self._sessions.values() if s.parameters is not None),
                         key=lambda s: s.last_used)
        for victim in victims:
            if held + size <= self._memory:
                break
            held -= victim.parameters.num_bytes  # type: ignore[union-attr]
            victim.parameters = None
            logger.warning("sessions: dropped the parameters of %s to stay within %d bytes", victim.id,
                           self._memory)
        session.parameters = parameters
        session.latest_version = parameters.version
