"""Tiny random-initialised Hugging Face models for the batch-provenance tests (no hub download).

Each family is built from a small config with random weights; the batches are right-padded with
an attention mask, so the position schemes (learned tables on broadcast ids, relative buckets,
rotary, ALiBi, positions from the mask's cumulative sum, BART's table looked up inside a layer
called with the batch) all meet the batch in their own way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

transformers = __import__("pytest").importorskip("transformers")

VOCAB, PAD, EOS = 40, 0, 1
NUM_LABELS = 2

_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, num_labels=NUM_LABELS)


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=EOS,
                                  eos_token_id=EOS, **_COMMON)
    return transformers.GPT2ForSequenceClassification(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, **_COMMON)
    return transformers.BertForSequenceClassification(cfg)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=32, max_position_embeddings=16, bos_token_id=EOS,
                                   eos_token_id=EOS, **_COMMON)
    return transformers.LlamaForSequenceClassification(cfg)


def _t5() -> nn.Module:
    cfg = transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
                                dropout_rate=0.0, decoder_start_token_id=PAD, eos_token_id=EOS, **_COMMON)
    return transformers.T5ForSequenceClassification(cfg)


def _opt() -> nn.Module:
    cfg = transformers.OPTConfig(hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                                 max_position_embeddings=16, word_embed_proj_dim=16, bos_token_id=EOS,
                                 eos_token_id=EOS, **_COMMON)
    return transformers.OPTForSequenceClassification(cfg)


def _bloom() -> nn.Module:
    cfg = transformers.BloomConfig(hidden_size=16, n_layer=2, n_head=2, bos_token_id=EOS, eos_token_id=EOS, **_COMMON)
    return transformers.BloomForSequenceClassification(cfg)


def _bart() -> nn.Module:
    cfg = transformers.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                  max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, bos_token_id=EOS, eos_token_id=EOS,
                                  decoder_start_token_id=EOS, forced_eos_token_id=None, **_COMMON)
    return transformers.BartForSequenceClassification(cfg)


def _deberta_v2(*, share_att_key: bool) -> nn.Module:
    # Relative (disentangled) attention: the position keys and queries, projected from the batch-free
    # relative-position table, are tiled once per batch row (``repeat``) and multiplied with it.
    cfg = transformers.DebertaV2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=16, relative_attention=True,
                                       position_buckets=4, max_relative_positions=8, pos_att_type=["p2c", "c2p"],
                                       norm_rel_ebd="layer_norm", share_att_key=share_att_key,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **_COMMON)
    return transformers.DebertaV2ForSequenceClassification(cfg)


def _deberta() -> nn.Module:
    # DeBERTa (v1): one position projection, broadcast over the batch in a 4-D matmul.
    cfg = transformers.DebertaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, relative_attention=True,
                                     max_relative_positions=8, pos_att_type=["p2c", "c2p"],
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **_COMMON)
    return transformers.DebertaForSequenceClassification(cfg)


_ENCODER = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=20, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_DECODER = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32, max_position_embeddings=20, bos_token_id=EOS, eos_token_id=EOS)


def _hf(config: str, model: str, **options: object) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model>`` from ``transformers.<config>(**options)``."""
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**options, **_COMMON))


#: More families, each with its own position scheme or layout: RoBERTa's positions from the
#: padding mask (offset by the pad id), DistilBERT's and ALBERT's factorised or separate
#: embeddings, ELECTRA's embedding projection, XLNet's two-stream relative attention over a
#: time-major layout, Mistral/Qwen2/Gemma2/Phi/GPT-NeoX/Falcon's rotary variants (partial rotary,
#: soft-capping, parallel blocks), GPT-Neo's local attention windows, MPT's ALiBi, Longformer's
#: sliding windows with global tokens, mBART's pre-norm encoder-decoder.
_MORE: dict[str, tuple[Callable[[], nn.Module], list[str]]] = {
    "roberta": (_hf("RobertaConfig", "RobertaForSequenceClassification", **_ENCODER), ["query", "value"]),
    "distilbert": (lambda: transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=20, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0, **_COMMON)), ["q_lin", "v_lin"]),
    "albert": (_hf("AlbertConfig", "AlbertForSequenceClassification", embedding_size=8, classifier_dropout_prob=0.0,
                   **_ENCODER), ["query", "value"]),
    "electra": (_hf("ElectraConfig", "ElectraForSequenceClassification", embedding_size=8, **_ENCODER),
                ["query", "value"]),
    "xlnet": (lambda: transformers.XLNetForSequenceClassification(transformers.XLNetConfig(
        d_model=16, n_layer=2, n_head=2, d_inner=32, dropout=0.0, **_COMMON)), ["layer_1"]),
    "mistral": (_hf("MistralConfig", "MistralForSequenceClassification", **_DECODER), ["q_proj", "v_proj"]),
    "qwen2": (_hf("Qwen2Config", "Qwen2ForSequenceClassification", **_DECODER), ["q_proj", "v_proj"]),
    "gemma2": (_hf("Gemma2Config", "Gemma2ForSequenceClassification", head_dim=8, **_DECODER), ["q_proj", "v_proj"]),
    "phi": (_hf("PhiConfig", "PhiForSequenceClassification", **_DECODER), ["q_proj", "v_proj"]),
    "gpt_neox": (_hf("GPTNeoXConfig", "GPTNeoXForSequenceClassification", rotary_pct=0.5,
                     **{k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}), ["query_key_value"]),
    "falcon": (_hf("FalconConfig", "FalconForSequenceClassification", hidden_size=16, num_hidden_layers=2,
                   num_attention_heads=2, bos_token_id=EOS, eos_token_id=EOS), ["query_key_value"]),
    "gpt_neo": (_hf("GPTNeoConfig", "GPTNeoForSequenceClassification", hidden_size=16, num_layers=2, num_heads=2,
                    attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=20,
                    bos_token_id=EOS, eos_token_id=EOS), ["q_proj", "v_proj"]),
    "mpt": (_hf("MptConfig", "MptForSequenceClassification", d_model=16, n_layers=2, n_heads=2, max_seq_len=20),
            ["Wqkv"]),
    # sliding-window attention with global tokens gathered across the batch (the CLS token here)
    "longformer": (_hf("LongformerConfig", "LongformerForSequenceClassification", attention_window=4, **_ENCODER),
                   ["query", "value"]),
    "mbart": (_hf("MBartConfig", "MBartForSequenceClassification", d_model=16, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                  max_position_embeddings=20, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                  bos_token_id=EOS, eos_token_id=EOS, decoder_start_token_id=EOS, forced_eos_token_id=None),
              ["q_proj", "v_proj"]),
}

