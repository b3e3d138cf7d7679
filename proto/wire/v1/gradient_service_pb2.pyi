from psg_wire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("id", "device", "node")
    ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    device: str
    node: str
    def __init__(self, id: _Optional[str] = ..., device: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_batch_rows", "max_message_bytes", "max_tensor_bytes", "max_request_bytes", "chunk_bytes", "max_model_bytes", "max_chunk_bytes")
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_batch_rows: int
    max_message_bytes: int
    max_tensor_bytes: int
    max_request_bytes: int
    chunk_bytes: int
    max_model_bytes: int
    max_chunk_bytes: int
    def __init__(self, max_batch_rows: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_tensor_bytes: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_model_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "backends", "workers", "limits", "losses", "default_accountant")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    version: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    limits: Limits
    losses: _containers.RepeatedScalarFieldContainer[str]
    default_accountant: str
    def __init__(self, version: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., losses: _Optional[_Iterable[str]] = ..., default_accountant: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelArgument(_message.Message):
    __slots__ = ("name", "type", "default_json", "required")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    default_json: str
    required: bool
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., default_json: _Optional[str] = ..., required: _Optional[bool] = ...) -> None: ...

class DimRange(_message.Message):
    __slots__ = ("min", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: int
    max: int
    def __init__(self, min: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class InputSignature(_message.Message):
    __slots__ = ("name", "kind", "row_shape", "num_embeddings", "required", "same_shape_as")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROW_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SAME_SHAPE_AS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    row_shape: _containers.RepeatedCompositeFieldContainer[DimRange]
    num_embeddings: int
    required: bool
    same_shape_as: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., row_shape: _Optional[_Iterable[_Union[DimRange, _Mapping]]] = ..., num_embeddings: _Optional[int] = ..., required: _Optional[bool] = ..., same_shape_as: _Optional[str] = ...) -> None: ...

class ModelSignatureInfo(_message.Message):
    __slots__ = ("inputs", "num_outputs", "targets_like")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_LIKE_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[InputSignature]
    num_outputs: int
    targets_like: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[InputSignature, _Mapping]]] = ..., num_outputs: _Optional[int] = ..., targets_like: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "description", "arguments", "origin", "parameters", "signature")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    arguments: _containers.RepeatedCompositeFieldContainer[ModelArgument]
    origin: str
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    signature: ModelSignatureInfo
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., arguments: _Optional[_Iterable[_Union[ModelArgument, _Mapping]]] = ..., origin: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., signature: _Optional[_Union[ModelSignatureInfo, _Mapping]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class DPSettings(_message.Message):
    __slots__ = ("mode", "augmentation_multiplicity", "loss_reduction", "batch_first", "max_grad_norm", "clipping", "noise_multiplier", "per_layer_max_grad_norms")
    MODE_FIELD_NUMBER: _ClassVar[int]
    AUGMENTATION_MULTIPLICITY_FIELD_NUMBER: _ClassVar[int]
    LOSS_REDUCTION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIRST_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    CLIPPING_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    PER_LAYER_MAX_GRAD_NORMS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    augmentation_multiplicity: int
    loss_reduction: str
    batch_first: bool
    max_grad_norm: float
    clipping: str
    noise_multiplier: float
    per_layer_max_grad_norms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, mode: _Optional[str] = ..., augmentation_multiplicity: _Optional[int] = ..., loss_reduction: _Optional[str] = ..., batch_first: _Optional[bool] = ..., max_grad_norm: _Optional[float] = ..., clipping: _Optional[str] = ..., noise_multiplier: _Optional[float] = ..., per_layer_max_grad_norms: _Optional[_Iterable[float]] = ...) -> None: ...

class PrivacySettings(_message.Message):
    __slots__ = ("accountant", "sample_rate", "delta", "target_epsilon", "steps", "epochs")
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TARGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    accountant: str
    sample_rate: float
    delta: float
    target_epsilon: float
    steps: int
    epochs: float
    def __init__(self, accountant: _Optional[str] = ..., sample_rate: _Optional[float] = ..., delta: _Optional[float] = ..., target_epsilon: _Optional[float] = ..., steps: _Optional[int] = ..., epochs: _Optional[float] = ...) -> None: ...

