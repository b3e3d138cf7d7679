"""Hugging Face transformers against the microbatch oracle: where the batch is, known not guessed.

Every family's position scheme meets the batch its own way: GPT-2 and BERT add a learned table
looked up with broadcast ``(1, T)`` ids, T5 adds a relative-position bias from a ``(T, T)`` bucket
matrix inside attention, OPT looks positions up from the attention mask's cumulative sum and runs
its MLP on ``(N*T, d)`` rows, Llama rotates, BLOOM biases with ALiBi, DeBERTa multiplies the batch's
queries and keys with position keys and queries projected from a batch-free table (broadcast in v1,
tiled per batch row with ``repeat`` in v2/v3, with shared or separate projections). Each is checked fully
trainable and with a LoRA adapter, padded batches with an attention mask, K in {1, 2}, in every
mode: a result is either the oracle's or a PsgError naming the layer, never a silent sum.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import torch

import psg_core
from psg_core import DPConfig, PsgError, UnsupportedModuleError, dp_gradient, per_sample_gradients
from tests.core import hf_models as hf
from tests.devices import to_device
from tests.oracle import assert_close_scaled

pytest.importorskip("peft")

pytestmark = [
    # peft calls transformers' deprecated name while wrapping a model (outside psg).
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    # transformers before 5.2x scripts DeBERTa's helpers with torch.jit.script, which torch 2.11 deprecates.
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
]

FAMILIES = sorted(hf.FAMILIES)
VARIANTS = ["full", "lora"]
KS = [1, 2]
N = 3
#: float32 through two transformer blocks against float64; relative to each tensor's largest entry.
RTOL, ATOL = 1e-3, 1e-5


@functools.cache
def _case(family: str, variant: str, K: int, device: torch.device
          ) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """Model, batch and oracle on ``device`` (built on the CPU from fixed seeds, then moved)."""
    model = hf.build(family, lora=variant == "lora").to(device)
    inputs, labels = to_device(hf.batch(family, N * K), device)
    return model, inputs, labels, hf.oracle(model, inputs, labels, K)


def _check(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    """Per tensor, with the absolute tolerance relative to the largest gradient entry of the model:
    some gradients are zero in exact arithmetic (a key bias under softmax) and float32 noise there
    is not an error."""
    assert set(grads) == set(expected), where
    scale = max(float(ref.abs().max()) for ref in expected.values() if ref.numel())
    for name, ref in expected.items():
        torch.testing.assert_close(grads[name].to("cpu", torch.float64), ref.to("cpu", torch.float64), rtol=RTOL,
                                   atol=ATOL * scale, msg=lambda m, name=name: f"{where} {name}: {m}")


def _mode_matches_the_oracle(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor,
                             oracle: dict[str, torch.Tensor], *, mode: str, K: int, where: str,
                             loss_fn: Callable[[object, torch.Tensor], torch.Tensor] = hf.loss_fn) -> None:
    """``per_sample_gradients`` in ``mode`` gives the oracle's per-sample gradients; ``"ghost"``:
    ``dp_gradient`` gives the oracle's clipped sum and norms (at a bound that clips)."""
    if mode == "ghost":
        reference = psg_core.clip_and_sum({n: g.float() for n, g in oracle.items()}, max_grad_norm=0.05)
        result = dp_gradient(model, inputs, labels, loss_fn=loss_fn,
                             config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=0.05))
        assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms", rtol=RTOL, atol=ATOL)
        _check(result.grads, reference.grads, where)
        return
    grads = per_sample_gradients(model, inputs, labels, loss_fn=loss_fn, mode=mode, augmentation_multiplicity=K)
    _check(grads, oracle, where)


