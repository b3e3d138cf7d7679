"""Tiny Hugging Face configs and batches for the service tests (random weights, no download).

The trainer's side builds its model with transformers itself, as a user would, and adds the same
:class:`~psg_wire.adapters.LoraAdapter` the session declares.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from psg_server.losses import IGNORE_INDEX
from psg_wire.adapters import LoraAdapter

VOCAB = 32
#: GPT-2, 2 layers of width 16, no dropout (so the service and the local reference agree exactly).
GPT2: dict[str, Any] = {"model_type": "gpt2", "vocab_size": VOCAB, "n_positions": 16, "n_embd": 16, "n_layer": 2,
                        "n_head": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1,
                        "eos_token_id": 1, "pad_token_id": 0}
#: BERT for sequence classification, 3 labels.
BERT: dict[str, Any] = {"model_type": "bert", "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 16,
                        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": 3}
#: DeBERTa-v3's layout (relative attention, shared position keys, log buckets) for sequence classification.
DEBERTA_V3: dict[str, Any] = {"model_type": "deberta-v2", "vocab_size": VOCAB, "hidden_size": 16,
                              "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
                              "max_position_embeddings": 16, "relative_attention": True, "position_buckets": 4,
                              "max_relative_positions": 8, "pos_att_type": ["p2c", "c2p"],
                              "norm_rel_ebd": "layer_norm", "share_att_key": True, "position_biased_input": False,
                              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": 3}
#: Mamba for causal LM: its mixer reads its convolution's weight itself, a unit (psg_core.unit_module).
MAMBA: dict[str, Any] = {"model_type": "mamba", "vocab_size": VOCAB, "hidden_size": 8, "state_size": 4,
                         "num_hidden_layers": 2, "expand": 2, "conv_kernel": 3, "time_step_rank": 2,
                         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
MAMBA_LORA = LoraAdapter(rank=2, target_modules=("in_proj", "x_proj"))
#: Image classifiers (8x8 RGB, 3 labels, no dropout or stochastic depth): ViT's layout with BEiT's
#: relative-position bias and layer scale, DINOv2's layer scale, Swin's shifted windows, ConvNeXt.
_IMAGE: dict[str, Any] = {"image_size": 8, "num_channels": 3, "num_labels": 3}
_VIT_LAYOUT: dict[str, Any] = {**_IMAGE, "patch_size": 4, "hidden_size": 16, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "hidden_dropout_prob": 0.0,
                               "attention_probs_dropout_prob": 0.0}
IMAGE_MODELS: dict[str, dict[str, Any]] = {
    "beit": {**_VIT_LAYOUT, "model_type": "beit", "intermediate_size": 32, "use_relative_position_bias": True,
             "layer_scale_init_value": 0.1, "use_mean_pooling": True, "drop_path_rate": 0.0},
    "dinov2": {**_VIT_LAYOUT, "model_type": "dinov2", "mlp_ratio": 2, "layerscale_value": 0.1, "drop_path_rate": 0.0},
    "swin": {**_IMAGE, "model_type": "swin", "patch_size": 2, "embed_dim": 8, "depths": [2, 1], "num_heads": [2, 2],
             "window_size": 2, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "drop_path_rate": 0.0},
    "convnext": {**_IMAGE, "model_type": "convnext", "hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2,
                 "layer_scale_init_value": 0.1, "drop_path_rate": 0.0},
}
#: Encoder-decoder LMs: T5's relative-position buckets, BART's learned positions (no dropout).
T5: dict[str, Any] = {"model_type": "t5", "vocab_size": VOCAB, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1,
                      "num_heads": 2, "relative_attention_num_buckets": 8, "dropout_rate": 0.0,
                      "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
BART: dict[str, Any] = {"model_type": "bart", "vocab_size": VOCAB, "d_model": 16, "encoder_layers": 1,
                        "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                        "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 16, "dropout": 0.0,
                        "attention_dropout": 0.0, "activation_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 1,
                        "eos_token_id": 1, "decoder_start_token_id": 0, "forced_eos_token_id": None}
#: Longformer (sliding windows of 4 with global tokens) for sequence classification, 3 labels.
LONGFORMER: dict[str, Any] = {**BERT, "model_type": "longformer", "attention_window": 4, "pad_token_id": 0}
#: LED: BART's layout with Longformer's attention in the encoder.
LED: dict[str, Any] = {"model_type": "led", "vocab_size": VOCAB, "d_model": 16, "encoder_layers": 1,
                       "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                       "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_encoder_position_embeddings": 16,
                       "max_decoder_position_embeddings": 16, "attention_window": 4, "dropout": 0.0,
                       "attention_dropout": 0.0, "activation_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 1,
                       "eos_token_id": 1, "decoder_start_token_id": 0}
#: Mixtral for causal LM: a router and 4 routed experts per layer (2 per token), every one trained.
MIXTRAL: dict[str, Any] = {"model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2,
                           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
                           "max_position_embeddings": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
#: The audio encoders' shared tiny layout: two conv feature layers (a 20-sample receptive field),
#: a weight-normed positional convolution, 2 transformer layers, no dropout, no SpecAugment masking.
_AUDIO: dict[str, Any] = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                          "intermediate_size": 16, "conv_dim": [4, 4], "conv_stride": [5, 2], "conv_kernel": [10, 3],
                          "num_conv_pos_embeddings": 4, "num_conv_pos_embedding_groups": 2, "num_labels": 3,
                          "hidden_dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
                          "feat_proj_dropout": 0.0, "final_dropout": 0.0, "layerdrop": 0.0, "mask_time_prob": 0.0}
#: WavLM: its attention runs F.multi_head_attention_forward on its projections (a unit).
WAVLM: dict[str, Any] = {"model_type": "wavlm", **_AUDIO, "num_buckets": 8, "max_bucket_distance": 20}
WAV2VEC2: dict[str, Any] = {"model_type": "wav2vec2", **_AUDIO}
#: LoRA on WavLM's feed-forward layers (its attention reads q/k/v's base weights itself).
WAVLM_LORA = LoraAdapter(rank=2, target_modules=("intermediate_dense", "output_dense"))
WAV2VEC2_LORA = LoraAdapter(rank=2, target_modules=("q_proj", "v_proj"))
DEBERTA_LORA = LoraAdapter(rank=2, target_modules=("query_proj", "value_proj"))
GPT2_LORA = LoraAdapter(rank=2, target_modules=("c_attn",), alpha=4)
BERT_LORA = LoraAdapter(rank=2, target_modules=("query", "value"))


def hf_model(config: dict[str, Any], model_class: str = "GPT2LMHeadModel", *, lora: LoraAdapter | None = None,
             seed: int = 0) -> nn.Module:
    """The trainer's copy: ``transformers.<model_class>`` from the config, plus ``lora``."""
    import transformers

    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(transformers.CONFIG_MAPPING[config["model_type"]](**fields))
    return lora.apply(model) if lora is not None else model


def token_batch(rows: int, length: int = 6, *, seed: int = 0, padded: bool = True
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``{"input_ids", "attention_mask"}`` right-padded (row i keeps ``length - i % 3`` tokens) and
    causal LM labels: the ids, IGNORE_INDEX on padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, length), generator=generator)  # (rows, T)
    mask = torch.ones(rows, length, dtype=torch.int64)  # (rows, T)
    if padded:
        for row in range(rows):
            mask[row, length - row % 3:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, IGNORE_INDEX)


def trainable_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that require grad."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
