"""One DP step on the frontend (README.md, "The gradient service": "One step").

validate -> split the N samples (K rows together) into shards -> executor -> merge in shard order
-> noise once (seeded per step) -> normalise by the expected batch size -> account -> persist the
session's progress (with ``--state-dir``, before the reply: no accounted step is lost) -> reply.
A logical batch sent in parts (:mod:`psg_server.accumulation`) runs everything up to the merge per
part, and the rest once, on the last part.
With adaptive clipping (:attr:`Session.adaptive_clipping <psg_server.sessions.Session>`), every
shard (every part) is clipped at the session's current bound, and after the gradient's noise the
same generator noises the count of unclipped samples of the whole logical batch, which moves the
bound; the step is accounted once, the bound persisted with it.
The privacy part (budget check, noise, normalisation, accounting) is
:class:`psg_core.privacy_step.PrivacyStep`, the one :class:`psg_core.DPStep` runs in process.
The result equals :func:`psg_core.dp.dp_gradient` on the whole batch, noised and normalised,
for any number of shards (up to floating point summation order).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from psg_core.backends.base import check_rows
from psg_core.config import DPGradient
from psg_core.errors import BatchLayoutError, NonFiniteInputError
from psg_server.accumulation import check_part, take_part
from psg_server.config import ServerConfig
from psg_server.errors import InvalidRequestError, LimitExceededError, StepTimeoutError
from psg_server.executor import ShardExecutor, ShardResult
from psg_server.losses import prepare_targets
from psg_server.metrics import Metrics
from psg_server.models import InputSpec
from psg_server.scheduler import cut_shards, plan_shards
from psg_server.sessions import BoundUpdate, Session, SessionStore
from psg_server.streams import (all_finite, check_push_version, parameter_check, parameter_set, read_header,
                                read_tensors, tensor_messages)
from psg_wire.codec import CodecLimits, HeaderCheck, TensorDecoder
from psg_wire.convert import StepReport, step_stats_to_proto
from psg_wire.flat import FlatTensors
from psg_wire.names import TARGETS, input_name, parse_input_name, parse_parameter_name
from psg_wire.v1 import gradient_service_pb2 as pb

__all__ = ["NORM_QUANTILES", "Batch", "StepRunner", "merge_results", "reply_tensors", "validate_batch"]

#: Quantiles of the per-sample norms reported with every step.
NORM_QUANTILES = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)


@dataclass(frozen=True)
class Batch:
    """A validated batch: the model's inputs and the targets, N * K rows on the batch dimension.

    ``inputs`` are the positional inputs followed by the keyword ones, whose names ``keywords``
    gives in order (the last ``len(keywords)`` inputs), as :class:`~psg_server.executor.Shard` holds them.
    """

    inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor
    num_samples: int
    keywords: tuple[str, ...] = ()


def _batch_check(session: Session, max_rows: int) -> HeaderCheck:
    """Header check of a batch tensor, run before its bytes are allocated or received: its name, its
    rows against the server's limit and, where the model states its inputs, the input's dtype kind
    and per-row shape (an input that cannot fit is refused at its header, not after its bytes)."""
    batch_dim = 0 if session.dp_config.batch_first else 1
    signature = session.signature

    def check(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        key = parse_input_name(name)
        if name != TARGETS and key is None:
            raise InvalidRequestError(f"ComputeGradients: unexpected tensor {name[:80]!r}; send the inputs as "
                                      f"'{input_name(0)}', '{input_name(1)}', ... (positional) or "
                                      f"'{input_name('<name>')}' (keyword, e.g. '{input_name('input_ids')}'), "
                                      f"and '{TARGETS}'")
        dim = batch_dim  # targets follow the inputs' layout
        if len(shape) > dim and shape[dim] > max_rows:
            raise LimitExceededError(f"ComputeGradients: {name!r} has {shape[dim]} rows, more than the "
                                     f"server's max_batch_rows={max_rows}")
        if key is None or signature is None:
            return
        model = session.spec.model
        named = ", ".join(input_name(k) for k in signature.keyword_inputs)
        if isinstance(key, int) and key >= len(signature.inputs):
            hint = f"; it takes keyword inputs {named}" if named and not signature.inputs else ""
            raise InvalidRequestError(f"ComputeGradients: model {model!r} takes {len(signature.inputs)} "
                                      f"input(s), got {name!r}{hint}")
        if isinstance(key, str) and key not in signature.keyword_inputs:
            raise InvalidRequestError(f"ComputeGradients: model {model!r} has no keyword input(s) {[name]}; "
                                      f"it takes {named or 'positional inputs only'}")
        if len(shape) > batch_dim:  # a tensor without the batch dimension is validate_batch's to refuse
            spec = signature.inputs[key] if isinstance(key, int) else signature.keyword_inputs[key]
            _check_input(key, dtype, shape, spec, batch_dim=batch_dim)
    return check


def _header_check(session: Session, max_rows: int, *, pushing: bool) -> HeaderCheck:
    """The batch's header check, plus :func:`~psg_server.streams.parameter_check` for the
    ``parameters/<name>`` tensors of a request that pushes (``push_version``)."""
    batch = _batch_check(session, max_rows)
    parameters = parameter_check(session, rpc="ComputeGradients") if pushing else None

    def check(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        parameter = parse_parameter_name(name)
        if parameter is None:
            batch(name, dtype, shape)
        elif parameters is None:
            raise InvalidRequestError(f"ComputeGradients: {name[:80]!r} is a parameter, but the header sets no "
                                      "push_version")
        else:
            parameters(parameter, dtype, shape)
    return check


def _fits(dim: int, spec: int | tuple[int, int]) -> bool:
    return dim == spec if isinstance(spec, int) else spec[0] <= dim <= spec[1]


def _check_input(key: int | str, dtype: torch.dtype, shape: tuple[int, ...], spec: InputSpec, *,
                 batch_dim: int) -> None:
    """What a tensor's header says against the input's spec: per-row shape and dtype kind."""
    where = f"ComputeGradients: {input_name(key)}"
    per_row = tuple(d for i, d in enumerate(shape) if i != batch_dim)
    if len(per_row) != len(spec.sample_shape) or not all(map(_fits, per_row, spec.sample_shape)):
        wanted = ["rows"] + [d if isinstance(d, int) else f"{d[0]}..{d[1]}" for d in spec.sample_shape]
        raise InvalidRequestError(f"{where} has shape {list(shape)}, which does not fit the "
                                  f"model: expected {wanted}")
    if spec.kind == "index" and (dtype.is_floating_point or dtype == torch.bool):
        raise InvalidRequestError(f"{where} must hold integer indices, got {dtype}")
    if spec.kind == "float" and not dtype.is_floating_point:
        raise InvalidRequestError(f"{where} must be floating point, got {dtype}")


def _prepare_input(key: int | str, tensor: torch.Tensor, spec: InputSpec | None, *, batch_dim: int,
                   dtype: torch.dtype) -> torch.Tensor:
    where = f"ComputeGradients: {input_name(key)}"
    if spec is not None:
        _check_input(key, tensor.dtype, tuple(tensor.shape), spec, batch_dim=batch_dim)
        if spec.kind == "mask":
            if tensor.numel() and not bool(((tensor == 0) | (tensor == 1)).all()):
                raise InvalidRequestError(f"{where} must be a mask of 0 and 1")
            return tensor.to(torch.int64)
        if spec.kind == "index":
            tensor = tensor.to(torch.int64)
            if spec.num_embeddings is None or not tensor.numel():  # an empty (Poisson) batch holds no index
                return tensor
            low, high = int(tensor.min()), int(tensor.max())
            if low < 0 or high >= spec.num_embeddings:
                raise InvalidRequestError(f"{where} holds indices in [{low}, {high}], outside "
                                          f"[0, {spec.num_embeddings})")
            return tensor
        tensor = tensor.to(dtype)
    if not all_finite(tensor):
        raise NonFiniteInputError(f"{where} contains NaN or infinity")
    return tensor


def _input_keys(session: Session, tensors: Mapping[str, torch.Tensor]) -> tuple[int, tuple[str, ...]]:
    """The number of positional inputs and the keywords (sorted) of a batch, checked against the
    model's signature: positions 0..n-1 all there, no unknown keyword, every required one sent."""
    keys = [parse_input_name(name) for name in tensors if name != TARGETS]
    positions = sorted(key for key in keys if isinstance(key, int))
    keywords = tuple(sorted(key for key in keys if isinstance(key, str)))
    expected = [input_name(i) for i in range(len(positions))]
    if not keys or positions != list(range(len(positions))):
        raise InvalidRequestError(f"ComputeGradients: positional inputs must be named {expected or [input_name(0)]}"
                                  f"{'' if keys else ' (or keyword ones inputs/<name>)'}, got "
                                  f"{[input_name(p) for p in positions]}")
    signature = session.signature
    if signature is None:
        return len(positions), keywords
    model = session.spec.model
    known = signature.keyword_inputs
    named = ", ".join(input_name(k) for k in known)
    if len(positions) != len(signature.inputs):
        hint = f"; it takes keyword inputs {named}" if known and not signature.inputs else ""
        raise InvalidRequestError(f"ComputeGradients: model {model!r} takes {len(signature.inputs)} input(s), "
                                  f"got {len(positions)}{hint}")
    unknown = [input_name(k) for k in keywords if k not in known]
    if unknown:
        raise InvalidRequestError(f"ComputeGradients: model {model!r} has no keyword input(s) {unknown}; "
                                  f"it takes {named or 'positional inputs only'}")
    missing = [input_name(k) for k, spec in known.items() if spec.required and k not in keywords]
    if missing:
        raise InvalidRequestError(f"ComputeGradients: the batch lacks the required input(s) {missing} of "
                                  f"model {model!r}")
    return len(positions), keywords