#: family -> (builder, LoRA target modules)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], list[str]]] = {
    "gpt2": (_gpt2, ["c_attn"]),
    "bert": (_bert, ["query", "value"]),
    "llama": (_llama, ["q_proj", "v_proj"]),
    "t5": (_t5, ["q", "v"]),
    "opt": (_opt, ["q_proj", "v_proj"]),
    "bloom": (_bloom, ["query_key_value"]),
    "bart": (_bart, ["q_proj", "v_proj"]),
    "deberta": (_deberta, ["in_proj"]),
    "deberta_v3": (lambda: _deberta_v2(share_att_key=True), ["query_proj", "value_proj"]),
    "deberta_v2": (lambda: _deberta_v2(share_att_key=False), ["query_proj", "value_proj"]),
    **_MORE,
}


#: Older transformers releases name some attention projections ``query``/``value`` (DINOv2 in 5.17).
_TARGET_ALIASES = {"q_proj": "query", "v_proj": "value"}


def lora_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """``targets`` as this transformers release names them in ``model`` (an alias where a name is
    absent), for peft's ``target_modules``."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return [t if t in names or t not in _TARGET_ALIASES else _TARGET_ALIASES[t] for t in targets]


def build(family: str, *, lora: bool, seed: int = 0) -> nn.Module:
    """The family's tiny classifier in eval mode (no dropout), optionally with a LoRA adapter."""
    torch.manual_seed(seed)
    builder, targets = FAMILIES[family]
    model = builder().eval()
    if lora:
        peft = __import__("pytest").importorskip("peft")
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=lora_targets(model, targets), lora_dropout=0.0,
                                 fan_in_fan_out=family == "gpt2")  # GPT-2's Conv1D stores W as (in, out)
        model = peft.get_peft_model(model, config).eval()
        # peft leaves the lora_B matrices at zero: randomise them so every gradient is non-trivial.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def batch(family: str, rows: int, steps: int = 6, *, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded token ids with an attention mask (row 0 ends with two pads) and labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, steps), generator=generator)
    mask = torch.ones(rows, steps, dtype=torch.long)
    mask[0, -2:] = 0
    ids[:, -1] = EOS  # T5's classifier reads the last <eos>
    ids[0, -3] = EOS
    ids[0, -2:] = PAD
    labels = torch.randint(0, NUM_LABELS, (rows,), generator=generator)
    return {"input_ids": ids, "attention_mask": mask}, labels


def loss_fn(outputs: object, labels: torch.Tensor) -> torch.Tensor:
    """Unreduced cross-entropy of the classifier's logits."""
    return F.cross_entropy(outputs.logits, labels, reduction="none")  # type: ignore[attr-defined]


def lm_loss(outputs: object, labels: torch.Tensor) -> torch.Tensor:
    """Per-token causal LM loss, ``(N*K, T-1)``: position t predicts token t+1; a label -100
    (padding) counts zero."""
    logits = outputs.logits[:, :-1]  # type: ignore[attr-defined]  # (N*K, T-1, V)
    return F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none", ignore_index=-100)


def token_loss(outputs: object, labels: torch.Tensor) -> torch.Tensor:
    """Per-token classification (or masked LM) loss, ``(N*K, T)``; a label -100 counts zero."""
    logits = outputs.logits  # type: ignore[attr-defined]  # (N*K, T, C)
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)


def oracle(model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, K: int, *,
           reduction: str = "mean", loss: Callable[[object, torch.Tensor], torch.Tensor] | None = None,
           dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """``{name: (N, *shape)}`` in ``dtype`` (a copy of the model and the floating inputs in it): each
    sample's gradient from its K rows alone (``loss``: the unreduced loss of the outputs, :func:`loss_fn` by default)."""
    import copy

    unreduced = loss_fn if loss is None else loss

    ref = copy.deepcopy(model).to(dtype)
    params = {name: p for name, p in ref.named_parameters() if p.requires_grad}
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for n in range(labels.shape[0] // K):
        rows = slice(n * K, (n + 1) * K)
        per_row = unreduced(ref(**{k: v[rows].to(dtype) if v.is_floating_point() else v[rows]
                                   for k, v in inputs.items()}), labels[rows])
        total = per_row.mean() if reduction == "mean" else per_row.sum()
        for (name, p), g in zip(params.items(), torch.autograd.grad(total, list(params.values()), allow_unused=True)):
            grads[name].append(torch.zeros_like(p) if g is None else g)
    return {name: torch.stack(gs) for name, gs in grads.items()}