def _classifier_matches_the_oracle(build: Callable[[], torch.nn.Module], inputs: dict[str, torch.Tensor],
                                   labels: torch.Tensor, *, mode: str, K: int, device: torch.device,
                                   where: str) -> None:
    """:func:`_mode_matches_the_oracle` for a sequence classifier built (in eval mode) from seed 0."""
    torch.manual_seed(0)
    model = build().eval()
    oracle = hf.oracle(model, inputs, labels, K)
    model, inputs, labels = model.to(device), to_device(inputs, device), labels.to(device)
    _mode_matches_the_oracle(model, inputs, labels, oracle, mode=mode, K=K, where=where)


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_per_sample_gradients_match_the_oracle(mode: str, family: str, variant: str, K: int,
                                               device: torch.device) -> None:
    model, inputs, labels, expected = _case(family, variant, K, device)
    if mode == "functorch" and family == "bloom":
        # BLOOM's GELU is an autograd.Function without a vmap rule: refused, naming the module.
        with pytest.raises(UnsupportedModuleError, match=r"gelu_impl.*BloomGelu"):
            per_sample_gradients(model, inputs, labels, loss_fn=hf.loss_fn, mode=mode, augmentation_multiplicity=K)
        return
    grads = per_sample_gradients(model, inputs, labels, loss_fn=hf.loss_fn, mode=mode, augmentation_multiplicity=K)
    _check(grads, expected, f"{family}/{variant}/{mode}/K={K}")


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_grad_sample_module_matches_the_oracle(family: str, variant: str, K: int, device: torch.device) -> None:
    model, inputs, labels, expected = _case(family, variant, K, device)
    # Full fine-tuning meets norms without a registered sampler (LlamaRMSNorm, T5LayerNorm, ...):
    # strict=False computes those with the per-layer torch.func fallback.
    wrapped = psg_core.GradSampleModule(model, strict=variant == "lora", augmentation_multiplicity=K)
    try:
        hf.loss_fn(wrapped(**inputs), labels).mean().backward()
        grads = {name: p.grad_sample for name, p in model.named_parameters() if p.requires_grad}
    finally:
        wrapped.remove_hooks()
        for p in model.parameters():
            p.grad, p.grad_sample = None, None
    _check(grads, expected, f"{family}/{variant}/GradSampleModule/K={K}")


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_ghost_clipped_sum_matches_the_oracle(family: str, variant: str, K: int, device: torch.device) -> None:
    model, inputs, labels, expected = _case(family, variant, K, device)
    bound = 0.05  # small enough that every sample is clipped
    reference = psg_core.clip_and_sum({n: g.to(torch.float32) for n, g in expected.items()}, max_grad_norm=bound)
    result = dp_gradient(model, inputs, labels, loss_fn=hf.loss_fn,
                         config=DPConfig(mode="ghost", augmentation_multiplicity=K, max_grad_norm=bound))
    assert_close_scaled(result.per_sample_norms, reference.per_sample_norms, name="norms", rtol=RTOL, atol=ATOL)
    _check(result.grads, reference.grads, f"{family}/{variant}/ghost/K={K}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_ew_is_right_or_refuses(family: str, variant: str, device: torch.device) -> None:
    """ExpandedWeights knows only torch's own per-sample ops: a result, or a PsgError naming the layer."""
    model, inputs, labels, expected = _case(family, variant, 2, device)
    try:
        grads = per_sample_gradients(model, inputs, labels, loss_fn=hf.loss_fn, mode="ew", augmentation_multiplicity=2)
    except PsgError as err:
        assert "module '" in str(err)
        return
    _check(grads, expected, f"{family}/{variant}/ew")


def _led() -> torch.nn.Module:
    return hf.transformers.LEDForConditionalGeneration(hf.transformers.LEDConfig(
        vocab_size=hf.VOCAB, pad_token_id=hf.PAD, eos_token_id=hf.EOS, bos_token_id=hf.EOS,
        decoder_start_token_id=hf.PAD, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_encoder_position_embeddings=20,
        max_decoder_position_embeddings=20, attention_window=4, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))


#: sample n's global tokens (each of its K rows alike): three (sample 0's rows end with padding), none,
#: the first. (transformers' float64 Longformer, the oracle's, returns NaN gradients for a padded row
#: without global tokens: its masks add the dtype's lowest value twice.)
_GLOBAL_TOKENS = ([0, 2, 3], [], [0])


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "gsm"])
@pytest.mark.parametrize("which", ["longformer", "led"])
def test_longformer_global_tokens_of_different_counts(which: str, mode: str, K: int, device: torch.device) -> None:
    """Longformer's (and LED's encoder's) self-attention gathers every row's global tokens with
    ``nonzero`` into slots padded to the batch's largest count (``num_global.max()``) and gives the
    padded slots the lowest score: row-wise, though the tracker would read mixing there. Samples
    with 0, 1 and 3 global tokens (one also padded) get the oracle's gradients in every mode."""
    torch.manual_seed(0)
    inputs, labels = hf.batch("longformer", N * K)
    glob = torch.zeros_like(inputs["attention_mask"])
    for n, places in enumerate(_GLOBAL_TOKENS):
        glob[n * K:(n + 1) * K, places] = 1
    inputs["global_attention_mask"] = glob
    if which == "led":
        model = _led().eval()
        generator = torch.Generator().manual_seed(2)
        labels = torch.randint(2, hf.VOCAB, (N * K, 3), generator=generator)
        inputs["decoder_input_ids"] = torch.cat([torch.full((N * K, 1), hf.PAD), labels[:, :-1]], dim=1)
        loss_fn: Callable[[object, torch.Tensor], torch.Tensor] = _token_loss
    else:
        model, loss_fn = hf.build("longformer", lora=False), hf.loss_fn
    oracle = hf.oracle(model, inputs, labels, K, loss=loss_fn)
    model, inputs, labels = model.to(device), to_device(inputs, device), labels.to(device)
    where = f"{which}/{mode}/K={K}"
    if mode == "gsm":
        wrapped = psg_core.GradSampleModule(model, strict=False, augmentation_multiplicity=K)
        try:
            loss_fn(wrapped(**inputs), labels).mean().backward()
            grads = {name: p.grad_sample for name, p in model.named_parameters()}
        finally:
            wrapped.remove_hooks()
        _check(grads, oracle, where)
    else:
        _mode_matches_the_oracle(model, inputs, labels, oracle, mode=mode, K=K, where=where, loss_fn=loss_fn)