def validate_batch(session: Session, tensors: Mapping[str, torch.Tensor]) -> Batch:
    """Checks a decoded batch against the session (names, layout, K, model signature, loss targets).

    Inputs travel as ``inputs/<i>`` (positional) and ``inputs/<name>`` (keyword); every one of
    them, and the targets, has the batch's N * K rows on the batch dimension.
    """
    config = session.dp_config
    batch_dim = 0 if config.batch_first else 1
    if TARGETS not in tensors:
        raise InvalidRequestError(f"ComputeGradients: the batch has no {TARGETS!r} tensor")
    num_positional, keywords = _input_keys(session, tensors)
    keys: list[int | str] = [*range(num_positional), *keywords]
    names = [input_name(key) for key in keys]
    rows = {name: (tensors[name].shape[batch_dim] if tensors[name].dim() > batch_dim else None)
            for name in names}
    if None in rows.values() or len(set(rows.values())) != 1:
        raise BatchLayoutError(f"ComputeGradients: every input needs the same number of rows on dimension "
                               f"{batch_dim}; got shapes { {n: list(tensors[n].shape) for n in names} }")
    # Zero rows is legal: Poisson sampling draws empty batches, which still get noise and a step.
    num_rows = int(next(iter(rows.values())))  # type: ignore[arg-type]
    num_samples = check_rows(num_rows, config.augmentation_multiplicity, where="ComputeGradients")
    dtype = next(p.dtype for p in session.parameter_info if p.dtype.is_floating_point)
    signature = session.signature
    specs: list[InputSpec | None] = [None] * len(keys)
    if signature is not None:
        specs = [signature.inputs[key] if isinstance(key, int) else signature.keyword_inputs[key] for key in keys]
    inputs = tuple(_prepare_input(key, tensors[name], spec, batch_dim=batch_dim, dtype=dtype)
                   for key, name, spec in zip(keys, names, specs))
    for key, spec in zip(keys, specs):
        other = spec.same_shape_as if spec is not None else None
        if other is None or other not in keywords:
            continue
        shape, wanted = tensors[input_name(key)].shape, tensors[input_name(other)].shape
        if shape != wanted:
            raise InvalidRequestError(f"ComputeGradients: {input_name(key)} must have the shape of "
                                      f"{input_name(other)}, {list(wanted)}; got {list(shape)}")
    like = None
    if signature is not None and signature.targets_like in keywords:
        like = (input_name(signature.targets_like), tensors[input_name(signature.targets_like)].shape)
    targets = prepare_targets(session.loss, tensors[TARGETS], rows=num_rows,
                              num_outputs=signature.num_outputs if signature else None, dtype=dtype,
                              batch_dim=batch_dim, like=like)
    return Batch(inputs=inputs, targets=targets, num_samples=num_samples, keywords=keywords)


