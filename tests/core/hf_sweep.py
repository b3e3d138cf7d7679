"""The Hugging Face sweep: every architecture transformers registers for a task (sequence
classification by default; token classification, causal and masked LM, image and audio
classification), built tiny, through psg's hooks and ghost modes against the microbatch oracle.

``python -m tests.core.hf_sweep [--task TASK] [-K 2] [TYPE ...]`` builds each model type (all of the
task's mapping, ``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES`` by default) from one small configuration
(:data:`TINY`: hidden size 16, two layers, two heads, ...; a config ignores the options it does not
know), each in a process of its own (one type's defaults can take gigabytes: a crash or an
out-of-memory ends that type's line only; ``--memory-gib`` caps each process's address space), and prints one line per type:

* ``ok``: psg's per-sample gradients (hooks) and ghost's norms and clipped sum equal the oracle's;
  ``ok in float64`` where float32 rounding alone puts them off (the model is ill-conditioned in
  float32: BiT's weight standardisation), and psg run on a float64 copy of the model equals the
  float64 oracle to 1e-9 (the line says how far the float32 oracle is from the float64 one);
* ``refused``: psg raised a :class:`psg_core.PsgError` (its message follows);
* ``WRONG``: psg returned values the oracle disagrees with, or non-finite ones (exit status 1);
* ``ERROR``: psg raised anything else (exit status 1);
* ``skipped``: the type did not build or run from this configuration, or its oracle could not be
  computed (nothing of psg's ran), or the comparison could not (psg returned; its values unchecked).

``--train`` runs the models in training mode with their dropouts at :data:`TRAIN_DROPOUT`: the
oracle is then each sample's gradient through the batch's forward, every forward (the oracle's and
psg's) seeded alike so that they draw the same masks (:func:`_train_oracle`), in float32, and each
tensor is compared on its own scale.

A process that dies once psg runs (a crash, a signal) is an ``ERROR``.

The oracle is :func:`tests.core.hf_models.oracle` (float64, each sample's K=1 rows alone); for a
type without float64 kernels (``grouped_mm``) or whose float64 run is not finite, the same loop in
float32. The sweep takes about 20 minutes on two cores; ``make test`` runs :func:`sweep_type` on a
few types (tests/core/test_hf_sweep.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import psg_core
from psg_core import DPConfig, PsgError, dp_gradient, per_sample_gradients
from tests.core import hf_models as hf

__all__ = ["TINY", "SAMPLES", "TASKS", "Task", "compare", "sweep_type", "main"]

#: One configuration for every type: the names differ by family (hidden_size, d_model, n_embd,
#: emb_dim...), so all are given.
TINY: dict[str, Any] = dict(
    hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
    vocab_size=hf.VOCAB, pad_token_id=hf.PAD, eos_token_id=hf.EOS, bos_token_id=hf.EOS, num_labels=hf.NUM_LABELS,
    max_position_embeddings=32, n_positions=32, type_vocab_size=2, layer_norm_eps=1e-5,
    d_model=16, n_head=2, n_layer=2, n_embd=16, emb_dim=16, n_layers=2, n_heads=2, num_layers=2, num_heads=2,
    d_ff=32, d_kv=8, ffn_dim=32, d_inner=32, d_head=8, head_dim=8, embedding_size=16,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
    encoder_ffn_dim=32, decoder_ffn_dim=32, entity_vocab_size=40, entity_emb_size=16,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, dropout=0.0, attention_dropout=0.0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, classifier_dropout=0.0, dropout_rate=0.0)
SAMPLES = 4  # N; the batch holds N*K rows, each sample's K copies together
#: psg's values against the oracle's: the largest difference over the largest oracle entry of the
#: model (float32 against float64 through two blocks)
TOLERANCE = 1e-3
BOUND = 0.05  # ghost's clipping bound (clips every sample of these models)


#: ``--train``: the models in training mode with every dropout TINY turns off at this rate
#: instead (the sweep's options by name; a config ignores those it does not know).
TRAIN_DROPOUT = 0.1
_DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout", "resid_pdrop",
             "embd_pdrop", "attn_pdrop", "classifier_dropout", "dropout_rate")
SEED = 7  # train mode: the generators' seed before every forward (the oracle's and psg's: the same draws)


Batch = tuple[dict[str, torch.Tensor], torch.Tensor]
Loss = Callable[[object, torch.Tensor], torch.Tensor]


def _text(rows: int, config: Any) -> Batch:
    return hf.batch("bert", rows, steps=8)


def _per_token(rows: int, config: Any) -> Batch:
    """Right-padded text with a class per token; padding labelled -100 (counts zero)."""
    inputs, _ = hf.batch("bert", rows, steps=8)
    labels = torch.randint(0, hf.NUM_LABELS, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    return inputs, labels.masked_fill(inputs["attention_mask"] == 0, -100)


def _next_token(rows: int, config: Any) -> Batch:
    """Right-padded text; the labels are the ids, padding -100 (causal LM: t predicts t+1)."""
    inputs, _ = hf.batch("bert", rows, steps=8)
    return inputs, inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)


def _masked(rows: int, config: Any) -> Batch:
    """Right-padded text with every third real token masked (id 2) and labelled; the rest -100."""
    inputs, _ = hf.batch("bert", rows, steps=8)
    ids = inputs["input_ids"]
    chosen = (torch.arange(ids.shape[1]) % 3 == 1) & (inputs["attention_mask"] == 1)
    labels = ids.masked_fill(~chosen, -100)
    return {**inputs, "input_ids": ids.masked_fill(chosen, 2)}, labels


def _classes(rows: int) -> torch.Tensor:
    return torch.randint(0, hf.NUM_LABELS, (rows,), generator=torch.Generator().manual_seed(4))


def _images(rows: int, config: Any) -> Batch:
    channels = getattr(config, "num_channels", 3)
    size = getattr(config, "image_size", IMAGE)
    size = size[0] if isinstance(size, (list, tuple)) else size
    pixels = torch.randn(rows, channels, size, size, generator=torch.Generator().manual_seed(5))
    return {"pixel_values": pixels}, _classes(rows)


def _audio(rows: int, config: Any) -> Batch:
    """Raw waveforms (``input_values``), or filter-bank features where the model reads them
    (``input_features``: Whisper's (mel, 2 x positions), AST's (frames, mel))."""
    generator = torch.Generator().manual_seed(6)
    if getattr(config, "model_type", "") == "whisper":
        shape: tuple[int, ...] = (rows, config.num_mel_bins, 2 * config.max_source_positions)
        return {"input_features": torch.randn(*shape, generator=generator)}, _classes(rows)
    if getattr(config, "model_type", "") == "audio-spectrogram-transformer":
        shape = (rows, config.max_length, config.num_mel_bins)
    elif getattr(config, "model_type", "") == "wav2vec2-bert":  # it reads filter banks
        shape = (rows, 12, config.feature_projection_input_dim)
        return {"input_features": torch.randn(*shape, generator=generator)}, _classes(rows)
    else:
        shape = (rows, 4000)
    return {"input_values": torch.randn(*shape, generator=generator)}, _classes(rows)


IMAGE = 32  # pixels a side


#: An override's value that removes the option (Falcon's ``head_dim`` is a read-only property)
DROP: Any = object()


@dataclass(frozen=True)
class Task:
    """A task's models (the auto class and its mapping), its batch and its unreduced loss."""

    auto: str  # transformers.AutoModelFor...
    mapping: str  # its MODEL_FOR_..._MAPPING_NAMES
    inputs: Callable[[int, Any], Batch]  # (rows, config) -> inputs and labels
    loss: Loss
    config: dict[str, Any] = field(default_factory=dict)  # over TINY
    #: tried when a type does not build or run from TINY and ``config``: this alone (the type's
    #: defaults otherwise) and the type's own entry of ``overrides``
    minimal: dict[str, Any] | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # type -> options over either

    def model_class(self, model_type: str) -> Any:
        """The task's class for ``model_type``: the first its mapping names (the auto class's
        ``from_config`` fails on a type that maps to several, DeiT's, in transformers 5)."""
        import transformers
        from transformers.models.auto import modeling_auto

        names = getattr(modeling_auto, self.mapping).get(model_type)
        if names is None:
            return lambda config: getattr(transformers, self.auto).from_config(config)
        return getattr(transformers, names if isinstance(names, str) else names[0])

    def configs(self, model_type: str) -> list[dict[str, Any]]:
        """The options to build ``model_type`` from, in the order to try them; an override's
        :data:`DROP` removes the option (a :data:`TINY` name the type's config cannot take)."""
        own = self.overrides.get(model_type, {})

        def merged(*layers: dict[str, Any]) -> dict[str, Any]:
            options = {k: v for layer in layers for k, v in layer.items()}
            return {k: v for k, v in options.items() if v is not DROP}

        tries = [merged(TINY, self.config, own)]
        return tries if self.minimal is None else [*tries, merged(self.minimal, own)]


