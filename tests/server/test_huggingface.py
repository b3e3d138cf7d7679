"""The Hugging Face family of the model registry, LoRA on registry models, and the token-level losses."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from psg_server.errors import InvalidRequestError, LimitExceededError, ModelNotFoundError
from psg_server.huggingface import TASKS
from psg_server.losses import IGNORE_INDEX, get_loss
from psg_server.models import ModelRegistry, default_registry
from psg_wire.adapters import LoraAdapter
from tests.server.hf_harness import (BART, BERT, DEBERTA_V3, GPT2, GPT2_LORA, IMAGE_MODELS, LED, LONGFORMER, MAMBA,
                                    VOCAB, WAV2VEC2, WAVLM,
                                    hf_model,
                                    token_batch)

TINY: dict[str, dict[str, Any]] = {
    "hf_causal_lm": GPT2,
    "hf_sequence_classification": BERT,
    "hf_token_classification": {**BERT, "model_type": "distilbert", "dim": 16, "n_layers": 1, "n_heads": 2,
                                "hidden_dim": 32},
    "hf_seq2seq_lm": {"model_type": "t5", "vocab_size": VOCAB, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1,
                      "num_heads": 2, "relative_attention_num_buckets": 8, "dropout_rate": 0.0,
                      "decoder_start_token_id": 0},
    "hf_audio_classification": WAV2VEC2,
    "hf_image_classification": {"model_type": "vit", "image_size": 8, "patch_size": 4, "num_channels": 3,
                                "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "intermediate_size": 32, "num_labels": 3},
}


#: More model types than TINY's one per task: (task, config).
EXTRA = {
    "deberta_v3_sequence": ("hf_sequence_classification", DEBERTA_V3),
    "mamba_causal": ("hf_causal_lm", MAMBA),
    "wavlm_audio": ("hf_audio_classification", WAVLM),
    "hubert_audio": ("hf_audio_classification", {**WAV2VEC2, "model_type": "hubert"}),
    "deberta_v1_tokens": ("hf_token_classification", {**BERT, "model_type": "deberta", "relative_attention": True,
                                                       "max_relative_positions": 8, "pos_att_type": ["p2c", "c2p"],
                                                       "type_vocab_size": 0}),
}
#: One tiny config per further allow-listed model type (their per-sample gradients are checked
#: against the oracle in tests/core/test_hf_models.py).
_DECODER: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "intermediate_size": 32, "max_position_embeddings": 16,
                            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
_ENCODER: dict[str, Any] = {**BERT, "num_hidden_layers": 1}
_MOE = {"num_experts_per_tok": 2}
for _task, _types in {
    "hf_causal_lm": {
        "falcon": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": VOCAB},
        "gemma": {**_DECODER, "head_dim": 8}, "gpt_neox": {**_DECODER, "rotary_pct": 0.5}, "mistral": _DECODER,
        "llama": _DECODER, "qwen2": _DECODER,
        "mixtral": {**_DECODER, "num_local_experts": 4, **_MOE}, "phi": _DECODER, "qwen3": {**_DECODER, "head_dim": 8},
        "qwen3_moe": {**_DECODER, "head_dim": 8, "num_experts": 4, "moe_intermediate_size": 8, **_MOE}},
    "hf_sequence_classification": {
        "albert": {**_ENCODER, "embedding_size": 8}, "electra": {**_ENCODER, "embedding_size": 8},
        "gemma2": {**_DECODER, "head_dim": 8, "num_labels": 3}, "mistral": {**_DECODER, "num_labels": 3},
        "mixtral": {**_DECODER, "num_local_experts": 4, **_MOE, "num_labels": 3},
        "qwen2": {**_DECODER, "num_labels": 3}, "llama": {**_DECODER, "num_labels": 3},
        "gpt2": {**GPT2, "num_labels": 3}, "roberta": _ENCODER,
        "distilbert": {**BERT, "model_type": "distilbert", "dim": 16, "n_layers": 1, "n_heads": 2, "hidden_dim": 32},
        "deberta": {**_ENCODER, "relative_attention": True, "max_relative_positions": 8,
                    "pos_att_type": ["p2c", "c2p"], "type_vocab_size": 0},
        "xlnet": {"vocab_size": VOCAB, "d_model": 16, "n_layer": 1, "n_head": 2, "d_inner": 32, "num_labels": 3},
        "longformer": LONGFORMER},
    "hf_image_classification": IMAGE_MODELS,
    "hf_seq2seq_lm": {"bart": BART, "mbart": {**BART, "model_type": "mbart"}, "led": LED},
    "hf_token_classification": {"albert": {**_ENCODER, "embedding_size": 8},
                                "electra": {**_ENCODER, "embedding_size": 8}, "bert": _ENCODER,
                                "roberta": _ENCODER, "deberta-v2": {**DEBERTA_V3, "num_hidden_layers": 1},
                                "longformer": {**LONGFORMER, "num_hidden_layers": 1}},
}.items():
    for _type, _config in _types.items():
        EXTRA[f"{_type}_{_task.removeprefix('hf_')}"] = (_task, {**_config, "model_type": _type})
CASES = {**{name: (name, config) for name, config in TINY.items()}, **EXTRA}


def test_every_allowed_model_type_is_built_by_a_case() -> None:
    built = {(task, config["model_type"]) for task, config in CASES.values()}
    allowed = {(name, model_type) for name, task in TASKS.items() for model_type in task.model_types}
    assert allowed - built == set()
assert set(TINY) == set(TASKS)


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return default_registry()


def parse(registry: ModelRegistry, name: str, config: dict[str, Any]) -> dict[str, Any]:
    return registry.parse_kwargs(name, json.dumps(config))


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_task_builds_from_a_config_and_fits_its_signature(registry: ModelRegistry, case: str) -> None:
    name, config = CASES[case]
    kwargs = parse(registry, name, config)
    model = registry.build(name, kwargs)
    signature = registry.signature(name, kwargs)
    assert signature is not None and signature.inputs == ()
    batch = {}
    for key, spec in signature.keyword_inputs.items():
        shape = tuple(d if isinstance(d, int) else max(d[0], min(d[1], 5)) for d in spec.sample_shape)
        batch[key] = (torch.randn(2, *shape) if spec.kind == "float"
                      else torch.randint(0, spec.num_embeddings or 2, (2, *shape)))
    logits = model(**batch).logits
    per_token = signature.targets_like is not None
    assert logits.shape == ((2, 5, signature.num_outputs) if per_token else (2, signature.num_outputs))
    described = registry.describe(name, kwargs, max_bytes=1 << 30)
    assert [(p.name, p.shape) for p in described] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert all(p.requires_grad for p in described)


@pytest.mark.parametrize("case", sorted(c for c, (name, _) in CASES.items()
                                  if TASKS[name].inputs in ("tokens", "seq2seq")))
def test_the_longest_rows_a_signature_allows_run(registry: ModelRegistry, case: str) -> None:
    """A row as long as the signature's bound fits the model's position tables (RoBERTa's and
    Longformer's count from the padding id on; LED pads its encoder's rows to its window)."""
    name, config = CASES[case]
    kwargs = parse(registry, name, config)
    signature = registry.signature(name, kwargs)
    assert signature is not None
    lengths = {key: spec.sample_shape[0][1] for key, spec in signature.keyword_inputs.items()}  # type: ignore[index]
    if max(lengths.values()) > 64:
        pytest.skip("no position table (relative positions): the bound is the service's own")
    model = registry.build(name, kwargs)
    batch = {key: torch.randint(2, signature.keyword_inputs[key].num_embeddings or 2, (2, lengths[key]))
             if signature.keyword_inputs[key].kind == "index" else torch.ones(2, lengths[key], dtype=torch.long)
             for key in lengths if signature.keyword_inputs[key].same_shape_as is None or key.endswith("attention_mask")}
    assert torch.isfinite(model(**batch).logits).all()


def test_the_server_model_has_the_trainers_names_and_flags(registry: ModelRegistry) -> None:
    kwargs = parse(registry, "hf_causal_lm", GPT2)
    described = registry.describe("hf_causal_lm", kwargs, max_bytes=1 << 30, lora=GPT2_LORA)
    trainer = hf_model(GPT2, lora=GPT2_LORA)
    assert [(p.name, p.shape, p.requires_grad) for p in described] == \
        [(n, tuple(p.shape), p.requires_grad) for n, p in trainer.named_parameters()]
    assert [p.name for p in described if p.requires_grad] == [
        f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{m}.default.weight" for i in (0, 1) for m in "AB"]


def test_signatures_name_the_keyword_inputs(registry: ModelRegistry) -> None:
    causal = registry.signature("hf_causal_lm", parse(registry, "hf_causal_lm", GPT2))
    assert causal is not None and sorted(causal.keyword_inputs) == ["attention_mask", "input_ids"]
    assert (causal.num_outputs, causal.targets_like) == (VOCAB, "input_ids")
    assert causal.keyword_inputs["input_ids"].sample_shape == ((1, 16),)
    assert not causal.keyword_inputs["attention_mask"].required
    bert = registry.signature("hf_sequence_classification", parse(registry, "hf_sequence_classification", BERT))
    assert bert is not None and "token_type_ids" in bert.keyword_inputs and bert.targets_like is None
    seq2seq = registry.signature("hf_seq2seq_lm", parse(registry, "hf_seq2seq_lm", TINY["hf_seq2seq_lm"]))
    assert seq2seq is not None and seq2seq.keyword_inputs["decoder_input_ids"].required
    assert seq2seq.targets_like == "decoder_input_ids"


@pytest.mark.parametrize("config, message", [
    ({**_DECODER, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 8},
     "num_experts_per_tok=8 must be between 1 and the number of experts, 4"),
    ({**_DECODER, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 0, "head_dim": 8},
     "num_experts_per_tok=0 must be between 1"),
    ({**_DECODER, "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3},
     "num_key_value_heads=3 must divide num_attention_heads=4"),
])
def test_configs_whose_models_cannot_run(registry: ModelRegistry, config: dict[str, Any], message: str) -> None:
    """Accepted by transformers, but the first step would fail inside the forward pass."""
    with pytest.raises(InvalidRequestError, match=message):
        parse(registry, "hf_causal_lm", config)


@pytest.mark.parametrize("config, error, message", [
    ({"n_layer": 1}, InvalidRequestError, 'with its "model_type"'),
    ({"model_type": "bloom"}, ModelNotFoundError, "builds no model_type 'bloom'; allowed: falcon, gemma, gpt2"),
    ({**GPT2, "n_layer": "two"}, InvalidRequestError, "transformers refuses the gpt2 config"),
    ({**GPT2, "auto_map": {"AutoModel": "evil.Model"}}, InvalidRequestError, "\\['auto_map'\\] are refused"),
    ({**GPT2, "quantization_config": {}}, InvalidRequestError, "are refused"),
    ({**GPT2, "attn_implementation": "flash_attention_2"}, InvalidRequestError, "must be one of \\['eager', 'sdpa'\\]"),
    ({**GPT2, "n_layer": 1000}, InvalidRequestError, "more than 128 layers"),
    ({**GPT2, "n_embd": 1e400}, InvalidRequestError, "must be finite"),
    ({**GPT2, "note": "x" * 300}, InvalidRequestError, "longer than 256 characters"),
])
def test_bad_configs(registry: ModelRegistry, config: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        registry.parse_kwargs("hf_causal_lm", json.dumps(config).replace("Infinity", "1e400"))


def test_a_config_the_model_cannot_be_built_from(registry: ModelRegistry) -> None:
    kwargs = parse(registry, "hf_causal_lm", {**GPT2, "n_embd": 15})
    with pytest.raises(InvalidRequestError, match="cannot build GPT2LMHeadModel from this config: .*divisible"):
        registry.describe("hf_causal_lm", kwargs, max_bytes=1 << 30)


def test_decoder_classifiers_need_a_pad_token(registry: ModelRegistry) -> None:
    with pytest.raises(InvalidRequestError, match="set pad_token_id"):
        parse(registry, "hf_sequence_classification", {**GPT2, "pad_token_id": None})


def test_a_large_config_is_refused_before_anything_is_allocated(registry: ModelRegistry) -> None:
    kwargs = parse(registry, "hf_causal_lm", {**GPT2, "vocab_size": 1 << 24, "n_embd": 1024, "n_head": 8})
    with pytest.raises(LimitExceededError, match="parameter bytes, more than"):
        registry.describe("hf_causal_lm", kwargs, max_bytes=1 << 30)


def test_lora_on_a_builtin_and_a_target_that_matches_nothing(registry: ModelRegistry) -> None:
    kwargs = registry.parse_kwargs("mlp", '{"in_features": 4, "hidden": [8], "num_classes": 3}')
    described = registry.describe("mlp", kwargs, max_bytes=1 << 20, lora=LoraAdapter(rank=2, target_modules=("0",)))
    assert [p.name for p in described if p.requires_grad] == ["base_model.model.0.lora_A.default.weight",
                                                              "base_model.model.0.lora_B.default.weight"]
    with pytest.raises(InvalidRequestError, match="LoRA adapter does not fit model 'hf_causal_lm'.*\\['q_proj'\\] "
                                                  "match no module.*'c_attn'"):
        registry.describe("hf_causal_lm", parse(registry, "hf_causal_lm", GPT2), max_bytes=1 << 30,
                          lora=LoraAdapter(rank=2, target_modules=("q_proj",)))


def test_causal_lm_loss_is_the_models_own_loss_per_sample() -> None:
    model = hf_model(GPT2)
    inputs, labels = token_batch(3)  # rows keep 6, 5 and 4 tokens
    per_row = get_loss("causal_lm").build()(model(**inputs), labels)  # (3,)
    for row in range(3):
        own = model(**{k: v[row:row + 1] for k, v in inputs.items()}, labels=labels[row:row + 1]).loss
        torch.testing.assert_close(per_row[row], own)


def test_token_cross_entropy_averages_over_labelled_tokens_only() -> None:
    logits = torch.randn(2, 4, 5)  # (rows, T, C)
    targets = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX] * 4])
    per_row = get_loss("token_cross_entropy").build()(logits, targets)
    expected = torch.nn.functional.cross_entropy(logits[0, :2], targets[0, :2])
    torch.testing.assert_close(per_row, torch.stack([expected, torch.zeros(())]))
