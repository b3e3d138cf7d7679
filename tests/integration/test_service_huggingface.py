"""Fine-tuning Hugging Face models through the service, over real sockets: keyword inputs, the
allow-listed transformers classes built from a config, LoRA with the frozen base pushed once,
per-token losses; the service's result equals psg_core's dp_gradient on the whole batch (noise off)
for one and two workers, and bad requests get their status codes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from psg_client import GradientClient, ServiceError
from psg_core.config import DPConfig
from psg_core.errors import ConfigError
from psg_server.background import BackgroundServer
from psg_wire.adapters import LoraAdapter
from psg_wire.codec import encode_tensors
from psg_wire.v1 import gradient_service_pb2 as pb
from psg_wire.v1 import gradient_service_pb2_grpc as pb_grpc
from psg_wire.v1.tensor_pb2 import TensorHeader
from tests.server.hf_harness import (BERT, BERT_LORA, DEBERTA_LORA, DEBERTA_V3, GPT2, GPT2_LORA, LED, LONGFORMER, MAMBA,
                                    MAMBA_LORA, BART, IMAGE_MODELS, MIXTRAL, T5,
                                    WAV2VEC2, WAV2VEC2_LORA, WAVLM, WAVLM_LORA, hf_model, token_batch,
                                    trainable_bytes)
from tests.server.service_harness import client_for, local_dp, serve

Code = grpc.StatusCode


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"{n}workers")
def server(request: pytest.FixtureRequest) -> Iterator[BackgroundServer]:
    # At most 2 samples per shard: with two workers every step is split and merged.
    with serve(num_workers=request.param, max_shard_samples=2) as running:
        yield running


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[GradientClient]:
    with client_for(server) as connected:
        yield connected


def assert_equals_local(result: Any, model: torch.nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                        config: DPConfig, loss: str, expected_batch_size: int) -> None:
    local = local_dp(model, inputs, targets, config, loss=loss)
    assert set(result.grads) == {n for n, p in model.named_parameters() if p.requires_grad} == set(local.grads)
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, local.grads[name] / expected_batch_size, rtol=1e-4, atol=1e-6)
    samples = local.num_samples
    assert result.samples == samples and result.mean_loss == pytest.approx(local.loss_sum / samples, rel=1e-5)


@pytest.mark.parametrize("mode, K", [("hooks", 1), ("ghost", 2)])
@pytest.mark.parametrize("lora", [GPT2_LORA, None], ids=["lora", "full"])
def test_gpt2_causal_lm_equals_local_dp_gradient(client: GradientClient, lora: LoraAdapter | None, mode: str,
                                                 K: int) -> None:
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.05)
    model = hf_model(GPT2, lora=lora, seed=K)
    inputs, labels = token_batch(4 * K, seed=K)  # right-padded, IGNORE_INDEX on the padding
    with client.create_session("hf_causal_lm", model_kwargs=GPT2, loss="causal_lm", expected_batch_size=4,
                               config=config, lora=lora) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "causal_lm", 4)
    assert 0 < result.fraction_clipped <= 1


@pytest.mark.parametrize("lora", [BERT_LORA, None], ids=["lora", "full"])
def test_bert_sequence_classification_equals_local_dp_gradient(client: GradientClient,
                                                               lora: LoraAdapter | None) -> None:
    config = DPConfig(max_grad_norm=0.5)
    model = hf_model(BERT, "BertForSequenceClassification", lora=lora)
    inputs, _ = token_batch(5, seed=3)
    labels = torch.tensor([0, 2, 1, 1, 0])
    with client.create_session("hf_sequence_classification", model_kwargs=BERT, loss="cross_entropy",
                               expected_batch_size=5, config=config, lora=lora) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "cross_entropy", 5)


@pytest.mark.parametrize("mode, K", [("hooks", 1), ("ghost", 2)])
@pytest.mark.parametrize("lora", [DEBERTA_LORA, None], ids=["lora", "full"])
def test_deberta_v3_sequence_classification_equals_local_dp_gradient(client: GradientClient, lora: LoraAdapter | None,
                                                                     mode: str, K: int) -> None:
    """DeBERTa's relative-position keys and queries are batch-free and tiled per batch row inside
    attention: the service follows them as psg_core does."""
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e-5)  # every sample clipped
    model = hf_model(DEBERTA_V3, "DebertaV2ForSequenceClassification", lora=lora, seed=K)
    inputs, _ = token_batch(4 * K, seed=K)
    labels = torch.arange(4 * K) % 3
    with client.create_session("hf_sequence_classification", model_kwargs=DEBERTA_V3, loss="cross_entropy",
                               expected_batch_size=4, config=config, lora=lora) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "cross_entropy", 4)
    assert 0 < result.fraction_clipped <= 1


@pytest.mark.parametrize("mode, K", [("hooks", 1), ("ghost", 2)])
@pytest.mark.parametrize("lora", [MAMBA_LORA, None], ids=["lora", "full"])
def test_mamba_causal_lm_equals_local_dp_gradient(client: GradientClient, lora: LoraAdapter | None, mode: str,
                                                  K: int) -> None:
    """Mamba's mixer reads its own convolution's weight and scans in place: one unit, differentiated
    per sample by torch.func (psg_core.unit_module); the service forces the cache off."""
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e-4)  # every sample clipped
    model = hf_model(MAMBA, "MambaForCausalLM", lora=lora, seed=K)
    model.config.use_cache = False
    inputs, labels = token_batch(4 * K, seed=K)
    with client.create_session("hf_causal_lm", model_kwargs=MAMBA, loss="causal_lm", expected_batch_size=4,
                               config=config, lora=lora) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "causal_lm", 4)
    assert result.fraction_clipped == 1


def _global_tokens(rows: int, K: int) -> torch.Tensor:
    """Longformer's global attention: sample n's K rows have none, the first token, or tokens 0 and 2."""
    glob = torch.zeros(rows, 6, dtype=torch.long)
    for n in range(rows // K):
        glob[n * K:(n + 1) * K, [[], [0], [0, 2]][n % 3]] = 1
    return glob


@pytest.mark.parametrize("mode, K", [("hooks", 1), ("ghost", 2)])
def test_longformer_sequence_classification_equals_local_dp_gradient(client: GradientClient, mode: str,
                                                                     K: int) -> None:
    """Longformer's self-attention gathers the global tokens of all rows into slots padded to the
    batch's largest count: row-wise, so each shard (two workers: two samples each) and the whole
    batch give every sample the same gradient."""
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.05)
    model = hf_model(LONGFORMER, "LongformerForSequenceClassification", seed=K)
    inputs, _ = token_batch(4 * K, seed=K)
    inputs["global_attention_mask"] = _global_tokens(4 * K, K)
    labels = torch.arange(4 * K) % 3
    with client.create_session("hf_sequence_classification", model_kwargs=LONGFORMER, loss="cross_entropy",
                               expected_batch_size=4, config=config) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "cross_entropy", 4)


def test_xlnet_sequence_classification_equals_local_dp_gradient(client: GradientClient) -> None:
    """XLNet has no position table (its config's max_position_embeddings is -1): its rows are
    bounded by the service's own limit (a bound of -1 refused every batch)."""
    kwargs = {"model_type": "xlnet", "vocab_size": 32, "d_model": 16, "n_layer": 1, "n_head": 2, "d_inner": 32,
              "num_labels": 3, "dropout": 0.0, "summary_last_dropout": 0.0, "pad_token_id": 0}
    config = DPConfig(mode="ghost", augmentation_multiplicity=2, max_grad_norm=0.05)
    model = hf_model(kwargs, "XLNetForSequenceClassification")
    inputs, _ = token_batch(8, seed=4)
    labels = torch.arange(8) % 3
    with client.create_session("hf_sequence_classification", model_kwargs=kwargs, loss="cross_entropy",
                               expected_batch_size=4, config=config) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "cross_entropy", 4)