_SMALL_VIT = dict(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2)
_WINDOWS = dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, patch_size=2)
#: Image types whose options are per stage (lists), or that nest their vision options
_IMAGE_OVERRIDES: dict[str, dict[str, Any]] = {
    "swin": _WINDOWS, "swinv2": _WINDOWS, "donut-swin": _WINDOWS,
    "dinat": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], kernel_size=3, patch_size=4, dilations=[[1], [1]]),
    "cvt": dict(embed_dim=[8, 16, 16], num_heads=[1, 2, 2], depth=[1, 1, 1], drop_path_rate=[0.0, 0.0, 0.0]),
    "perceiver": dict(num_latents=8, d_latents=16, d_model=16, num_self_attends_per_block=1, num_self_attention_heads=2,
                      num_cross_attention_heads=2, qk_channels=16, v_channels=16),
    "clip": dict(vision_config=_SMALL_VIT), "metaclip_2": dict(vision_config=_SMALL_VIT),
    "siglip": dict(vision_config=_SMALL_VIT), "siglip2": dict(vision_config=_SMALL_VIT),
}

#: DeepSeek's mixture of experts: a few small experts, one group; one dense layer, then MoE
_DEEPSEEK_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                     n_group=1, topk_group=1, first_k_dense_replace=1)
#: Multi-head latent attention (DeepSeek V2/V3 and its kin): small low-rank query and key-value
#: projections, rope and nope halves of the query-key head (and V3.2's small sparse indexer)
_MLA = dict(_DEEPSEEK_MOE, num_key_value_heads=2, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
            kv_lora_rank=8, q_lora_rank=8, index_topk=4, index_head_dim=8, index_n_heads=2)
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
#: Mamba-2 mixers: two heads over the expanded width 32, a small state
_MAMBA_HYBRID = dict(mamba_n_heads=2, mamba_d_state=8, mamba_chunk_size=8)
#: Gated DeltaNet (Qwen3.5's linear attention): two small heads; then one full-attention layer
_DELTANET = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                 layer_types=["linear_attention", "full_attention"])
#: A composite configuration's text decoder, where the task's class takes the whole (Gemma 3's, 4's)
_TEXT = dict(vocab_size=hf.VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8, intermediate_size=32, sliding_window=4)
_PER_LAYER = dict(vocab_size_per_layer_input=hf.VOCAB, hidden_size_per_layer_input=8, global_head_dim=8)  # Gemma 3n/4
#: Causal LM types whose defaults TINY does not reach (options of their own: layer lists, expert
#: counts, nested configurations) or whose configuration rejects a TINY option
_CAUSAL_OVERRIDES: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
                     "minicpm3", "sarvam_mla", "youtu"), _MLA),
    **dict.fromkeys(("dots3_note", "dots3_note_text"),  # head_dim: nope + rope
                    dict(_MLA, head_dim=8, shared_experts_intermediate_size=16)),
    "longcat_flash": dict(_MLA, ffn_hidden_size=32, expert_ffn_hidden_size=16, moe_topk=2, zero_expert_num=2),
    "dots1": _DEEPSEEK_MOE,
    "llama4": dict(num_local_experts=4, intermediate_size_mlp=32),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16),
    # DBRX's attention reads rope_theta from its attention config, which does not declare it, and
    # clamps by clip_qkv, which cannot be None
    "dbrx": dict(attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "codegen": dict(rotary_dim=4), "gptj": dict(rotary_dim=4),  # rotary over part of the 8-wide head
    "diffllama": dict(num_key_value_heads=2),  # differential attention splits the value heads in two
    "falcon": dict(head_dim=DROP),  # a read-only property of its config
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # a global layer, a local one
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # state-space and hybrid models: one layer of each kind
    "mamba2": dict(head_dim=16, n_groups=1, state_size=8, chunk_size=8),
    "bamba": dict(_MAMBA_HYBRID, attn_layer_indices=[1]),
    "granitemoehybrid": dict(_MAMBA_HYBRID, layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                             shared_intermediate_size=16),
    # Zamba ties its hybrid layers' shared block to the first's: two of them
    "zamba": dict(n_mamba_heads=2, mamba_d_state=8, head_dim=16, layers_block_type=["hybrid", "hybrid"]),
    "zamba2": dict(n_mamba_heads=2, mamba_d_state=8, chunk_size=8, adapter_rank=4,
                   layers_block_type=["linear_attention", "hybrid"]),
    "qwen3_5": _DELTANET, "qwen3_5_moe": dict(_DELTANET, **_EXPERTS),
    "qwen4_exp": dict(_DELTANET, **_EXPERTS, hc_count=2, hc_lowrank=4, indexer_n_heads=2, indexer_kv_heads=1,
                      indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2),  # full attention's indexer
    # one codebook: each row of the batch a sample's (MusicGen reads num_codebooks rows per sample)
    "musicgen": dict(num_codebooks=1), "musicgen_melody": dict(num_codebooks=1),
    # Gemma: small per-layer embeddings (a table of 262144 rows by default); Gemma 3 with a small
    # SigLIP tower (text does not run it) without its pooling head (a fused MultiheadAttention)
    "gemma3": dict(text_config=_TEXT, mm_tokens_per_image=4, vision_config=dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=4,
        vision_use_head=False)),
    "gemma3n_text": dict(_PER_LAYER, num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0]),
    "gemma4": dict(text_config={**_TEXT, **_PER_LAYER}), "gemma4_text": dict(_PER_LAYER, sliding_window=4),
}