class LoraSettings(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("model", "model_kwargs_json", "loss", "dp", "expected_batch_size", "privacy", "seed", "secure_rng", "lora", "wire", "adaptive_clipping", "capture")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SECURE_RNG_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_CLIPPING_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_kwargs_json: str
    loss: str
    dp: DPSettings
    expected_batch_size: int
    privacy: PrivacySettings
    seed: int
    secure_rng: bool
    lora: LoraSettings
    wire: WireSettings
    adaptive_clipping: AdaptiveClippingSettings
    capture: bool
    def __init__(self, model: _Optional[str] = ..., model_kwargs_json: _Optional[str] = ..., loss: _Optional[str] = ..., dp: _Optional[_Union[DPSettings, _Mapping]] = ..., expected_batch_size: _Optional[int] = ..., privacy: _Optional[_Union[PrivacySettings, _Mapping]] = ..., seed: _Optional[int] = ..., secure_rng: _Optional[bool] = ..., lora: _Optional[_Union[LoraSettings, _Mapping]] = ..., wire: _Optional[_Union[WireSettings, _Mapping]] = ..., adaptive_clipping: _Optional[_Union[AdaptiveClippingSettings, _Mapping]] = ..., capture: _Optional[bool] = ...) -> None: ...

class AdaptiveClippingSettings(_message.Message):
    __slots__ = ("target_quantile", "learning_rate", "count_noise_multiplier")
    TARGET_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    COUNT_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    target_quantile: float
    learning_rate: float
    count_noise_multiplier: float
    def __init__(self, target_quantile: _Optional[float] = ..., learning_rate: _Optional[float] = ..., count_noise_multiplier: _Optional[float] = ...) -> None: ...

class WireSettings(_message.Message):
    __slots__ = ("parameters_dtype", "gradients_dtype")
    PARAMETERS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    parameters_dtype: str
    gradients_dtype: str
    def __init__(self, parameters_dtype: _Optional[str] = ..., gradients_dtype: _Optional[str] = ...) -> None: ...

class ParameterSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "requires_grad")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    requires_grad: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., requires_grad: _Optional[bool] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "parameters", "noise_multiplier", "signature")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    noise_multiplier: float
    signature: ModelSignatureInfo
    def __init__(self, session_id: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., noise_multiplier: _Optional[float] = ..., signature: _Optional[_Union[ModelSignatureInfo, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "model", "steps", "param_version", "epsilon_spent", "budget_left", "delta", "parameters", "frozen_version", "dp", "latest_param_version", "wire", "adaptive_clipping", "clip_bound", "capture")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_LEFT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    FROZEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    LATEST_PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_CLIPPING_FIELD_NUMBER: _ClassVar[int]
    CLIP_BOUND_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    steps: int
    param_version: int
    epsilon_spent: float
    budget_left: float
    delta: float
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    frozen_version: int
    dp: DPSettings
    latest_param_version: int
    wire: WireSettings
    adaptive_clipping: AdaptiveClippingSettings
    clip_bound: float
    capture: bool
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., steps: _Optional[int] = ..., param_version: _Optional[int] = ..., epsilon_spent: _Optional[float] = ..., budget_left: _Optional[float] = ..., delta: _Optional[float] = ..., parameters: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., frozen_version: _Optional[int] = ..., dp: _Optional[_Union[DPSettings, _Mapping]] = ..., latest_param_version: _Optional[int] = ..., wire: _Optional[_Union[WireSettings, _Mapping]] = ..., adaptive_clipping: _Optional[_Union[AdaptiveClippingSettings, _Mapping]] = ..., clip_bound: _Optional[float] = ..., capture: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushParametersHeader(_message.Message):
    __slots__ = ("session_id", "version", "group")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: int
    group: _tensor_pb2.TensorGroup
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[int] = ..., group: _Optional[_Union[_tensor_pb2.TensorGroup, _Mapping]] = ...) -> None: ...

class PushParametersRequest(_message.Message):
    __slots__ = ("header", "tensor", "chunk", "group")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    header: PushParametersHeader
    tensor: _tensor_pb2.TensorHeader
    chunk: bytes
    group: _tensor_pb2.TensorGroup
    def __init__(self, header: _Optional[_Union[PushParametersHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., group: _Optional[_Union[_tensor_pb2.TensorGroup, _Mapping]] = ...) -> None: ...

class PushParametersResponse(_message.Message):
    __slots__ = ("version", "num_bytes", "frozen_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FROZEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_bytes: int
    frozen_version: int
    def __init__(self, version: _Optional[int] = ..., num_bytes: _Optional[int] = ..., frozen_version: _Optional[int] = ...) -> None: ...

class ComputeGradientsHeader(_message.Message):
    __slots__ = ("session_id", "param_version", "step_seed", "part", "more_parts", "grouped_reply", "push_version", "group", "single_message_reply")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_SEED_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    MORE_PARTS_FIELD_NUMBER: _ClassVar[int]
    GROUPED_REPLY_FIELD_NUMBER: _ClassVar[int]
    PUSH_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SINGLE_MESSAGE_REPLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    param_version: int
    step_seed: int
    part: int
    more_parts: bool
    grouped_reply: bool
    push_version: int
    group: _tensor_pb2.TensorGroup
    single_message_reply: bool
    def __init__(self, session_id: _Optional[str] = ..., param_version: _Optional[int] = ..., step_seed: _Optional[int] = ..., part: _Optional[int] = ..., more_parts: _Optional[bool] = ..., grouped_reply: _Optional[bool] = ..., push_version: _Optional[int] = ..., group: _Optional[_Union[_tensor_pb2.TensorGroup, _Mapping]] = ..., single_message_reply: _Optional[bool] = ...) -> None: ...

class ComputeGradientsRequest(_message.Message):
    __slots__ = ("header", "tensor", "chunk", "group")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    header: ComputeGradientsHeader
    tensor: _tensor_pb2.TensorHeader
    chunk: bytes
    group: _tensor_pb2.TensorGroup
    def __init__(self, header: _Optional[_Union[ComputeGradientsHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., group: _Optional[_Union[_tensor_pb2.TensorGroup, _Mapping]] = ...) -> None: ...

class NormQuantile(_message.Message):
    __slots__ = ("quantile", "value")
    QUANTILE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    quantile: float
    value: float
    def __init__(self, quantile: _Optional[float] = ..., value: _Optional[float] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step", "param_version", "samples", "mean_loss", "norm_quantiles", "fraction_clipped", "epsilon_spent", "budget_left", "server_seconds", "pending", "num_dropped", "clip_bound", "next_clip_bound", "unclipped_fraction")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    NORM_QUANTILES_FIELD_NUMBER: _ClassVar[int]
    FRACTION_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_LEFT_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CLIP_BOUND_FIELD_NUMBER: _ClassVar[int]
    NEXT_CLIP_BOUND_FIELD_NUMBER: _ClassVar[int]
    UNCLIPPED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    step: int
    param_version: int
    samples: int
    mean_loss: float
    norm_quantiles: _containers.RepeatedCompositeFieldContainer[NormQuantile]
    fraction_clipped: float
    epsilon_spent: float
    budget_left: float
    server_seconds: float
    pending: bool
    num_dropped: int
    clip_bound: float
    next_clip_bound: float
    unclipped_fraction: float
    def __init__(self, step: _Optional[int] = ..., param_version: _Optional[int] = ..., samples: _Optional[int] = ..., mean_loss: _Optional[float] = ..., norm_quantiles: _Optional[_Iterable[_Union[NormQuantile, _Mapping]]] = ..., fraction_clipped: _Optional[float] = ..., epsilon_spent: _Optional[float] = ..., budget_left: _Optional[float] = ..., server_seconds: _Optional[float] = ..., pending: _Optional[bool] = ..., num_dropped: _Optional[int] = ..., clip_bound: _Optional[float] = ..., next_clip_bound: _Optional[float] = ..., unclipped_fraction: _Optional[float] = ...) -> None: ...

class ComputeGradientsResponse(_message.Message):
    __slots__ = ("stats", "tensor", "chunk", "group", "result")
    STATS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    stats: StepStats
    tensor: _tensor_pb2.TensorHeader
    chunk: bytes
    group: _tensor_pb2.TensorGroup
    result: StepResult
    def __init__(self, stats: _Optional[_Union[StepStats, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., group: _Optional[_Union[_tensor_pb2.TensorGroup, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("stats", "gradients")
    STATS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    stats: StepStats
    gradients: _tensor_pb2.TensorGroup
    def __init__(self, stats: _Optional[_Union[StepStats, _Mapping]] = ..., gradients: _Optional[_Union[_tensor_pb2.TensorGroup, _Mapping]] = ...) -> None: ...