@pytest.mark.parametrize("family, mode, K", [("t5", "hooks", 1), ("t5", "ghost", 2), ("bart", "hooks", 2),
                                             ("bart", "ghost", 1), ("led", "ghost", 2)])
def test_seq2seq_lm_equals_local_dp_gradient(client: GradientClient, family: str, mode: str, K: int) -> None:
    """Encoder-decoder LMs: the decoder's inputs and the token targets beside the encoder's, the LM
    head tied to the shared table; each row's loss averaged over its labelled decoder tokens."""
    kwargs, model_class = {"t5": (T5, "T5ForConditionalGeneration"), "bart": (BART, "BartForConditionalGeneration"),
                           "led": (LED, "LEDForConditionalGeneration")}[family]
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.05)
    model = hf_model(kwargs, model_class, seed=K)
    inputs, _ = token_batch(4 * K, seed=K)
    generator = torch.Generator().manual_seed(K)
    labels = torch.randint(2, 32, (4 * K, 4), generator=generator)
    labels[0, -1] = -100  # an unlabelled target position
    decoder = torch.cat([torch.zeros(4 * K, 1, dtype=torch.long), labels[:, :-1].clamp(min=0)], dim=1)
    batch = {**inputs, "decoder_input_ids": decoder}
    if family == "led":
        batch["global_attention_mask"] = _global_tokens(4 * K, K)
    with client.create_session("hf_seq2seq_lm", model_kwargs=kwargs, loss="token_cross_entropy",
                               expected_batch_size=4, config=config) as session:
        session.push_parameters(model)
        result = session.compute_gradients(batch, labels)
    assert_equals_local(result, model, batch, labels, config, "token_cross_entropy", 4)