#: The sweep's tasks: ``--task NAME``.
TASKS: dict[str, Task] = {
    "sequence": Task("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                     _text, hf.loss_fn),
    "token": Task("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                  _per_token, hf.token_loss),
    # training runs without the key-value cache (a cache holds the whole batch's state)
    "causal-lm": Task("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", _next_token, hf.lm_loss,
                      dict(use_cache=False), overrides=_CAUSAL_OVERRIDES),
    "masked-lm": Task("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", _masked, hf.token_loss),
    "image": Task("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", _images,
                  hf.loss_fn, dict(image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=16,
                                   hidden_sizes=[8, 16], depths=[1, 1], encoder_stride=4),
                  minimal=dict(image_size=IMAGE, num_channels=3, num_labels=hf.NUM_LABELS), overrides=_IMAGE_OVERRIDES),
    "audio": Task("AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", _audio,
                  hf.loss_fn, dict(num_mel_bins=8, max_source_positions=16, max_length=16, use_weighted_layer_sum=False,
                                   feature_projection_input_dim=8, conv_dim=(16, 16, 16), conv_stride=(5, 4, 4),
                                   conv_kernel=(10, 4, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
                                   classifier_proj_size=8, frequency_stride=4, time_stride=4, patch_size=4)),
}


def compare(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, per_tensor: bool = False
            ) -> float | None:
    """The largest ``|grads - expected|`` over the largest ``|expected|`` entry of all tensors
    (``per_tensor``: of the tensor's own, or 1e-3 of all tensors' where that is larger: a tensor
    whose gradients are small must be right too); None when a value on either side is not finite."""
    scale = max((float(ref.abs().max()) for ref in expected.values() if ref.numel()), default=0.0)
    worst = 0.0
    for name, ref in expected.items():
        got = grads[name].to(torch.float64)
        if not (bool(torch.isfinite(ref).all()) and bool(torch.isfinite(got).all())):
            return None
        if ref.numel():
            own = max(float(ref.abs().max()), 1e-3 * scale) if per_tensor else scale
            worst = max(worst, float((got - ref).abs().max()) / max(own, 1e-30))
    return worst


def _oracle(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, K: int,
            loss: Loss = hf.loss_fn) -> tuple[dict[str, torch.Tensor], str]:
    try:
        oracle = hf.oracle(model, inputs, labels, K, loss=loss)
        if all(bool(torch.isfinite(g).all()) for g in oracle.values()):
            return oracle, "float64"
        why = "float64 run not finite"
    except RuntimeError as err:
        why = f"no float64 run: {str(err)[:80]}"
    float32 = hf.oracle(model, inputs, labels, K, loss=loss, dtype=torch.float32)
    return {name: g.to(torch.float64) for name, g in float32.items()}, f"float32 ({why})"


def _seeded() -> None:
    """Every generator a forward may draw from (torch's, numpy's: SpecAugment, Python's) at
    :data:`SEED`."""
    import random

    import numpy

    torch.manual_seed(SEED)
    numpy.random.seed(SEED)
    random.seed(SEED)


def _train_oracle(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, K: int,
                  loss: Loss) -> dict[str, torch.Tensor]:
    """Train mode: each sample's gradient of its rows' mean loss through the batch's forward, every
    forward seeded alike (the same dropout masks as psg's forward, seeded so too); rows do not mix,
    so that is the sample's own gradient. In the model's dtype (float32: another dtype may draw
    other masks)."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for n in range(labels.shape[0] // K):
        _seeded()
        total = loss(model(**inputs), labels)[n * K:(n + 1) * K].mean()
        for (name, p), g in zip(params.items(), torch.autograd.grad(total, list(params.values()), allow_unused=True)):
            grads[name].append(torch.zeros_like(p) if g is None else g)
    return {name: torch.stack(gs).to(torch.float64) for name, gs in grads.items()}


def _run_mode(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor,
              oracle: dict[str, torch.Tensor], mode: str, K: int, loss: Loss = hf.loss_fn,
              tolerance: float = TOLERANCE, seeded: bool = False) -> str:
    if seeded:
        _seeded()
    try:
        if mode == "ghost":
            reference = psg_core.clip_and_sum({n: g.float() for n, g in oracle.items()}, max_grad_norm=BOUND)
            result = dp_gradient(model, inputs, labels, loss_fn=loss,
                                 config=DPConfig(mode="ghost", max_grad_norm=BOUND, augmentation_multiplicity=K))
            grads = {**result.grads, "<norms>": result.per_sample_norms}
            expected = {**{n: g.double() for n, g in reference.grads.items()},
                        "<norms>": reference.per_sample_norms.double()}
        else:
            grads = per_sample_gradients(model, inputs, labels, loss_fn=loss, mode=mode, augmentation_multiplicity=K)
            expected = oracle
    except PsgError as err:
        return f"refused {type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 (anything else psg raised is a defect: reported)
        return f"ERROR {type(err).__name__}: {err}"
    try:
        error = compare(grads, expected, per_tensor=seeded)  # (train mode: a float32 oracle of the same dtype)
    except RuntimeError as err:  # the check's float64 copies of a huge table: the harness's limit
        return f"skipped: psg returned, the comparison could not run ({str(err)[:120]})"
    if error is None:
        return "WRONG: values that are not finite"
    return "ok" if error < tolerance else \
        f"WRONG: off by {error:.2e} of the largest entry{' (of its tensor, train mode)' if seeded else ''}"


def _config(transformers: Any, model_type: str, model_class: Any, options: dict[str, Any]) -> Any:
    """``model_type``'s configuration from ``options``; only the part ``model_class`` reads where the
    type's configuration is composite and the class takes one of its parts (a vision-language or
    music model's causal LM takes its text decoder's: Qwen3.5, Llama 4, Mllama, MusicGen)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    own = getattr(model_class, "config_class", None)
    if own is not None and own in getattr(CONFIG_MAPPING[model_type], "sub_configs", {}).values():
        return own(**options)
    return transformers.AutoConfig.for_model(model_type, **options)


def _built(transformers: Any, model_type: str, spec: Task, K: int, train: bool = False
           ) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """The model (eval mode; ``train``: training mode, its dropouts at :data:`TRAIN_DROPOUT`) and a
    batch it runs on, from the first of the task's configurations that builds and runs; the last
    one's error when none does."""
    tries = spec.configs(model_type)
    if train:
        tries = [{**options, **{key: TRAIN_DROPOUT for key in _DROPOUTS if key in options}} for options in tries]
    for i, options in enumerate(tries):
        torch.manual_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model_class = spec.model_class(model_type)
                config = _config(transformers, model_type, model_class, options)
                model = model_class(config).train(train)
                inputs, labels = spec.inputs(SAMPLES * K, config)
                with torch.no_grad():
                    model(**inputs)
            return model, inputs, labels
        except Exception:
            if i == len(tries) - 1:
                raise
    raise AssertionError("unreachable")


def sweep_type(model_type: str, modes: Sequence[str] = ("hooks", "ghost"), *, K: int = 1, task: str = "sequence",
               on_psg: Callable[[], None] | None = None, train: bool = False) -> dict[str, str]:
    """One type's line: ``{"type", "oracle"}`` and a result per mode, or ``{"type", "skipped"}``, for
    a batch of :data:`SAMPLES` samples of ``K`` copies each (augmentation multiplicity K) of the
    :data:`TASKS` entry ``task``; ``on_psg`` is called once the model and its oracle are ready,
    before psg runs. ``train``: the model in training mode with dropout (:func:`_train_oracle`)."""
    import transformers

    line = {"type": model_type}
    spec = TASKS[task]
    torch.manual_seed(0)
    try:
        model, inputs, labels = _built(transformers, model_type, spec, K, train)
        if train:
            oracle, line["oracle"] = _train_oracle(model, inputs, labels, K, spec.loss), "float32, training mode"
        else:
            oracle, line["oracle"] = _oracle(model, inputs, labels, K, spec.loss)
    except Exception as err:  # noqa: BLE001 (a type this configuration does not fit: not psg's)
        return {**line, "skipped": f"{type(err).__name__}: {str(err)[:160]}"}
    if on_psg is not None:
        on_psg()
    for mode in modes:
        line[mode] = _run_mode(model, inputs, labels, oracle, mode, K, spec.loss, seeded=train)
        if line[mode].startswith("WRONG: off") and line["oracle"] == "float64":
            line[mode] = _in_float64(model, inputs, labels, oracle, mode, K, spec.loss, line[mode]) or line[mode]
    return line


def _in_float64(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor,
                oracle: dict[str, torch.Tensor], mode: str, K: int, loss: Loss, wrong: str) -> str | None:
    """``ok in float64 ...`` when psg's float32 result (``wrong``: its WRONG verdict) is no further
    from the float64 oracle than twice the float32 oracle is, and psg on a float64 copy of the
    model equals the float64 oracle to 1e-9; else None."""
    import copy

    float32 = hf.oracle(model, inputs, labels, K, loss=loss, dtype=torch.float32)
    rounding = compare({n: g.double() for n, g in float32.items()}, oracle)
    off = float(wrong.split("off by ")[1].split(" ")[0])
    if rounding is None or off > 2 * rounding:
        return None
    double = copy.deepcopy(model).double()
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    verdict = _run_mode(double, inputs64, labels, oracle, mode, K, loss, tolerance=1e-9)
    return f"ok in float64 (float32 rounding: the float32 oracle is off by {rounding:.1e}, psg by {off:.1e})" \
        if verdict == "ok" else None


def _in_its_own_process(model_type: str, timeout: float, memory_gib: float, K: int = 1, task: str = "sequence",
                        train: bool = False) -> dict[str, str]:
    command = [sys.executable, "-m", "tests.core.hf_sweep", "--one", model_type, "--memory-gib", str(memory_gib),
               "-K", str(K), "--task", task] + (["--train"] if train else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        stdout, why = done.stdout, (f"the process ended with status {done.returncode} "
                                    f"({(done.stderr.strip().splitlines() or [''])[-1][:160]})")
    except subprocess.TimeoutExpired as expired:
        done, why = None, f"over {timeout:.0f} s"
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if done is not None and done.returncode == 0 and lines and "stage" not in lines[-1]:
        return lines[-1]  # type: ignore[no-any-return]
    if any(line.get("stage") == "psg" for line in lines):  # it died while psg ran: psg's
        return {"type": model_type, "hooks": f"ERROR {why}", "ghost": f"ERROR {why}"}
    return {"type": model_type, "skipped": why}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the sweep; exit status 1 when a type is WRONG or psg raised an ERROR."""
    parser = argparse.ArgumentParser(prog="python -m tests.core.hf_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every one of the task's mapping)")
    parser.add_argument("--task", choices=sorted(TASKS), default="sequence", help="the models' task (default: sequence)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one type, one JSON line
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per type")
    parser.add_argument("--memory-gib", type=float, default=12.0, help="address space per type's process")
    parser.add_argument("-K", type=int, default=1, help="augmentation multiplicity: each sample's copies in the batch")
    parser.add_argument("--train", action="store_true",
                        help="the models in training mode, with dropout: each sample's gradient through the "
                             "batch's forward, seeded as psg's")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    if options.one:
        import resource

        import transformers

        # One type's defaults can ask for tens of gigabytes (a vocabulary, an expert count): the
        # allocation fails in this process (the type is skipped) before the machine runs out.
        limit = int(options.memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        transformers.logging.set_verbosity_error()
        stage = json.dumps({"type": options.one, "stage": "psg"})
        print(json.dumps(sweep_type(options.one, K=options.K, task=options.task, train=options.train,
                                    on_psg=lambda: print(stage, flush=True))), flush=True)
        return 0
    from transformers.models.auto import modeling_auto

    types = options.types or sorted(getattr(modeling_auto, TASKS[options.task].mapping))
    tally: dict[str, int] = {}
    bad = 0
    for model_type in types:
        line = _in_its_own_process(model_type, options.timeout, options.memory_gib, options.K, options.task,
                                   options.train)
        outcomes = ["skipped"] if "skipped" in line else [line[m].split(" ")[0].rstrip(":") for m in ("hooks", "ghost")]
        for outcome in outcomes:
            tally[outcome] = tally.get(outcome, 0) + 1
        bad += any(o in ("WRONG", "ERROR") for o in outcomes)
        print(json.dumps(line), flush=True)
    print(f"{len(types)} types: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
          + " (hooks and ghost counted apart; a skipped type once)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
