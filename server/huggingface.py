"""The Hugging Face model family: allow-listed transformers classes built from a config, with
random weights.

Each task is one registry entry; its ``model_kwargs_json`` is a transformers config (the fields of a
``config.json``, e.g. ``GPT2Config(...).to_dict()``) whose ``model_type`` the task allows:

=============================  ================================================  =====================================
entry                          transformers class (its Auto mapping)             model types
=============================  ================================================  =====================================
hf_causal_lm                   AutoModelForCausalLM                              falcon, gemma, gpt2, gpt_neox, llama,
                                                                                 mamba, mistral, mixtral, phi, qwen2,
                                                                                 qwen3, qwen3_moe
hf_sequence_classification     AutoModelForSequenceClassification                albert, bert, deberta, deberta-v2,
                                                                                 distilbert, electra, gemma2, gpt2,
                                                                                 llama, longformer, mistral, mixtral,
                                                                                 qwen2, roberta, xlnet
hf_token_classification        AutoModelForTokenClassification                   albert, bert, deberta, deberta-v2,
                                                                                 distilbert, electra, longformer,
                                                                                 roberta
hf_seq2seq_lm                  AutoModelForSeq2SeqLM                             bart, led, mbart, t5
hf_image_classification        AutoModelForImageClassification                   beit, convnext, dinov2, swin, vit
hf_audio_classification        AutoModelForAudioClassification                   wav2vec2, hubert, wavlm
=============================  ================================================  =====================================

Longformer and LED also take ``inputs/global_attention_mask`` (1 where a token attends to every
token and every token to it; Longformer's classifier puts it on the first token when it is not sent).

Nothing is downloaded and no code comes from elsewhere: the config class and the model class are
the installed transformers' own (its Auto mappings, never ``trust_remote_code``), the model is built
with random weights (the trainer pushes its own, pretrained ones for instance), and keys that would
load anything (``auto_map``, ``quantization_config``) are refused. A training step needs only the
logits, so ``use_cache``, ``output_attentions`` and ``output_hidden_states`` are switched off and
``return_dict`` on, whatever the config says. The models take keyword inputs (``inputs/input_ids``,
``inputs/attention_mask``, ..., see :func:`signature`); transformers is imported when a session
first uses the family.

>>> import torch
>>> registry = ModelRegistry()
>>> register_huggingface(registry)
>>> kwargs = registry.parse_kwargs("hf_causal_lm", '{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, '
...                                '"n_head": 2, "vocab_size": 11, "n_positions": 16}')
>>> model = registry.build("hf_causal_lm", kwargs)
>>> model(input_ids=torch.zeros(2, 5, dtype=torch.long)).logits.shape
torch.Size([2, 5, 11])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from psg_server.errors import InvalidRequestError, ModelNotFoundError
from psg_server.models import InputSpec, ModelArgument, ModelRegistry, ModelSignature

__all__ = ["TASKS", "HuggingFaceTask", "register_huggingface", "signature"]

#: Config keys that would make transformers load code or weights from elsewhere.
_REFUSED_KEYS = frozenset({"auto_map", "quantization_config", "trust_remote_code"})
#: Attention implementations psg follows (flash and flex kernels are not traced per sample).
_ATTENTION = frozenset({"eager", "sdpa"})
#: Set whatever the config says: a training step needs only the logits.
_FORCED = {"use_cache": False, "output_attentions": False, "output_hidden_states": False, "return_dict": True}
#: Layer counts above this are refused before anything is built (the byte limit comes after).
_MAX_LAYERS = 128
#: Sequence length bound of models without a position table (T5's relative positions).
_MAX_SEQUENCE = 1 << 16
_MAX_DEPTH = 6
_MAX_ITEMS = 1024
_MAX_STRING = 256
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "num_decoder_layers")
#: Longest waveform an audio model takes (samples: 65 s at 16 kHz; the request byte limit applies too).
_MAX_AUDIO = 1 << 20


@dataclass(frozen=True)
class HuggingFaceTask:
    """One entry of the family: a transformers Auto mapping and the model types it may build."""

    #: Registry name (``CreateSession``'s model).
    name: str
    #: The Auto class, for the description.
    auto_class: str
    #: Name of the ``MODEL_FOR_..._MAPPING_NAMES`` dict in ``transformers.models.auto.modeling_auto``.
    mapping: str
    #: Allowed ``model_type`` values (tested with psg's backends).
    model_types: tuple[str, ...]
    #: "tokens", "seq2seq", "image" or "audio": which keyword inputs the models take.
    inputs: str
    #: The logits are per token (targets have the shape of ``targets_like``).
    per_token: bool
    #: Decoder-only classifiers find each row's last token by the padding token: it must be set.
    needs_pad_token: tuple[str, ...] = ()


TASKS: dict[str, HuggingFaceTask] = {task.name: task for task in (
    HuggingFaceTask("hf_causal_lm", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                    ("falcon", "gemma", "gpt2", "gpt_neox", "llama", "mamba", "mistral", "mixtral", "phi", "qwen2",
                     "qwen3", "qwen3_moe"), "tokens", per_token=True),
    HuggingFaceTask("hf_sequence_classification", "AutoModelForSequenceClassification",
                    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                    ("albert", "bert", "deberta", "deberta-v2", "distilbert", "electra", "gemma2", "gpt2", "llama",
                     "longformer", "mistral", "mixtral", "qwen2", "roberta", "xlnet"), "tokens",
                    per_token=False,
                    needs_pad_token=("gemma2", "gpt2", "llama", "mistral", "mixtral", "qwen2")),
    HuggingFaceTask("hf_token_classification", "AutoModelForTokenClassification",
                    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", ("albert", "bert", "deberta", "deberta-v2",
                                                                     "distilbert", "electra", "longformer",
                                                                     "roberta"), "tokens",
                    per_token=True),
    HuggingFaceTask("hf_seq2seq_lm", "AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                    ("bart", "led", "mbart", "t5"), "seq2seq", per_token=True),
    HuggingFaceTask("hf_image_classification", "AutoModelForImageClassification",
                    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", ("beit", "convnext", "dinov2", "swin", "vit"),
                    "image", per_token=False),
    HuggingFaceTask("hf_audio_classification", "AutoModelForAudioClassification",
                    "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", ("wav2vec2", "hubert", "wavlm"), "audio",
                    per_token=False),
)}


def register_huggingface(registry: ModelRegistry) -> None:
    """Registers every task of :data:`TASKS`."""
    for task in TASKS.values():
        description = (f"Hugging Face {task.auto_class} built from a transformers config (config.json's "
                       f"fields) with random weights; model_type: {', '.join(task.model_types)}")
        registry.register(task.name, functools.partial(_build, task), description=description,
                          signature=functools.partial(signature, task.name),
                          arguments=(ModelArgument("model_type", "str", None, True),),
                          parse_kwargs=functools.partial(_parse, task))


def _where(task: HuggingFaceTask) -> str:
    return f"CreateSession: model {task.name!r}"


def _check_value(task: HuggingFaceTask, value: Any, path: str, depth: int = 0) -> None:
    """JSON values of sane size: no huge strings or lists, no deep nesting, finite numbers."""
    where = f"{_where(task)} config field {path[:80]!r}"
    if depth > _MAX_DEPTH:
        raise InvalidRequestError(f"{where} nests deeper than {_MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequestError(f"{where} must be finite, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 53:
        raise InvalidRequestError(f"{where} is out of range: {value!r:.40}")
    if isinstance(value, str) and len(value) > _MAX_STRING:
        raise InvalidRequestError(f"{where} is longer than {_MAX_STRING} characters")
    if isinstance(value, (list, dict)):
        if len(value) > _MAX_ITEMS:
            raise InvalidRequestError(f"{where} has more than {_MAX_ITEMS} items")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _check_value(task, item, f"{path}.{key}", depth + 1)


def _parse(task: HuggingFaceTask, given: dict[str, Any]) -> dict[str, Any]:
    """Validates a config object for ``task`` (see the module docstring) and returns it as the
    builder's kwargs; builds the config once, so transformers' own checks run here."""
    model_type = given.get("model_type")
    if not isinstance(model_type, str):
        raise InvalidRequestError(f"{_where(task)}: model_kwargs_json must be a transformers config with its "
                                  f"\"model_type\" (one of {', '.join(task.model_types)})")
    if model_type not in task.model_types:
        raise ModelNotFoundError(f"{_where(task)} builds no model_type {model_type[:40]!r}; allowed: "
                                 f"{', '.join(task.model_types)}")
    refused = sorted(_REFUSED_KEYS & set(given))
    if refused:
        raise InvalidRequestError(f"{_where(task)}: config keys {refused} are refused (the server loads no "
                                  "code and no weights)")
    for key in ("attn_implementation", "_attn_implementation"):
        if given.get(key) is not None and given[key] not in _ATTENTION:
            raise InvalidRequestError(f"{_where(task)}: {key} must be one of {sorted(_ATTENTION)}, got "
                                      f"{given[key]!r:.40}")
    _check_value(task, given, "config")
    config = _config(task, given)
    for key in _LAYER_KEYS:
        layers = getattr(config, key, None)
        if isinstance(layers, int) and layers > _MAX_LAYERS:
            raise InvalidRequestError(f"{_where(task)}: {key}={layers} is more than {_MAX_LAYERS} layers")
    _check_shapes(task, config)
    if model_type in task.needs_pad_token and config.pad_token_id is None:
        raise InvalidRequestError(f"{_where(task)}: a {model_type} classifier finds each row's last token by "
                                  "the padding token; set pad_token_id")
    return dict(given)


def _check_shapes(task: HuggingFaceTask, config: Any) -> None:
    """Relations transformers' configs accept but the models cannot run with (each would fail the
    first step inside the forward pass): a router choosing more experts than there are, query heads
    that key/value heads do not divide."""
    def number(*keys: str) -> int | None:
        return next((value for key in keys if isinstance(value := getattr(config, key, None), int)
                     and not isinstance(value, bool)), None)

    experts = number("num_local_experts", "num_experts", "n_routed_experts")
    chosen = number("num_experts_per_tok")
    if experts is not None and chosen is not None and not 0 < chosen <= experts:
        raise InvalidRequestError(f"{_where(task)}: num_experts_per_tok={chosen} must be between 1 and the "
                                  f"number of experts, {experts}")
    heads, shared = number("num_attention_heads"), number("num_key_value_heads")
    if heads is not None and shared is not None and (shared < 1 or heads % shared):
        raise InvalidRequestError(f"{_where(task)}: num_key_value_heads={shared} must divide "
                                  f"num_attention_heads={heads}")


def _as_json(value: Any) -> Any:
    """Undoes the tuples that session specs make of lists (transformers' configs want lists)."""
    if isinstance(value, (tuple, list)):
        return [_as_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    return value


def _config(task: HuggingFaceTask, kwargs: Mapping[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    fields = {key: _as_json(value) for key, value in kwargs.items() if key != "model_type"}
    fields.update(_FORCED)
    try:
        return CONFIG_MAPPING[kwargs["model_type"]](**fields)
    except Exception as err:  # noqa: BLE001  the config is the caller's: whatever transformers refuses is theirs
        raise InvalidRequestError(f"{_where(task)}: transformers refuses the {kwargs['model_type']} config: "
                                  f"{_first_line(err)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())[:300]


def _build(task: HuggingFaceTask, **kwargs: Any) -> nn.Module:
    import transformers
    from transformers.models.auto import modeling_auto

    config = _config(task, kwargs)
    model_class = getattr(transformers, getattr(modeling_auto, task.mapping)[kwargs["model_type"]])
    try:
        return model_class(config)
    except Exception as err:  # noqa: BLE001  as in _config: a config the model cannot be built from
        raise InvalidRequestError(f"{_where(task)}: cannot build {model_class.__name__} from this config: "
                                  f"{_first_line(err)}") from None


#: Model types with Longformer's global attention (``global_attention_mask``).
_GLOBAL_ATTENTION = frozenset({"longformer", "led"})
#: Model types whose positions count from the padding id on (RoBERTa's scheme: token t of a row is
#: at position ``pad_token_id + 1 + t``), so a row holds ``max_position_embeddings - pad_token_id - 1``.
_POSITIONS_AFTER_PAD = frozenset({"roberta", "longformer"})


def _max_lengths(config: Any) -> tuple[int, int]:
    """The longest rows (encoder, decoder) the position tables of ``config``'s model hold.

    >>> import transformers
    >>> _max_lengths(transformers.RobertaConfig(max_position_embeddings=16, pad_token_id=1))
    (14, 14)
    >>> _max_lengths(transformers.XLNetConfig()) == (_MAX_SEQUENCE, _MAX_SEQUENCE)
    True
    >>> _max_lengths(transformers.LEDConfig(max_encoder_position_embeddings=20, max_decoder_position_embeddings=8,
    ...                                     attention_window=4))
    (20, 8)
    """
    if config.model_type == "led":
        # LED pads the encoder's rows to a multiple of its attention window, positions from 0
        window = max(config.attention_window) if isinstance(config.attention_window, list) else config.attention_window
        encoder = config.max_encoder_position_embeddings
        return encoder // window * window, config.max_decoder_position_embeddings
    length = getattr(config, "max_position_embeddings", None)
    if not isinstance(length, int) or length <= 0:  # no table (XLNet's is -1: relative positions only)
        return _MAX_SEQUENCE, _MAX_SEQUENCE
    if config.model_type in _POSITIONS_AFTER_PAD and isinstance(config.pad_token_id, int):
        length -= config.pad_token_id + 1
    return length, length


def signature(name: str, **kwargs: Any) -> ModelSignature:
    """What the model of task ``name`` with config ``kwargs`` takes (keyword inputs only) and how
    many logits per row (or per token) it returns.

    >>> sig = signature("hf_causal_lm", model_type="gpt2", vocab_size=11, n_positions=16)
    >>> sorted(sig.keyword_inputs), sig.num_outputs, sig.targets_like
    (['attention_mask', 'input_ids'], 11, 'input_ids')
    """
    task = TASKS[name]
    config = _config(task, kwargs)
    if task.inputs == "image":
        size = config.image_size
        pixels = InputSpec("float", (config.num_channels, size, size))
        return ModelSignature(inputs=(), num_outputs=config.num_labels, keyword_inputs={"pixel_values": pixels})
    if task.inputs == "audio":
        # The waveform must cover the convolutional feature encoder's receptive field (one frame).
        # No attention mask: a row masked below one frame breaks transformers' length arithmetic;
        # clips of a batch share a length, zero-padded as the feature extractors pad them.
        shortest = 1
        for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
            shortest = (shortest - 1) * stride + kernel
        audio = {"input_values": InputSpec("float", ((shortest, _MAX_AUDIO),))}
        return ModelSignature(inputs=(), num_outputs=config.num_labels, keyword_inputs=audio)
    max_length, decoder_length = _max_lengths(config)
    tokens = InputSpec("index", ((1, max_length),), num_embeddings=config.vocab_size)
    mask = InputSpec("mask", ((1, max_length),), required=False, same_shape_as="input_ids")
    inputs = {"input_ids": tokens, "attention_mask": mask}
    if config.model_type in _GLOBAL_ATTENTION:
        inputs["global_attention_mask"] = InputSpec("mask", ((1, max_length),), required=False,
                                                    same_shape_as="input_ids")
    type_vocab = getattr(config, "type_vocab_size", None)
    if isinstance(type_vocab, int) and type_vocab > 0:
        inputs["token_type_ids"] = InputSpec("index", ((1, max_length),), num_embeddings=type_vocab,
                                             required=False, same_shape_as="input_ids")
    if task.inputs == "seq2seq":
        inputs["decoder_input_ids"] = InputSpec("index", ((1, decoder_length),), num_embeddings=config.vocab_size)
        inputs["decoder_attention_mask"] = InputSpec("mask", ((1, decoder_length),), required=False,
                                                     same_shape_as="decoder_input_ids")
        return ModelSignature(inputs=(), num_outputs=config.vocab_size, keyword_inputs=inputs,
                              targets_like="decoder_input_ids")
    if task.name == "hf_causal_lm":
        return ModelSignature(inputs=(), num_outputs=config.vocab_size, keyword_inputs=inputs,
                              targets_like="input_ids")
    return ModelSignature(inputs=(), num_outputs=config.num_labels, keyword_inputs=inputs,
                          targets_like="input_ids" if task.per_token else None)