#: Families whose code passes numpy's axis= keyword to torch (IBert's IntLayerNorm takes
#: ``x.mean(axis=2)``, Funnel pools with ``torch.cat(parts, axis=axis)``), which the tracker once read
#: as an op over the batch axis. Funnel's relative token-type attention reads token type ids; given
#: none, it makes them, ``torch.zeros(input_ids.size())``, which hold the batch (see
#: test_funnel_defaults_its_token_type_ids).
_AXIS_KEYWORD: dict[str, Callable[[], torch.nn.Module]] = {
    "ibert": hf._hf("IBertConfig", "IBertForSequenceClassification", **hf._ENCODER),
    "funnel": hf._hf("FunnelConfig", "FunnelForSequenceClassification", d_model=16, n_head=2, d_head=8, d_inner=32,
                     block_sizes=[1, 1], hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
}


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("family", sorted(_AXIS_KEYWORD))
def test_families_using_the_axis_keyword_match_the_oracle(family: str, mode: str, K: int,
                                                          device: torch.device) -> None:
    inputs, labels = hf.batch(family, N * K, steps=8)
    inputs["token_type_ids"] = (torch.arange(8) >= 4).long().expand(N * K, 8).clone()
    _classifier_matches_the_oracle(_AXIS_KEYWORD[family], inputs, labels, mode=mode, K=K, device=device,
                                   where=f"{family}/{mode}/K={K}")


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_funnel_defaults_its_token_type_ids(mode: str, K: int, device: torch.device) -> None:
    """Without token type ids Funnel makes zeros of ``input_ids.size()``, which its relative
    attention (no grad sampler: run per sample under torch.func) reads: the tracker knows that
    size object for the batch's, so the zeros hold the batch's rows (refused before: the fallback
    got the whole (N*K, T) table in each sample's call)."""
    inputs, labels = hf.batch("funnel", N * K, steps=8)
    assert "token_type_ids" not in inputs
    _classifier_matches_the_oracle(_AXIS_KEYWORD["funnel"], inputs, labels, mode=mode, K=K, device=device,
                                   where=f"funnel/{mode}/K={K}")


#: Families that add their position table expanded to the embeddings' shape first,
#: ``position_embeddings(position_ids).expand_as(inputs_embeds)`` (refused before: expand_as was
#: not a meeting point).
_EXPANDED_POSITIONS: dict[str, Callable[[], torch.nn.Module]] = {
    name: hf._hf(f"{name}Config", f"{name}ForSequenceClassification", emb_dim=16, n_layers=2, n_heads=2,
                 dropout=0.0, attention_dropout=0.0, max_position_embeddings=20)
    for name in ("XLM", "Flaubert")
}


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("family", sorted(_EXPANDED_POSITIONS))
def test_position_tables_expanded_as_the_batch_match_the_oracle(family: str, mode: str, K: int,
                                                                 device: torch.device) -> None:
    inputs, labels = hf.batch("bert", N * K)
    _classifier_matches_the_oracle(_EXPANDED_POSITIONS[family], inputs, labels, mode=mode, K=K, device=device,
                                   where=f"{family}/{mode}/K={K}")


@pytest.mark.parametrize("family", ["bert", "roberta", "llama", "gpt2", "mistral"])
def test_functorch_batches_sdpa_models(family: str, monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """transformers' sdpa mask utilities branch on the padding mask's values, which vmap cannot
    batch, and torch's fused attention kernels have no batching rule: functorch has every sdpa mask
    built and runs torch's math kernel (one vmapped call, no loop over samples or inside a kernel),
    and transformers' mask registry holds its own function again afterwards, also after a failure."""
    import psg_core.backends.functorch as functorch_backend
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    model, inputs, labels, expected = _case(family, "full", 2, device)
    assert model.config._attn_implementation == "sdpa"

    def no_loop(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model ran one sample at a time")

    monkeypatch.setattr(functorch_backend, "_one_at_a_time", no_loop)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no kernel without a batching rule (a loop inside vmap) either
        grads = per_sample_gradients(model, inputs, labels, loss_fn=hf.loss_fn, mode="functorch",
                                     augmentation_multiplicity=2)
    _check(grads, expected, f"{family}/functorch/batched")
    assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_mask

    def failing_loss(outputs: object, targets: torch.Tensor) -> torch.Tensor:
        raise ValueError("the loss failed")

    with pytest.raises(Exception, match="the loss failed"):
        per_sample_gradients(model, inputs, labels, loss_fn=failing_loss, mode="functorch",
                             augmentation_multiplicity=2)
    assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_mask
    assert model.config._attn_implementation == "sdpa"


def test_functorch_in_threads_restores_transformers_mask_registry(device: torch.device) -> None:
    """The mask swap is process-wide: functorch steps overlapping in threads each get the oracle's
    gradients, and transformers' own function is back once the last one ends."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    # one model per thread (a call swaps its model's parameters for the vmapped ones while it runs)
    cases = [_case(family, "full", 2, device) for family in ("bert", "llama", "gpt2", "roberta")]

    def run(case: tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]
            ) -> dict[str, torch.Tensor]:
        model, inputs, labels, _ = case
        return per_sample_gradients(model, inputs, labels, loss_fn=hf.loss_fn, mode="functorch",
                                    augmentation_multiplicity=2)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, cases))
    for (_, _, _, expected), grads in zip(cases, results):
        _check(grads, expected, "functorch in threads")
    assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_mask


def test_sum_reduction_and_dp_gradient_hooks(device: torch.device) -> None:
    model, inputs, labels, _ = _case("gpt2", "full", 2, device)
    expected = hf.oracle(model, inputs, labels, 2, reduction="sum")
    grads = per_sample_gradients(model, inputs, labels, loss_fn=hf.loss_fn, augmentation_multiplicity=2,
                                 loss_reduction="sum")
    _check(grads, expected, "gpt2/sum")
    reference = psg_core.clip_and_sum({n: g.to(torch.float32) for n, g in expected.items()}, max_grad_norm=0.1)
    result = dp_gradient(model, inputs, labels, loss_fn=hf.loss_fn,
                         config=DPConfig(mode="hooks", augmentation_multiplicity=2, loss_reduction="sum",
                                         max_grad_norm=0.1))
    _check(result.grads, reference.grads, "gpt2/dp_gradient")


def _causal_lm() -> torch.nn.Module:
    """GPT-2's LM head shares its weight with the token table: both uses add up per sample."""
    cfg = hf.transformers.GPT2Config(vocab_size=hf.VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = hf.transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def _masked_lm() -> torch.nn.Module:
    """BERT's MLM head owns ``bias`` and its decoder Linear holds the same Parameter (the head has no
    grad sampler: the torch.func fallback must not count the decoder's use of it too)."""
    cfg = hf.transformers.BertConfig(vocab_size=hf.VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, pad_token_id=hf.PAD)
    model = hf.transformers.BertForMaskedLM(cfg)
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    return model


def _causal(config: str, model: str, **options: object) -> Callable[[], torch.nn.Module]:
    """A tiny causal LM of another family (the service's hf_causal_lm builds these)."""
    return lambda: getattr(hf.transformers, model)(getattr(hf.transformers, config)(
        vocab_size=hf.VOCAB, pad_token_id=hf.PAD, bos_token_id=hf.EOS, eos_token_id=hf.EOS, hidden_size=16,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=20, **options))


_DECODER = dict(num_key_value_heads=1, intermediate_size=32)
LANGUAGE_MODELS = {
    "causal_lm_tied_embeddings": (_causal_lm, hf.lm_loss),
    "masked_lm_tied_bias": (_masked_lm, hf.token_loss),
    # every parameter trained, the routed experts' too (one grouped call on per-sample copies)
    "mixtral_causal_lm": (_causal("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                                  **_DECODER), hf.lm_loss),
    "qwen3_moe_causal_lm": (_causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=8, head_dim=8, **_DECODER), hf.lm_loss),
    # the LM head is the token table (tied), scaled by sqrt(d) on the way in
    "gemma_causal_lm_tied": (_causal("GemmaConfig", "GemmaForCausalLM", head_dim=8, **_DECODER), hf.lm_loss),
    "qwen3_causal_lm": (_causal("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, **_DECODER), hf.lm_loss),
    "phi_causal_lm": (_causal("PhiConfig", "PhiForCausalLM", **_DECODER), hf.lm_loss),
    "gpt_neox_causal_lm": (_causal("GPTNeoXConfig", "GPTNeoXForCausalLM", intermediate_size=32, rotary_pct=0.5),
                           hf.lm_loss),
    "falcon_causal_lm": (_causal("FalconConfig", "FalconForCausalLM"), hf.lm_loss),
    # Llama 4's experts block tiles each token once per expert (row-wise by psg's knowledge) and
    # returns the tokens flattened, T entries per batch row
    "llama4_causal_lm_moe": (_causal("Llama4TextConfig", "Llama4ForCausalLM", num_local_experts=4,
                                     num_experts_per_tok=1, intermediate_size_mlp=32, head_dim=8,
                                     **_DECODER), hf.lm_loss),
    # its mixer convolves with its child's conv1d.weight itself (met per batch row)
    "falcon_mamba_causal_lm": (lambda: hf.transformers.FalconMambaForCausalLM(hf.transformers.FalconMambaConfig(
        vocab_size=hf.VOCAB, pad_token_id=hf.PAD, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2,
        conv_kernel=3, use_cache=False)), hf.lm_loss),
}


# vmap runs the routed experts' histc without a batching rule (a loop, and a warning)
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("which", list(LANGUAGE_MODELS))
def test_language_models_match_the_oracle(which: str, mode: str, K: int, device: torch.device) -> None:
    torch.manual_seed(0)
    build, loss_fn = LANGUAGE_MODELS[which]
    model = build().eval().to(device)
    inputs = to_device(hf.batch("gpt2", N * K)[0], device)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    import copy

    ref = copy.deepcopy(model).double()
    if any(type(m).__name__.endswith("Experts") for m in ref.modules()):
        ref.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    params = {n: p for n, p in ref.named_parameters()}
    expected: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for n in range(N):
        rows = slice(n * K, (n + 1) * K)
        loss = loss_fn(ref(**{k: v[rows] for k, v in inputs.items()}), labels[rows]).mean()
        for name, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
            expected[name].append(g)
    oracle = {n: torch.stack(gs) for n, gs in expected.items()}
    _mode_matches_the_oracle(model, inputs, labels, oracle, mode=mode, K=K, where=f"{which}/{mode}/K={K}",
                             loss_fn=loss_fn)


# ----------------------------------------------------------------------------- vision
def _image(config: str, model: str, **options: object) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(hf.transformers, model)(getattr(hf.transformers, config)(num_labels=hf.NUM_LABELS,
                                                                                     **options))


_VIT = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
#: Image classifiers, each with its own way of meeting the batch: ViT's and DeiT's class (and
#: distillation) tokens expanded over the batch, BEiT's relative-position bias table and layer
#: scale, DINOv2's interpolated position table and layer scale, Swin's shifted windows (the batch
#: merged with the windows, a relative-position table per window), ConvNeXt's depthwise
#: convolutions and channels-last LayerNorm with layer scale. LoRA on the attention projections.
VISION_MODELS: dict[str, tuple[Callable[[], torch.nn.Module], list[str]]] = {
    "vit": (_image("ViTConfig", "ViTForImageClassification", **_VIT), ["q_proj", "v_proj"]),
    "deit": (_image("DeiTConfig", "DeiTForImageClassificationWithTeacher", **_VIT), ["q_proj", "v_proj"]),
    "beit": (_image("BeitConfig", "BeitForImageClassification", use_relative_position_bias=True,
                    layer_scale_init_value=0.1, use_mean_pooling=True, **_VIT), ["q_proj", "v_proj"]),
    "dinov2": (_image("Dinov2Config", "Dinov2ForImageClassification", image_size=16, patch_size=4, hidden_size=16,
                      num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, layerscale_value=0.1),
               ["q_proj", "v_proj"]),
    "swin": (_image("SwinConfig", "SwinForImageClassification", image_size=16, patch_size=2, embed_dim=8,
                    depths=[2, 1], num_heads=[2, 2], window_size=4), ["q_proj", "v_proj"]),
    "convnext": (_image("ConvNextConfig", "ConvNextForImageClassification", num_channels=3, hidden_sizes=[8, 16],
                        depths=[1, 1], num_stages=2, layer_scale_init_value=0.1), ["pwconv1", "pwconv2"]),
}


def _vision_case(which: str, lora: bool, K: int, device: torch.device
                 ) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    import copy

    torch.manual_seed(0)
    build, targets = VISION_MODELS[which]
    model = build().eval()
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                           target_modules=hf.lora_targets(model, targets))).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(N * K, 3, 16, 16, generator=generator)
    labels = torch.randint(0, hf.NUM_LABELS, (N * K,), generator=generator)
    ref = copy.deepcopy(model).double()
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    expected: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for n in range(N):
        rows = slice(n * K, (n + 1) * K)
        loss = hf.loss_fn(ref(pixel_values=pixels[rows].double()), labels[rows]).mean()
        for name, g in zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)):
            expected[name].append(torch.zeros_like(params[name]) if g is None else g)
    oracle = {n: torch.stack(gs) for n, gs in expected.items()}
    return model.to(device), pixels.to(device), labels.to(device), oracle


# vmap runs torch's fused CPU attention kernel without a batching rule (a loop, and a warning)
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("which", sorted(VISION_MODELS))
def test_image_classifiers_match_the_oracle(which: str, mode: str, variant: str, K: int,
                                            device: torch.device) -> None:
    model, pixels, labels, oracle = _vision_case(which, variant == "lora", K, device)
    _mode_matches_the_oracle(model, {"pixel_values": pixels}, labels, oracle, mode=mode, K=K,
                             where=f"{which}/{variant}/{mode}/K={K}")


# ----------------------------------------------------------------------------- sequence to sequence
def _seq2seq(config: str, model: str, **options: object) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(hf.transformers, model)(getattr(hf.transformers, config)(
        vocab_size=hf.VOCAB, pad_token_id=hf.PAD, eos_token_id=hf.EOS, decoder_start_token_id=hf.PAD, **options))


_BART = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=20, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, bos_token_id=hf.EOS, forced_eos_token_id=None)
#: Encoder-decoder language models (the service's hf_seq2seq_lm): T5's relative-position buckets in
#: encoder, decoder and cross attention, BART's and mBART's learned positions, all with the LM head
#: tied to the shared token table (and BART's final_logits_bias buffer).
SEQ2SEQ_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "t5": _seq2seq("T5Config", "T5ForConditionalGeneration", d_model=16, d_kv=8, d_ff=32, num_layers=2,
                   num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0),
    "bart": _seq2seq("BartConfig", "BartForConditionalGeneration", **_BART),
    "mbart": _seq2seq("MBartConfig", "MBartForConditionalGeneration", **_BART),
}


def _token_loss(outputs: object, labels: torch.Tensor) -> torch.Tensor:
    """Each row's mean cross entropy over its labelled decoder tokens (the service's token loss)."""
    logits = outputs.logits  # type: ignore[attr-defined]  # (rows, T, V)
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                                  reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("which", sorted(SEQ2SEQ_MODELS))
def test_seq2seq_language_models_match_the_oracle(which: str, mode: str, K: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model = SEQ2SEQ_MODELS[which]().eval()
    inputs = hf.batch("t5", N * K)[0]
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(2, hf.VOCAB, (N * K, 4), generator=generator)
    labels[0, -1] = -100  # a padded target position
    decoder = torch.cat([torch.full((N * K, 1), hf.PAD), labels[:, :-1].clamp(min=0)], dim=1)  # shifted right
    inputs = {**inputs, "decoder_input_ids": decoder}
    oracle = hf.oracle(model, inputs, labels, K, loss=_token_loss)
    model, inputs, labels = model.to(device), to_device(inputs, device), labels.to(device)
    _mode_matches_the_oracle(model, inputs, labels, oracle, mode=mode, K=K, where=f"{which}/{mode}/K={K}",
                             loss_fn=_token_loss)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "t5"])
def test_gradient_checkpointing_of_fully_fine_tuned_models(family: str, mode: str, device: torch.device) -> None:
    """Activation (gradient) checkpointing, non-reentrant, on a fully fine-tuned model: its RMSNorm
    weights (LlamaRMSNorm, Gemma2's, T5LayerNorm: no grad sampler) meet the batch pointwise inside
    the checkpointed blocks, and torch's checkpoint raised CheckpointError on psg's rewritten ops.
    Train mode (the blocks are checkpointed only when training; these configurations have no
    dropout), against the oracle of the model in eval mode without checkpointing."""
    model = hf.build(family, lora=False)
    inputs, labels = hf.batch(family, N)
    oracle = hf.oracle(model, inputs, labels, 1)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # (transformers >= 5.24; the old name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    model, inputs, labels = model.to(device), to_device(inputs, device), labels.to(device)
    _mode_matches_the_oracle(model, inputs, labels, oracle, mode=mode, K=1, where=f"{family}/checkpointed/{mode}")