@pytest.mark.parametrize("mode, K", [("hooks", 1), ("ghost", 2)])
def test_mixtral_causal_lm_with_trainable_experts_equals_local_dp_gradient(client: GradientClient, mode: str,
                                                                           K: int) -> None:
    """A mixture of experts fully fine-tuned: the routed experts' per-sample gradients come from one
    grouped call on per-sample copies of the experts, in the workers as in process."""
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.05)
    model = hf_model(MIXTRAL, "MixtralForCausalLM", seed=K)
    assert any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())
    inputs, labels = token_batch(4 * K, seed=K)
    with client.create_session("hf_causal_lm", model_kwargs=MIXTRAL, loss="causal_lm", expected_batch_size=4,
                               config=config) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "causal_lm", 4)
    assert 0 < result.fraction_clipped <= 1


# BEiT's layer scale lives in its layer: the torch.func fallback runs the layer's attention under vmap,
# which loops over torch's fused CPU attention kernel (no batching rule) and warns
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("family, mode, K", [("beit", "hooks", 1), ("dinov2", "ghost", 2), ("swin", "ghost", 1),
                                             ("convnext", "hooks", 2)])
def test_image_classifiers_equal_local_dp_gradient(client: GradientClient, family: str, mode: str, K: int) -> None:
    """Vision transformers and a ConvNeXt fully fine-tuned through the service: relative-position
    bias tables, layer scale, Swin's windows (the batch merged with them), depthwise convolutions."""
    import transformers

    kwargs = IMAGE_MODELS[family]
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=0.05)
    fields = {k: v for k, v in kwargs.items() if k != "model_type"}
    torch.manual_seed(K)
    model = transformers.AutoModelForImageClassification.from_config(
        transformers.CONFIG_MAPPING[kwargs["model_type"]](**fields))
    generator = torch.Generator().manual_seed(K)
    pixels = torch.randn(4 * K, 3, 8, 8, generator=generator)
    labels = torch.randint(0, 3, (4 * K,), generator=generator)
    with client.create_session("hf_image_classification", model_kwargs=kwargs, loss="cross_entropy",
                               expected_batch_size=4, config=config) as session:
        session.push_parameters(model)
        result = session.compute_gradients({"pixel_values": pixels}, labels)
    assert_equals_local(result, model, {"pixel_values": pixels}, labels, config, "cross_entropy", 4)


@pytest.mark.parametrize("mode, K", [("hooks", 1), ("ghost", 2)])
@pytest.mark.parametrize("case", ["wavlm-full", "wavlm-lora", "wav2vec2-lora"])
def test_audio_classification_equals_local_dp_gradient(client: GradientClient, case: str, mode: str, K: int) -> None:
    """Speech encoders through the service: a convolutional feature encoder (GroupNorm), a
    weight-normed positional convolution, and for WavLM an attention that runs
    F.multi_head_attention_forward on its projections' weights (one unit, psg_core.unit_module)
    and hands the next layer a relative-position bias tiled from its parameters."""
    config_json, model_class, lora = {
        "wavlm-full": (WAVLM, "WavLMForSequenceClassification", None),
        "wavlm-lora": (WAVLM, "WavLMForSequenceClassification", WAVLM_LORA),
        "wav2vec2-lora": (WAV2VEC2, "Wav2Vec2ForSequenceClassification", WAV2VEC2_LORA)}[case]
    config = DPConfig(mode=mode, augmentation_multiplicity=K, max_grad_norm=1e-4)  # every sample clipped
    model = hf_model(config_json, model_class, lora=lora, seed=K)
    audio = torch.randn(4 * K, 120, generator=torch.Generator().manual_seed(K))
    inputs, labels = {"input_values": audio}, torch.arange(4 * K) % 3
    with client.create_session("hf_audio_classification", model_kwargs=config_json, loss="cross_entropy",
                               expected_batch_size=4, config=config, lora=lora) as session:
        session.push_parameters(model)
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "cross_entropy", 4)
    assert result.fraction_clipped == 1


