"""psg_wire: the wire contract of the psg gradient service, shared by server and client.

Everything both ends must agree on, and nothing else: the generated protobuf and gRPC modules
(:mod:`psg_wire.v1`, from ``proto/psg/v1``), the tensor codec and frame writer
(:mod:`psg_wire.codec`), the flat-buffer layout of tensor groups (:mod:`psg_wire.flat`), the names
the ``.proto`` files cannot express (:mod:`psg_wire.names`), the conversions between psg's Python
values and their messages (:mod:`psg_wire.convert`) and the LoRA adapter both ends must build
alike (:mod:`psg_wire.adapters`).
``psg_server`` and ``psg_client`` both import this package; neither imports the other.
``proto/README.md`` describes the protocol.

>>> import torch
>>> decoder = TensorDecoder(CodecLimits())
>>> for frame in encode_tensors([(input_name(0), torch.ones(2, 3)), (TARGETS, torch.zeros(2))]):
...     decoder.add(frame)
>>> sorted(decoder.finish())
['inputs/0', 'targets']
"""

from __future__ import annotations

from psg_wire.adapters import LoraAdapter
from psg_wire.codec import (DEFAULT_CHUNK_BYTES, DTYPES, ChunkFrame, CodecError, CodecLimits, FrameWire,
                            GroupFrame, TensorDecoder, TensorLimitError, dtype_name, encode_group, encode_tensor,
                            encode_tensors)
from psg_wire.convert import (PrivacyRequest, StepReport, dp_config_from_proto, dp_config_to_proto,
                              lora_from_proto, lora_to_proto, parameter_spec_from_proto,
                              parameter_spec_to_proto, privacy_from_proto, privacy_to_proto,
                              step_stats_from_proto, step_stats_to_proto)
from psg_wire.flat import FlatLayout, FlatTensors
from psg_wire.names import (INPUT_PREFIX, REASON_METADATA_KEY, SERVICE_NAME, TARGETS, Reason, input_name,
                            parse_input_name)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPES",
    "INPUT_PREFIX",
    "REASON_METADATA_KEY",
    "SERVICE_NAME",
    "TARGETS",
    "ChunkFrame",
    "CodecError",
    "CodecLimits",
    "FlatLayout",
    "FlatTensors",
    "FrameWire",
    "GroupFrame",
    "LoraAdapter",
    "PrivacyRequest",
    "Reason",
    "StepReport",
    "TensorDecoder",
    "TensorLimitError",
    "dp_config_from_proto",
    "dp_config_to_proto",
    "dtype_name",
    "encode_group",
    "encode_tensor",
    "encode_tensors",
    "input_name",
    "lora_from_proto",
    "lora_to_proto",
    "parameter_spec_from_proto",
    "parameter_spec_to_proto",
    "parse_input_name",
    "privacy_from_proto",
    "privacy_to_proto",
    "step_stats_from_proto",
    "step_stats_to_proto",
]
