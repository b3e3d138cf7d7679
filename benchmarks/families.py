"""The ``families`` suite: DP steps of Hugging Face models fully fine-tuned, every parameter trained.

Four families whose layers go beyond Linear, Embedding and the norms torch ships, each built from a
config with random weights (nothing is downloaded):

* ``llama``: ``LlamaForCausalLM``, RMSNorm weights (``weight * x_hat``), rotary positions;
* ``mixtral``: ``MixtralForCausalLM``, routed experts trained too (2 of 8 per token);
* ``beit``: ``BeitForImageClassification``, relative-position bias tables and layer scale;
* ``convnext``: ``ConvNextForImageClassification``, depthwise convolutions, channels-first
  LayerNorm and layer scale.

The causal LMs take N right-padded sequences with the service's ``causal_lm`` loss
(:class:`psg_server.losses.TokenCrossEntropy`); the image classifiers N random RGB images with
cross entropy. A step is forward, backward, the per-sample norms and the sum of the per-sample
gradients clipped at C = 1 (no noise, no optimizer). Rows per family:

* ``non-private``: ``loss.backward()``;
* ``psg-hooks`` / ``psg-ghost`` / ``psg-functorch``: :func:`psg_core.dp_gradient` in that mode;
* ``opacus-hooks``: Opacus' ``GradSampleModule`` and ``DPOptimizer.clip_and_accumulate()``, where
  Opacus takes the model (what it refuses becomes the row's note).

Every private row's clipped sum is compared with psg hooks' (``max_rel_diff``). The methods of one
family are timed interleaved in one process (a fresh subprocess when isolated). Peak memory is not
measured here (the ``training`` and ``gpt2`` suites measure it). No target: the table records what
the per-layer machinery costs on models people fine-tune (psg's layers without a grad sampler whose
parameters meet the batch in pointwise ops, the routed experts' grouped call on per-sample copies).

    python -m benchmarks.run --suites families              # the reported size
    python -m benchmarks.run --suites families --size tiny  # a smoke run

>>> sorted(SIZES), FAMILIES
(['full', 'gpu', 'gpu16', 'quick', 'tiny'], ('llama', 'mixtral', 'beit', 'convnext'))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpt2 import GPT2Size, Step, make_batch
from benchmarks.harness import (RunOptions, Suite, error_text, register_suite, relative_distance, run_isolated,
                                time_interleaved)
from benchmarks.models import opacus_available

__all__ = ["FAMILIES", "FAMILIES_SUITE", "METHODS", "SIZES", "build", "prepare_step", "run_family",
           "run_suite", "render"]

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "mixtral", "beit", "convnext")
METHODS = ("non-private", "psg-hooks", "psg-ghost", "psg-functorch", "opacus-hooks")
MAX_GRAD_NORM = 1.0
#: Relative L2 distance of a clipped sum from psg hooks' beyond which a row is flagged as computing
#: something else.
_AGREEMENT = 1e-3
_PAD, _EOS = 0, 1
#: the image classifiers' labels (a config field every transformers config takes)
_CLASSES: dict[str, Any] = {"num_labels": 10}


#: The gpt2 suite's scales, narrower: the width of the transformers (the first ConvNeXt stage's is a
#: quarter of it), their layers and heads, the vocabulary, T tokens per sequence and N sequences or
#: images per batch; images are 32 x 32 pixels where T >= 32, else 16 x 16.
SIZES: dict[str, GPT2Size] = {
    "full": GPT2Size(layers=4, width=128, heads=4, vocab=4000, length=64, batch=16),
    "quick": GPT2Size(layers=2, width=64, heads=4, vocab=1000, length=32, batch=8),
    "tiny": GPT2Size(layers=1, width=16, heads=4, vocab=40, length=6, batch=2),
}
SIZES["gpu"] = SIZES["gpu16"] = SIZES["full"]


def _image_side(size: GPT2Size) -> int:
    return 32 if size.length >= 32 else 16


def _causal(size: GPT2Size, config: str, model: str, **options: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config)(vocab_size=size.vocab, hidden_size=size.width, num_hidden_layers=size.layers,
                                        num_attention_heads=size.heads, num_key_value_heads=size.heads // 2,
                                        intermediate_size=2 * size.width,
                                        max_position_embeddings=size.length, pad_token_id=_PAD, bos_token_id=_EOS,
                                        eos_token_id=_EOS, **options)
    return getattr(transformers, model)(cfg)  # type: ignore[no-any-return]


def build(family: str, size: GPT2Size, *, seed: int = 0) -> nn.Module:
    """The family's model with random weights (the same ``seed``, the same weights), in train mode
    with no dropout, every parameter trainable."""
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        model = _causal(size, "LlamaConfig", "LlamaForCausalLM")
    elif family == "mixtral":
        model = _causal(size, "MixtralConfig", "MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    elif family == "beit":
        model = transformers.BeitForImageClassification(transformers.BeitConfig(
            image_size=_image_side(size), patch_size=4, hidden_size=size.width, num_hidden_layers=size.layers,
            num_attention_heads=size.heads, intermediate_size=2 * size.width, use_relative_position_bias=True,
            layer_scale_init_value=0.1, use_mean_pooling=True, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, drop_path_rate=0.0, **_CLASSES))
    elif family == "convnext":
        widths = [max(8, size.width // 4) * 2 ** i for i in range(3)]
        model = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
            num_channels=3, hidden_sizes=widths, depths=[max(1, size.layers // 2)] * 3, num_stages=3,
            image_size=_image_side(size), layer_scale_init_value=0.1, drop_path_rate=0.0, **_CLASSES))
    else:
        raise ValueError(f"families suite: unknown family {family!r}; expected one of {list(FAMILIES)}")
    return model.train()


def _batch(family: str, size: GPT2Size, *, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if family in ("beit", "convnext"):
        side = _image_side(size)
        pixels = torch.randn(size.batch, 3, side, side, generator=generator)
        return {"pixel_values": pixels}, torch.randint(0, 10, (size.batch,), generator=generator)
    return make_batch(size, seed=seed)


def _loss(family: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """Per-row losses ``(N,)``: the service's causal-LM loss, or cross entropy of the logits."""
    if family in ("llama", "mixtral"):
        from psg_server.losses import get_loss

        return get_loss("causal_lm").build()  # type: ignore[no-any-return]
    return lambda outputs, labels: F.cross_entropy(outputs.logits, labels, reduction="none")


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def prepare_step(family: str, method: str, size: GPT2Size, device: str) -> Step:
    """``method``'s step on the family's model and batch, on ``device``.

    Raises:
        RuntimeError: an Opacus method without opacus installed; whatever Opacus raises for the model.
    """
    if method not in METHODS:
        raise ValueError(f"families suite: unknown method {method!r}; expected one of {list(METHODS)}")
    model = build(family, size).to(device)
    inputs, labels = _batch(family, size, seed=2)
    inputs, labels = {k: v.to(device) for k, v in inputs.items()}, labels.to(device)
    loss_fn = _loss(family)
    if method == "non-private":
        def backward() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(**inputs), labels).mean().backward()

        return Step(backward, lambda: None, model)
    if method.startswith("psg"):
        from psg_core import DPConfig, dp_gradient

        config = DPConfig(mode=method.removeprefix("psg-"), max_grad_norm=MAX_GRAD_NORM)
        held: dict[str, torch.Tensor] = {}

        def private() -> None:
            held.clear()
            held.update(dp_gradient(model, inputs, labels, loss_fn=loss_fn, config=config).grads)

        return Step(private, lambda: dict(held), model)
    if not opacus_available():
        raise RuntimeError("opacus is not installed (pip install 'psg[bench]')")
    from opacus.grad_sample import GradSampleModule
    from opacus.optimizers import DPOptimizer

    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    params = _trainable(model)
    optimizer = DPOptimizer(torch.optim.SGD(list(params.values()), lr=0.0), noise_multiplier=0.0,
                            max_grad_norm=MAX_GRAD_NORM, expected_batch_size=labels.shape[0], loss_reduction="mean")

    def opacus() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped(**inputs), labels).mean().backward()
        optimizer.clip_and_accumulate()

    return Step(opacus, lambda: {n: getattr(p, "summed_grad") for n, p in params.items()
                                 if getattr(p, "summed_grad", None) is not None}, model)