def test_dp_lora_training_pushes_the_base_model_once(client: GradientClient) -> None:
    """A few noisy DP steps of a LoRA GPT-2, as a trainer runs them: after the first push, every
    version carries only the adapter, and only the adapter's gradients come back."""
    model = hf_model(GPT2, lora=GPT2_LORA)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter = trainable_bytes(model)
    assert adapter * 20 < full
    lora_b = "base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight"
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.8)
    with client.create_session("hf_causal_lm", model_kwargs=GPT2, loss="causal_lm", expected_batch_size=4,
                               config=config, sample_rate=0.01, delta=1e-5, seed=7, lora=GPT2_LORA) as session:
        assert {n for n, trainable in session.trainable.items() if trainable} == \
            {n for n, p in model.named_parameters() if p.requires_grad}
        pushed, epsilons = [], []
        for step in range(3):
            session.push_parameters(model)
            pushed.append(session.last_push_bytes)
            inputs, labels = token_batch(4, seed=step)
            result = session.compute_gradients(inputs, labels)
            assert set(result.grads) == {n for n, p in model.named_parameters() if p.requires_grad}
            optimizer.zero_grad()
            result.apply_to(model)
            optimizer.step()
            epsilons.append(result.epsilon_spent)
        assert pushed == [full, adapter, adapter]
        info = session.info()
        assert (info.steps, info.param_version, info.frozen_version) == (3, 3, 1)
    assert dict(model.named_parameters())[lora_b].abs().sum() > 0  # lora_B left zero: the adapter trained
    assert epsilons == sorted(epsilons) and all(math.isfinite(e) and e > 0 for e in epsilons)


def test_frozen_parameters_can_be_sent_again_and_are_used(client: GradientClient) -> None:
    config = DPConfig(max_grad_norm=0.05)
    model = hf_model(GPT2, lora=GPT2_LORA)
    inputs, labels = token_batch(4, seed=5)
    with client.create_session("hf_causal_lm", model_kwargs=GPT2, loss="causal_lm", expected_batch_size=4,
                               config=config, lora=GPT2_LORA) as session:
        session.push_parameters(model)
        session.compute_gradients(inputs, labels)
        with torch.no_grad():  # the trainer changes its base model: it says so with frozen=True
            dict(model.named_parameters())["base_model.model.transformer.wte.weight"].mul_(2.0)
        session.push_parameters(model, frozen=True)
        assert session.last_push_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
        result = session.compute_gradients(inputs, labels)
    assert_equals_local(result, model, inputs, labels, config, "causal_lm", 4)


# ------------------------------------------------------------------------------------ bad input
def raw_push(client: GradientClient, session_id: str, version: int, named: list[tuple[str, torch.Tensor]]) -> Any:
    """A PushParameters of exactly ``named``, through the client's channel but not its checks."""
    def requests() -> Iterator[pb.PushParametersRequest]:
        yield pb.PushParametersRequest(header=pb.PushParametersHeader(session_id=session_id, version=version))
        for frame in encode_tensors(named):
            yield (pb.PushParametersRequest(tensor=frame) if isinstance(frame, TensorHeader)
                   else pb.PushParametersRequest(chunk=bytes(frame)))

    return client.call(lambda stub, kw: stub.PushParameters(requests(), **kw))