class StepRunner:
    """Runs ComputeGradients: receive, validate, shard, merge, noise, normalise, account, reply."""

    def __init__(self, *, config: ServerConfig, store: SessionStore, executor: ShardExecutor,
                 metrics: Metrics) -> None:
        self._config = config
        self._store = store
        self._executor = executor
        self._metrics = metrics
        self._limits = CodecLimits(max_tensor_bytes=config.max_tensor_bytes,
                                   max_total_bytes=config.max_request_bytes, max_tensors=64,
                                   max_chunk_bytes=config.max_chunk_bytes)

    async def compute(self, requests: AsyncIterator[pb.ComputeGradientsRequest], *, owner: str,
                      time_remaining: Callable[[], float | None],
                      ) -> AsyncIterator[pb.ComputeGradientsResponse]:
        """The whole RPC: consumes the request stream, yields the reply stream.

        ``time_remaining`` gives the seconds left before the client's deadline (None: no deadline).
        """
        started = time.perf_counter()
        metrics = self._metrics
        with metrics.phase("receive"):
            header = await read_header(requests, rpc="ComputeGradients")
            session = self._store.get(header.session_id, owner)
            # Fail before the batch is uploaded; each check is made again under the session's lock.
            pushing = _check_version(session, header)
            reply_chunk_bytes = self._reply_chunk_bytes(session, header)
            check_part(session.pending, part=header.part, param_version=header.param_version, session_id=session.id)
            step_seed = header.step_seed if header.HasField("step_seed") else None
            releases = not header.more_parts  # the request whose step draws noise (the last part)
            if releases:
                session.check_step_seed(step_seed)
            limits = self._limits
            if pushing:  # the parameters travel too: room for every one of them
                limits = dataclasses.replace(limits, max_tensors=limits.max_tensors + len(session.parameter_info))
            decoder = TensorDecoder(limits, check_header=_header_check(session, self._config.max_batch_rows,
                                                                       pushing=pushing),
                                    pin_memory=self._executor.pinned_inputs)
            tensors = await read_tensors(requests, decoder, header)
        # Under the lock, the checks made when the header came are made again (another request may
        # have pushed, stepped or sent a part meanwhile), atomically with what they guard: storing
        # the pushed set, computing at a version, adding a part, releasing under a step seed.
        async with session.lock:
            with metrics.phase("validate"):
                if pushing:  # stored as PushParameters would, then the step runs at that version
                    pushed = {parameter: tensors.pop(name) for name, parameter in
                              [(name, parse_parameter_name(name)) for name in list(tensors)] if parameter is not None}
                    self._store.store_parameters(session, parameter_set(session, header.push_version, pushed,
                                                                        rpc="ComputeGradients"),
                                                 rpc="ComputeGradients")
                batch = validate_batch(session, tensors)
                parameters = session.parameters_for(header.param_version)
                check_part(session.pending, part=header.part, param_version=header.param_version,
                           session_id=session.id)
                if releases:
                    session.check_step_seed(step_seed)
                # Refuse before computing, not after. Accounting (here and below) can take a good
                # fraction of a second under PLD, so it runs on a thread, off the event loop.
                if header.part == 0 or not header.more_parts:
                    await _account(session, session.check_budget)
            with metrics.phase("compute"):
                plan = plan_shards(batch.num_samples, self._executor.throughputs(),
                                   max_shard_samples=self._config.max_shard_samples)
                config = session.dp_config
                shards = cut_shards(batch.inputs, batch.targets, plan,
                                    augmentation_multiplicity=config.augmentation_multiplicity,
                                    batch_first=config.batch_first)
                if batch.keywords:
                    shards = [dataclasses.replace(shard, keywords=batch.keywords) for shard in shards]
                if session.adaptive_clipping is not None:  # the spec keeps the bound the session opened with
                    shards = [dataclasses.replace(shard, max_grad_norm=session.clip_bound) for shard in shards]
                remaining = time_remaining()
                timeout = self._config.step_timeout_seconds if remaining is None else \
                    min(self._config.step_timeout_seconds, remaining)
                try:
                    async with asyncio.timeout(timeout):  # no extra task, unlike wait_for
                        results = await self._executor.run(session.spec, parameters, shards)
                except TimeoutError:
                    raise StepTimeoutError(f"ComputeGradients: the step took longer than {timeout:.3g} s; "
                                           "its shards were cancelled") from None
                metrics.observe_workers(results)
                merged = merge_results(results)
                session.pending, total = take_part(session.pending, merged, part=header.part,
                                                   more_parts=header.more_parts, param_version=parameters.version,
                                                   session_id=session.id)
            if total is not None:
                with metrics.phase("noise"):
                    grads, update = self._release(session, total, step_seed)
                    reply = reply_tensors(grads, dtype=session.wire.gradients)
                with metrics.phase("account"):
                    # Accounted and (with --state-dir) written durably before the result goes out,
                    # all or nothing: no released step is lost, none counted that was not released.
                    record = functools.partial(self._store.record_step, session, update, step_seed=step_seed)
                    step = await (_off_loop(record) if self._store.persistent else _account(session, record))
        metrics.samples.inc(merged.num_samples)
        if total is None:  # a part of a logical batch: its statistics, nothing released
            yield pb.ComputeGradientsResponse(stats=_stats(session, merged, step=0, version=parameters.version,
                                                           seconds=time.perf_counter() - started, pending=True))
            return
        stats = _stats(session, total, step=step, version=parameters.version,
                       seconds=time.perf_counter() - started, update=update)
        with metrics.phase("send"):
            if isinstance(reply, FlatTensors) and not header.grouped_reply:
                reply = reply.views()  # a client that reads no groups: one header per tensor
            named = reply.items() if isinstance(reply, dict) else reply
            lead = None
            if header.grouped_reply:  # the stats and the gradients' first group in one message
                lead = ("result", pb.StepResult(stats=stats), "gradients")
            else:
                yield pb.ComputeGradientsResponse(stats=stats)
            for message in tensor_messages(pb.ComputeGradientsResponse, named, chunk_bytes=reply_chunk_bytes,
                                           group=header.grouped_reply, lead=lead):
                yield message

    def _reply_chunk_bytes(self, session: Session, header: pb.ComputeGradientsHeader) -> int:
        """The reply's chunk size: the server's, or with ``single_message_reply`` one chunk for all
        the gradients, refused before the step when that message would pass the message limit."""
        if not header.single_message_reply:
            return self._config.chunk_bytes
        if not header.grouped_reply:
            raise InvalidRequestError("ComputeGradients: single_message_reply needs grouped_reply (the gradients "
                                      "travel as one group inside the StepResult)")
        wire_dtype = session.wire.gradients
        payload = sum(math.prod(info.shape) * (wire_dtype or info.dtype).itemsize
                      for info in session.parameter_info if info.requires_grad)
        # The group's tensor headers, the alignment between its tensors and the stats take a few
        # hundred bytes per tensor at most.
        framing = 512 * (1 + sum(1 for info in session.parameter_info if info.requires_grad))
        limit = self._config.max_chunk_bytes
        if payload + framing > limit:
            raise InvalidRequestError(
                f"ComputeGradients: single_message_reply: the gradients ({payload:,} bytes) do not fit in one "
                f"message under the server's limit ({limit:,} bytes of payload); read the reply as a stream")
        return limit

    @staticmethod
    def _release(session: Session, merged: DPGradient,
                 step_seed: int | None) -> tuple[dict[str, torch.Tensor], BoundUpdate | None]:
        """What a step releases from the merged clipped sum of its logical batch: the gradient,
        noised once (seeded per step) and normalised, and with adaptive clipping the bound's update,
        its count noised by the same generator after the gradient (as :class:`psg_core.DPStep` does)."""
        generator = None
        if session.draws_noise and not session.secure_rng:
            # On the device that holds the sum (a GPU's generator draws other values than the CPU's).
            device = next(iter(merged.grads.values())).device if merged.grads else torch.device("cpu")
            generator = torch.Generator(device=device).manual_seed(session.noise_seed(step_seed))
        grads = session.noise_step.noise_and_normalise(merged.grads, generator=generator,
                                                       secure_rng=session.secure_rng)
        update = None
        if session.adaptive_clipping is not None:
            update = session.adapt_bound(merged.per_sample_norms, generator=generator)
        return grads, update

    @staticmethod
    def _noise_and_normalise(session: Session, merged: DPGradient,
                             step_seed: int | None) -> dict[str, torch.Tensor]:
        """The released gradient of :meth:`_release`."""
        return StepRunner._release(session, merged, step_seed)[0]