def run_family(payload: dict[str, Any]) -> dict[str, Any]:
    """Every method of one family, timed interleaved (JSON in, JSON out; runs in a subprocess).

    Args:
        payload: ``{"options": RunOptions.to_json(), "family": str}``.
    """
    options = RunOptions.in_child(payload)
    family = payload["family"]
    size = SIZES[options.size]
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Step] = {}
    for method in METHODS:
        rows[method] = {"family": family, "method": method, "batch": size.batch, "device": options.device}
        try:
            step = prepare_step(family, method, size, options.device)
            for _ in range(max(1, options.warmup)):  # at least one: the agreement reads its result
                step()
        except Exception as err:  # noqa: BLE001 - a refusal is the row's note, the run goes on
            logger.warning("families suite: %s / %s did not run: %s", family, method, err)
            rows[method]["error"] = error_text(err)
            continue
        steps[method] = step
        rows[method]["parameters"] = sum(p.numel() for p in _trainable(step.model).values())
    reference = steps["psg-hooks"].clipped_sum() if "psg-hooks" in steps else None
    for method, step in steps.items():
        computed = step.clipped_sum()
        if computed is not None and reference:
            rows[method]["max_rel_diff"] = relative_distance(computed, reference)
    if steps:
        for method, timing in time_interleaved(dict(steps), warmup=0, repeats=options.repeats,
                                               device=options.device).items():
            rows[method].update(timing.fields())
    return {"rows": [rows[method] for method in METHODS]}