def status_of(call: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(ServiceError) as err:
        call()
    return err.value.code, err.value.details, err.value.reason


@pytest.mark.parametrize("model, kwargs, lora, code, message", [
    ("hf_causal_lm", {**GPT2, "model_type": "bloom"}, None, Code.NOT_FOUND, "builds no model_type 'bloom'"),
    ("hf_masked_lm", GPT2, None, Code.NOT_FOUND, "unknown model 'hf_masked_lm'"),
    ("hf_causal_lm", {**GPT2, "n_head": "two"}, None, Code.INVALID_ARGUMENT, "transformers refuses the gpt2 config"),
    ("hf_causal_lm", {**GPT2, "n_embd": 15}, None, Code.INVALID_ARGUMENT, "cannot build GPT2LMHeadModel"),
    ("hf_causal_lm", {**GPT2, "auto_map": {"AutoModelForCausalLM": "x.Y"}}, None, Code.INVALID_ARGUMENT,
     "are refused"),
    ("hf_causal_lm", GPT2, LoraAdapter(rank=2, target_modules=("q_proj",)), Code.INVALID_ARGUMENT,
     "['q_proj'] match no module of the GPT2LMHeadModel model; its adaptable modules are named"),
])
def test_bad_sessions(client: GradientClient, model: str, kwargs: dict[str, Any], lora: LoraAdapter | None,
                      code: grpc.StatusCode, message: str) -> None:
    got, details, _ = status_of(lambda: client.create_session(model, model_kwargs=kwargs, loss="causal_lm",
                                                              expected_batch_size=2, lora=lora))
    assert got == code and message in details


def test_bad_lora_settings_on_the_wire(server: BackgroundServer) -> None:
    request = pb.CreateSessionRequest(model="hf_causal_lm", model_kwargs_json='{"model_type": "gpt2"}',
                                      loss="causal_lm", expected_batch_size=1, dp=pb.DPSettings(max_grad_norm=1.0),
                                      lora=pb.LoraSettings(rank=0, target_modules=["c_attn"]))
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GradientServiceStub(channel).CreateSession(request, timeout=30)
    assert err.value.code() == Code.INVALID_ARGUMENT and "rank must be an int in [1, 1024]" in err.value.details()


def test_bad_batches_and_pushes(client: GradientClient) -> None:
    model = hf_model(GPT2, lora=GPT2_LORA)
    inputs, labels = token_batch(2)
    with client.create_session("hf_causal_lm", model_kwargs=GPT2, loss="causal_lm", expected_batch_size=2,
                               config=DPConfig(max_grad_norm=1.0), lora=GPT2_LORA) as session:
        # the first push must carry the frozen base model
        code, details, reason = status_of(lambda: session.push_parameters(model, frozen=False))
        assert (code, reason) == (Code.FAILED_PRECONDITION, "PARAMETERS_MISSING") and "holds no frozen" in details
        frozen = [(n, p.detach()) for n, p in model.named_parameters() if not p.requires_grad]
        trainable = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]
        with pytest.raises(ConfigError, match="missing"):  # the client checks before sending
            session.push_parameters(frozen[:3] + trainable)
        # and the server, for clients that do not: some frozen parameters but not all
        code, details, _ = status_of(lambda: raw_push(client, session.id, 1, frozen[:3] + trainable))
        assert code == Code.INVALID_ARGUMENT and f"holds 3 of the {len(frozen)} frozen parameters" in details
        session.push_parameters(model)
        code, details, _ = status_of(lambda: session.compute_gradients({"attention_mask": inputs["attention_mask"]},
                                                                       labels))
        assert code == Code.INVALID_ARGUMENT and "lacks the required input(s) ['inputs/input_ids']" in details
        code, details, _ = status_of(lambda: session.compute_gradients({**inputs, "labels": labels}, labels))
        assert code == Code.INVALID_ARGUMENT and "has no keyword input(s) ['inputs/labels']" in details
        code, details, _ = status_of(lambda: session.compute_gradients(inputs["input_ids"], labels))
        assert code == Code.INVALID_ARGUMENT and "it takes keyword inputs inputs/input_ids" in details
        code, details, _ = status_of(lambda: session.compute_gradients(inputs, labels[:, :4]))
        assert code == Code.INVALID_ARGUMENT and "must have the shape of 'inputs/input_ids'" in details
        assert session.compute_gradients(inputs, labels).samples == 2  # and the session goes on


def test_a_model_that_fails_in_its_own_code_is_the_callers_error(client: GradientClient) -> None:
    """A config transformers accepts but the model cannot run (Phi rotating more dimensions than a
    head has): the step fails inside the model's forward, which is the caller's INVALID_ARGUMENT
    naming the model's module, not an INTERNAL error; the server goes on."""
    phi = {"model_type": "phi", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 16, "pad_token_id": 0, "partial_rotary_factor": 2.0}
    model = hf_model(phi, "PhiForCausalLM")
    inputs, labels = token_batch(4)
    with client.create_session("hf_causal_lm", model_kwargs=phi, loss="causal_lm", expected_batch_size=4,
                               config=DPConfig(max_grad_norm=1.0)) as session:
        session.push_parameters(model)
        code, details, reason = status_of(lambda: session.compute_gradients(inputs, labels))
    assert (code, reason) == (Code.INVALID_ARGUMENT, "INVALID_REQUEST"), (code, reason, details)
    assert "failed in its own code (transformers.models.phi.modeling_phi) on this batch: RuntimeError" in details
    with client.create_session("hf_causal_lm", model_kwargs=GPT2, loss="causal_lm", expected_batch_size=4,
                               config=DPConfig(max_grad_norm=1.0)) as session:
        session.push_parameters(hf_model(GPT2))
        assert session.compute_gradients(inputs, labels).samples == 4