def _check_version(session: Session, header: pb.ComputeGradientsHeader) -> bool:
    """Whether the request pushes parameters (``push_version``); refuses, before the batch is
    uploaded, a push that is stale or misplaced, or a step at a version the session does not hold."""
    if not header.push_version:
        session.parameters_for(header.param_version)
        return False
    if header.param_version != header.push_version:
        raise InvalidRequestError(f"ComputeGradients: a request that pushes version {header.push_version} must "
                                  f"compute at it; param_version is {header.param_version}")
    if header.part != 0:
        raise InvalidRequestError("ComputeGradients: only part 0 of a logical batch may push parameters")
    check_push_version(session, header.push_version, rpc="ComputeGradients")
    return True


def merge_results(results: Sequence[DPGradient]) -> DPGradient:
    """The shard results summed in shard order (the step's clipped sum): in place, into the first
    result's flat buffer, when every result is a :class:`ShardResult` over the same layout (one
    addition over each buffer), otherwise as :meth:`DPGradient.merge` does. A single result is the
    sum itself."""
    if len(results) == 1:
        return results[0]
    flats = [result.flat if isinstance(result, ShardResult) else None for result in results]
    first = flats[0]
    if first is None or any(flat is None or flat.layout != first.layout for flat in flats):
        return DPGradient.merge(list(results))
    for flat in flats[1:]:
        first.add_(flat)  # type: ignore[arg-type]
    return DPGradient(grads=first.views(), per_sample_norms=torch.cat([r.per_sample_norms for r in results]),
                      loss_sum=float(sum(r.loss_sum for r in results)), num_samples=sum(r.num_samples for r in results),
                      num_clipped=sum(r.num_clipped for r in results), num_dropped=sum(r.num_dropped for r in results))