def run_suite(options: RunOptions) -> list[dict[str, Any]]:
    """Five rows per family (its methods), in :data:`FAMILIES` order."""
    if options.size not in SIZES:
        raise ValueError(f"families suite: no size {options.size!r}; expected one of {sorted(SIZES)}")
    rows: list[dict[str, Any]] = []
    for index, family in enumerate(FAMILIES, 1):
        logger.info("families suite [%d/%d] %s: timing %d methods interleaved", index, len(FAMILIES), family,
                    len(METHODS))
        payload = {"options": options.to_json(), "family": family}
        if options.isolate:
            result = run_isolated("benchmarks.families:run_family", payload, timeout_s=options.timeout_s,
                                  pin_mmap=False)
            rows += result.get("rows") or [{"family": family, "method": method,
                                            "error": result.get("error", "no result")} for method in METHODS]
        else:
            rows += run_family(payload)["rows"]
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown section: one table, a row per (family, method), time relative to non-private."""
    lines = ["| family | method | median ms | min-max ms | x non-private | max rel diff | note |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        base = next((r for r in rows if r["family"] == row["family"] and r["method"] == "non-private"), None)
        if "error" in row:
            lines.append(f"| {row['family']} | {row['method']} | | | | | {row['error'][:160]} |")
            continue
        ratio = (f"{row['median_ms'] / base['median_ms']:.2f}" if base is not None and base.get("median_ms")
                 else "")
        diff = f"{row['max_rel_diff']:.1e}" if "max_rel_diff" in row else ""
        note = ("its clipped sum is not psg hooks' (psg's match the per-sample oracle: "
                "tests/core/test_hf_models.py)" if row.get("max_rel_diff", 0.0) > _AGREEMENT else "")
        lines.append(f"| {row['family']} | {row['method']} | {row['median_ms']:.1f} | "
                     f"{row['min_ms']:.1f}-{row['max_ms']:.1f} | {ratio} | {diff} | {note} |")
    return "\n".join(lines)


FAMILIES_SUITE = register_suite(Suite(
    name="families",
    description="Hugging Face families fully fine-tuned (Llama, Mixtral with trainable experts, BEiT, ConvNeXt): "
                "psg hooks / ghost / functorch and Opacus hooks against non-private steps",
    run=run_suite, render=render))