def test_bad_audio_batches(client: GradientClient) -> None:
    """A waveform shorter than one feature frame, a non-finite one, an attention mask (the audio
    task takes none) or integer samples: INVALID_ARGUMENT with the reason, and the session goes on."""
    model = hf_model(WAVLM, "WavLMForSequenceClassification")
    labels = torch.tensor([0, 2])
    with client.create_session("hf_audio_classification", model_kwargs=WAVLM, loss="cross_entropy",
                               expected_batch_size=2, config=DPConfig(max_grad_norm=1.0)) as session:
        session.push_parameters(model)
        code, details, _ = status_of(lambda: session.compute_gradients({"input_values": torch.randn(2, 19)}, labels))
        assert code == Code.INVALID_ARGUMENT and "20..1048576" in details  # the receptive field: 20 samples
        audio = torch.randn(2, 64)
        audio[1, 5] = float("nan")
        code, details, _ = status_of(lambda: session.compute_gradients({"input_values": audio}, labels))
        assert code == Code.INVALID_ARGUMENT and "contains NaN or infinity" in details
        code, details, _ = status_of(lambda: session.compute_gradients(
            {"input_values": torch.randn(2, 64), "attention_mask": torch.ones(2, 64)}, labels))
        assert code == Code.INVALID_ARGUMENT and "has no keyword input(s) ['inputs/attention_mask']" in details
        code, details, _ = status_of(lambda: session.compute_gradients({"input_values": torch.ones(2, 64,
                                                                                                  dtype=torch.int64)},
                                                                       labels))
        assert code == Code.INVALID_ARGUMENT, details
        assert session.compute_gradients({"input_values": torch.randn(2, 64)}, labels).samples == 2


# ------------------------------------------------------------------------------------ Ray pool
def test_lora_through_the_embedded_ray_pool(ray_session: Any) -> None:
    """Two Ray workers: the adapter's new versions reach the actors (whose models keep the frozen
    base), and every step equals dp_gradient on the whole batch."""
    from psg_server.pool import WorkerPool

    config = DPConfig(max_grad_norm=0.05)
    model = hf_model(GPT2, lora=GPT2_LORA)
    pool = WorkerPool(num_workers=2, start_timeout_s=120.0, use_gpus=False)  # compared with the CPU
    with serve(executor=pool, max_shard_samples=2) as running, client_for(running) as client:
        assert [w.id for w in client.server_info().workers] == ["ray-worker-0", "ray-worker-1"]
        with client.create_session("hf_causal_lm", model_kwargs=GPT2, loss="causal_lm", expected_batch_size=4,
                                   config=config, lora=GPT2_LORA) as session:
            for step in range(2):
                session.push_parameters(model)
                inputs, labels = token_batch(4, seed=step)
                result = session.compute_gradients(inputs, labels)
                assert_equals_local(result, model, inputs, labels, config, "causal_lm", 4)
                result.apply_to(model)
                with torch.no_grad():
                    for p in model.parameters():
                        if p.requires_grad:
                            p.sub_(10.0 * p.grad)
            assert session.last_push_bytes == trainable_bytes(model)


def test_the_readme_lora_example_runs(server: BackgroundServer) -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Fine-tuning a Hugging Face model with LoRA", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match
    code = match.group(1).replace('"localhost:50051"', repr(server.target)).replace("print(", "printed.append(")
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(16, 12, dtype=torch.int64)
    mask[::2, 9:] = 0
    loader = [{"input_ids": torch.randint(0, 1000, (16, 12), generator=generator), "attention_mask": mask}
              for _ in range(2)]
    namespace: dict[str, Any] = {"loader": loader, "printed": []}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert len(namespace["printed"]) == 2 and "epsilon" in namespace["printed"][-1]
    session = namespace["session"]
    assert session.last_push_bytes == trainable_bytes(namespace["model"])