def reply_tensors(grads: dict[str, torch.Tensor], *, dtype: torch.dtype | None
                  ) -> dict[str, torch.Tensor] | FlatTensors:
    """What the reply encodes: host gradients as they are (the encoder copies them once into the
    messages), gradients on a GPU as one flat buffer copied to the host at once; with a wire
    ``dtype`` (bf16), one flat buffer cast to it (on the device, before the copy)."""
    if dtype is None and all(t.device.type == "cpu" for t in grads.values()):
        return grads
    return FlatTensors.pack(grads, dtype=dtype).to("cpu")


async def _account(session: Session, function: Callable[[], Any]) -> Any:
    """``function()`` (a budget check or a step record) off the event loop when the session has an
    accountant to consult; inline when it has none, so nothing would block the loop."""
    return await _off_loop(function) if session.accounted else function()


async def _off_loop(function: Callable[[], Any]) -> Any:
    """``function()`` on a worker thread. If the caller is cancelled meanwhile, the call still
    finishes before the cancellation goes on, so the session lock covers the accountant's update."""
    future = asyncio.get_running_loop().run_in_executor(None, function)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


def _stats(session: Session, merged: DPGradient, *, step: int, version: int,
           seconds: float, pending: bool = False, update: BoundUpdate | None = None) -> pb.StepStats:
    norms = merged.per_sample_norms.detach().to(torch.float64).cpu()  # (N,)
    # A dropped sample's norm is NaN or infinite (its gradient was not finite): the quantiles are
    # those of the kept samples, as the sum and the loss are.
    if merged.num_dropped:
        norms = norms[torch.isfinite(norms)]  # (N - dropped,)
    # An empty (Poisson) batch has no norms: report no quantiles rather than invent some.
    values = _quantiles(norms) if norms.numel() else []
    kept = merged.num_samples - merged.num_dropped
    # Adaptive clipping: the bound the samples were clipped at (a pending part's: the current one).
    bound = update.bound if update is not None else \
        session.clip_bound if session.adaptive_clipping is not None else None
    return step_stats_to_proto(StepReport(
        step=step, param_version=version, samples=merged.num_samples,
        mean_loss=merged.loss_sum / kept if kept else 0.0, norm_quantiles=dict(zip(NORM_QUANTILES, values)),
        fraction_clipped=merged.num_clipped / max(merged.num_samples, 1), epsilon_spent=session.epsilon_spent,
        budget_left=session.budget_left, server_seconds=seconds, pending=pending, num_dropped=merged.num_dropped,
        clip_bound=bound, next_clip_bound=None if update is None else update.next_bound,
        unclipped_fraction=None if update is None else update.unclipped_fraction))



def _quantiles(norms: torch.Tensor) -> list[float]:
    """:data:`NORM_QUANTILES` of ``norms`` (float64, non-empty), interpolated linearly between order
    statistics as ``torch.quantile`` does; in Python for a small batch, where torch's dispatch
    costs more than the sort."""
    if norms.numel() > 4096:
        return torch.quantile(norms, torch.tensor(NORM_QUANTILES, dtype=torch.float64)).tolist()
    ordered = sorted(norms.tolist())
    last = len(ordered) - 1
    values = []
    for level in NORM_QUANTILES:
        position = level * last
        low = int(position)
        high = min(low + 1, last)
        values.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return values
